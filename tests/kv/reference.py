"""Numpy reference for psrl.kv gather/scatter, plus cache builders shared by the kv tests.

Every cache is backed by a numpy integer array of raw bits (uint16 for fp16/bf16, uint32 for fp32), so
the reference compares bits exactly and works for bf16, which numpy cannot represent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

BITS_DTYPE = {"float16": np.uint16, "bfloat16": np.uint16, "float32": np.uint32}
NUMPY_DTYPE = {"float16": np.float16, "float32": np.float32}


@dataclass
class Cache:
    """One layer: `bits` is the reference view, `typed` the same memory as numpy or torch."""

    bits: np.ndarray  # [2, num_blocks, block_size, num_kv_heads, head_size], may be strided
    typed: Any


def random_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype_name: str) -> np.ndarray:
    bits_dtype = BITS_DTYPE[dtype_name]
    return rng.integers(0, np.iinfo(bits_dtype).max, size=shape, dtype=bits_dtype, endpoint=True)


def typed_view(bits: np.ndarray, dtype_name: str, backend: str) -> Any:
    if backend == "numpy":
        return bits.view(NUMPY_DTYPE[dtype_name])
    import torch

    return torch.from_numpy(bits).view(getattr(torch, dtype_name))


def to_bits(typed: Any, dtype_name: str) -> np.ndarray:
    if isinstance(typed, np.ndarray):
        return typed.view(BITS_DTYPE[dtype_name])
    import torch

    bits_torch = torch.int16 if BITS_DTYPE[dtype_name] == np.uint16 else torch.int32
    return typed.detach().cpu().contiguous().view(bits_torch).numpy().view(BITS_DTYPE[dtype_name])


def make_cache(
    rng: np.random.Generator,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype_name: str,
    backend: str,
    layout: str = "contiguous",
) -> Cache:
    """layout: contiguous | block_major ([num_blocks, 2, ...] transposed) | strided_blocks | kv_reversed."""
    inner = (block_size, num_kv_heads, head_size)
    if layout == "contiguous":
        bits = random_bits(rng, (2, num_blocks, *inner), dtype_name)
    elif layout == "block_major":
        bits = random_bits(rng, (num_blocks, 2, *inner), dtype_name).transpose(1, 0, 2, 3, 4)
    elif layout == "strided_blocks":
        bits = random_bits(rng, (2, 2 * num_blocks + 1, *inner), dtype_name)[:, 1::2]
    elif layout == "kv_reversed":  # negative kv stride: numpy only
        bits = random_bits(rng, (2, num_blocks, *inner), dtype_name)[::-1]
    else:
        raise ValueError(layout)
    return Cache(bits=bits, typed=typed_view(bits, dtype_name, backend))


def gather_reference(caches: list[Cache], block_ids: np.ndarray) -> np.ndarray:
    return np.stack([cache.bits[:, block_ids] for cache in caches])


def scatter_reference(buffer_bits: np.ndarray, caches: list[Cache], block_ids: np.ndarray) -> list[np.ndarray]:
    expected = []
    for layer, cache in enumerate(caches):
        after = cache.bits.copy()
        after[:, block_ids] = buffer_bits[layer]
        expected.append(after)
    return expected
