"""Cache layout and the block allocator."""

from __future__ import annotations

import pytest
import torch

from psrl.engine import BlockAllocator, CacheConfig, ConfigError, OutOfBlocks, PagedKVCache

from .helpers import model_config


def test_cache_layout_is_vllm_flash_attention_layout() -> None:
    cfg = model_config(num_hidden_layers=3)
    cache = PagedKVCache(cfg, CacheConfig(block_size=8, num_blocks=10))
    assert len(cache.layers) == 3
    for layer in cache.layers:
        assert layer.shape == (2, 10, 8, cfg.num_key_value_heads, cfg.head_dim)
        assert layer.is_contiguous()
        assert layer.dtype == torch.float32


def test_allocator_hands_out_distinct_blocks_and_takes_them_back() -> None:
    alloc = BlockAllocator(8)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert len(set(a) | set(b)) == 8
    assert alloc.num_free == 0 and alloc.num_used == 8 and alloc.num_total == 8
    with pytest.raises(OutOfBlocks) as err:
        alloc.allocate(1)
    assert err.value.requested == 1 and err.value.free == 0
    alloc.free(a)
    assert alloc.num_free == 3
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free([a[0]])
    with pytest.raises(ValueError, match="out of range"):
        alloc.free([99])
    assert sorted(alloc.allocate(3)) == sorted(a)
    assert alloc.allocate(0) == []


def test_cache_config_validation() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        CacheConfig(block_size=0)
    with pytest.raises(ConfigError, match="num_blocks"):
        CacheConfig(num_blocks=-1)
    assert CacheConfig(block_size=16, num_blocks=4).capacity_tokens == 64
