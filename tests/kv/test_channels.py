"""psrl.kv.channels on the host: POSIX shared memory between two processes, the NHD/HND and partial-last-block
gather/scatter the channels rely on, and the clear errors of the CUDA IPC and NCCL APIs on a machine without
them. GPU tests are in test_channels_cuda.py."""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing
import os
import re
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import psrl.kv as kv
from psrl import _kvx
from psrl.kv import channels
from psrl.kv.channels import (
    KVLayoutMismatchError,
    ShmChannel,
    ShmMappings,
    ShmPool,
    ShmSegment,
    ShmSegmentNotFoundError,
    ShmSizeMismatchError,
    ShmTransfer,
    shm_receive,
    shm_send,
)

from .reference import BITS_DTYPE, random_bits, to_bits, typed_view

DEV_SHM = Path("/dev/shm")

# --- caches and the numpy reference -----------------------------------------------------------------


def make_layer(
    rng: np.random.Generator,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    dtype_name: str,
    backend: str,
    layout: str,
) -> tuple[np.ndarray, Any]:
    """One layer as (bits in logical [2, nb, bs, H, D] order, the same memory typed). layout: NHD | HND |
    block_major (NHD blocks, [nb, 2, ...] storage) | HND_block_major."""
    if layout == "NHD":
        bits = random_bits(rng, (2, num_blocks, block_size, heads, head_size), dtype_name)
    elif layout == "HND":
        bits = random_bits(rng, (2, num_blocks, heads, block_size, head_size), dtype_name).transpose(0, 1, 3, 2, 4)
    elif layout == "block_major":
        bits = random_bits(rng, (num_blocks, 2, block_size, heads, head_size), dtype_name).transpose(1, 0, 2, 3, 4)
    elif layout == "HND_block_major":
        bits = random_bits(rng, (num_blocks, 2, heads, block_size, head_size), dtype_name).transpose(1, 0, 3, 2, 4)
    else:
        raise ValueError(layout)
    return bits, typed_view(bits, dtype_name, backend)


def make_caches(
    seed: int, num_layers: int, num_blocks: int, shape: tuple[int, int, int], dtype_name: str, layout: str
) -> tuple[list[np.ndarray], list[Any]]:
    rng = np.random.default_rng(seed)
    backend = "torch" if dtype_name == "bfloat16" else "numpy"
    layers = [make_layer(rng, num_blocks, *shape, dtype_name, backend, layout) for _ in range(num_layers)]
    return [bits for bits, _ in layers], [typed for _, typed in layers]


def gather_ref(bits: list[np.ndarray], ids: np.ndarray, num_tokens: int | None) -> np.ndarray:
    out = np.stack([layer[:, ids] for layer in bits])  # [L, 2, n, bs, H, D]
    if num_tokens is not None and len(ids):
        block_size = out.shape[3]
        out[:, :, -1, num_tokens - (len(ids) - 1) * block_size :] = 0
    return out


def scatter_ref(
    buffer: np.ndarray, bits: list[np.ndarray], ids: np.ndarray, num_tokens: int | None
) -> list[np.ndarray]:
    expected = []
    for layer, cache in enumerate(bits):
        after = cache.copy()
        if num_tokens is None or not len(ids):
            after[:, ids] = buffer[layer]
        else:
            block_size = cache.shape[2]
            last = num_tokens - (len(ids) - 1) * block_size
            after[:, ids[:-1]] = buffer[layer][:, :-1]
            after[:, ids[-1], :last] = buffer[layer][:, -1, :last]
        expected.append(after)
    return expected


# --- child-process side (spawned worker) --------------------------------------------------------------

_LIVE: dict[str, ShmChannel] = {}  # source channels a worker keeps open until the parent releases them


def child_send(
    seed: int, spec: dict[str, Any], ids: list[int], num_tokens: int | None, num_threads: int | None
) -> dict[str, Any]:
    _, caches = make_caches(seed, spec["layers"], spec["blocks"], spec["shape"], spec["dtype"], spec["layout"])
    channel = shm_send(caches, ids, num_tokens=num_tokens, num_threads=num_threads)
    _LIVE[channel.name] = channel
    return channel.transfer.to_dict()


def child_release(name: str) -> dict[str, Any]:
    """Close a source channel as a `with` block would; reports whether the name still existed."""
    channel = _LIVE.pop(name)
    still_there = (DEV_SHM / name.lstrip("/")).exists()
    channel.__exit__(None, None, None)
    return {"existed_before_close": still_there, "exists_after": (DEV_SHM / name.lstrip("/")).exists()}


def child_receive(seed: int, spec: dict[str, Any], transfer: dict[str, Any], ids: list[int]) -> list[np.ndarray]:
    _, caches = make_caches(seed, spec["layers"], spec["blocks"], spec["shape"], spec["dtype"], spec["layout"])
    shm_receive(ShmTransfer.from_dict(transfer), caches, ids)
    return [to_bits(c, spec["dtype"]).copy() for c in caches]


_POOL: list[ShmPool] = []  # a worker's source pool, kept across calls


def child_pooled_send(seed: int, spec: dict[str, Any], ids: list[int], num_tokens: int | None) -> dict[str, Any]:
    if not _POOL:
        _POOL.append(ShmPool(64 << 20, min_segment_bytes=4096))
    _, caches = make_caches(seed, spec["layers"], spec["blocks"], spec["shape"], spec["dtype"], spec["layout"])
    channel = shm_send(caches, ids, num_tokens=num_tokens, pool=_POOL[0])
    _LIVE[channel.name] = channel
    return channel.transfer.to_dict()


def child_recycle(name: str) -> dict[str, int]:
    _LIVE.pop(name).recycle()
    return {"created": _POOL[0].created, "reused": _POOL[0].reused}


def child_close_pool() -> None:
    _POOL.pop().close()


def child_open_missing(transfer: dict[str, Any]) -> str:
    try:
        ShmChannel.open(ShmTransfer.from_dict(transfer))
    except ShmSegmentNotFoundError as exc:
        return f"not found: {exc}"
    return "opened"


@pytest.fixture(scope="module")
def worker() -> Iterator[ProcessPoolExecutor]:
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def needs_torch(dtype_name: str) -> None:
    if dtype_name == "bfloat16":
        pytest.importorskip("torch")


# --- two processes through shared memory ---------------------------------------------------------------

TRANSFER_CASES = [
    # (dtype, source layout, destination layout, num_tokens or None, num_threads)
    ("float16", "NHD", "NHD", None, None),
    ("float16", "NHD", "HND", 7 * 16 + 5, 2),  # partial last block, NHD -> HND
    ("float32", "HND", "NHD", 7 * 16 + 1, 1),
    ("float32", "HND_block_major", "block_major", None, 3),
    ("bfloat16", "HND", "HND", 7 * 16 + 16, None),  # num_tokens that fills the last block
    ("bfloat16", "block_major", "HND", 7 * 16 + 9, None),
]


@pytest.mark.parametrize(("dtype_name", "src_layout", "dst_layout", "num_tokens", "num_threads"), TRANSFER_CASES)
def test_shm_source_in_child_destination_here(
    worker: ProcessPoolExecutor,
    dtype_name: str,
    src_layout: str,
    dst_layout: str,
    num_tokens: int | None,
    num_threads: int | None,
) -> None:
    needs_torch(dtype_name)
    shape = (16, 4, 64)
    src = {"layers": 3, "blocks": 20, "shape": shape, "dtype": dtype_name, "layout": src_layout}
    rng = np.random.default_rng(1)
    src_ids = rng.choice(20, size=8, replace=False)
    dst_ids = rng.choice(30, size=8, replace=False)

    transfer_dict = worker.submit(child_send, 11, src, src_ids.tolist(), num_tokens, num_threads).result()
    transfer = ShmTransfer.from_dict(transfer_dict)
    assert transfer.shape == (3, 2, 8, *shape)
    assert transfer.num_tokens == num_tokens
    assert (DEV_SHM / transfer.name.lstrip("/")).exists()

    src_bits, _ = make_caches(11, 3, 20, shape, dtype_name, src_layout)  # same seed: the child's caches
    dst_bits, dst_caches = make_caches(12, 3, 30, shape, dtype_name, dst_layout)
    expected = scatter_ref(gather_ref(src_bits, src_ids, num_tokens), dst_bits, dst_ids, num_tokens)

    shm_receive(transfer, dst_caches, dst_ids)

    assert not (DEV_SHM / transfer.name.lstrip("/")).exists()  # the destination unlinked it on open
    for cache, after in zip(dst_caches, expected, strict=True):
        np.testing.assert_array_equal(to_bits(cache, dtype_name), after)
    released = worker.submit(child_release, transfer.name).result()
    assert released == {"existed_before_close": False, "exists_after": False}


@pytest.mark.parametrize(("dtype_name", "src_layout", "dst_layout", "num_tokens", "num_threads"), TRANSFER_CASES[:4])
def test_shm_source_here_destination_in_child(
    worker: ProcessPoolExecutor,
    dtype_name: str,
    src_layout: str,
    dst_layout: str,
    num_tokens: int | None,
    num_threads: int | None,
) -> None:
    shape = (16, 4, 64)
    rng = np.random.default_rng(2)
    src_ids = rng.choice(20, size=8, replace=False)
    dst_ids = rng.choice(30, size=8, replace=False)
    src_bits, src_caches = make_caches(21, 2, 20, shape, dtype_name, src_layout)
    dst_spec = {"layers": 2, "blocks": 30, "shape": shape, "dtype": dtype_name, "layout": dst_layout}
    dst_bits, _ = make_caches(22, 2, 30, shape, dtype_name, dst_layout)
    expected = scatter_ref(gather_ref(src_bits, src_ids, num_tokens), dst_bits, dst_ids, num_tokens)

    with shm_send(src_caches, src_ids, num_tokens=num_tokens, num_threads=num_threads) as channel:
        np.testing.assert_array_equal(
            channel.buffer().view(BITS_DTYPE[dtype_name]), gather_ref(src_bits, src_ids, num_tokens)
        )
        name = channel.name
        result = worker.submit(child_receive, 22, dst_spec, channel.transfer.to_dict(), dst_ids.tolist()).result()
        assert channel.unlink() is False  # the destination already removed the name
    assert channel.closed
    assert not (DEV_SHM / name.lstrip("/")).exists()
    for got, after in zip(result, expected, strict=True):
        np.testing.assert_array_equal(got, after)


def test_shm_open_after_unlink_in_other_process(worker: ProcessPoolExecutor) -> None:
    _, caches = make_caches(3, 1, 4, (2, 1, 8), "float16", "NHD")
    with shm_send(caches, [1, 2]) as channel:
        channel.unlink()
        message = worker.submit(child_open_missing, channel.transfer.to_dict()).result()
    assert message.startswith("not found:")
    assert channel.name in message


def test_pooled_segments_serve_later_transfers_across_processes(worker: ProcessPoolExecutor) -> None:
    """The source (a child) keeps its segment for the next transfer once this side has read it; this side keeps
    it mapped: the second transfer neither creates nor maps a segment, and both arrive intact (the second one
    smaller, into a segment still holding the first one's bytes past its end)."""
    shape = (16, 2, 32)
    src = {"layers": 2, "blocks": 20, "shape": shape, "dtype": "float16", "layout": "HND"}
    src_bits, _ = make_caches(31, 2, 20, shape, "float16", "HND")
    mappings = ShmMappings(64 << 20)
    names = []
    try:
        for ids, num_tokens in (([3, 1, 4, 5], 60), ([9, 2, 6], 40)):
            transfer = ShmTransfer.from_dict(worker.submit(child_pooled_send, 31, src, ids, num_tokens).result())
            assert transfer.pooled and transfer.nbytes == 2 * 2 * len(ids) * 16 * 2 * 32 * 2
            dst_bits, dst = make_caches(32, 2, 12, shape, "float16", "NHD")
            shm_receive(transfer, dst, [7, 0, 11, 5][: len(ids)], mappings=mappings)
            expected = scatter_ref(
                gather_ref(src_bits, np.array(ids), num_tokens),
                dst_bits,
                np.array([7, 0, 11, 5][: len(ids)]),
                num_tokens,
            )
            for cache, after in zip(dst, expected, strict=True):
                np.testing.assert_array_equal(to_bits(cache, "float16"), after)
            assert (DEV_SHM / transfer.name.lstrip("/")).exists()  # pooled: the destination leaves the name
            names.append(transfer.name)
            stats = worker.submit(child_recycle, transfer.name).result()
        assert names[0] == names[1] and stats == {"created": 1, "reused": 1} and mappings.opened == 1
    finally:
        mappings.close()
        worker.submit(child_close_pool).result()
    assert not (DEV_SHM / names[0].lstrip("/")).exists()


def test_pool_reuses_only_read_segments_and_keeps_its_bound() -> None:
    _, caches = make_caches(41, 1, 8, (4, 2, 8), "float16", "NHD")  # a block: 2 * 4 * 2 * 8 * 2 = 256 bytes
    pool = ShmPool(4096, min_segment_bytes=1024)
    try:
        first = shm_send(caches, [1, 2], pool=pool)  # 512 bytes: the 1024-byte class
        assert pool.size_class(first.transfer.nbytes) == 1024 and first.segment.size == 1024
        first.__exit__(None, None, None)  # never acknowledged: retired, not reused (a reader may still copy)
        assert not (DEV_SHM / first.name.lstrip("/")).exists()
        second = shm_send(caches, [3], pool=pool)
        assert (pool.created, pool.reused) == (2, 0)
        second.recycle()
        assert pool.idle_bytes == 1024 and (DEV_SHM / second.name.lstrip("/")).exists()
        third = shm_send(caches, [4, 5, 6], pool=pool)  # 768 bytes: the same class, the same segment
        assert third.name == second.name and (pool.created, pool.reused) == (2, 1)
        big = shm_send(caches, list(range(8)), pool=pool)  # 2048 bytes: a class of its own
        third.recycle()
        big.recycle()
        assert pool.idle_bytes == 3072
        small = ShmPool(1024, min_segment_bytes=1024)
        with shm_send(caches, list(range(8)), pool=small) as over:  # its class exceeds the bound: not pooled
            assert not over.transfer.pooled and over.segment.size == over.transfer.nbytes == 2048
        assert small.created == 0 and not (DEV_SHM / over.name.lstrip("/")).exists()
        with pytest.raises(ValueError, match="not from a pool"):
            shm_send(caches, [1]).recycle()
        with pytest.raises(ValueError, match="not both"):
            shm_send(caches, [1], pool=pool, name="/psrl-test-x")
    finally:
        pool.close()
    assert pool.idle_bytes == 0 and not (DEV_SHM / third.name.lstrip("/")).exists()
    late = shm_send(caches, [1], pool=pool)
    late.recycle()  # released after close: destroyed, not kept
    assert pool.idle_bytes == 0 and not (DEV_SHM / late.name.lstrip("/")).exists()


def test_pool_never_reuses_a_segment_someone_views_or_removed() -> None:
    _, caches = make_caches(43, 1, 8, (4, 2, 8), "float16", "NHD")
    pool = ShmPool(1 << 20, min_segment_bytes=1024)
    try:
        viewed = shm_send(caches, [1], pool=pool)
        view = np.frombuffer(viewed.segment, dtype=np.uint8)
        viewed.recycle()  # a live view would see the next transfer's bytes: retired instead
        assert pool.idle_bytes == 0 and not (DEV_SHM / viewed.name.lstrip("/")).exists()
        del view
        removed = shm_send(caches, [2], pool=pool)
        removed.recycle()
        channels.ShmSegment.unlink_name(removed.name)  # e.g. a stale-segment sweep: no reader could open it
        fresh = shm_send(caches, [3], pool=pool)
        assert fresh.name != removed.name and (pool.created, pool.reused) == (3, 0)
        fresh.recycle()
        assert pool.idle_bytes == 1024
    finally:
        pool.close()


def test_a_creator_only_closed_is_unlinked_when_collected() -> None:
    _, caches = make_caches(44, 1, 8, (4, 2, 8), "float16", "NHD")
    channel = shm_send(caches, [1])
    name = channel.name
    channel.close()
    assert (DEV_SHM / name.lstrip("/")).exists()
    del channel
    assert not (DEV_SHM / name.lstrip("/")).exists()


def test_mappings_keep_their_bound_but_never_unmap_one_in_use() -> None:
    _, caches = make_caches(42, 1, 8, (4, 2, 8), "float16", "NHD")
    pool = ShmPool(1 << 20, min_segment_bytes=1024)
    mappings = ShmMappings(1024)
    try:
        a, b = shm_send(caches, [1], pool=pool), shm_send(caches, [2], pool=pool)
        held = ShmChannel.open(a.transfer, mappings=mappings)  # in use
        with ShmChannel.open(b.transfer, mappings=mappings):
            pass
        # 2048 bytes mapped against a bound of 1024: b (unused) went, a (in use) stays mapped
        assert mappings.mapped_bytes == 1024 and not held.segment.closed
        held.close()
        assert mappings.mapped_bytes == 1024  # within the bound once a is unused: kept for the next transfer
        again = ShmChannel.open(a.transfer, mappings=mappings)
        assert again.segment is held.segment and mappings.opened == 2
        again.close()
        a.recycle()
        b.recycle()
        channels.ShmSegment.unlink_name(a.name)  # the source gave it up: its mapping goes first
        with ShmChannel.open(b.transfer, mappings=mappings):
            pass
        assert mappings.mapped_bytes == 1024 and mappings.opened == 3  # b again; a's mapping dropped
    finally:
        mappings.close()
        pool.close()


# --- one process: the channel object -------------------------------------------------------------------


def test_segment_basics() -> None:
    name = channels.new_segment_name("psrl-test")
    segment = ShmSegment.create(name, 64)
    try:
        assert (segment.name, segment.size, len(segment), segment.created) == (name, 64, 64, True)
        assert segment.address != 0 and not segment.readonly and not segment.closed
        view = np.frombuffer(segment, dtype=np.float32)  # zero copy: writes show in the other mapping
        assert view.flags.writeable and not view.any()
        view[:] = 2.5
        with ShmSegment.open(name) as other:
            assert not other.created and other.size == 64
            assert np.frombuffer(other, dtype=np.float32).tolist() == [2.5] * 16
        assert segment.exports == 1
        with pytest.raises(BufferError, match="still use it"):
            segment.close()
        del view
        assert segment.exports == 0
        with ShmSegment.open(name, readonly=True) as readonly:
            frozen = np.frombuffer(readonly, dtype=np.uint8)
            assert not frozen.flags.writeable
            with pytest.raises(TypeError, match="read-only"):
                memoryview(readonly)[0] = 1
            del frozen
        with pytest.raises(FileExistsError):
            ShmSegment.create(name, 8)
    finally:
        assert segment.unlink() is True
    assert segment.unlink() is False and ShmSegment.unlink_name(name) is False
    segment.close()
    segment.close()  # idempotent
    assert segment.closed
    with pytest.raises(ValueError, match="closed"):
        np.frombuffer(segment, dtype=np.uint8)
    with pytest.raises(FileNotFoundError):
        ShmSegment.open(name)


def test_segment_names_and_sizes() -> None:
    names = {channels.new_segment_name() for _ in range(100)}
    assert len(names) == 100
    assert all(re.fullmatch(rf"/psrl-kv-{os.getpid()}-[0-9a-f]{{32}}", n) for n in names)
    for bad in ["", "/", "a/b", "/a/b", "x" * 300]:
        with pytest.raises(ValueError):
            ShmSegment.create(bad, 1)
    assert ShmSegment.normalize_name("abc") == "/abc"
    name = channels.new_segment_name("psrl-test")
    with ShmSegment.create(name, 0) as empty:  # a zero-block transfer still has a segment
        try:
            assert empty.size == 0 and np.frombuffer(empty, dtype=np.float16).shape == (0,)
        finally:
            empty.unlink()


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32"])
def test_channel_round_trip_in_process(dtype_name: str) -> None:
    needs_torch(dtype_name)
    src_bits, src = make_caches(5, 2, 10, (4, 2, 8), dtype_name, "HND")
    dst_bits, dst = make_caches(6, 2, 12, (4, 2, 8), dtype_name, "NHD")
    layout = kv.describe_kv_cache(src)
    assert layout.kv_layout == "HND" and kv.describe_kv_cache(dst).kv_layout == "NHD"
    with ShmChannel.create(layout, 3, num_tokens=10) as source:
        source.gather(src, [9, 0, 4])
        buffer = source.buffer(src[0])
        assert type(buffer) is type(src[0])  # numpy for numpy caches, torch for torch ones
        assert source.buffer(src[0]) is buffer  # one cached view
        del buffer
        with ShmChannel.open(source.transfer) as destination:
            destination.scatter(dst, [1, 2, 3])
    expected = scatter_ref(gather_ref(src_bits, np.array([9, 0, 4]), 10), dst_bits, np.array([1, 2, 3]), 10)
    for cache, after in zip(dst, expected, strict=True):
        np.testing.assert_array_equal(to_bits(cache, dtype_name), after)
    assert source.closed and destination.closed
    assert not (DEV_SHM / source.name.lstrip("/")).exists()


def test_shm_channel_misuse_is_a_clear_error() -> None:
    _, caches = make_caches(45, 1, 8, (4, 2, 8), "float16", "NHD")
    layout = kv.describe_kv_cache(caches)
    with pytest.raises(kv.KVLayoutMismatchError, match="host caches"):
        ShmChannel.create(dataclasses.replace(layout, cuda_device=0), 1)
    with shm_send(caches, [1]) as channel:
        pass
    with pytest.raises(ValueError, match="closed"):
        channel.buffer()
    with pytest.raises(ValueError, match="max_idle_bytes"):
        ShmPool(-1)
    with pytest.raises(ValueError, match="min_segment_bytes"):
        ShmPool(1024, min_segment_bytes=0)
    pool, mappings = ShmPool(1 << 20, min_segment_bytes=1024), ShmMappings(1 << 20)
    try:
        pooled = shm_send(caches, [1], pool=pool)
        with ShmChannel.open(pooled.transfer, mappings=mappings):
            pass
        too_big = dataclasses.replace(pooled.transfer, shape=(1, 2, 8, 4, 2, 8))  # 2048 bytes, segment 1024
        with pytest.raises(channels.ShmSizeMismatchError, match="2048"):
            ShmChannel.open(too_big, mappings=mappings)  # the mapped name is known: checked against it
        pooled.recycle()
    finally:
        mappings.close()
        pool.close()


def test_transfer_descriptor() -> None:
    transfer = ShmTransfer("/x", (2, 2, 3, 16, 8, 128), "bfloat16", num_tokens=40)
    assert transfer.nbytes == 2 * 2 * 3 * 16 * 8 * 128 * 2 and transfer.num_ids == 3 and transfer.itemsize == 2
    assert ShmTransfer.from_dict(transfer.to_dict()) == transfer and "pooled" not in transfer.to_dict()
    pooled = ShmTransfer("/x", (2, 2, 3, 16, 8, 128), "bfloat16", pooled=True)
    assert ShmTransfer.from_dict(pooled.to_dict()) == pooled
    with pytest.raises(ValueError, match="dtype"):
        ShmTransfer("/x", (2, 2, 3, 16, 8, 128), "float64")
    with pytest.raises(ValueError, match="shape"):
        ShmTransfer("/x", (2, 3, 3, 16, 8, 128), "float16")


# --- errors ---------------------------------------------------------------------------------------------


def test_open_missing_segment() -> None:
    transfer = ShmTransfer(channels.new_segment_name("psrl-test"), (1, 2, 1, 2, 1, 8), "float16")
    with pytest.raises(ShmSegmentNotFoundError, match="does not exist") as info:
        ShmChannel.open(transfer)
    assert isinstance(info.value, FileNotFoundError)


def test_size_mismatch_leaves_segment_in_place() -> None:
    name = channels.new_segment_name("psrl-test")
    with ShmSegment.create(name, 100) as segment:
        try:
            transfer = ShmTransfer(name, (1, 2, 1, 2, 1, 8), "float16")  # 64 bytes
            with pytest.raises(ShmSizeMismatchError, match="100 bytes"):
                ShmChannel.open(transfer)
            assert (DEV_SHM / name.lstrip("/")).exists()
        finally:
            segment.unlink()


def test_layout_mismatch() -> None:
    _, src = make_caches(7, 2, 6, (4, 2, 8), "float32", "NHD")
    _, other_heads = make_caches(8, 2, 6, (4, 1, 8), "float32", "NHD")
    _, fp16 = make_caches(8, 2, 6, (4, 2, 8), "float16", "NHD")
    with shm_send(src, [0, 1], num_tokens=5) as channel, ShmChannel.open(channel.transfer, unlink=False) as peer:
        with pytest.raises(KVLayoutMismatchError, match="need"):
            peer.scatter(other_heads, [0, 1])
        with pytest.raises(KVLayoutMismatchError, match="need"):
            peer.scatter(src, [0, 1, 2])
        with pytest.raises(KVLayoutMismatchError, match="float32"):
            peer.scatter(fp16, [0, 1])
        with pytest.raises(IndexError, match="out of range"):
            peer.scatter(src, [0, 6])
        with pytest.raises(ValueError, match="distinct"):
            peer.scatter(src, [1, 1])


def test_errors_unlink_the_segment() -> None:
    _, caches = make_caches(9, 1, 6, (4, 2, 8), "float16", "NHD")
    before = set(DEV_SHM.glob("psrl-kv-*"))
    with pytest.raises(IndexError):
        shm_send(caches, [0, 9])  # gather fails after the segment was made
    with pytest.raises(ValueError, match="num_tokens"):
        shm_send(caches, [0, 1], num_tokens=9)  # 2 blocks of 4 hold at most 8 tokens
    with pytest.raises(RuntimeError, match="boom"), shm_send(caches, [0, 1]):
        raise RuntimeError("boom")
    assert set(DEV_SHM.glob("psrl-kv-*")) == before


def test_close_with_a_live_view_defers_the_unmap() -> None:
    bits, caches = make_caches(10, 1, 6, (4, 2, 8), "float16", "NHD")
    channel = shm_send(caches, [3])
    kept = channel.buffer()
    raw = np.frombuffer(channel.segment, dtype=np.uint8)  # a view the channel does not own
    channel.__exit__(None, None, None)
    assert channel.closed and not channel.segment.closed  # still mapped for the live views
    assert not (DEV_SHM / channel.name.lstrip("/")).exists()
    np.testing.assert_array_equal(kept.view(np.uint16), gather_ref(bits, np.array([3]), None))
    assert raw.nbytes == channel.transfer.nbytes
    with pytest.raises(ValueError, match="closed"):
        channel.buffer()
    del kept, raw
    assert channel.segment.exports == 0
    channel.close()
    assert channel.segment.closed


# --- the gather/scatter features the channels use: HND strides and a partial last block ------------------


@pytest.mark.parametrize("layout", ["NHD", "HND", "block_major", "HND_block_major"])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("num_threads", [1, 3])
def test_strided_and_partial_gather_scatter(layout: str, dtype_name: str, num_threads: int) -> None:
    needs_torch(dtype_name)
    rng = np.random.default_rng(hash((layout, dtype_name, num_threads)) % 2**32)
    block_size, heads, head_size = 8, 3, 16
    bits, caches = make_caches(int(rng.integers(1 << 30)), 3, 24, (block_size, heads, head_size), dtype_name, layout)
    ids = rng.choice(24, size=10, replace=False)
    for num_tokens in (None, 9 * block_size + 1, 9 * block_size + 5, 10 * block_size):
        out = kv.gather_blocks(caches, ids, num_tokens=num_tokens, num_threads=num_threads)
        np.testing.assert_array_equal(to_bits(out, dtype_name), gather_ref(bits, ids, num_tokens))

        targets = rng.choice(24, size=10, replace=False)
        buffer_bits = random_bits(rng, (3, 2, 10, block_size, heads, head_size), dtype_name)
        expected = scatter_ref(buffer_bits, bits, targets, num_tokens)
        kv.scatter_blocks(
            typed_view(buffer_bits, dtype_name, "torch" if dtype_name == "bfloat16" else "numpy"),
            caches,
            targets,
            num_tokens=num_tokens,
            num_threads=num_threads,
        )
        for cache, after in zip(caches, expected, strict=True):
            np.testing.assert_array_equal(to_bits(cache, dtype_name), after)


def test_large_hnd_copy_uses_threads_correctly() -> None:
    bits, caches = make_caches(13, 4, 64, (16, 8, 128), "float16", "HND")  # 16 MiB moved
    ids = np.random.default_rng(0).integers(0, 64, size=64)
    for threads in (1, 4):
        out = kv.gather_blocks(caches, ids, num_threads=threads, num_tokens=63 * 16 + 3)
        np.testing.assert_array_equal(to_bits(out, "float16"), gather_ref(bits, ids, 63 * 16 + 3))


def test_num_tokens_validation() -> None:
    _, caches = make_caches(14, 1, 6, (4, 2, 8), "float16", "NHD")
    for bad in (0, 4, 9):
        with pytest.raises(ValueError, match="does not fit 2 blocks"):
            kv.gather_blocks(caches, [0, 1], num_tokens=bad)
    with pytest.raises(TypeError, match="num_tokens"):
        kv.gather_blocks(caches, [0, 1], num_tokens=5.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no block ids"):
        kv.gather_blocks(caches, [], num_tokens=3)
    assert kv.gather_blocks(caches, [], num_tokens=0).shape == (1, 2, 0, 4, 2, 8)


def test_native_strides_and_last_block_validation() -> None:
    cache = np.zeros((2, 4, 2, 3, 8), dtype=np.float16)  # HND storage of [2, 4, bs=3, H=2, 8]
    buffer = np.zeros((1, 2, 2, 3, 2, 8), dtype=np.float16)
    geometry = dict(
        layer_ptrs=[cache.ctypes.data],
        num_blocks=4,
        block_size=3,
        num_kv_heads=2,
        head_size=8,
        itemsize=2,
        kv_stride=4 * 48,
        block_stride=48,
        token_stride=8,
        head_stride=24,
    )
    ids = np.array([0, 3])

    def scatter(last_block_tokens: int | None = None, **changes: int) -> None:
        layout = _kvx.KVCacheLayout(**{**geometry, **changes})
        _kvx.scatter_blocks(layout, ids, buffer.ctypes.data, buffer.nbytes, last_block_tokens=last_block_tokens)

    scatter(last_block_tokens=2)
    for bad in (0, 4):
        with pytest.raises(ValueError, match="last_block_tokens"):
            scatter(last_block_tokens=bad)
    with pytest.raises(ValueError, match="overlap"):
        scatter(head_stride=8)  # heads and tokens on the same memory
    with pytest.raises(ValueError, match="overlap"):
        scatter(block_stride=24)
    # Overlapping reads are harmless: gather accepts them.
    overlapping = _kvx.KVCacheLayout(**{**geometry, "head_stride": 8})
    _kvx.gather_blocks(overlapping, ids, buffer.ctypes.data, buffer.nbytes)


def test_head_elements_must_be_contiguous() -> None:
    cache = np.zeros((2, 6, 4, 2, 16), dtype=np.float16)[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        kv.gather_blocks([cache], [0])
    hnd = np.zeros((2, 6, 2, 4, 8), dtype=np.float16).transpose(0, 1, 3, 2, 4)
    assert kv.describe_kv_cache([hnd]).kv_layout == "HND"
    with pytest.raises(ValueError, match="token/head strides"):
        kv.gather_blocks([hnd, np.zeros((2, 6, 4, 2, 8), dtype=np.float16)], [0])


# --- CUDA IPC and NCCL without a GPU ----------------------------------------------------------------------


def nccl_loadable() -> bool:
    if channels.nccl_library_candidates():
        return True
    try:
        ctypes.CDLL("libnccl.so.2")
    except OSError:
        return False
    return True


@pytest.mark.skipif(nccl_loadable(), reason="an NCCL library is installed here")
def test_nccl_missing_library_raises_clearly() -> None:
    with pytest.raises(channels.NcclUnavailableError, match=r"(?s)no usable NCCL library.*/nonexistent/libnccl"):
        channels.nccl_get_unique_id(library="/nonexistent/libnccl.so.2")
    assert issubclass(channels.NcclUnavailableError, RuntimeError)
    if kv.HAS_CUDA:
        with pytest.raises(channels.NcclUnavailableError, match="no usable NCCL library"):
            channels.NcclChannel(b"\0" * 128, 2, 0)
    else:
        with pytest.raises(channels.CudaUnavailableError, match="has none"):
            channels.NcclChannel(b"\0" * 128, 2, 0)


def test_nccl_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSRL_NCCL_LIBRARY", "/opt/nccl/libnccl.so.2")
    found = channels.nccl_library_candidates("/explicit/libnccl.so.2")
    assert found[:2] == ["/explicit/libnccl.so.2", "/opt/nccl/libnccl.so.2"]
    wheel = [p for p in found[2:] if not Path(p).exists()]
    assert wheel == []  # a wheel's library is offered only when it is really there
    monkeypatch.delenv("PSRL_NCCL_LIBRARY")
    assert channels.nccl_library_candidates() == found[2:]


@pytest.mark.skipif(kv.HAS_CUDA, reason="only meaningful in a build without CUDA")
def test_cuda_ipc_without_cuda_build_raises() -> None:
    with pytest.raises(channels.CudaUnavailableError, match="CUDA IPC"):
        channels.CudaIpcBuffer(channels.CudaIpcDescriptor(b"\0" * 64, 0, (1,), "float16", 0))
    with pytest.raises(channels.CudaUnavailableError):
        channels.cuda_peer_copy_async(1, 0, 2, 0, 8)


@pytest.mark.skipif(not kv.HAS_CUDA, reason="needs psrl._kvx built with CUDA")
def test_cuda_ipc_argument_errors_without_a_device() -> None:
    with pytest.raises(ValueError, match="64 bytes"):
        _kvx.cuda_ipc_open(b"short", 0)
    with pytest.raises(ValueError, match="64 bytes"):
        _kvx.CudaEvent.from_ipc_handle(b"short", 0)
    with pytest.raises(ValueError, match="null"):
        _kvx.cuda_ipc_export(0)
    with pytest.raises(ValueError, match="128 bytes"):
        _kvx.NcclCommunicator(b"short", 2, 0, 0, [])
    with pytest.raises(ValueError, match="rank"):
        _kvx.NcclCommunicator(b"\0" * 128, 2, 2, 0, [])
    if _kvx.cuda_device_count() == 0:
        with pytest.raises(RuntimeError, match="cuda"):
            _kvx.cuda_ipc_open(b"\0" * 64, 0)
        with pytest.raises(RuntimeError):
            _kvx.CudaEvent(0, True)
