"""Reference engine: a small Qwen2-like transformer with a vLLM-layout paged KV cache and continuous batching."""

from psrl.engine.async_engine import AsyncEngine, RequestStream
from psrl.engine.config import ModelConfig
from psrl.engine.engine import Engine, EngineStats
from psrl.engine.errors import (
    ConfigError,
    DuplicateRequestError,
    EmptyPromptError,
    EngineDeadError,
    EngineError,
    EngineStepError,
    InvalidRequestError,
    InvalidSamplingError,
    KVCacheTooSmallError,
    MaxModelLenExceededError,
    OutOfBlocks,
    TokenOutOfRangeError,
    WeightLoadError,
)
from psrl.engine.kv_cache import BlockAllocator, CacheConfig, PagedKVCache
from psrl.engine.model import Qwen2Model
from psrl.engine.request import RequestOutput
from psrl.engine.sampler import SamplingOptions

__all__ = [
    "AsyncEngine",
    "BlockAllocator",
    "CacheConfig",
    "ConfigError",
    "DuplicateRequestError",
    "EmptyPromptError",
    "Engine",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "EngineStepError",
    "InvalidRequestError",
    "InvalidSamplingError",
    "KVCacheTooSmallError",
    "MaxModelLenExceededError",
    "ModelConfig",
    "OutOfBlocks",
    "PagedKVCache",
    "Qwen2Model",
    "RequestOutput",
    "RequestStream",
    "SamplingOptions",
    "TokenOutOfRangeError",
    "WeightLoadError",
]
