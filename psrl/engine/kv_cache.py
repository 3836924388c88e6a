"""Paged KV cache in vLLM's FlashAttention layout, and the free-list allocator of its blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from psrl.engine.config import ModelConfig
from psrl.engine.errors import ConfigError


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 1024

    def __post_init__(self) -> None:
        self.validate()

    @property
    def capacity_tokens(self) -> int:
        return self.block_size * self.num_blocks

    def validate(self) -> None:
        for name in ("block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class PagedKVCache:
    """Per layer one contiguous tensor `[2, num_blocks, block_size, num_kv_heads, head_size]` (0 = K, 1 = V),
    in psrl.kv's vocabulary (head_size: the model config's HF `head_dim`).

    Kept as plain contiguous tensors so the block gather/scatter extension (psrl._kvx) can address them.
    """

    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, *, device: str | torch.device = "cpu"
    ) -> None:
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks
        self.num_kv_heads = model_config.num_key_value_heads
        self.head_size = model_config.head_dim
        shape = (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        self.layers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=model_config.dtype, device=device) for _ in range(model_config.num_hidden_layers)
        ]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_size)
