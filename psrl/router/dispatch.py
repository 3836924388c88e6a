"""Dispatch: take an instance (through the routing loop or directly), send the Generate, and run a request's
iterations, looping it back after a weight-sync abort (partial rollout) until it ends with stop or length."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from psrl.psmanager.errors import PSManagerError
from psrl.router.config import ConnectionMode, KvTransferConfig
from psrl.router.errors import (
    BadRequest,
    RequestAborted,
    RouterError,
    WorkerInternalError,
    WorkerStreamFailed,
    WorkerTimeout,
    WorkerUnavailable,
)
from psrl.router.metadata import RoutingMeta
from psrl.router.metrics import RouterMetrics
from psrl.router.pipeline.context import Generation, GenerationInput
from psrl.router.pipeline.execute import Delta, WorkerCall
from psrl.router.pipeline.partial_rollout import RolloutState, SegmentEnd, classify
from psrl.router.pipeline.prepare import check_prompt
from psrl.router.pipeline.stops import StopAcrossLoopBack
from psrl.router.policies.base import SelectionRequest
from psrl.router.registry import InstanceId, InstanceState, WorkerRegistry
from psrl.router.routing_loop import RoutingLoop
from psrl.router.selector import AdmissionHook, Resolved, Selector, Ticket
from psrl.router.tokenizers import TokenizerStore
from psrl.router.worker_client import WorkerClients

logger = logging.getLogger(__name__)

# Failures of the instance itself (they count against its circuit breaker); client errors do not.
WORKER_FAULTS = (WorkerUnavailable, WorkerStreamFailed, WorkerTimeout, WorkerInternalError)
# How a replica that dies (or drops the connection) under a running request shows up mid-stream.
REPLICA_FAILURES = (WorkerStreamFailed, WorkerUnavailable)
START_ATTEMPTS = 3  # placements a PSRL request gets when its replica fails before answering


LOOPBACK_WAIT_S = 300.0


class PartialRolloutExhausted(RouterError):
    status = 500
    code = "partial_rollout_exhausted"


class Dispatcher:
    def __init__(
        self,
        registry: WorkerRegistry,
        selector: Selector,
        admission: AdmissionHook,
        loop: RoutingLoop | None,
        clients: WorkerClients,
        metrics: RouterMetrics,
        tokenizers: TokenizerStore,
        *,
        request_timeout_s: float | None,
        partial_rollout: bool,
        max_iterations: int,
        kv_transfer: KvTransferConfig | None = None,
    ) -> None:
        self.registry = registry
        self.selector = selector
        self.admission = admission
        self.loop = loop
        self.clients = clients
        self.metrics = metrics
        self.tokenizers = tokenizers  # a loop-back with stop strings reads its output's text
        self.request_timeout_s = request_timeout_s
        self.partial_rollout = partial_rollout
        self.max_iterations = max_iterations
        self.kv_transfer = kv_transfer or KvTransferConfig()

    def kv_transfer_params(self, source: tuple[InstanceId, str] | None, gen: GenerationInput) -> str:
        """`kv_transfer_params_json` for a loop-back from `source` (the instance that aborted it and the request
        id it ran under there); "" when transfers are off or the source is gone. Sent to the source's own
        instance too: the replica then takes its pinned blocks over without a copy."""
        if not self.kv_transfer.enable or source is None:
            return ""
        iid, source_request_id = source
        worker = self.registry.get(iid.base_worker_id)
        if worker is None or worker.connection_mode is not ConnectionMode.GRPC:
            return ""
        c = self.kv_transfer
        return json.dumps(
            {
                "source": {"target": worker.target, "dp_rank": iid.dp_rank, "base_worker_id": iid.base_worker_id},
                "request_id": source_request_id,
                "num_tokens": len(gen.prompt_ids) - 1,
                "mode": c.transfer_mode,
                "timeout_ms": c.transfer_timeout_ms,
            }
        )

    def instances(self, model: str, grpc_only: bool) -> Sequence[InstanceState]:
        view = self.registry.view(model)
        return view.grpc_instances if grpc_only else view.instances

    async def acquire(
        self, model: str, meta: RoutingMeta, request: SelectionRequest, *, grpc_only: bool = False
    ) -> Ticket:
        """An instance for one iteration: from the routing loop for PSRL requests, else selected here."""
        instances = self.instances(model, grpc_only)
        if grpc_only and not instances and self.registry.instances_of(model):
            raise BadRequest(f"model {model!r} is served only by HTTP workers; this endpoint needs gRPC workers")
        if self.loop is not None and meta.has_psrl:
            # the loop re-reads the instances at each attempt: the fleet changes while a request waits
            return await self.loop.acquire(meta, request, lambda: self.instances(model, grpc_only))
        if not meta.has_psrl:  # the admission hook has no say: nothing to wait for
            return self.selector.commit(self._chosen(self.selector.available(instances, meta), request), meta, request)
        try:
            resolved = await self.selector.resolve(instances, meta)
        except PSManagerError as e:
            raise WorkerUnavailable(f"the PSManager is unavailable: {e}") from e
        instance = self._chosen(resolved, request)
        try:
            return await self.selector.place(instance, meta, request)
        except Exception as e:  # released already; so is a cancelled one (the client left), which passes through
            raise WorkerUnavailable(f"could not record the placement: {e}") from e

    def _chosen(self, resolved: Resolved, request: SelectionRequest) -> InstanceState:
        selection = self.selector.select(resolved, request)
        self.metrics.selected(selection.step, selection.instance is not None)
        if selection.instance is None:
            raise WorkerUnavailable(selection.reason)
        return selection.instance

    def finish(self, ticket: Ticket, error: RouterError | None) -> None:
        """Release the ticket exactly once, judging the instance by how the request ended."""
        success = not isinstance(error, WORKER_FAULTS)
        if ticket.routed:
            assert self.loop is not None
            self.loop.finished(ticket, success=success)
        else:
            self.selector.release(ticket, success=success)
        if isinstance(error, WorkerUnavailable):
            # Out of rotation at once; the health loop brings it back when it answers again.
            ticket.instance.worker.health.mark_down()

    async def start_call(self, ticket: Ticket, gen: GenerationInput) -> WorkerCall:
        """Send the Generate (ending the hand-off) and wait for its first frame; on failure the ticket is
        released and the error raised."""
        call: WorkerCall | None = None
        try:
            if ticket.meta.has_psrl and await self.admission.is_aborted(ticket.meta):
                raise RequestAborted(f"request {ticket.meta.request_id} was aborted")
            call = WorkerCall(self.clients, ticket.instance, gen, self.request_timeout_s)
            if ticket.release_handoff is not None:
                await call.wait_sent()
                ticket.release_handoff()
            await call.start()
        except BaseException as e:  # a RouterError, or cancelled (a sibling choice failed, the client left)
            if call is not None:
                call.cancel()
            self.finish(ticket, e if isinstance(e, RouterError) else None)
            raise
        return call


class Rollout:
    """One request's life over its iterations: `start()` places it and waits for the first frame (so errors
    are HTTP errors), then `deltas()` streams every token of every choice, across loop-backs, and ends each
    choice with a Delta carrying its merged generation (also in `results` afterwards). `start()` returns the
    first instance (a stream's headers); `ticket` is the latest.

    An n > 1 request is one Generate for all its choices. When a weight sync interrupts it, each unfinished
    choice continues on its own, as an n = 1 request of its prompt plus its output (a child Rollout over that
    choice's state, `resumed`; their deltas are merged as they come). KV moves per request (a replica pins no
    choice's KV at an abort), so a choice's first continuation is prefilled again. A request refused as a whole
    (nothing produced: the replica's admission was closed) is retried as it was."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        model: str,
        meta: RoutingMeta,
        gen: GenerationInput,
        *,
        resumed: RolloutState | None = None,
    ) -> None:
        self._d = dispatcher
        self._model = model
        self.meta = meta
        self.states = [resumed] if resumed is not None else [RolloutState(gen, i) for i in range(gen.sampling.n)]
        self.ticket: Ticket | None = None
        self._call: WorkerCall | None = None
        self._last: list[Generation | None] = [None] * len(self.states)  # each choice's last segment
        self._merged: list[Generation | None] = [None] * len(self.states)  # each finished choice, whole
        self._interrupted = 0  # aborts after producing tokens
        self._refused = 0  # consecutive aborts with nothing produced (admission closed)
        # Where the request's KV is: the instance and request id of the last iteration that ran (produced tokens
        # or took KV in); a refused attempt computed nothing, so it does not move the source.
        self._kv_source: tuple[InstanceId, str] | None = None

    async def _begin(self, gen: GenerationInput) -> WorkerCall:
        request = SelectionRequest(gen.request_id, self._model, gen.prompt_ids, None, self.meta.routing_key)
        ticket = await self._d.acquire(self._model, self.meta, request, grpc_only=True)
        try:
            check_prompt(gen.prompt_ids, gen.sampling, ticket.instance.worker.max_context_length)
            params = self._d.kv_transfer_params(self._kv_source, gen)
        except BaseException:  # whatever fails between placement and the call, the ticket is released
            self._d.finish(ticket, None)
            raise
        if params:
            gen = replace(gen, kv_transfer_params_json=params)
        call = await self._d.start_call(ticket, gen)
        self.ticket = ticket
        return call

    async def _loop_back(self, gen: GenerationInput) -> WorkerCall:
        """A looped-back request already holds tokens: while no instance can take it (a sync in progress),
        it waits rather than failing."""
        deadline = asyncio.get_running_loop().time() + LOOPBACK_WAIT_S
        while True:
            try:
                return await self._begin(gen)
            except REPLICA_FAILURES:  # also a replica that failed before its health check noticed
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def start(self) -> Ticket:
        """Place the request and wait for its first frame. A PSRL request whose replica fails before that frame
        (a non-streamed call's first frame is its answer) starts again elsewhere, a few times at most."""
        for attempt in range(START_ATTEMPTS):
            try:
                self._call = await self._begin(self.states[0].original)
                break
            except REPLICA_FAILURES as e:
                if not self._recovers or attempt == START_ATTEMPTS - 1:
                    raise
                logger.warning("request %s: %s; it starts again", self.states[0].original.request_id, e.message)
        assert self.ticket is not None
        return self.ticket

    @property
    def _recovers(self) -> bool:
        """Whether a replica failure under this request loops it back (PSRL requests, partial rollout on)."""
        return self.meta.has_psrl and self._d.partial_rollout

    def deltas(self) -> AsyncIterator[Delta]:
        assert self._call is not None, "start() first"
        return self._one_choice() if len(self.states) == 1 else self._choices()

    def _settle(self, index: int, segment: Generation, ticket: Ticket) -> bool:
        """Add a choice's segment: True when the choice is finished, False when it loops back."""
        state = self.states[index]
        state.add(segment, ticket.instance.weight_version)
        if classify(segment, state) is SegmentEnd.LOOP_BACK and self._d.partial_rollout:
            return False
        if segment.finish_reason == "abort" and state.remaining_tokens == 0:
            segment = replace(segment, finish_reason="length")  # aborted exactly at the budget
        self._last[index] = segment
        return True

    def _closing(self, index: int) -> Delta:
        last = self._last[index]
        assert last is not None
        merged = self._merged[index] = self.states[index].merged(last)
        return Delta([], None, None, index, merged)

    def _survive(self, error: RouterError, open_segments: list[Generation]) -> None:
        """A replica that fails mid-decode under a PSRL request (partial rollout on) costs it nothing: its open
        choices end as if a sync had aborted them, keeping what they streamed, and loop back to another
        instance, where their KV is recomputed. Any other request fails with the error."""
        if not self._recovers:
            raise error
        logger.warning(
            "request %s: %s; it continues elsewhere with the tokens it had",
            self.states[0].original.request_id,
            error.message,
        )
        for segment in open_segments:
            segment.finish_reason = "abort"

    async def _interrupted_by(self, ticket: Ticket, produced: bool) -> None:
        """Count an interruption (or a refusal, backing off), give up past the limits, and point the next
        iteration at the instance that aborted it (the KV-transfer source, not a pin), dropping a one-shot pin
        and keeping the version it was pinned to as its floor."""
        if produced:
            self._interrupted += 1
            self._refused = 0
        else:
            # Refused at admission (the replica is mid-sync): not progress, so back off instead of spinning.
            self._refused += 1
            await asyncio.sleep(min(0.05 * self._refused, 1.0))
        if self._interrupted >= self._d.max_iterations or self._refused >= 10 * self._d.max_iterations:
            raise PartialRolloutExhausted(
                f"request interrupted {self._interrupted} times and refused {self._refused} times in a row; "
                "giving up (max_rollout_iterations)"
            )
        self.meta = self.meta._replace(hint=ticket.instance.id, force_pin_once=False, version_tag=ticket.pinned_version)

    async def _stop_watch(self) -> StopAcrossLoopBack | None:
        """For a loop-back with stop strings: the watch for one begun in the output so far."""
        state = self.states[0]
        if not state.original.sampling.stop or not state.output_ids:
            return None
        tok = await self._d.tokenizers.get(self._model)
        return StopAcrossLoopBack.after(tok, state.original.sampling, state.output_ids)

    @staticmethod
    async def _watched(call: WorkerCall, watch: StopAcrossLoopBack) -> AsyncIterator[Delta]:
        """`call`'s deltas, ended at a stop string `watch` sees complete (the caller then cancels the call)."""
        deltas = call.deltas()
        try:
            async for delta in deltas:
                hit = None if watch.done else watch.feed(delta.token_ids)
                if hit is not None:
                    cut = call.end_at_stop(delta, *hit)
                    await deltas.aclose()
                    await call.routed_experts_after_cut()  # the segment's rows, when it asked for them
                    yield cut
                    return
                yield delta
        finally:
            await deltas.aclose()

    async def _one_choice(
        self, watch: StopAcrossLoopBack | None = None, *, whole: bool = False
    ) -> AsyncIterator[Delta]:
        """The choice's iterations; `watch`: the stop-string watch of a call that is a loop-back already. `whole`
        (`collect`): only the closing Delta is wanted, so each call is read by `finish`, without its deltas."""
        call = self._call
        assert call is not None
        while True:
            ticket = self.ticket
            assert ticket is not None
            try:
                if whole and watch is None:
                    await call.finish()
                else:
                    async for delta in call.deltas() if watch is None else self._watched(call, watch):
                        if not whole:
                            yield delta
            except REPLICA_FAILURES as e:
                self._survive(e, [call.result])
            finally:
                call.cancel()
                self._d.finish(ticket, call.error)
            if self._choice_ended(call, ticket):
                yield self._closing(0)
                return
            watch, call = await self._next_iteration(call, ticket)

    def _choice_ended(self, call: WorkerCall, ticket: Ticket) -> bool:
        """After one iteration of the lone choice: True when it is finished, else False, with the KV source of
        the next iteration noted."""
        segment = call.result
        if segment.kv_moved_tokens is not None:  # admitted with kv_transfer_params (a refusal reports nothing)
            self._d.metrics.kv_transfer(segment.kv_moved_tokens)
        if self._settle(0, segment, ticket):
            return True
        if call.error is not None:
            self._kv_source = None  # the replica failed: its KV is gone, the next hop recomputes it
        elif segment.output_ids or segment.kv_moved_tokens:
            # It ran there (its KV, moved in or computed, is now pinned there): the next hop pulls from it.
            self._kv_source = (ticket.instance.id, call.gen.request_id)
        return False

    async def _next_iteration(self, call: WorkerCall, ticket: Ticket) -> tuple[StopAcrossLoopBack | None, WorkerCall]:
        """Loop the lone choice back after an iteration that did not finish it: its stop-string watch and call."""
        state = self.states[0]
        await self._interrupted_by(ticket, bool(call.result.output_ids))
        logger.info(
            "request %s looped back from %s after %d tokens (iteration %d)",
            state.original.request_id,
            ticket.instance.id,
            len(state.output_ids),
            state.iterations,
        )
        watch = await self._stop_watch()
        return watch, await self._loop_back(state.next_input())

    async def _choices(self) -> AsyncIterator[Delta]:
        call = self._call
        assert call is not None
        while True:
            ticket = self.ticket
            assert ticket is not None
            unfinished: list[int] = []
            try:
                async for delta in call.deltas():
                    if delta.finished is None:
                        yield delta
                    elif self._settle(delta.index, delta.finished, ticket):
                        yield self._closing(delta.index)
                    else:
                        unfinished.append(delta.index)
            except REPLICA_FAILURES as e:
                open_choices = [i for i, r in enumerate(call.results) if r.finish_reason is None]
                self._survive(e, [call.results[i] for i in open_choices])
                for i in open_choices:
                    if self._settle(i, call.results[i], ticket):
                        yield self._closing(i)
                    else:
                        unfinished.append(i)
            finally:
                call.cancel()
                self._d.finish(ticket, call.error)
            if not unfinished:
                return
            produced = any(s.output_ids for s in self.states)
            await self._interrupted_by(ticket, produced)
            if produced or len(unfinished) < len(self.states):
                logger.info(
                    "request %s: choices %s continue on their own after an abort",
                    self.states[0].original.request_id,
                    unfinished,
                )
                async for delta in self._continue_each(unfinished):
                    yield delta
                return
            original = self.states[0].original
            retry_id = f"{original.request_id}-r{self.states[0].iterations}"
            call = await self._loop_back(replace(original, request_id=retry_id))

    async def _continue_each(self, indexes: list[int]) -> AsyncIterator[Delta]:
        """Run each of these choices on as an n = 1 Rollout of its own, yielding their deltas as they come."""
        queue: asyncio.Queue[Delta | Exception | None] = asyncio.Queue()

        async def run(index: int) -> None:
            child = Rollout(self._d, self._model, self.meta, self.states[index].original, resumed=self.states[index])
            child._interrupted, child._refused = self._interrupted, self._refused
            try:
                watch = await child._stop_watch()
                child._call = await child._loop_back(self.states[index].next_input())
                async for delta in child._one_choice(watch):
                    if delta.finished is not None:
                        self._merged[index] = child._merged[0]
                    queue.put_nowait(replace(delta, index=index))
            except Exception as e:  # handed to the reader, which raises it (and stops the others)
                queue.put_nowait(e)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.ensure_future(run(i)) for i in indexes]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self) -> list[Generation]:
        """Run the request to its end without streaming it (after `start()`): each choice's merged generation."""
        assert self._call is not None, "start() first"
        async for _ in self._one_choice(whole=True) if len(self.states) == 1 else self._choices():
            pass
        return self.results

    @property
    def results(self) -> list[Generation]:
        """Each choice's merged generation (its closing Delta's), once `deltas()` is done."""
        out = [gen for gen in self._merged if gen is not None]
        assert len(out) == len(self._merged), "deltas() first"
        return out
