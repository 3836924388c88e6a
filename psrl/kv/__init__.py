"""KV-cache block movement for migrating requests between engines."""

from psrl.kv.blocks import (
    HAS_CUDA,
    KVCacheLayout,
    buffer_shape,
    describe_kv_cache,
    gather_blocks,
    scatter_blocks,
    transfer_nbytes,
)

__all__ = [
    "HAS_CUDA",
    "KVCacheLayout",
    "buffer_shape",
    "describe_kv_cache",
    "gather_blocks",
    "scatter_blocks",
    "transfer_nbytes",
]
