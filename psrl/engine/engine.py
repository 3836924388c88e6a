"""The reference engine's synchronous core: admission, one batched forward per step, sampling, stop checks.

Stop checks follow vLLM: the tokenizer's EOS (unless ignore_eos), a stop token id, the length limit, and stop
strings, matched in the output decoded incrementally (stop_strings.py; needs the engine's `tokenizer`).

Thread-safety: `add_request`, `abort` and the stats take a short lock and can be called from any thread
while `step()` runs in another; the model forward itself runs outside that lock. `load_weights` builds
the new weights off to the side and swaps them between two steps (and clears the prefix cache, whose
blocks were computed with the old weights).

Prefix caching (on by default, like vLLM v1): full blocks are shared between requests with the same token
prefix; see prefix_cache.py. With `kv_events_enabled` on, the cache's changes are recorded as KV events
for `drain_kv_events()`.

Routed experts (a Qwen2-MoE config): a request whose sampling sets `routed_experts_prompt_start` records the
top-k expert ids of every MoE layer for each position it feeds from there on, and its finished output (stop,
length or abort) carries them, as vLLM's routed experts. Positions it must report are computed here, never
taken from the prefix cache or migrated KV (Request.kv_reuse_limit), so every row is this engine's own.

KV migration (pins, leases, reserved and migrated blocks) is kept by the KV manager beside the block pool
(kv_manager.py); the engine calls it under its lock.

Weight syncs: `close_admission` refuses new requests (AdmissionClosedError), `freeze` stops scheduling
without touching any request's state (a frozen step only hands out pending abort outputs),
`abort_all_for_sync` ends every request and reports what each had produced, calling `on_sync_abort` for
each while its KV blocks are still held. The async layer (AsyncEngine.pause) combines them into vLLM's
pause modes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from psrl.engine.batch import build_paged_batch
from psrl.engine.config import ModelConfig
from psrl.engine.errors import (
    AdmissionClosedError,
    ConfigError,
    DuplicateRequestError,
    EmptyPromptError,
    EngineStepError,
    InvalidRequestError,
    InvalidSamplingError,
    KVCacheTooSmallError,
    MaxModelLenExceededError,
    TokenOutOfRangeError,
)
from psrl.engine.kv_cache import CacheConfig, PagedKVCache, blocks_for_tokens
from psrl.engine.kv_events import KvEvent
from psrl.engine.kv_manager import KvManager
from psrl.engine.model import Qwen2Model
from psrl.engine.prefix_cache import BlockPool
from psrl.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from psrl.engine.routing import RoutingRecorder, expert_id_dtype
from psrl.engine.sampler import Sampler, SampleResult, SamplingOptions
from psrl.engine.scheduler import ScheduledChunk, Scheduler
from psrl.engine.stop_strings import StopStringDetector
from psrl.engine.sync import KvLease, PreloadedKV, SyncAbortedRequest
from psrl.tokenizer import Tokenizer

MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the most alternatives a request may ask for per token


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_total_blocks: int
    block_size: int
    kv_cache_usage: float  # 0..1
    kv_capacity_tokens: int  # num_blocks * block_size
    weight_version: int
    num_preemptions: int
    prefix_caching: bool = False
    num_cached_blocks: int = 0  # blocks the prefix cache can serve (held by requests or free)
    prefix_cache_queries: int = 0  # tokens looked up at admission
    prefix_cache_hits: int = 0  # of those, tokens served from the cache

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Engine:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        *,
        seed: int = 0,
        weights_path: str | Path | None = None,
        device: str | torch.device = "cpu",
        eos_token_ids: tuple[int, ...] | list[int] = (),
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 4096,
        enable_prefix_caching: bool = True,
        tokenizer: Tokenizer | None = None,
        max_logprobs: int = MAX_LOGPROBS,
    ) -> None:
        model_config.validate()
        cache_config.validate()
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.model_config = model_config
        self.cache_config = cache_config
        self.device = torch.device(device)
        self.seed = seed
        # The first is the tokenizer's EOS; further ones are the model's other EOS ids, which vLLM turns into
        # stop token ids (so they end a request reported as a matched token, and ignore_eos ignores them too).
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.tokenizer = tokenizer  # decodes outputs for stop strings; without one, stop strings are refused
        self.max_logprobs = max_logprobs
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = model_config.max_position_embeddings
        self.enable_prefix_caching = enable_prefix_caching

        self._model = self._build_model(seed=seed if weights_path is None else None, path=weights_path)
        self.weight_version = 0
        self.kv_cache = PagedKVCache(model_config, cache_config, device=self.device)
        self._pool = BlockPool(cache_config.num_blocks, cache_config.block_size, enable_caching=enable_prefix_caching)
        self._kv = KvManager(self._pool)  # pins, leases, reservations and migrated KV, over the same pool
        self._scheduler = Scheduler(self._pool, max_num_seqs, max_num_batched_tokens, self._kv.drop_oldest_pin)
        self._sampler = Sampler(seed)
        self._requests: dict[str, Request] = {}
        self._pending_outputs: list[RequestOutput] = []  # abort notices for the next step to return
        self._pending_abort_ids: set[str] = set()  # ids stay taken until their abort notice is returned
        self._lock = threading.Lock()  # requests, queues, blocks, pending outputs, admission, freeze
        self._step_lock = threading.Lock()  # one step at a time; weight swaps between steps
        self._admission_closed: str | None = None  # why new requests are refused; None = open
        self._frozen = False
        # Called (under the engine lock) for each request a sync pause aborts, while its blocks are still held.
        self.on_sync_abort: Callable[[SyncAbortedRequest], None] | None = None
        # KV migration: with a TTL set, a sync abort pins the request's KV blocks (for a peer to pull) instead
        # of freeing them; a pin ends when unpinned, when the request comes back here, or when it expires.
        self.kv_pin_ttl_s: float | None = None
        # Prompt positions this engine computed (prefill work; what a prefix-cache hit or migrated KV saves).
        self.num_prompt_tokens_computed = 0

    # ---- weights --------------------------------------------------------------------------------

    @property
    def model(self) -> Qwen2Model:
        return self._model

    def _build_model(
        self,
        *,
        seed: int | None = None,
        path: str | Path | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> Qwen2Model:
        if sum(x is not None for x in (seed, path, state_dict)) != 1:
            raise ValueError("give exactly one weight source: seed, path or state_dict")
        if path is not None:
            return Qwen2Model.from_safetensors(self.model_config, path, device=self.device)
        if state_dict is not None:
            return Qwen2Model(self.model_config, state_dict, device=self.device)
        assert seed is not None
        return Qwen2Model.random(self.model_config, seed, device=self.device)

    def load_weights(
        self,
        *,
        seed: int | None = None,
        path: str | Path | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
        version: int,
    ) -> None:
        """Build new weights (errors leave the old ones in place), then swap them in between two steps."""
        self.swap_weights(self.build_weights(seed=seed, path=path, state_dict=state_dict), version=version)

    def build_weights(
        self,
        *,
        seed: int | None = None,
        path: str | Path | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> Qwen2Model:
        """The first half of load_weights: new weights built off to the side, nothing swapped yet.

        Lets a replica with several dp ranks build every rank's weights first and swap only if all built.
        """
        return self._build_model(seed=seed, path=path, state_dict=state_dict)

    def swap_weights(self, model: Qwen2Model, *, version: int) -> None:
        """The second half of load_weights: swap in weights from build_weights between two steps."""
        if model.config != self.model_config:
            raise ConfigError("these weights were built for another model config")
        with self._step_lock:
            self._model = model
            self.weight_version = version
            if self.enable_prefix_caching:
                with self._lock:
                    self._pool.reset()

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        preloaded: PreloadedKV | None = None,
        kv_pending: bool = False,
        pin_on_sync_abort: bool = True,
    ) -> None:
        """Queue a request. `preloaded`: migrated KV for its leading tokens (the blocks become the request's);
        `kv_pending`: hold it until `attach_kv` hands it its migrated KV (or none: then it is prefilled);
        `pin_on_sync_abort` False: a sync abort frees its KV even when pinning is on (a choice of an n > 1
        request: KV migration moves whole requests only)."""
        closed = self._admission_closed
        if closed is not None:  # refused before validation, like a paused vLLM servicer
            raise AdmissionClosedError(closed)
        sampling.validate()
        self._check_sampling(request_id, sampling)
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise EmptyPromptError(f"request {request_id!r} has an empty prompt")
        if not all(isinstance(t, int) for t in prompt):
            raise TokenOutOfRangeError(f"request {request_id!r}: prompt token ids must be integers")
        vocab = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            bad = next(t for t in prompt if not 0 <= t < vocab)
            raise TokenOutOfRangeError(
                f"request {request_id!r}: prompt token id {bad} is outside the vocabulary [0, {vocab})"
            )
        max_total = self._max_total_tokens(request_id, len(prompt), sampling.max_tokens)
        detector = None
        if sampling.stop:
            assert self.tokenizer is not None  # checked by _check_sampling
            skip = sampling.skip_special_tokens
            detector = StopStringDetector(self.tokenizer, sampling.stop, skip_special_tokens=skip)
        request = Request(
            request_id,
            prompt,
            sampling,
            max_total,
            stop_detector=detector,
            pin_on_sync_abort=pin_on_sync_abort,
            routing=self._routing_recorder(request_id, len(prompt), sampling),
        )
        if preloaded is not None:
            self._check_preloaded(request, preloaded)
        with self._lock:
            if self._admission_closed is not None:  # closed while this request was being validated
                raise AdmissionClosedError(self._admission_closed)
            if request_id in self._requests or request_id in self._pending_abort_ids:
                raise DuplicateRequestError(f"request id {request_id!r} is already in the engine")
            self._kv.unpin(request_id)  # it came back here: its pin (if any) is not needed any more
            self._requests[request_id] = request
            if kv_pending:
                request.status = RequestStatus.WAITING_FOR_KV
                return
            if preloaded is not None:
                self._kv.preload(request, preloaded)
            self._scheduler.add(request)

    def _routing_recorder(self, request_id: str, prompt_len: int, sampling: SamplingOptions) -> RoutingRecorder | None:
        """The recorder of a request that asks for its routed experts; None when it does not ask or the model has
        no MoE layers (vLLM ignores the start then too)."""
        start = sampling.routed_experts_prompt_start
        mc = self.model_config
        if start is None or not mc.is_moe:
            return None
        if start > prompt_len:  # vLLM's rule and words
            raise InvalidRequestError(
                f"request {request_id!r}: routed_experts_prompt_start must be between 0 and prompt_len "
                f"({prompt_len}), got {start}"
            )
        return RoutingRecorder(start, len(mc.moe_layers), mc.num_experts_per_tok, expert_id_dtype(mc.num_experts))

    def _check_sampling(self, request_id: str, sampling: SamplingOptions) -> None:
        """What SamplingOptions.validate cannot tell alone: limits of this engine and its vocabulary."""
        if sampling.n != 1:
            raise InvalidSamplingError(
                f"request {request_id!r}: the engine runs one sequence per request; AsyncEngine.generate runs n > 1"
            )
        if sampling.logprobs is not None and sampling.logprobs > self.max_logprobs:
            raise InvalidSamplingError(
                f"Requested sample logprobs of {sampling.logprobs}, which is greater than max allowed: "
                f"{self.max_logprobs}"
            )
        vocab = self.model_config.vocab_size
        outside = [t for t in sampling.stop_token_ids if t >= vocab]
        if outside:
            raise InvalidSamplingError(
                f"token_id(s) {outside} in stop_token_ids contain out-of-vocab token ids. Vocabulary size: {vocab}"
            )
        if sampling.stop and self.tokenizer is None:
            raise InvalidSamplingError("stop strings need the engine's tokenizer, and this engine has none")

    def _check_preloaded(self, request: Request, kv: PreloadedKV) -> None:
        block_size = self.cache_config.block_size
        if not 0 < kv.num_tokens < request.num_tokens:
            raise InvalidRequestError(
                f"request {request.request_id!r}: migrated KV for {kv.num_tokens} tokens of a "
                f"{request.num_tokens}-token prompt (it must leave at least the last token to compute)"
            )
        if len(kv.block_ids) != blocks_for_tokens(kv.num_tokens, block_size):
            raise InvalidRequestError(
                f"request {request.request_id!r}: {len(kv.block_ids)} blocks for {kv.num_tokens} migrated tokens "
                f"(block_size {block_size})"
            )
        if kv.token_ids is not None and tuple(request.token_ids[: kv.num_tokens]) != kv.token_ids:
            raise InvalidRequestError(
                f"request {request.request_id!r}: the migrated KV is for other tokens than its prompt's first "
                f"{kv.num_tokens}"
            )

    def _max_total_tokens(self, request_id: str, prompt_len: int, max_tokens: int | None) -> int:
        """The most tokens (prompt + output) this request may reach, or a typed error if it cannot run.

        Like vLLM, a max_tokens reaching past max_model_len is no error: the request ends there ("length")."""
        kv_capacity = self.cache_config.capacity_tokens
        if prompt_len >= self.max_model_len:
            raise MaxModelLenExceededError(
                # vLLM's words: the router (and PSRL) read "maximum model length" as a prompt overflow.
                f"request {request_id!r}: the prompt (length {prompt_len}) is longer than the maximum model length "
                f"of {self.max_model_len} minus one token to generate"
            )
        if max_tokens is not None:
            total = min(prompt_len + max_tokens, self.max_model_len)
            # The last sampled token never needs a KV slot.
            if total - 1 > kv_capacity:
                raise KVCacheTooSmallError(
                    f"request {request_id!r}: prompt + max_tokens needs {total - 1} KV slots but the cache "
                    f"holds only {kv_capacity} ({self.cache_config.num_blocks} blocks of "
                    f"{self.cache_config.block_size})"
                )
            return total
        if prompt_len > kv_capacity:
            raise KVCacheTooSmallError(
                f"request {request_id!r}: prompt of {prompt_len} tokens can never fit in the KV cache "
                f"({kv_capacity} token slots)"
            )
        return min(self.max_model_len, kv_capacity + 1)

    def abort(self, request_id: str) -> bool:
        """Stop a request now: frees its blocks; the next step() returns its final "abort" output.

        Returns False when the request is unknown or already finished. Once this returns True no further
        tokens are emitted for the request, even from a step that is running concurrently.
        """
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                return False
            self._abort_locked(req)
            return True

    def _abort_locked(self, req: Request) -> None:
        """Caller holds _lock."""
        del self._requests[req.request_id]
        self._kv.hold_while_written(req)  # the forward in flight may still write its blocks
        self._scheduler.finish(req)
        self._pending_abort_ids.add(req.request_id)
        self._pending_outputs.append(
            RequestOutput(
                request_id=req.request_id,
                new_token_ids=[],
                new_logprobs=[] if req.sampling.logprobs is not None else None,
                new_top_logprobs=[] if req.sampling.logprobs else None,
                finish_reason=FinishReason.ABORT,
                matched_stop_token_id=None,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=max(req.num_cached_tokens, 0),
                num_output_tokens=req.num_output_tokens,
                routed_experts=req.routed_experts(),
            )
        )

    # ---- weight-sync control --------------------------------------------------------------------

    def close_admission(self, reason: str) -> None:
        """Refuse new requests (AdmissionClosedError) until open_admission; running ones are untouched."""
        with self._lock:
            self._admission_closed = reason

    def open_admission(self) -> None:
        with self._lock:
            self._admission_closed = None

    @property
    def admission_closed_reason(self) -> str | None:
        """Why new requests are refused, or None while admission is open."""
        return self._admission_closed

    def freeze(self) -> None:
        """Stop scheduling: later steps run no forward and only hand out pending abort outputs.

        Requests keep their tokens, KV blocks and sampler state, so after unfreeze they continue exactly as
        if nothing happened. A step already running finishes normally (AsyncEngine.pause waits for it).
        """
        with self._lock:
            self._frozen = True

    def unfreeze(self) -> None:
        with self._lock:
            self._frozen = False

    @property
    def frozen(self) -> bool:
        return self._frozen

    def abort_all_for_sync(self) -> list[SyncAbortedRequest]:
        """Abort every live request (running first, then waiting), like abort() on each.

        Returns each one as it stood; `on_sync_abort` sees each before its blocks are freed.
        """
        aborted = []
        with self._lock:
            held = [r for r in self._requests.values() if r.status is RequestStatus.WAITING_FOR_KV]
            for req in [*self._scheduler.running, *self._scheduler.waiting, *held]:
                snapshot = SyncAbortedRequest(
                    request_id=req.request_id,
                    token_ids=tuple(req.token_ids),
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_computed_tokens=req.num_computed_tokens,
                    block_ids=tuple(req.block_ids),
                )
                if self.on_sync_abort is not None:
                    self.on_sync_abort(snapshot)
                if self.kv_pin_ttl_s is not None and req.pin_on_sync_abort:
                    self._kv.pin(req, self.kv_pin_ttl_s)
                self._abort_locked(req)
                aborted.append(snapshot)
        return aborted

    def get_block_ids(self, request_id: str) -> list[int] | None:
        """The KV block table of a live request (a copy), or None if it is not in the engine.

        With prefix caching its leading blocks may be shared with other requests and the cache: read them,
        never write them.
        """
        with self._lock:
            req = self._requests.get(request_id)
            return None if req is None else list(req.block_ids)

    # ---- KV migration ---------------------------------------------------------------------------

    def pin_kv(self, request_id: str, ttl_s: float) -> int:
        """Pin a live request's computed KV for `ttl_s` seconds (it keeps running); returns the tokens pinned."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                raise InvalidRequestError(f"request {request_id!r} is not running here: nothing to pin")
            return self._kv.pin(req, ttl_s)

    def unpin_kv(self, request_id: str) -> bool:
        with self._lock:
            return self._kv.unpin(request_id)

    @property
    def num_pinned(self) -> int:
        return self._kv.num_pinned

    def lease_kv(self, request_id: str, token_ids: Sequence[int], *, allow_prefix_cache: bool) -> KvLease | None:
        """The source side of a transfer: blocks holding the K/V of the longest prefix of `token_ids` that the
        request's pin holds (or, with `allow_prefix_cache` and no pin, the prefix cache's full blocks). The
        blocks get an extra reference, so they stay valid until `release_blocks` even if the pin ends."""
        with self._lock:
            return self._kv.lease(request_id, token_ids, allow_prefix_cache=allow_prefix_cache)

    def lease_cached_prefix(self, token_ids: Sequence[int]) -> KvLease | None:
        """The full blocks of `token_ids` this engine's prefix cache holds, with a reference each (released by
        `release_blocks`, or handed to a request in a PreloadedKV): the part of a migration not to move."""
        with self._lock:
            return self._kv.lease_cached_prefix(token_ids)

    def adopt_pin(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> PreloadedKV | None:
        """A request looped back to this engine takes over the pinned KV of its previous iteration without a
        copy: the pin's blocks holding the longest common prefix (at most `max_tokens`) become its blocks."""
        with self._lock:
            return self._kv.adopt_pin(request_id, token_ids, max_tokens)

    def reserve_blocks(self, num_tokens: int) -> list[int]:
        """Fresh blocks for `num_tokens` incoming migrated tokens (OutOfBlocks when the cache cannot spare them)."""
        with self._lock:
            return self._kv.reserve(num_tokens)

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop the reference a lease or a reservation took."""
        with self._lock:
            self._kv.release(block_ids)

    def attach_kv(self, request_id: str, kv: PreloadedKV | None) -> bool:
        """Release a `kv_pending` request into the queue, with its migrated KV or (None) to be prefilled.
        False when it is gone (aborted meanwhile): the caller still owns `kv`'s blocks then."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.status is not RequestStatus.WAITING_FOR_KV:
                return False
            if kv is not None:
                self._check_preloaded(req, kv)
                self._kv.preload(req, kv)
            self._scheduler.add(req)
            return True

    # ---- prefix cache and KV events -------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (running requests keep theirs); records AllBlocksCleared.

        Returns how many cached blocks were dropped. Unlike vLLM this never fails: blocks that requests
        still hold simply stop being shared, and those requests add nothing more to the cache.
        """
        with self._lock:
            return self._pool.reset()

    @property
    def kv_events_enabled(self) -> bool:
        return self._pool.events_enabled

    @kv_events_enabled.setter
    def kv_events_enabled(self, enabled: bool) -> None:
        """Record KV events from now on (off: nothing is recorded and pending events are dropped)."""
        with self._lock:
            self._pool.set_events_enabled(enabled)

    def drain_kv_events(self) -> list[KvEvent]:
        """The KV events recorded since the last drain, oldest first."""
        with self._lock:
            return self._pool.drain_events()

    def drain_kv_events_with_snapshot(self) -> tuple[list[KvEvent], list[KvEvent]]:
        """(pending events, cache state after them) taken atomically, so a new subscriber can start from the
        snapshot while earlier subscribers get the pending events: nobody misses or repeats a change."""
        with self._lock:
            return self._pool.drain_events(), self._pool.snapshot()

    def kv_cache_snapshot(self) -> list[KvEvent]:
        """The cached blocks as events: AllBlocksCleared, then BlocksStored chains, parents first."""
        with self._lock:
            return self._pool.snapshot()

    # ---- the step -------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """Whether step() has work: pending outputs, or requests to run unless frozen."""
        with self._lock:
            return bool(self._pending_outputs) or (not self._frozen and self._scheduler.has_unfinished())

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward over every scheduled token, sample, and return delta outputs."""
        with self._step_lock:
            with self._lock:
                self._kv.expire_pins()
                if self._frozen:
                    return self._take_pending_outputs()
                chunks = self._scheduler.schedule()
                if not chunks:
                    return self._take_pending_outputs()
                batch = build_paged_batch(
                    chunks, self.cache_config.block_size, self.model_config.num_queries_per_kv, self.device
                )
                sampling_chunks = [c for c in chunks if c.samples]
                options = [c.request.sampling for c in sampling_chunks]
                generators = [c.request.generator for c in sampling_chunks]
                # Only a step with a request recording its routing keeps the experts the MoE layers chose.
                routing: list[torch.Tensor] | None = [] if any(c.request.routing is not None for c in chunks) else None
                self._kv.begin_forward()
            model = self._model
            try:
                with torch.inference_mode():
                    logits = model.forward_paged(batch, self.kv_cache.layers, routing=routing)
                    sampled = self._sampler.sample(logits, options, generators) if options else None
                routed = _routing_rows(routing, self.model_config.num_experts)
            except Exception as exc:
                raise EngineStepError(self._fail_chunks(chunks), exc) from exc  # its frees wait for the forward
            finally:
                with self._lock:
                    self._kv.end_forward()
            with self._lock:
                return self._take_pending_outputs() + self._update(chunks, sampled, routed)

    def _take_pending_outputs(self) -> list[RequestOutput]:
        out, self._pending_outputs = self._pending_outputs, []
        self._pending_abort_ids.clear()
        return out

    def _fail_chunks(self, chunks: list[ScheduledChunk]) -> list[str]:
        failed = []
        with self._lock:
            for chunk in chunks:
                req = chunk.request
                if req.status is not RequestStatus.FINISHED:
                    self._requests.pop(req.request_id, None)
                    self._scheduler.finish(req)
                    failed.append(req.request_id)
        return failed

    def _update(
        self, chunks: list[ScheduledChunk], sampled: SampleResult | None, routed: np.ndarray | None = None
    ) -> list[RequestOutput]:
        """`routed`: the step's top-k expert ids [batch rows, num_moe_layers, top_k], when a request records them."""
        outputs: list[RequestOutput] = []
        row = -1
        first = 0  # the chunk's first row in the flattened batch (build_paged_batch's order)
        for chunk in chunks:
            req = chunk.request
            rows = slice(first, first + chunk.num_tokens)
            first += chunk.num_tokens
            if chunk.samples:
                row += 1
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the forward ran: its abort output is already queued
            if req.routing is not None:
                assert routed is not None
                req.routing.write(chunk.start, routed[rows])
            req.num_computed_tokens = chunk.start + chunk.num_tokens
            self.num_prompt_tokens_computed += max(0, min(req.num_computed_tokens, req.num_prompt_tokens) - chunk.start)
            self._scheduler.cache_computed_blocks(req)
            if not chunk.samples:
                continue
            assert sampled is not None
            token = sampled.token_ids[row]
            req.token_ids.append(token)
            finish_reason, matched = self._check_stop(req, token)
            matched_str = self._check_stop_strings(req, token, finish_reason)
            if matched_str is not None:
                finish_reason, matched = FinishReason.STOP, None
            logprob = sampled.logprobs[row]
            top = sampled.top_logprobs[row]
            outputs.append(
                RequestOutput(
                    request_id=req.request_id,
                    new_token_ids=[token],
                    new_logprobs=None if logprob is None else [logprob],
                    new_top_logprobs=None if top is None else [top],
                    finish_reason=finish_reason,
                    matched_stop_token_id=matched,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    num_output_tokens=req.num_output_tokens,
                    matched_stop_str=matched_str,
                    routed_experts=req.routed_experts() if finish_reason is not None else None,
                )
            )
            if finish_reason is not None:
                self._requests.pop(req.request_id, None)
                self._scheduler.finish(req)
        return outputs

    def _check_stop(self, req: Request, token: int) -> tuple[FinishReason | None, int | None]:
        """vLLM's rules; a stop token ends the request even on its last allowed position."""
        if not req.sampling.ignore_eos and token in self.eos_token_ids:
            # Like vLLM: the tokenizer's EOS is not reported as a matched stop token, the model's other EOS ids are.
            return FinishReason.STOP, None if token == self.eos_token_ids[0] else token
        if token in req.sampling.stop_token_ids:
            return FinishReason.STOP, token
        if req.num_tokens >= req.max_total_tokens:
            return FinishReason.LENGTH, None
        return None, None

    @staticmethod
    def _check_stop_strings(req: Request, token: int, finish_reason: FinishReason | None) -> str | None:
        """The stop string `token` completes, checked after the id rules as vLLM's detokenizer does: a stop string
        also ends a request at its length limit, and the text of a token that stopped it by id is left out
        unless include_stop_str_in_output (so that id stays the reason)."""
        if req.stop_detector is None or (
            finish_reason is FinishReason.STOP and not req.sampling.include_stop_str_in_output
        ):
            return None
        return req.stop_detector.push(token)

    # ---- stats ----------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued, or waiting for migrated KV."""
        return len(self._requests) - len(self._scheduler.running)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests; cached blocks nobody holds are reclaimable and count as free."""
        return self._pool.num_used

    @property
    def num_total_blocks(self) -> int:
        return self._pool.num_total

    @property
    def num_cached_blocks(self) -> int:
        return self._pool.num_cached

    @property
    def kv_cache_usage(self) -> float:
        return self._pool.num_used / self._pool.num_total

    @property
    def kv_capacity_tokens(self) -> int:
        return self.cache_config.capacity_tokens

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                num_running=len(self._scheduler.running),
                num_waiting=len(self._requests) - len(self._scheduler.running),  # queued or waiting for KV
                num_used_blocks=self._pool.num_used,
                num_total_blocks=self._pool.num_total,
                block_size=self.cache_config.block_size,
                kv_cache_usage=self._pool.num_used / self._pool.num_total,
                kv_capacity_tokens=self.cache_config.capacity_tokens,
                weight_version=self.weight_version,
                num_preemptions=self._scheduler.num_preemptions,
                prefix_caching=self.enable_prefix_caching,
                num_cached_blocks=self._pool.num_cached,
                prefix_cache_queries=self._scheduler.prefix_cache_queries,
                prefix_cache_hits=self._scheduler.prefix_cache_hits,
            )


def _routing_rows(routing: list[torch.Tensor] | None, num_experts: int) -> np.ndarray | None:
    """The MoE layers' expert ids of one step as one array [rows, num_moe_layers, top_k] (vLLM's dtype)."""
    if not routing:
        return None
    return torch.stack(routing, dim=1).cpu().numpy().astype(expert_id_dtype(num_experts))
