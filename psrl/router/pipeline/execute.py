"""The execute stage's unit: one Generate call on the chosen instance, read as deltas and accumulated like SMG.

Accumulation rule (the servicer's framing): chunk token ids are the output; a complete frame's ids count only
when no chunk came for its choice (non-streamed calls), because when streaming it repeats the last chunk's
delta. With n > 1 every frame names its choice (`index`): streamed, the choices' chunks interleave and each
choice's complete frame comes when it finishes; non-streamed, one complete frame per choice.

Routed experts: a generation that asks for them (`routed_experts_start`) sends that position as Generate
metadata, and once a choice's complete frame is read its rows are taken from the replica's
`psrl.experts.RoutedExperts` service (kept there before the frame was sent, dropped there once taken).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
import numpy as np
from smg_grpc_proto.generated import vllm_engine_pb2

from psrl._proto import routed_experts_pb2
from psrl.router.errors import (
    BadRequest,
    PromptOverflow,
    RouterError,
    WorkerInternalError,
    WorkerStreamFailed,
    WorkerTimeout,
    WorkerUnavailable,
)
from psrl.router.pipeline.context import Generation, GenerationInput, RoutedExperts
from psrl.router.registry import InstanceState
from psrl.router.worker_client import WorkerClients

logger = logging.getLogger(__name__)

_OVERFLOW_MARKERS = ("maximum model length", "maximum context length")
# Sent by our replicas once they admit a request (psrl.worker.admission.ACCEPTED_METADATA_KEY; the
# router never imports the worker, they meet on the wire).
ACCEPTED_METADATA_KEY = "x-psrl-accepted"
# Generate metadata asking our replicas for routed experts from this position on
# (psrl.worker.routed_experts.ROUTED_EXPERTS_METADATA_KEY; stock replicas ignore it).
ROUTED_EXPERTS_METADATA_KEY = "x-psrl-routed-experts-start"
ROUTED_EXPERTS_TIMEOUT_S = 30.0
_EXPERT_ID_DTYPES = ("uint8", "uint16")
# After the last complete frame the replica only has its trailers to send; a call still open this long
# after it is reset.
TRAILERS_GRACE_S = 10.0
_unsupported_logged: set[str] = set()  # replica targets that said they cannot record routed experts


@dataclass(slots=True)
class Delta:
    """New tokens of choice `index`; or, with `finished` set (and no tokens), the end of that choice."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    index: int = 0
    finished: Generation | None = None


def _logprobs_of(proto: vllm_engine_pb2.OutputLogProbs, want_top: bool):
    if not proto.token_ids:
        return None, None
    top = None
    if want_top and proto.top_logprobs:
        top = [list(zip(t.token_ids, t.values)) for t in proto.top_logprobs]
    return list(proto.token_logprobs), top


def _moved_tokens(report: str) -> int:
    """The replica's answer to kv_transfer_params (`{"moved_tokens": n}`); 0 when it is unreadable."""
    try:
        return int(json.loads(report).get("moved_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0


def map_rpc_error(e: grpc.aio.AioRpcError, *, started: bool, instance: InstanceState) -> RouterError:
    """One place where gRPC failures become router errors."""
    code, detail = e.code(), e.details() or ""
    where = f"worker {instance.id.base_worker_id} rank {instance.id.dp_rank}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        logger.info("%s refused the request: %s", where, detail)
        if any(m in detail for m in _OVERFLOW_MARKERS):
            return PromptOverflow(detail)
        return BadRequest(detail)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return WorkerTimeout(f"{where} did not finish within the request timeout")
    if started:
        return WorkerStreamFailed(f"{where} failed mid-stream ({code.name}): {detail}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return WorkerUnavailable(f"{where} is unavailable ({code.name}): {detail}")
    return WorkerInternalError(f"{where} failed ({code.name}): {detail}")


class WorkerCall:
    """One Generate RPC. `start()` waits for the first frame, so connection errors surface before any HTTP
    response is sent; iterating then yields deltas, and `results` holds each choice's accumulated generation
    (`result`: the first). With n > 1 a choice's end is yielded too (a Delta with `finished`)."""

    def __init__(
        self, clients: WorkerClients, instance: InstanceState, gen: GenerationInput, timeout_s: float | None
    ) -> None:
        self.instance = instance
        self.gen = gen
        self.results = [Generation() for _ in range(gen.sampling.n)]
        self.result = self.results[0]
        self.error: RouterError | None = None  # set when the call failed (also for streams that report it in-band)
        self._want_top = bool(gen.sampling.logprobs)
        self._clients = clients
        ask = (
            () if gen.routed_experts_start is None else ((ROUTED_EXPERTS_METADATA_KEY, str(gen.routed_experts_start)),)
        )
        self._call = clients.generate(instance.worker.target, gen.to_wire(instance.id.dp_rank), timeout_s, ask)
        self._first: vllm_engine_pb2.GenerateResponse | None = None
        self._frames = 0
        self._saw_chunk = [False] * gen.sampling.n
        self._open = gen.sampling.n  # choices without their complete frame yet

    async def _read(self) -> vllm_engine_pb2.GenerateResponse | None:
        try:
            frame = await self._call.read()
        except grpc.aio.AioRpcError as e:
            started = self._frames > 0 or await self._was_accepted()
            self.error = map_rpc_error(e, started=started, instance=self.instance)
            raise self.error from e
        if frame is None:
            return None
        self._frames += 1
        return frame

    async def _was_accepted(self) -> bool:
        try:
            metadata = await self._call.initial_metadata()
        except grpc.aio.AioRpcError:
            return False
        return any(key == ACCEPTED_METADATA_KEY for key, _ in metadata or ())

    async def wait_sent(self) -> None:
        """Return once the Generate is on the wire (the routing loop's hand-off ends here)."""
        try:
            await self._call.wait_for_connection()
        except grpc.aio.AioRpcError as e:
            self.error = map_rpc_error(e, started=False, instance=self.instance)
            raise self.error from e

    async def start(self) -> None:
        self._first = await self._read()

    def cancel(self) -> None:
        """The caller is done with the call. One still running is stopped (the replica then aborts the request),
        unless every choice's complete frame is in: the answer is whole, and only the RPC's status is left, in the
        trailers that follow (often a wake later). Nothing after the answer would change it, so it is not waited
        for, and the call is released to end on its own: a reset would cost the replica an abort of a finished
        request."""
        if not self._open:
            self._call.release(TRAILERS_GRACE_S)
        elif not self._call.done():
            self._call.cancel()

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        frame = self._first if self._frames else await self._read()
        self._first = None
        results = self.results
        while frame is not None:
            delta, done = self._apply(frame)
            if done >= 0 and self.gen.routed_experts_start is not None:
                results[done].routed_experts = await self._take_routed_experts(done)
            if delta is not None:
                yield delta
            if done >= 0:
                if len(results) > 1:
                    yield Delta([], None, None, done, results[done])
                if not self._open:
                    return  # whole: `cancel` releases the call
            frame = await self._read()
        for delta in self._ended_early():
            yield delta

    async def finish(self) -> None:
        """Read the call to its end without deltas, for a caller that needs only `results` (a non-streamed
        answer): the same accumulation as `deltas`, without an async generator's cost."""
        frame = self._first if self._frames else await self._read()
        self._first = None
        while frame is not None:
            done = self._apply(frame)[1]
            if done >= 0:
                if self.gen.routed_experts_start is not None:
                    self.results[done].routed_experts = await self._take_routed_experts(done)
                if not self._open:
                    return
            frame = await self._read()
        self._ended_early()

    def _apply(self, frame: vllm_engine_pb2.GenerateResponse) -> tuple[Delta | None, int]:
        """Add a frame to its choice's result: the Delta of its new tokens (None: none), and the index of the
        choice it completed (-1: none)."""
        which = frame.WhichOneof("response")
        if which == "chunk":
            c = frame.chunk
            index = c.index
            res = self._result_of(index)
            self._saw_chunk[index] = True
            res.prompt_tokens = c.prompt_tokens or res.prompt_tokens
            res.cached_tokens = max(res.cached_tokens, c.cached_tokens)
            if not c.token_ids:
                return None, -1
            ids = list(c.token_ids)
            lps, top = _logprobs_of(c.output_logprobs, self._want_top)
            _extend(res, ids, lps, top)
            return Delta(ids, lps, top, index), -1
        if which != "complete":
            return None, -1
        c = frame.complete  # each field read once: a protobuf attribute costs a lookup by name
        index = c.index
        res = self._result_of(index)
        res.finish_reason = c.finish_reason or "stop"
        res.prompt_tokens = c.prompt_tokens or res.prompt_tokens
        res.cached_tokens = max(res.cached_tokens, c.cached_tokens)
        matched = c.WhichOneof("matched_stop")
        if matched == "matched_token_id":
            res.matched_stop_token_id = c.matched_token_id
        elif matched == "matched_stop_str":
            res.matched_stop_str = c.matched_stop_str
        moved = c.kv_transfer_params_json
        if moved:
            res.kv_moved_tokens = _moved_tokens(moved)
        self._open -= 1
        if self._saw_chunk[index]:
            return None, index
        ids = list(c.output_ids)
        if not ids:
            return None, index
        lps, top = _logprobs_of(c.output_logprobs, self._want_top)
        _extend(res, ids, lps, top)
        return Delta(ids, lps, top, index), index

    def _result_of(self, index: int) -> Generation:
        try:
            return self.results[index]
        except IndexError:
            raise self._no_such_choice(index) from None

    def _ended_early(self) -> list[Delta]:
        """The stream ended before every choice's complete frame. A replica that refuses a request (admission
        closed) answers one empty abort frame, whatever n: the other choices end as aborted too (their closing
        Deltas, for n > 1). Anything else is the call's failure, raised."""
        results = self.results
        if len(results) > 1 and any(r.finish_reason == "abort" for r in results):
            closing = []
            for i, r in enumerate(results):
                if r.finish_reason is None:
                    r.finish_reason = "abort"
                    closing.append(Delta([], None, None, i, r))
            return closing
        self.error = WorkerStreamFailed(
            f"worker {self.instance.id.base_worker_id} closed the stream without a complete frame for every choice"
        )
        raise self.error

    def end_at_stop(self, delta: Delta, keep: int, stop: str) -> Delta:
        """End the choice `keep` ids into `delta`, at a stop string the replica could not see (it began before a
        loop-back): the ids after the one completing it are dropped, as vLLM drops them. The call is done."""
        res = self.results[delta.index]
        drop = len(delta.token_ids) - keep
        if drop:
            del res.output_ids[-drop:]
            if res.logprobs is not None:
                del res.logprobs[-drop:]
            if res.top_logprobs is not None:
                del res.top_logprobs[-drop:]
            if res.routed_experts is not None:  # a non-streamed answer's rows came with it
                res.routed_experts = self._rows_kept(res, res.routed_experts)
        res.finish_reason, res.matched_stop_str, res.matched_stop_token_id = "stop", stop, None
        return Delta(
            delta.token_ids[:keep],
            None if delta.logprobs is None else delta.logprobs[:keep],
            None if delta.top_logprobs is None else delta.top_logprobs[:keep],
            delta.index,
        )

    async def routed_experts_after_cut(self) -> None:
        """After end_at_stop on a stream asking for routed experts: the replica never saw that stop, so it is
        aborted, its stream read on to the complete frame, and the rows of the ids kept taken. Without them the
        segment has none (any failure here costs only the routing, which partial rollout then reports). A
        non-streamed answer's rows came with it, and end_at_stop cut them."""
        if self.gen.routed_experts_start is None or self.result.routed_experts is not None or self._call.done():
            return
        stub = self._clients.stub(self.instance.worker.target)
        try:
            await stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=[self.gen.request_id]), timeout=10)
            while True:
                frame = await self._call.read()
                if frame is None:
                    return
                if frame.WhichOneof("response") == "complete":
                    break
        except grpc.aio.AioRpcError as e:
            logger.warning("request %s: no routed experts after its stop string: %s", self.gen.request_id, e.code())
            return
        routed = await self._take_routed_experts(frame.complete.index)
        if routed is not None:
            self.result.routed_experts = self._rows_kept(self.result, routed)

    def _rows_kept(self, res: Generation, routed: RoutedExperts) -> RoutedExperts:
        """The rows of the positions fed for the ids `res` keeps: the prompt's and every id's but the last."""
        kept = len(self.gen.prompt_ids) + len(res.output_ids) - 1 - routed.prompt_start
        return RoutedExperts(routed.rows[: max(kept, 0)], routed.prompt_start)

    async def _take_routed_experts(self, index: int) -> RoutedExperts | None:
        """The rows the replica kept for choice `index`; None (logged) when it has none or cannot say."""
        target, rid = self.instance.worker.target, self.gen.request_id
        try:
            reply = await self._clients.take_routed_experts(target, rid, index, ROUTED_EXPERTS_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._log_unsupported("it does not serve psrl.experts.RoutedExperts (a stock vLLM servicer?)")
            else:
                logger.warning("request %s: TakeRoutedExperts failed (%s): %s", rid, e.code().name, e.details())
            return None
        if reply.status == routed_experts_pb2.ROUTED_EXPERTS_UNSUPPORTED:
            self._log_unsupported(reply.reason)
            return None
        if reply.status != routed_experts_pb2.ROUTED_EXPERTS_OK:
            logger.warning("request %s choice %d: no routed experts: %s", rid, index, reply.reason)
            return None
        shape = (reply.num_rows, reply.num_layers, reply.top_k)
        try:
            if reply.dtype not in _EXPERT_ID_DTYPES:
                raise ValueError(f"dtype {reply.dtype!r} is not one of {_EXPERT_ID_DTYPES}")
            wire = np.dtype(reply.dtype).newbyteorder("<")
            rows = np.frombuffer(reply.data, dtype=wire).reshape(shape).astype(reply.dtype)
        except ValueError as e:
            logger.warning("request %s choice %d: malformed routed experts %s: %s", rid, index, shape, e)
            return None
        return RoutedExperts(rows, reply.prompt_start)

    def _log_unsupported(self, reason: str) -> None:
        target = self.instance.worker.target
        if target not in _unsupported_logged:  # once per replica: every request asking would repeat it
            _unsupported_logged.add(target)
            logger.warning("worker %s records no routed experts: %s", self.instance.id.base_worker_id, reason)

    def _no_such_choice(self, index: int) -> WorkerStreamFailed:
        self.error = WorkerStreamFailed(
            f"worker {self.instance.id.base_worker_id} sent choice {index} of a request with n={len(self.results)}"
        )
        return self.error


def _extend(res: Generation, ids: list[int], lps: list[float] | None, top) -> None:
    res.output_ids.extend(ids)
    if lps is not None:
        if res.logprobs is None:
            res.logprobs = []
        res.logprobs.extend(lps)
    if top is not None:
        if res.top_logprobs is None:
            res.top_logprobs = []
        res.top_logprobs.extend(top)
