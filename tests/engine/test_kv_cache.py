"""Cache layout and the block allocator."""

from __future__ import annotations

import pytest
import torch

from psrl.engine import CacheConfig, ConfigError, PagedKVCache

from .helpers import model_config


def test_cache_layout_is_vllm_flash_attention_layout() -> None:
    cfg = model_config(num_hidden_layers=3)
    cache = PagedKVCache(cfg, CacheConfig(block_size=8, num_blocks=10))
    assert len(cache.layers) == 3
    for layer in cache.layers:
        assert layer.shape == (2, 10, 8, cfg.num_key_value_heads, cfg.head_dim)
        assert layer.is_contiguous()
        assert layer.dtype == torch.float32


def test_cache_config_validation() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        CacheConfig(block_size=0)
    with pytest.raises(ConfigError, match="num_blocks"):
        CacheConfig(num_blocks=-1)
    assert CacheConfig(block_size=16, num_blocks=4).capacity_tokens == 64
