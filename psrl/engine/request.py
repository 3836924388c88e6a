"""Per-request state inside the engine, and the delta output a step returns for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from psrl.engine.routing import RoutingRecorder
from psrl.engine.sampler import SamplingOptions
from psrl.engine.stop_strings import StopStringDetector


class RequestStatus(enum.Enum):
    WAITING_FOR_KV = "waiting_for_kv"  # admitted, not schedulable until its migrated KV lands (or fails)
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a request ended (wire values, as vLLM's)."""

    STOP = "stop"  # an EOS or stop token id, or a stop string
    LENGTH = "length"  # max_tokens, or the model's or the cache's length limit
    ABORT = "abort"  # aborted: by the client, a sync pause or a shutdown


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta: only the new tokens)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    new_top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: FinishReason | None  # None while it runs
    matched_stop_token_id: int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int  # total so far, this delta included
    matched_stop_str: str | None = None  # the stop string that ended it (then matched_stop_token_id is None)
    index: int = 0  # which choice of an n > 1 request (set by AsyncEngine's stream)
    # On the finished output of a request that asked (SamplingOptions.routed_experts_prompt_start): its routed
    # experts [n, num_moe_layers, top_k], row i = position prompt_start + i, up to the last position it fed.
    routed_experts: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Request:
    """A sequence being generated: its tokens, its KV blocks and how many of its tokens the cache holds."""

    __slots__ = (
        "block_hashes",
        "block_ids",
        "cache_epoch",
        "generator",
        "max_total_tokens",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_tokens",
        "pin_on_sync_abort",
        "request_id",
        "routing",
        "sampling",
        "status",
        "stop_detector",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        max_total_tokens: int,
        *,
        stop_detector: StopStringDetector | None = None,
        pin_on_sync_abort: bool = True,
        routing: RoutingRecorder | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output so far
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.max_total_tokens = max_total_tokens  # prompt + output may not exceed this
        self.block_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        # Prefix caching: hashes of the full blocks of token_ids (filled lazily), how many leading
        # block_ids are registered in the prefix cache (or were served from it), the pool epoch the
        # request's KV was computed under, and the prompt tokens served from the cache at first
        # admission (-1 until then; what vLLM reports as num_cached_tokens).
        self.block_hashes: list[int] = []
        self.num_cached_blocks = 0
        self.cache_epoch = 0
        self.num_cached_tokens = -1
        self.status = RequestStatus.WAITING
        self.stop_detector = stop_detector  # decodes the output when it has stop strings
        self.pin_on_sync_abort = pin_on_sync_abort  # keep its KV for a migration peer when a sync aborts it
        self.routing = routing  # records its routed experts (a MoE model, and it asked)
        self.generator: torch.Generator | None = None
        if sampling.seed is not None:
            self.generator = torch.Generator(device="cpu").manual_seed(sampling.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def kv_reuse_limit(self) -> int:
        """How many leading tokens may come from cached or migrated KV: all but the last, and for a request
        recording its routing none it has no row for yet (their routing must be computed here)."""
        limit = self.num_tokens - 1
        return limit if self.routing is None else min(limit, self.routing.frontier)

    def routed_experts(self) -> np.ndarray | None:
        return None if self.routing is None else self.routing.rows()
