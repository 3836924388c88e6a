"""psrl.kv CUDA gather/scatter against the numpy reference (needs a GPU and a CUDA build)."""

from __future__ import annotations

import numpy as np
import pytest

import psrl.kv as kv
from psrl import _kvx

from .reference import gather_reference, make_cache, random_bits, scatter_reference, to_bits

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (_kvx.HAS_CUDA and torch.cuda.is_available()),
        reason="needs a CUDA device and psrl._kvx built with CUDA",
    ),
]

CASES = [
    # (num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, layout)
    (4, 64, 16, 8, 128, "float16", "contiguous"),  # 16-byte vector path
    (3, 33, 16, 2, 64, "bfloat16", "block_major"),
    (2, 17, 3, 1, 7, "float16", "strided_blocks"),  # 2-byte scalar fallback
    (1, 9, 1, 5, 7, "float32", "contiguous"),  # 4-byte path
    (2, 40, 32, 4, 128, "float32", "block_major"),
    # More ids than one launch's pointer table holds (~4000): split over launches.
    (3, 9000, 1, 2, 8, "float32", "contiguous"),
    (2, 2500, 2, 1, 8, "float16", "strided_blocks"),
]


def to_cuda(caches):
    # Keep each host layout's strides on the device so the kernel sees the same kv/block strides.
    device_caches = []
    for cache in caches:
        t = cache.typed
        device_caches.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda").copy_(t))
    return device_caches


@pytest.mark.parametrize("case", CASES)
def test_cuda_gather_matches_reference(case) -> None:
    num_layers, num_blocks, block_size, heads, head_size, dtype_name, layout = case
    rng = np.random.default_rng(num_blocks)
    shape = (num_blocks, block_size, heads, head_size)
    caches = [make_cache(rng, *shape, dtype_name, "torch", layout) for _ in range(num_layers)]
    device_caches = to_cuda(caches)
    ids = rng.integers(0, num_blocks, size=2 * num_blocks)  # repeats

    out = kv.gather_blocks(device_caches, ids)
    torch.cuda.synchronize()

    assert out.is_cuda
    np.testing.assert_array_equal(to_bits(out, dtype_name), gather_reference(caches, ids))


@pytest.mark.parametrize("case", CASES)
def test_cuda_scatter_matches_reference(case) -> None:
    num_layers, num_blocks, block_size, heads, head_size, dtype_name, layout = case
    rng = np.random.default_rng(1000 + num_blocks)
    shape = (num_blocks, block_size, heads, head_size)
    caches = [make_cache(rng, *shape, dtype_name, "torch", layout) for _ in range(num_layers)]
    device_caches = to_cuda(caches)
    ids = rng.choice(num_blocks, size=max(1, num_blocks // 2), replace=False)
    buffer_bits = random_bits(rng, (num_layers, 2, len(ids), block_size, heads, head_size), dtype_name)
    expected = scatter_reference(buffer_bits, caches, ids)
    bits_torch = torch.int16 if dtype_name != "float32" else torch.int32
    buffer = torch.from_numpy(buffer_bits.view(np.int16 if bits_torch == torch.int16 else np.int32))
    buffer = buffer.view(getattr(torch, dtype_name)).to("cuda")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kv.scatter_blocks(buffer, device_caches, ids)
    stream.synchronize()

    for device_cache, after in zip(device_caches, expected, strict=True):
        np.testing.assert_array_equal(to_bits(device_cache, dtype_name), after)


def test_cuda_round_trip_and_device_count() -> None:
    assert _kvx.cuda_device_count() >= 1
    rng = np.random.default_rng(5)
    source = to_cuda([make_cache(rng, 50, 16, 8, 128, "bfloat16", "torch") for _ in range(2)])
    target = to_cuda([make_cache(rng, 30, 16, 8, 128, "bfloat16", "torch", "block_major") for _ in range(2)])
    src_ids = rng.choice(50, size=20, replace=False)
    dst_ids = rng.choice(30, size=20, replace=False)
    kv.scatter_blocks(kv.gather_blocks(source, src_ids), target, dst_ids)
    torch.cuda.synchronize()
    for s, t in zip(source, target, strict=True):
        assert torch.equal(t[:, torch.as_tensor(dst_ids, device="cuda")], s[:, torch.as_tensor(src_ids, device="cuda")])


def test_cuda_errors_raise() -> None:
    cache = torch.zeros((2, 4, 2, 2, 8), dtype=torch.float16, device="cuda")
    with pytest.raises(IndexError):
        kv.gather_blocks([cache], [4])
    with pytest.raises(ValueError, match="lives in"):
        kv.gather_blocks([cache], [0], out=np.zeros((1, 2, 1, 2, 2, 8), dtype=np.float16))
