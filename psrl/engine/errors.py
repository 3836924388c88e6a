"""Typed errors of the reference engine; each carries a short `code` for the layer that maps it to a wire status."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the reference engine raises on purpose."""

    code = "engine_error"


class InvalidRequestError(EngineError, ValueError):
    """A request (or its sampling options) the engine refuses at admission; never retried as is."""

    code = "invalid_request"


class EmptyPromptError(InvalidRequestError):
    code = "empty_prompt"


class TokenOutOfRangeError(InvalidRequestError):
    code = "token_out_of_range"


class DuplicateRequestError(InvalidRequestError):
    code = "duplicate_request_id"


class MaxModelLenExceededError(InvalidRequestError):
    code = "max_model_len_exceeded"


class KVCacheTooSmallError(InvalidRequestError):
    """The request could never fit in the KV cache, even alone."""

    code = "kv_cache_too_small"


class InvalidSamplingError(InvalidRequestError):
    code = "invalid_sampling"


class ConfigError(EngineError, ValueError):
    code = "invalid_config"


class WeightLoadError(EngineError, ValueError):
    """Weights that do not match the model config: missing, unexpected or mis-shaped tensors."""

    code = "weight_load_failed"


class OutOfBlocks(EngineError):
    """The block allocator has fewer free blocks than asked for."""

    code = "out_of_kv_blocks"

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"asked for {requested} KV blocks but only {free} are free")
        self.requested = requested
        self.free = free


class EngineStepError(EngineError, RuntimeError):
    """A model step failed; the requests it had scheduled were failed and removed, the engine lives on."""

    code = "engine_step_failed"

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids


class KvEventsOverflowError(EngineError, RuntimeError):
    """A KV-event subscriber fell too far behind and was dropped; it resubscribes to get a fresh snapshot."""

    code = "kv_events_overflow"


class AdmissionClosedError(EngineError, RuntimeError):
    """The engine takes no new requests right now (a weight sync paused it, or a sync failed).

    Not a ValueError: the request itself is fine; the servicer answers it with an empty "abort" frame.
    """

    code = "admission_closed"

    def __init__(self, reason: str) -> None:
        super().__init__(f"admission is closed: {reason}")
        self.reason = reason


class EngineDeadError(EngineError, RuntimeError):
    """The async engine was shut down (or its thread died); no more requests are served."""

    code = "engine_dead"
