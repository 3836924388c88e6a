"""Reference engine: a small Qwen2-like transformer with a vLLM-layout paged KV cache and continuous batching."""

from psrl.engine.async_engine import AsyncEngine, KvEventStream, RequestStream
from psrl.engine.config import ModelConfig
from psrl.engine.engine import Engine, EngineStats
from psrl.engine.errors import (
    AdmissionClosedError,
    ConfigError,
    DuplicateRequestError,
    EmptyPromptError,
    EngineDeadError,
    EngineError,
    EngineStepError,
    InvalidRequestError,
    InvalidSamplingError,
    KVCacheTooSmallError,
    KvEventsOverflowError,
    MaxModelLenExceededError,
    OutOfBlocks,
    TokenOutOfRangeError,
    WeightLoadError,
)
from psrl.engine.kv_cache import CacheConfig, PagedKVCache
from psrl.engine.kv_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventsUpdate,
    StoredBlock,
)
from psrl.engine.kv_manager import KvManager
from psrl.engine.model import Qwen2Model
from psrl.engine.prefix_cache import BlockPool, hash_block_tokens
from psrl.engine.request import FinishReason, RequestOutput
from psrl.engine.sampler import SamplingOptions
from psrl.engine.sync import KvLease, KvSource, PauseMode, PreloadedKV, SyncAbortedRequest, common_prefix

__all__ = [
    "AdmissionClosedError",
    "AllBlocksCleared",
    "AsyncEngine",
    "BlockPool",
    "BlocksRemoved",
    "BlocksStored",
    "CacheConfig",
    "ConfigError",
    "DuplicateRequestError",
    "EmptyPromptError",
    "Engine",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "EngineStepError",
    "FinishReason",
    "InvalidRequestError",
    "InvalidSamplingError",
    "KVCacheTooSmallError",
    "KvEvent",
    "KvEventStream",
    "KvEventsOverflowError",
    "KvEventsUpdate",
    "KvLease",
    "KvManager",
    "KvSource",
    "MaxModelLenExceededError",
    "ModelConfig",
    "OutOfBlocks",
    "PagedKVCache",
    "PauseMode",
    "PreloadedKV",
    "Qwen2Model",
    "RequestOutput",
    "RequestStream",
    "SamplingOptions",
    "StoredBlock",
    "SyncAbortedRequest",
    "TokenOutOfRangeError",
    "WeightLoadError",
    "common_prefix",
    "hash_block_tokens",
]
