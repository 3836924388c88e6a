"""psrl.kv on a GPU: the one-launch kernels with HND strides and a partial last block, CUDA IPC between two
processes (scatter reading peer memory, gather writing it, cudaMemcpyPeerAsync, interprocess events) and,
with two GPUs and an NCCL library, the NCCL channel. Skipped without a CUDA build and a device."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import pytest

import psrl.kv as kv
from psrl import _kvx
from psrl.kv import channels

from .reference import random_bits, to_bits
from .test_channels import gather_ref, make_caches, scatter_ref

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (_kvx.HAS_CUDA and torch.cuda.is_available()),
        reason="needs a CUDA device and psrl._kvx built with CUDA",
    ),
]

SHAPE = (16, 4, 64)  # block_size, heads, head_size


def to_cuda(caches: list[Any]) -> list[Any]:
    """Device copies that keep each host layer's strides (NHD, HND, block-major...)."""
    out = []
    for t in caches:
        if isinstance(t, np.ndarray):
            t = torch.from_numpy(t)
        out.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda").copy_(t))
    return out


def device_caches(seed: int, layers: int, blocks: int, dtype_name: str, layout: str, shape=SHAPE):
    bits, host = make_caches(seed, layers, blocks, shape, dtype_name, layout)
    if dtype_name != "bfloat16":
        host = [torch.from_numpy(h) for h in host]
    return bits, to_cuda(host)


# --- kernels --------------------------------------------------------------------------------------------

KERNEL_CASES = [
    # (dtype, layout, (block_size, heads, head_size))
    ("float16", "NHD", (16, 8, 128)),
    ("bfloat16", "HND", (16, 8, 128)),  # 16-byte vectors on the strided path
    ("float32", "HND_block_major", (16, 2, 64)),
    ("float16", "HND", (3, 5, 7)),  # 2-byte fallback, odd sizes
    ("bfloat16", "block_major", (32, 1, 64)),
]


@pytest.mark.parametrize(("dtype_name", "layout", "shape"), KERNEL_CASES)
def test_cuda_strided_and_partial(dtype_name: str, layout: str, shape: tuple[int, int, int]) -> None:
    block_size = shape[0]
    bits, caches = device_caches(3, 3, 40, dtype_name, layout, shape)
    rng = np.random.default_rng(4)
    ids = rng.choice(40, size=12, replace=False)
    for num_tokens in (None, 11 * block_size + 1, 12 * block_size - 1 if block_size > 1 else None):
        out = kv.gather_blocks(caches, ids, num_tokens=num_tokens)
        torch.cuda.synchronize()
        assert out.is_cuda
        np.testing.assert_array_equal(to_bits(out, dtype_name), gather_ref(bits, ids, num_tokens))

        targets = rng.choice(40, size=12, replace=False)
        buffer_bits = random_bits(rng, (3, 2, 12, *shape), dtype_name)
        before = [to_bits(c, dtype_name) for c in caches]
        expected = scatter_ref(buffer_bits, before, targets, num_tokens)
        int_dtype = torch.int16 if buffer_bits.dtype == np.uint16 else torch.int32
        buffer = torch.from_numpy(buffer_bits.view(np.int16 if int_dtype == torch.int16 else np.int32))
        buffer = buffer.view(getattr(torch, dtype_name)).cuda()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            kv.scatter_blocks(buffer, caches, targets, num_tokens=num_tokens)
        stream.synchronize()
        for cache, after in zip(caches, expected, strict=True):
            np.testing.assert_array_equal(to_bits(cache, dtype_name), after)
        bits = [to_bits(c, dtype_name) for c in caches]


def test_events_and_peer_copy_in_one_process() -> None:
    src = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    event = channels.cuda_peer_copy_async(dst.data_ptr(), 0, src.data_ptr(), 0, src.numel() * 4)
    event.synchronize()
    assert event.query() and torch.equal(src, dst)
    waiter = _kvx.CudaEvent(0, False)
    stream = torch.cuda.Stream()
    waiter.record(torch.cuda.current_stream().cuda_stream)
    waiter.wait(stream.cuda_stream)
    stream.synchronize()
    assert _kvx.cuda_pointer_device(src.data_ptr()) == 0
    with pytest.raises(ValueError, match="interprocess"):
        waiter.ipc_handle()


# --- CUDA IPC between two processes ------------------------------------------------------------------------

_LIVE: dict[str, Any] = {}


def child_export(seed: int, dtype_name: str, layout: str, ids: list[int], num_tokens: int | None) -> dict[str, Any]:
    _, caches = device_caches(seed, 2, 30, dtype_name, layout)
    buffer = kv.gather_blocks(caches, ids, num_tokens=num_tokens)  # on torch's current stream, not synced
    export = channels.CudaIpcExport(buffer, num_tokens=num_tokens)  # event recorded after the gather
    _LIVE["export"] = (export, caches)
    return export.descriptor.to_dict()


def child_release() -> bool:
    export, _ = _LIVE.pop("export")
    export.close()
    return True


def child_push(seed: int, dtype_name: str, layout: str, ids: list[int], descriptor: dict[str, Any]) -> bool:
    _, caches = device_caches(seed, 2, 30, dtype_name, layout)
    with channels.CudaIpcBuffer.open(channels.CudaIpcDescriptor.from_dict(descriptor), 0) as peer:
        done = peer.gather(caches, ids)  # one kernel writing the parent's memory
        done.synchronize()
    return True


@pytest.fixture(scope="module")
def worker() -> Iterator[ProcessPoolExecutor]:
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


@pytest.mark.parametrize(
    ("dtype_name", "src_layout", "dst_layout", "num_tokens"),
    [("float16", "NHD", "HND", 7 * 16 + 3), ("bfloat16", "HND", "NHD", None), ("float32", "HND", "HND", 8 * 16)],
)
def test_ipc_pull(
    worker: ProcessPoolExecutor, dtype_name: str, src_layout: str, dst_layout: str, num_tokens: int | None
) -> None:
    rng = np.random.default_rng(5)
    src_ids = rng.choice(30, size=8, replace=False)
    dst_ids = rng.choice(40, size=8, replace=False)
    descriptor = channels.CudaIpcDescriptor.from_dict(
        worker.submit(child_export, 31, dtype_name, src_layout, src_ids.tolist(), num_tokens).result()
    )
    assert descriptor.shape == (2, 2, 8, *SHAPE) and len(descriptor.handle) == 64
    src_bits, _ = make_caches(31, 2, 30, SHAPE, dtype_name, src_layout)
    dst_bits, dst = device_caches(32, 2, 40, dtype_name, dst_layout)
    expected_buffer = gather_ref(src_bits, src_ids, num_tokens)
    expected = scatter_ref(expected_buffer, dst_bits, dst_ids, num_tokens)
    try:
        with channels.CudaIpcBuffer.open(descriptor, 0) as peer:
            done = peer.scatter(dst, dst_ids)  # one kernel reading the child's memory
            local = torch.empty(descriptor.shape, dtype=getattr(torch, dtype_name), device="cuda")
            copied = peer.copy_to(local)  # cudaMemcpyPeerAsync
            done.synchronize()
            copied.synchronize()
    finally:
        assert worker.submit(child_release).result()
    for cache, after in zip(dst, expected, strict=True):
        np.testing.assert_array_equal(to_bits(cache, dtype_name), after)
    np.testing.assert_array_equal(to_bits(local, dtype_name), expected_buffer)


def test_ipc_push(worker: ProcessPoolExecutor) -> None:
    ids = [4, 0, 29, 7]
    src_bits, _ = make_caches(41, 2, 30, SHAPE, "bfloat16", "HND")
    buffer = torch.full((2, 2, 4, *SHAPE), 7.0, dtype=torch.bfloat16, device="cuda")
    with channels.CudaIpcExport(buffer) as export:
        assert worker.submit(child_push, 41, "bfloat16", "HND", ids, export.descriptor.to_dict()).result()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(to_bits(buffer, "bfloat16"), gather_ref(src_bits, np.array(ids), None))


def test_ipc_errors() -> None:
    host = torch.zeros(16)
    with pytest.raises(ValueError, match="CUDA tensors"):
        channels.CudaIpcExport(host)
    with pytest.raises(ValueError, match="contiguous"):
        channels.CudaIpcExport(torch.zeros((4, 4), device="cuda").t())
    with pytest.raises(ValueError, match="not device memory"):
        _kvx.cuda_ipc_export(host.data_ptr())
    buffer = torch.zeros(64, device="cuda")
    with channels.CudaIpcExport(buffer) as export, pytest.raises(RuntimeError, match="cudaIpcOpenMemHandle"):
        channels.CudaIpcBuffer.open(export.descriptor, 0)  # the exporting process cannot open its own handle


# --- NCCL between two GPUs ------------------------------------------------------------------------------------


def nccl_ready() -> bool:
    if torch.cuda.device_count() < 2:
        return False
    try:
        _kvx.nccl_load(channels.nccl_library_candidates())
    except channels.NcclUnavailableError:
        return False
    return True


def child_nccl_recv(unique_id: bytes, ids: list[int], num_tokens: int) -> list[np.ndarray]:
    torch.cuda.set_device(1)
    _, caches = make_caches(52, 2, 20, SHAPE, "float16", "HND")
    device = [torch.from_numpy(c).to("cuda:1") for c in caches]
    with channels.NcclChannel(unique_id, 2, 1, device=1) as comm:
        comm.recv_blocks(device, ids, peer=0, num_tokens=num_tokens)
        torch.cuda.synchronize(1)
    return [to_bits(c, "float16") for c in device]


@pytest.mark.skipif(not nccl_ready(), reason="needs 2 GPUs and an NCCL library")
def test_nccl_send_recv_blocks(worker: ProcessPoolExecutor) -> None:
    unique_id = channels.nccl_get_unique_id()
    assert len(unique_id) == 128
    src_bits, src = device_caches(51, 2, 20, "float16", "NHD")
    src_ids, dst_ids, num_tokens = [3, 9, 1], [0, 5, 19], 2 * 16 + 4
    receiving = worker.submit(child_nccl_recv, unique_id, dst_ids, num_tokens)
    with channels.NcclChannel(unique_id, 2, 0, device=0) as comm:
        comm.send_blocks(src, src_ids, peer=1, num_tokens=num_tokens)
        torch.cuda.synchronize(0)
    got = receiving.result(timeout=120)
    dst_bits, _ = make_caches(52, 2, 20, SHAPE, "float16", "HND")
    expected = scatter_ref(gather_ref(src_bits, np.array(src_ids), num_tokens), dst_bits, np.array(dst_ids), num_tokens)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, e)
