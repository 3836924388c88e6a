"""psrl.kv host gather/scatter against the numpy reference in reference.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import psrl.kv as kv
from psrl import _kvx

from .reference import (
    Cache,
    gather_reference,
    make_cache,
    random_bits,
    scatter_reference,
    to_bits,
    typed_view,
)

torch = pytest.importorskip("torch")

DTYPES = ["float16", "bfloat16", "float32"]
LAYOUTS = ["contiguous", "block_major", "strided_blocks"]


def backend_for(dtype_name: str, seed: int) -> str:
    # bf16 only exists in torch; the other dtypes alternate between numpy and torch.
    return "torch" if dtype_name == "bfloat16" or seed % 2 else "numpy"


def random_caches(rng: np.random.Generator, dtype_name: str, backend: str, layout: str = "contiguous") -> list[Cache]:
    num_layers = int(rng.integers(1, 5))
    num_blocks = int(rng.integers(1, 40))
    block_size = int(rng.choice([1, 3, 16, 32]))
    num_kv_heads = int(rng.integers(1, 9))
    head_size = int(rng.choice([1, 7, 64, 128]))
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    return [make_cache(rng, *shape, dtype_name, backend, layout) for _ in range(num_layers)]


def new_buffer(rng: np.random.Generator, caches: list[Cache], num_ids: int, dtype_name: str, backend: str):
    shape = (len(caches), 2, num_ids, *caches[0].bits.shape[2:])
    bits = random_bits(rng, shape, dtype_name)
    return bits, typed_view(bits, dtype_name, backend)


def test_module_imports_and_reports_cuda() -> None:
    assert isinstance(_kvx.HAS_CUDA, bool)
    assert kv.HAS_CUDA is _kvx.HAS_CUDA
    assert _kvx.cuda_device_count() >= 0
    assert _kvx.default_num_threads() >= 1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_gather_matches_reference(seed: int, dtype_name: str, layout: str) -> None:
    rng = np.random.default_rng(seed)
    backend = backend_for(dtype_name, seed)
    caches = random_caches(rng, dtype_name, backend, layout)
    num_blocks = caches[0].bits.shape[1]
    block_ids = rng.integers(0, num_blocks, size=int(rng.integers(1, 2 * num_blocks + 1)))  # repeats
    num_threads = [None, 1, 2, 16][seed % 4]

    out = kv.gather_blocks([c.typed for c in caches], block_ids.tolist(), num_threads=num_threads)

    assert type(out) is type(caches[0].typed)
    assert out.dtype == caches[0].typed.dtype
    np.testing.assert_array_equal(to_bits(out, dtype_name), gather_reference(caches, block_ids))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_scatter_matches_reference(seed: int, dtype_name: str, layout: str) -> None:
    rng = np.random.default_rng(100 + seed)
    backend = backend_for(dtype_name, seed)
    caches = random_caches(rng, dtype_name, backend, layout)
    num_blocks = caches[0].bits.shape[1]
    block_ids = rng.choice(num_blocks, size=int(rng.integers(1, num_blocks + 1)), replace=False)
    buffer_bits, buffer = new_buffer(rng, caches, len(block_ids), dtype_name, backend)
    expected = scatter_reference(buffer_bits, caches, block_ids)

    kv.scatter_blocks(buffer, [c.typed for c in caches], block_ids, num_threads=[None, 1, 3][seed % 3])

    for cache, after in zip(caches, expected, strict=True):
        np.testing.assert_array_equal(cache.bits, after)


def test_negative_kv_stride_numpy() -> None:
    rng = np.random.default_rng(7)
    caches = [make_cache(rng, 9, 4, 2, 7, "float16", "numpy", "kv_reversed") for _ in range(2)]
    ids = np.array([8, 0, 3, 3])
    out = kv.gather_blocks([c.typed for c in caches], ids)
    np.testing.assert_array_equal(to_bits(out, "float16"), gather_reference(caches, ids))

    targets = np.array([1, 5, 2, 7])
    expected = scatter_reference(to_bits(out, "float16"), caches, targets)
    kv.scatter_blocks(out, [c.typed for c in caches], targets)
    for cache, after in zip(caches, expected, strict=True):
        np.testing.assert_array_equal(cache.bits, after)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_round_trip_between_caches(dtype_name: str) -> None:
    rng = np.random.default_rng(3)
    backend = "torch" if dtype_name == "bfloat16" else "numpy"
    source = [make_cache(rng, 30, 16, 2, 64, dtype_name, backend) for _ in range(3)]
    target = [make_cache(rng, 20, 16, 2, 64, dtype_name, backend, "block_major") for _ in range(3)]
    source_ids = rng.choice(30, size=12, replace=False)
    target_ids = rng.choice(20, size=12, replace=False)
    untouched = np.setdiff1d(np.arange(20), target_ids)
    before = [t.bits[:, untouched].copy() for t in target]

    buffer = kv.gather_blocks([c.typed for c in source], source_ids)
    kv.scatter_blocks(buffer, [c.typed for c in target], target_ids)

    for src, dst, kept in zip(source, target, before, strict=True):
        np.testing.assert_array_equal(dst.bits[:, target_ids], src.bits[:, source_ids])
        np.testing.assert_array_equal(dst.bits[:, untouched], kept)


@pytest.mark.parametrize("num_threads", [1, 2, 5, 64])
def test_thread_counts_agree_on_a_large_copy(num_threads: int) -> None:
    # Large enough (16 MiB) that the host path really splits the work over threads.
    rng = np.random.default_rng(11)
    caches = [make_cache(rng, 80, 16, 8, 128, "float16", "numpy", "block_major") for _ in range(4)]
    ids = rng.integers(0, 80, size=64)
    out = kv.gather_blocks([c.typed for c in caches], ids, num_threads=num_threads)
    np.testing.assert_array_equal(to_bits(out, "float16"), gather_reference(caches, ids))

    targets = rng.choice(80, size=64, replace=False)
    expected = scatter_reference(to_bits(out, "float16"), caches, targets)
    kv.scatter_blocks(out, [c.typed for c in caches], targets, num_threads=num_threads)
    for cache, after in zip(caches, expected, strict=True):
        np.testing.assert_array_equal(cache.bits, after)


def test_gather_into_given_out_and_id_containers() -> None:
    rng = np.random.default_rng(5)
    caches = [make_cache(rng, 10, 4, 2, 8, "float32", "torch") for _ in range(2)]
    ids = [4, 9, 0]
    expected = gather_reference(caches, np.array(ids))
    for block_ids in (ids, np.array(ids, dtype=np.int32), torch.tensor(ids)):
        out = torch.zeros(kv.buffer_shape([c.typed for c in caches], 3), dtype=torch.float32)
        returned = kv.gather_blocks([c.typed for c in caches], block_ids, out=out)
        assert returned is out
        np.testing.assert_array_equal(to_bits(out, "float32"), expected)


def test_empty_block_ids() -> None:
    rng = np.random.default_rng(0)
    caches = [make_cache(rng, 5, 2, 1, 8, "float16", "numpy") for _ in range(2)]
    out = kv.gather_blocks([c.typed for c in caches], [])
    assert out.shape == (2, 2, 0, 2, 1, 8)
    kv.scatter_blocks(out, [c.typed for c in caches], [])


def test_transfer_nbytes_and_layout() -> None:
    rng = np.random.default_rng(0)
    caches = [make_cache(rng, 12, 16, 8, 128, "float16", "numpy", "block_major").typed for _ in range(3)]
    assert kv.transfer_nbytes(caches, 5) == 3 * 2 * 5 * 16 * 8 * 128 * 2
    layout = kv.describe_kv_cache(caches)
    assert (layout.kv_stride, layout.block_stride) == (16 * 8 * 128, 2 * 16 * 8 * 128)
    assert layout.buffer_shape(5) == (3, 2, 5, 16, 8, 128)


def test_concurrent_python_threads() -> None:
    rng = np.random.default_rng(21)
    jobs = []
    for _ in range(8):
        caches = [make_cache(rng, 40, 16, 4, 64, "float16", "numpy", "block_major") for _ in range(3)]
        jobs.append((caches, rng.integers(0, 40, size=32)))
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def run(caches: list[Cache], ids: np.ndarray) -> None:
        try:
            barrier.wait()
            for _ in range(5):
                out = kv.gather_blocks([c.typed for c in caches], ids, num_threads=2)
                np.testing.assert_array_equal(to_bits(out, "float16"), gather_reference(caches, ids))
        except BaseException as exc:  # reported to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# --- errors: every bad input raises, nothing crashes --------------------------------------------------


@pytest.fixture
def small_caches() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [make_cache(rng, 6, 4, 2, 8, "float16", "numpy").typed for _ in range(2)]


@pytest.mark.parametrize("bad_id", [6, 100, -1])
def test_out_of_range_ids(small_caches: list[np.ndarray], bad_id: int) -> None:
    with pytest.raises(IndexError, match="out of range"):
        kv.gather_blocks(small_caches, [0, bad_id])
    buffer = np.zeros(kv.buffer_shape(small_caches, 2), dtype=np.float16)
    with pytest.raises(IndexError, match="out of range"):
        kv.scatter_blocks(buffer, small_caches, [0, bad_id])


def test_scatter_rejects_repeated_targets(small_caches: list[np.ndarray]) -> None:
    buffer = np.zeros(kv.buffer_shape(small_caches, 3), dtype=np.float16)
    with pytest.raises(ValueError, match="distinct"):
        kv.scatter_blocks(buffer, small_caches, [1, 2, 1])


def test_wrong_buffer_shape_and_dtype(small_caches: list[np.ndarray]) -> None:
    with pytest.raises(ValueError, match="shape"):
        kv.gather_blocks(small_caches, [1, 2], out=np.zeros((2, 2, 3, 4, 2, 8), dtype=np.float16))
    with pytest.raises(ValueError, match="dtype"):
        kv.gather_blocks(small_caches, [1, 2], out=np.zeros((2, 2, 2, 4, 2, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="shape"):
        kv.scatter_blocks(np.zeros((2, 2, 1, 4, 2, 8), dtype=np.float16), small_caches, [1, 2])
    strided = np.zeros((2, 2, 4, 4, 2, 8), dtype=np.float16)[:, :, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        kv.gather_blocks(small_caches, [1, 2], out=strided)


def test_mismatched_layers(small_caches: list[np.ndarray]) -> None:
    with pytest.raises(ValueError, match=r"layer_caches\[1\]: shape"):
        kv.gather_blocks([small_caches[0], np.zeros((2, 7, 4, 2, 8), np.float16)], [0])
    with pytest.raises(ValueError, match=r"layer_caches\[1\]: dtype"):
        kv.gather_blocks([small_caches[0], small_caches[1].astype(np.float32)], [0])
    with pytest.raises(ValueError, match="strides"):
        other = np.zeros((6, 2, 4, 2, 8), np.float16).transpose(1, 0, 2, 3, 4)
        kv.gather_blocks([small_caches[0], other], [0])
    with pytest.raises(ValueError, match="empty"):
        kv.gather_blocks([], [0])


def test_non_contiguous_inner_block() -> None:
    cache = np.zeros((2, 6, 4, 2, 16), dtype=np.float16)[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        kv.gather_blocks([cache], [0])
    hnd = np.zeros((2, 6, 2, 4, 8), dtype=np.float16).transpose(0, 1, 3, 2, 4)  # HND is supported
    assert kv.gather_blocks([hnd], [0]).shape == (1, 2, 1, 4, 2, 8)


def test_bad_shapes_dtypes_and_ids(small_caches: list[np.ndarray]) -> None:
    with pytest.raises(ValueError, match="expected shape"):
        kv.gather_blocks([np.zeros((3, 6, 4, 2, 8), np.float16)], [0])
    with pytest.raises(ValueError, match="expected shape"):
        kv.gather_blocks([np.zeros((2, 6, 4, 8), np.float16)], [0])
    with pytest.raises(ValueError, match="itemsize"):
        kv.gather_blocks([np.zeros((2, 6, 4, 2, 8), np.int8)], [0])
    with pytest.raises(ValueError, match="itemsize"):
        kv.gather_blocks([np.zeros((2, 6, 4, 2, 8), np.float64)], [0])
    with pytest.raises(ValueError, match="one-dimensional"):
        kv.gather_blocks(small_caches, [[0, 1]])
    with pytest.raises(ValueError, match="integers"):
        kv.gather_blocks(small_caches, [0.5])
    with pytest.raises(TypeError):
        kv.gather_blocks([[0.0] * 8], [0])


def test_read_only_destinations(small_caches: list[np.ndarray]) -> None:
    buffer = kv.gather_blocks(small_caches, [0])
    frozen = [c.copy() for c in small_caches]
    for c in frozen:
        c.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kv.scatter_blocks(buffer, frozen, [1])
    buffer.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kv.gather_blocks(small_caches, [0], out=buffer)


def test_native_module_validates_raw_arguments() -> None:
    cache = np.zeros((2, 4, 2, 2, 8), dtype=np.float16)
    buffer = np.zeros((1, 2, 2, 2, 2, 8), dtype=np.float16)
    geometry = dict(
        layer_ptrs=[cache.ctypes.data],
        num_blocks=4,
        block_size=2,
        num_kv_heads=2,
        head_size=8,
        itemsize=2,
        kv_stride=4 * 32,
        block_stride=32,
    )
    layout = _kvx.KVCacheLayout(**geometry)
    assert (layout.layer_ptrs, layout.head_size, layout.token_stride, layout.head_stride) == (
        [cache.ctypes.data],
        8,
        16,
        8,
    )  # NHD strides by default
    args = dict(layout=layout, block_ids=np.array([0, 3]), dst_ptr=buffer.ctypes.data, dst_nbytes=buffer.nbytes)
    _kvx.gather_blocks(**args)
    with pytest.raises(ValueError, match="bytes, expected"):
        _kvx.gather_blocks(**{**args, "dst_nbytes": buffer.nbytes - 2})
    with pytest.raises(ValueError, match="itemsize"):
        _kvx.KVCacheLayout(**{**geometry, "itemsize": 8})
    with pytest.raises(ValueError, match="null"):
        _kvx.KVCacheLayout(**{**geometry, "layer_ptrs": [0]})
    with pytest.raises(ValueError, match="null"):
        _kvx.gather_blocks(**{**args, "dst_ptr": 0})
    with pytest.raises(ValueError, match="at least one layer"):
        _kvx.KVCacheLayout(**{**geometry, "layer_ptrs": []})
    with pytest.raises(ValueError, match="positive"):
        _kvx.KVCacheLayout(**{**geometry, "block_size": 0})
    with pytest.raises(IndexError):
        _kvx.gather_blocks(**{**args, "block_ids": [0, 4]})
    with pytest.raises(ValueError, match="one-dimensional"):
        _kvx.gather_blocks(**{**args, "block_ids": np.zeros((1, 2), dtype=np.int64)})
    with pytest.raises(AttributeError):
        layout.num_blocks = 8  # type: ignore[misc]  # checked once, so immutable


class FakeCudaTensor:
    """Just enough of a torch CUDA tensor for psrl.kv to route it to the CUDA path."""

    dtype = "torch.float16"
    is_cuda = True

    class device:  # mimics torch.device
        index = 0
        type = "cuda"

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def data_ptr(self) -> int:
        return 1 << 20  # never dereferenced: the call must fail before any copy

    def stride(self) -> tuple[int, ...]:
        strides, step = [], 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= size
        return tuple(reversed(strides))

    def element_size(self) -> int:
        return 2

    def new_empty(self, shape: tuple[int, ...]) -> FakeCudaTensor:
        return FakeCudaTensor(shape)


@pytest.mark.skipif(_kvx.HAS_CUDA, reason="only meaningful in a build without CUDA")
def test_cuda_tensors_without_cuda_build_raise() -> None:
    cache = FakeCudaTensor((2, 4, 2, 2, 8))
    with pytest.raises(RuntimeError, match="without CUDA"):
        kv.gather_blocks([cache], [1])
    with pytest.raises(RuntimeError, match="without CUDA"):
        kv.scatter_blocks(FakeCudaTensor((1, 2, 1, 2, 2, 8)), [cache], [1])
