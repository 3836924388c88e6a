"""`vllm.grpc.engine.VllmEngine` served over the reference engine, frame for frame like smg-grpc-servicer.

Streaming: every engine step's delta becomes a chunk (new ids, their log-probs); a finished request then
gets a complete frame carrying only the last delta, so the router accumulates chunks and uses the complete
frame's ids only when no chunk came. An abort while streaming therefore ends with an empty chunk and an
empty "abort" complete frame. Without streaming, one complete frame carries every id produced so far.
With n > 1 every frame carries its choice's `index`: streamed, the choices' chunks interleave and each choice
gets its complete frame when it finishes; without streaming, one complete frame per choice, in index order,
once all of them finished. A stop string ends a request with "stop" and `matched_stop_str`; its ids run up
to the token that completed the match (the router cuts the text).

Requests are read as the stock servicer and vLLM read them, and refused (INVALID_ARGUMENT) where vLLM refuses
them, plus what the reference engine does not implement (structured output, prompt log-probs, logit bias,
min_tokens, min_p and the penalties): refused rather than silently ignored.

Admission: while a weight sync paused the replica or failed (psrl.worker.control), a new Generate is not an
error: like smg-grpc-servicer with admission closed, it gets one complete frame with finish_reason "abort"
and no ids, at once, and no admission metadata.

KV events: `SubscribeKvEvents` streams every dp rank's prefix-cache events on one call, each batch tagged
with its `dp_rank` and numbered per rank. There is no replay history: each rank's stream opens with a
snapshot of its live cached blocks (a KvCacheCleared, then the blocks parents first, marked as
KvSnapshotChunk), numbered from start_sequence_number + 1, so a resuming client sees no gap and resyncs.
`FlushCache` clears every rank's prefix cache at once (subscribers get a KvCacheCleared).

Routed experts (a Qwen2-MoE model folder): a Generate whose metadata asks for them
(`x-psrl-routed-experts-start`, psrl.worker.routed_experts) records them from that position on, and each
choice's rows are kept in `routed_experts` (the replica's `psrl.experts.RoutedExperts` service) just before its
complete frame is sent, so the router can take them once it has read that frame.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import time
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl.engine import (
    AdmissionClosedError,
    AllBlocksCleared,
    AsyncEngine,
    BlocksRemoved,
    BlocksStored,
    EngineDeadError,
    EngineError,
    KvEvent,
    KvEventsOverflowError,
    KvEventStream,
    KvEventsUpdate,
    PreloadedKV,
    RequestOutput,
    SamplingOptions,
)
from psrl.worker.admission import ACCEPTED_METADATA_KEY, refused_complete
from psrl.worker.kv_migration import (
    KvPuller,
    KvTransferParams,
    KvTransferParamsError,
    TransferMode,
    kv_transfer_params_object,
)
from psrl.worker.model_folder import ModelFolder
from psrl.worker.routed_experts import BadRoutedExpertsAsk, RoutedExpertsServicer, RoutedExpertsStore, asked_start

logger = logging.getLogger(__name__)

TOKENIZER_CHUNK_BYTES = 64 * 1024
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
SNAPSHOT_EVENTS_PER_BATCH = 256  # a big cache's snapshot goes out as several KvSnapshotChunk batches
_MERGED_UPDATES = 8  # per rank: past this the rank's own queue fills, and overflows if the client stalls
# Batches are numbered from start_sequence_number + 1 in a uint64: a start past this leaves too little room
# (fewer than 2**63 numbers) and is refused, instead of failing once a number no longer fits.
MAX_START_SEQUENCE_NUMBER = 2**63 - 1


def sampling_from_proto(params: vllm_engine_pb2.SamplingParams, vocab_size: int) -> SamplingOptions:
    """The stock servicer's and vLLM's reading of the proto: unset temperature is 1.0, top_p 0 means 1, top_k 0
    means off, n 0 means 1, seed -1 means none, logprobs -1 means the whole vocabulary, and special tokens are
    decoded (for stop strings) unless skip_special_tokens. The engine refuses values out of range."""
    unsupported = _unsupported(params)
    if unsupported is not None:
        raise ValueError(f"{unsupported} is not supported by the reference replica")
    logprobs = params.logprobs if params.HasField("logprobs") else None
    return SamplingOptions(
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_p=params.top_p if params.top_p != 0.0 else 1.0,
        top_k=params.top_k,
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        seed=params.seed if params.HasField("seed") and params.seed != -1 else None,
        logprobs=vocab_size if logprobs == -1 else logprobs,
        n=params.n or 1,
        stop=tuple(params.stop),
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
    )


def _unsupported(params: vllm_engine_pb2.SamplingParams) -> str | None:
    """The first setting the reference engine cannot honour, which vLLM would; None when there is none.
    (truncate_prompt_tokens is not here: vLLM ignores it for tokenized input too.)"""
    if params.WhichOneof("constraint"):
        return "structured output (a constraint)"
    if params.HasField("prompt_logprobs"):
        return "prompt_logprobs"
    if params.logit_bias:
        return "logit_bias"
    if params.min_tokens:
        return "min_tokens"
    if params.min_p:
        return "min_p"
    if params.frequency_penalty or params.presence_penalty:
        return "frequency_penalty / presence_penalty"
    if params.repetition_penalty not in (0.0, 1.0):  # 0 is the proto's unset: 1, no penalty
        return "repetition_penalty"
    return None


def _output_logprobs(out: RequestOutput, with_top: bool) -> vllm_engine_pb2.OutputLogProbs | None:
    if out.new_logprobs is None or not out.new_token_ids:
        return None
    proto = vllm_engine_pb2.OutputLogProbs(token_logprobs=out.new_logprobs, token_ids=out.new_token_ids)
    if with_top and out.new_top_logprobs is not None:
        for alternatives in out.new_top_logprobs:
            proto.top_logprobs.append(
                vllm_engine_pb2.TopLogProbs(
                    token_ids=[tid for tid, _ in alternatives], values=[lp for _, lp in alternatives]
                )
            )
    return proto


class _Accumulated:
    """Everything one choice of a non-streamed request produced, for its complete frame."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.has_logprobs = False
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            self.has_logprobs = True
            self.logprobs.extend(out.new_logprobs)
        if out.new_top_logprobs is not None:
            self.top.extend(out.new_top_logprobs)
        self.last = out

    def as_output(self) -> RequestOutput:
        """The choice's finished output with every id it produced."""
        assert self.last is not None and self.last.finished  # a request stream ends only once each choice did
        return replace(
            self.last,
            new_token_ids=self.ids,
            new_logprobs=self.logprobs if self.has_logprobs else None,
            new_top_logprobs=self.top if self.top else None,
        )


class ReferenceServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """One servicer over `dp_size` engines; `data_parallel_rank` picks the engine."""

    def __init__(
        self,
        engines: list[AsyncEngine],
        folder: ModelFolder,
        served_model_name: str,
        kv_puller: KvPuller | None = None,
    ) -> None:
        if not engines:
            raise ValueError("at least one engine is required")
        self.engines = engines
        self.kv_puller = kv_puller  # None: kv_transfer_params_json is checked, then ignored (the request is prefilled)
        self._kv_pulls: set[asyncio.Task[None]] = set()
        self.folder = folder
        self.served_model_name = served_model_name
        self._started = time.time()
        self._last_receive = 0.0
        self._rank_of: dict[str, int] = {}
        self._tokenizer_zip: tuple[bytes, str] | None = None
        unsupported = None if folder.model_config.is_moe else f"the model {served_model_name!r} has no MoE layers"
        # Served beside this servicer on the replica's server (psrl.worker.server).
        self.routed_experts = RoutedExpertsServicer(RoutedExpertsStore(), unsupported)

    # ---- Generate ---------------------------------------------------------------------------------

    def _pick_rank(self, request: vllm_engine_pb2.GenerateRequest) -> int:
        if request.HasField("data_parallel_rank"):
            rank = request.data_parallel_rank
            if not 0 <= rank < len(self.engines):
                raise _InvalidArgument(f"data_parallel_rank {rank} is out of range [0, {len(self.engines)}).")
            return rank
        # Unpinned: the least busy rank, as vLLM's DP coordinator balances internally.
        loads = [e.stats() for e in self.engines]
        return min(range(len(self.engines)), key=lambda r: loads[r].num_running + loads[r].num_waiting)

    def _prompt_ids(self, request: vllm_engine_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("input")
        if which == "tokenized":
            return list(request.tokenized.input_ids)
        if which == "text":
            return self.folder.tokenizer.encode(request.text)
        raise _InvalidArgument("GenerateRequest carries neither tokenized input nor text")

    async def Generate(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
        self._last_receive = time.time()
        request_id = request.request_id
        try:
            if not request_id:
                raise _InvalidArgument("request_id is required")
            if request_id in self._rank_of:
                raise _InvalidArgument(f"request_id {request_id!r} is already running")
            # The stock servicer's order: KV-transfer params, prompt, sampling, then the rank.
            kv_params = self._kv_params(request)
            prompt = self._prompt_ids(request)
            sampling = sampling_from_proto(request.sampling_params, self.folder.model_config.vocab_size)
            routed_start = self._routed_experts_start(context)
            if routed_start is not None:
                sampling = replace(sampling, routed_experts_prompt_start=routed_start)
            rank = self._pick_rank(request)
            with_top = bool(sampling.logprobs)
            engine = self.engines[rank]
            moved = _KvMoved()
            report = None if kv_params is None else moved
            if sampling.n > 1:
                kv_params = None  # KV migration moves whole requests: the choices of an n > 1 one are prefilled
            preloaded: PreloadedKV | None = None
            pending = kv_params is not None and kv_params.mode == TransferMode.ASYNC
            if kv_params is not None and not pending and engine.admission_closed_reason is None:
                assert self.kv_puller is not None
                preloaded = await self.kv_puller.pull(engine, rank, prompt, kv_params)
                moved.tokens = preloaded.num_tokens if preloaded is not None else 0
            try:
                stream = engine.generate(request_id, prompt, sampling, preloaded=preloaded, kv_pending=pending)
            except BaseException as e:
                if preloaded is not None:
                    engine.engine.release_blocks(preloaded.block_ids)
                if not isinstance(e, AdmissionClosedError):
                    raise
                logger.info("Generate %s refused: %s", request_id, e.reason)
                yield vllm_engine_pb2.GenerateResponse(complete=refused_complete(len(prompt)))
                return
            if pending:
                assert kv_params is not None
                task = asyncio.create_task(self._pull_then_attach(engine, rank, request_id, prompt, kv_params, moved))
                self._kv_pulls.add(task)
                task.add_done_callback(self._kv_pulls.discard)
            self._rank_of[request_id] = rank
            try:
                # Tell the router the request is admitted, so a death from here on reads as mid-request (502)
                # even when no frame has come yet (non-streamed calls).
                await context.send_initial_metadata(((ACCEPTED_METADATA_KEY, "1"),))
                if request.stream:
                    async for out in stream:
                        yield vllm_engine_pb2.GenerateResponse(chunk=self._chunk(out, with_top))
                        if out.finished:
                            self._keep_routed_experts(request_id, out, routed_start)
                            yield vllm_engine_pb2.GenerateResponse(complete=self._complete(out, with_top, report))
                else:
                    choices = [_Accumulated() for _ in range(sampling.n)]
                    async for out in stream:
                        choices[out.index].add(out)
                    for choice in choices:
                        full = choice.as_output()
                        self._keep_routed_experts(request_id, full, routed_start)
                        yield vllm_engine_pb2.GenerateResponse(complete=self._complete(full, with_top, report))
            finally:
                self._rank_of.pop(request_id, None)
        except _InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ValueError as e:  # engine-side validation: prompt too long, bad ids, bad sampling
            logger.info("Generate %s rejected: %s", request_id, e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _routed_experts_start(self, context: grpc.aio.ServicerContext) -> int | None:
        """The position the call asks routed experts from (None: not asked, or a model without MoE layers)."""
        try:
            start = asked_start(context.invocation_metadata())
        except BadRoutedExpertsAsk as e:
            raise _InvalidArgument(str(e)) from None
        return start if self.routed_experts.unsupported is None else None

    def _keep_routed_experts(self, request_id: str, out: RequestOutput, start: int | None) -> None:
        if start is not None and out.routed_experts is not None:
            self.routed_experts.store.put(request_id, out.index, out.routed_experts, start)

    def _kv_params(self, request: vllm_engine_pb2.GenerateRequest) -> KvTransferParams | None:
        """Where the request's KV is. Like vLLM, a kv_transfer_params_json that is present must be a JSON object
        whether or not it is used; an empty one, or any while KV migration is off, asks for nothing."""
        if not request.HasField("kv_transfer_params_json"):
            return None
        try:
            # Parsed within bounds (nesting, integer digits): a hostile value is refused, never a RecursionError.
            data = kv_transfer_params_object(request.kv_transfer_params_json)
            if not data or self.kv_puller is None:
                return None
            return KvTransferParams.from_dict(data)
        except KvTransferParamsError as e:  # vLLM's words, behind the prefix every refusal of this field has here
            raise _InvalidArgument(str(e)) from None

    async def _pull_then_attach(
        self,
        engine: AsyncEngine,
        rank: int,
        request_id: str,
        prompt: list[int],
        params: KvTransferParams,
        moved: _KvMoved,
    ) -> None:
        """`async` mode: the request waits in the engine (counted as waiting) while its KV is pulled."""
        assert self.kv_puller is not None
        try:
            kv = await self.kv_puller.pull(engine, rank, prompt, params)  # a failed pull is None: a fallback
        except BaseException:  # cancelled (shutdown): never leave the request waiting
            engine.attach_kv(request_id, None)
            raise
        used = kv
        try:
            attached = engine.attach_kv(request_id, kv)
        except ValueError:  # KV that does not fit this request: prefill it instead
            logger.exception("KV for %s does not fit it; prefilling", request_id)
            used = None
            attached = engine.attach_kv(request_id, None)
        moved.tokens = used.num_tokens if attached and used is not None else 0
        if kv is not None and (not attached or used is None):
            engine.engine.release_blocks(kv.block_ids)  # aborted meanwhile, or not used: the blocks are ours

    @staticmethod
    def _chunk(out: RequestOutput, with_top: bool) -> vllm_engine_pb2.GenerateStreamChunk:
        return vllm_engine_pb2.GenerateStreamChunk(
            token_ids=out.new_token_ids,
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=len(out.new_token_ids),
            cached_tokens=out.num_cached_tokens,
            output_logprobs=_output_logprobs(out, with_top),
            index=out.index,
        )

    @staticmethod
    def _complete(
        out: RequestOutput, with_top: bool, kv_moved: _KvMoved | None = None
    ) -> vllm_engine_pb2.GenerateComplete:
        extra: dict[str, Any] = {}
        if out.matched_stop_token_id is not None:
            extra["matched_token_id"] = out.matched_stop_token_id
        elif out.matched_stop_str is not None:
            extra["matched_stop_str"] = out.matched_stop_str
        if kv_moved is not None:
            extra["kv_transfer_params_json"] = kv_moved.report()
        return vllm_engine_pb2.GenerateComplete(
            output_ids=out.new_token_ids,
            finish_reason=out.finish_reason or "stop",
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=len(out.new_token_ids),
            cached_tokens=out.num_cached_tokens,
            output_logprobs=_output_logprobs(out, with_top),
            index=out.index,
            **extra,
        )

    # ---- management ------------------------------------------------------------------------------

    async def Abort(
        self, request: vllm_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.AbortResponse:
        for request_id in request.request_ids:
            rank = self._rank_of.get(request_id)
            if rank is not None:
                await self.engines[rank].abort(request_id)
        return vllm_engine_pb2.AbortResponse()

    def _dead_ranks(self) -> list[int]:
        return [rank for rank, e in enumerate(self.engines) if not e.is_alive()]

    async def healthy(self) -> bool:
        """Whether every rank's engine lives (the probe of the standard health service, grpc_services.py)."""
        return not self._dead_ranks()

    async def HealthCheck(
        self, request: vllm_engine_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.HealthCheckResponse:
        dead = self._dead_ranks()
        if dead:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message=f"engine ranks {dead} died")
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="Health")

    async def GetModelInfo(
        self, request: vllm_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetModelInfoResponse:
        cfg = self.folder.model_config
        tok = self.folder.tokenizer
        max_len = self.engines[0].engine.max_model_len
        pad = tok.token_to_id(tok.pad_token) if tok.pad_token else None
        bos = self.folder.bos_token_id
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=str(self.folder.path),
            is_generation=True,
            max_context_length=max_len,
            vocab_size=cfg.vocab_size,
            served_model_name=self.served_model_name,
            tokenizer_path=str(self.folder.path),
            model_type="qwen2_moe" if cfg.is_moe else "qwen2",
            architectures=["Qwen2MoeForCausalLM" if cfg.is_moe else "Qwen2ForCausalLM"],
            eos_token_ids=list(tok.eos_token_ids),
            pad_token_id=-1 if pad is None else pad,
            bos_token_id=-1 if bos is None else bos,
            max_req_input_len=max_len,
        )

    async def GetServerInfo(
        self, request: vllm_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        engine = self.engines[0].engine
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=len(self._rank_of),
            is_paused=all(e.paused for e in self.engines),
            last_receive_timestamp=self._last_receive,
            uptime_seconds=time.time() - self._started,
            # The wire protocol is vLLM's; the router treats us exactly like a vLLM gRPC worker.
            server_type="vllm-grpc",
            data_parallel_size=len(self.engines),
            kv_cache_dtype="auto",
            block_size=engine.cache_config.block_size,
            model_dtype=f"torch.{engine.model_config.torch_dtype}",
            max_num_seqs=engine.max_num_seqs,
        )

    async def GetLoads(
        self, request: vllm_engine_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetLoadsResponse:
        ranks = range(len(self.engines))
        if request.HasField("dp_rank"):
            if not 0 <= request.dp_rank < len(self.engines):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"dp_rank {request.dp_rank} is out of range for dp_size {len(self.engines)}",
                )
            ranks = range(request.dp_rank, request.dp_rank + 1)
        loads = []
        for rank in ranks:
            s = self.engines[rank].stats()
            loads.append(
                vllm_engine_pb2.SchedulerLoad(
                    dp_rank=rank,
                    num_running_reqs=s.num_running,
                    num_waiting_reqs=s.num_waiting,
                    num_total_reqs=s.num_running + s.num_waiting,
                    num_used_tokens=s.num_used_blocks * s.block_size,
                    max_total_num_tokens=s.num_total_blocks * s.block_size,
                    token_usage=s.kv_cache_usage,
                    cache_hit_rate=s.prefix_cache_hit_rate,
                    max_running_requests=self.engines[rank].engine.max_num_seqs,
                )
            )
        return vllm_engine_pb2.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            version="psrl-reference",
            dp_rank_count=len(loads),
            loads=loads,
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        if self._tokenizer_zip is None:
            self._tokenizer_zip = await asyncio.to_thread(_zip_tokenizer, self.folder.path)
        data, sha = self._tokenizer_zip
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = start + TOKENIZER_CHUNK_BYTES
            yield common_pb2.GetTokenizerChunk(data=data[start:end], sha256=sha if end >= len(data) else "")

    # ---- KV events -------------------------------------------------------------------------------

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        if request.start_sequence_number > MAX_START_SEQUENCE_NUMBER:
            message = f"start_sequence_number {request.start_sequence_number} is past {MAX_START_SEQUENCE_NUMBER}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        streams: list[KvEventStream] = []
        pumps: list[asyncio.Task[None]] = []
        merged: asyncio.Queue[tuple[int, KvEventsUpdate | EngineError]] = asyncio.Queue(
            maxsize=_MERGED_UPDATES * len(self.engines)
        )
        try:
            try:
                for engine in self.engines:
                    streams.append(engine.subscribe_kv_events())
            except EngineDeadError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            pumps = [asyncio.create_task(_pump_kv(rank, s, merged)) for rank, s in enumerate(streams)]
            cursors = [
                _KvRankStream(rank, engine, request.start_sequence_number) for rank, engine in enumerate(self.engines)
            ]
            await context.send_initial_metadata(())  # the client's call resolves before the first batch
            while True:
                rank, item = await merged.get()
                if isinstance(item, KvEventsOverflowError):
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(item))
                elif isinstance(item, EngineError):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(item))
                else:
                    for batch in cursors[rank].batches(item):
                        yield batch
        finally:  # client gone, cancelled or failed: unsubscribe, so the engines stop recording for it
            for pump in pumps:
                pump.cancel()
            for stream in streams:
                stream.close()

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        """Drop every rank's prefix cache; running requests keep their blocks (never needs to wait)."""
        cleared = sum(engine.reset_prefix_cache() for engine in self.engines)
        return common_pb2.FlushCacheResponse(success=True, message=f"dropped {cleared} cached blocks")


@dataclass
class _KvMoved:
    """What a request with kv_transfer_params got: the prompt tokens whose KV moved in (0: it was prefilled),
    reported back on its complete frame's kv_transfer_params_json."""

    tokens: int = 0

    def report(self) -> str:
        return json.dumps({"moved_tokens": self.tokens})


async def _pump_kv(
    rank: int, stream: KvEventStream, merged: asyncio.Queue[tuple[int, KvEventsUpdate | EngineError]]
) -> None:
    """Move one rank's updates into the call's queue (blocking when the client is slow)."""
    try:
        async for update in stream:
            await merged.put((rank, update))
    except EngineError as e:
        await merged.put((rank, e))


@dataclass
class _KvRankStream:
    """One dp rank's numbering on one SubscribeKvEvents call, and the proto conversion of its updates."""

    rank: int
    engine: AsyncEngine
    sequence_number: int  # of the last batch sent
    event_id: int = 0
    sample: int = 0

    @property
    def medium(self) -> str:
        return "GPU" if self.engine.engine.device.type == "cuda" else "CPU"

    def batches(self, update: KvEventsUpdate) -> list[common_pb2.KvEventBatch]:
        if not update.is_snapshot:
            events = []
            for event in update.events:
                self.event_id += 1
                events.append(_kv_event_proto(event, self.event_id, self.medium))
            return [self._batch(update.timestamp, events)]
        # Synthesized events carry event_id 0 (KvSnapshotChunk's rule); the first chunk opens with the clear.
        size = SNAPSHOT_EVENTS_PER_BATCH
        chunks = [update.events[i : i + size] for i in range(0, len(update.events), size)] or [()]
        num_blocks = sum(len(e.blocks) for e in update.events if isinstance(e, BlocksStored))
        out = []
        for index, chunk in enumerate(chunks):
            batch = self._batch(update.timestamp, [_kv_event_proto(e, 0, self.medium) for e in chunk])
            batch.snapshot.CopyFrom(
                common_pb2.KvSnapshotChunk(index=index, count=len(chunks), blocks=num_blocks, unknown_before=0)
            )
            out.append(batch)
        return out

    def _batch(self, timestamp: float, events: list[common_pb2.KvCacheEvent]) -> common_pb2.KvEventBatch:
        self.sequence_number += 1
        self.sample += 1
        return common_pb2.KvEventBatch(
            sequence_number=self.sequence_number,
            timestamp=timestamp,
            events=events,
            dp_rank=self.rank,
            load=self._load(),
        )

    def _load(self) -> common_pb2.EngineLoad:
        s = self.engine.stats()
        load = common_pb2.EngineLoad(
            running_requests=s.num_running,
            waiting_requests=s.num_waiting,
            token_usage=s.kv_cache_usage,
            # Cached blocks nobody holds are reclaimable, so usage already excludes them.
            active_token_usage=s.kv_cache_usage,
            max_running_requests=self.engine.engine.max_num_seqs,
            age_ms=0,
            sample=self.sample,
        )
        if self.sample == 1:  # telemetry beyond the routing core: on a stream's first record only
            load.cache_hit_rate = s.prefix_cache_hit_rate
            load.num_used_tokens = s.num_used_blocks * s.block_size
            load.max_total_num_tokens = s.num_total_blocks * s.block_size
        return load


def _kv_event_proto(event: KvEvent, event_id: int, medium: str) -> common_pb2.KvCacheEvent:
    if isinstance(event, BlocksStored):
        stored = common_pb2.KvBlocksStored(
            blocks=[
                common_pb2.KvBlock(block_hash=b.block_hash, token_ids=b.token_ids, block_size=event.block_size)
                for b in event.blocks
            ],
            tier=common_pb2.KV_CACHE_TIER_DEVICE,
            medium=medium,
            locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
        )
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, BlocksRemoved):
        removed = common_pb2.KvBlocksRemoved(
            block_hashes=event.block_hashes,
            tier=common_pb2.KV_CACHE_TIER_DEVICE,
            medium=medium,
            locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
        )
        return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)
    assert isinstance(event, AllBlocksCleared)
    return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


class _InvalidArgument(ValueError):
    """A request the servicer itself refuses (before the engine sees it)."""


def _zip_tokenizer(folder: Path) -> tuple[bytes, str]:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in _TOKENIZER_FILES:
            if (folder / name).is_file():
                zf.write(folder / name, name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()
