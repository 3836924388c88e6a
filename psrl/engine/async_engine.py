"""AsyncEngine: the engine's step loop in one background thread, with per-request asyncio streams.

The thread sleeps on a condition variable while there is no work and runs `Engine.step()` back to back
while there is; each step's delta outputs are handed to the event loops of their consumers in one
`call_soon_threadsafe` per loop, so the asyncio side never blocks on the model.

KV events: `subscribe_kv_events()` returns a stream that starts with a snapshot of the prefix cache and then
gets the events of every step, pushed by the step thread right after the step (no polling). The engine
records events only while at least one subscriber exists.

Parallel sampling (`n > 1`), as vLLM's AsyncLLM does it: the n choices of a request run as requests of their own
(`{index}_{request_id}`, seeded ones with seed + index), share one stream whose outputs carry their choice's
`index`, and end together on abort(request_id).

Weight syncs: `pause(mode)` closes admission and returns once the pause is in effect, i.e. once the step
thread sits idle with nothing it may run (so no forward is in flight and every abort output is handed to
its stream); `resume()` undoes it. `prepare_weights` + `swap_weights` split `load_weights` so that a
replica can swap several ranks only once all of them built their new weights.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from psrl.engine.engine import Engine, EngineStats
from psrl.engine.errors import (
    AdmissionClosedError,
    DuplicateRequestError,
    EngineDeadError,
    EngineStepError,
    InvalidRequestError,
    KvEventsOverflowError,
)
from psrl.engine.kv_events import KvEvent, KvEventsUpdate
from psrl.engine.model import Qwen2Model
from psrl.engine.request import RequestOutput
from psrl.engine.sampler import SamplingOptions
from psrl.engine.sync import PauseMode, PreloadedKV, SyncAbortedRequest

logger = logging.getLogger(__name__)

_Item = RequestOutput | BaseException


def choice_request_id(request_id: str, index: int) -> str:
    """The engine's id of choice `index` of an n > 1 request (vLLM's child request id)."""
    return f"{index}_{request_id}"


class RequestStream(AsyncIterator[RequestOutput]):
    """Delta outputs of one request, of every choice of it when n > 1 (each output carries its `index` and the
    request's id). Ends once every choice had its finished output; raises if the engine failed one (the others
    are aborted then).

    Leaving it early (cancellation, `aclose()`, or dropping it unfinished) aborts every unfinished choice.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, engine_ids: Sequence[str]) -> None:
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._unfinished = {engine_id: index for index, engine_id in enumerate(engine_ids)}  # -> choice index
        self._parallel = len(engine_ids) > 1

    @property
    def engine_ids(self) -> tuple[str, ...]:
        """The engine's ids of the choices that have not finished yet."""
        return tuple(self._unfinished)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            self._close()
            raise
        if isinstance(item, BaseException):
            self._close()  # the failed choice is gone already; the others would run for nobody
            raise item
        index = self._unfinished[item.request_id]
        if item.finished:
            del self._unfinished[item.request_id]
            if not self._unfinished:
                self._owner._forget(self)
        if self._parallel:
            item = replace(item, request_id=self.request_id, index=index)
        return item

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._unfinished:
            self._owner._abort_quietly(self)
            self._unfinished.clear()

    def __del__(self) -> None:
        if self._unfinished:
            self._owner._abort_quietly(self)


class KvEventStream(AsyncIterator[KvEventsUpdate]):
    """KV-event updates for one subscriber: first a snapshot of the cache, then every step's events.

    Never ends on its own; raises EngineDeadError after shutdown, KvEventsOverflowError when its consumer
    fell more than `max_pending` updates behind (resubscribe for a fresh snapshot). Close it (`close()`,
    `aclose()`, or cancellation while waiting) to unsubscribe; a stream that is dropped unclosed is
    unsubscribed by the overflow rule once `max_pending` updates pile up.
    """

    def __init__(self, owner: AsyncEngine, loop: asyncio.AbstractEventLoop, max_pending: int) -> None:
        self._owner = owner
        self._loop = loop
        self._max_pending = max_pending
        self._queue: asyncio.Queue[KvEventsUpdate | BaseException] = asyncio.Queue()
        self._closed = False

    def __aiter__(self) -> KvEventStream:
        return self

    async def __anext__(self) -> KvEventsUpdate:
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            self.close()
            raise
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._owner._unsubscribe_kv(self)

    async def aclose(self) -> None:
        self.close()

    def _put(self, item: KvEventsUpdate | BaseException) -> None:
        """On the subscriber's loop."""
        if self._closed:
            return
        if isinstance(item, KvEventsUpdate) and self._queue.qsize() >= self._max_pending:
            item = KvEventsOverflowError(f"KV-event subscriber fell {self._max_pending} updates behind")
        if isinstance(item, BaseException):
            while not self._queue.empty():  # nothing queued is of use once the stream failed
                self._queue.get_nowait()
            self.close()  # unsubscribe now, but still hand the error to the reader
        self._queue.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[_Item]]] = {}  # by engine id
        self._parallel: dict[str, RequestStream] = {}  # n > 1 requests by their own id, for abort
        self._streams_lock = threading.Lock()  # both tables
        self._kv_subscribers: list[KvEventStream] = []
        # Held while taking events from the engine and queueing them to subscribers, so that every
        # subscriber sees them in the engine's order whichever thread publishes.
        self._kv_lock = threading.Lock()
        self._wake = threading.Condition()
        self._shutdown = False
        # Guarded by _wake: whether the step thread sits waiting with nothing it may run, and the futures of
        # coroutines waiting for that (pause), resolved by the step thread each time it goes to wait.
        self._idle = False
        self._idle_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._thread = threading.Thread(target=self._run, name="psrl-engine-step", daemon=True)
        self._thread.start()

    # ---- public API -----------------------------------------------------------------------------

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        preloaded: PreloadedKV | None = None,
        kv_pending: bool = False,
    ) -> RequestStream:
        """Add a request and return its stream of delta outputs (`preloaded`, `kv_pending`: Engine.add_request).

        With `sampling.n > 1` its choices run as requests of their own (see the module docstring); they take no
        migrated KV and a sync abort never pins theirs: KV migration moves whole requests, n == 1 only.
        Validation errors (typed ValueErrors) raise here, before any iteration. Use as
        `async for out in engine.generate(...)`; must be called with a running event loop.
        """
        if self._shutdown or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")
        n = sampling.n
        if n > 1:
            # What only the whole request can tell (n itself), checked after admission as Engine.add_request
            # checks the rest: a paused engine refuses before it validates anything.
            closed = self.engine.admission_closed_reason
            if closed is not None:
                raise AdmissionClosedError(closed)
            sampling.validate()
            if preloaded is not None or kv_pending:
                raise InvalidRequestError(f"request {request_id!r}: migrated KV is for n == 1 requests, not n = {n}")
        engine_ids = [request_id] if n == 1 else [choice_request_id(request_id, i) for i in range(n)]
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, engine_ids)
        with self._streams_lock:
            if any(i in self._streams or i in self._parallel for i in {request_id, *engine_ids}):
                stream._unfinished.clear()
                raise DuplicateRequestError(f"request id {request_id!r} is already in the engine")
            for engine_id in engine_ids:
                self._streams[engine_id] = (loop, stream._queue)
            if n > 1:
                self._parallel[request_id] = stream
        try:
            if n == 1:
                self.engine.add_request(
                    request_id, prompt_token_ids, sampling, preloaded=preloaded, kv_pending=kv_pending
                )
            else:
                for index, engine_id in enumerate(engine_ids):
                    choice = sampling.for_choice(index)
                    self.engine.add_request(engine_id, prompt_token_ids, choice, pin_on_sync_abort=False)
        except BaseException:
            self._abort_quietly(stream)  # the choices already added, if any; none of them has produced anything
            stream._unfinished.clear()
            raise
        self._notify()
        return stream

    def attach_kv(self, request_id: str, kv: PreloadedKV | None) -> bool:
        """Release a `kv_pending` request (see Engine.attach_kv) and wake the step thread."""
        attached = self.engine.attach_kv(request_id, kv)
        if attached:
            self._notify()
        return attached

    async def abort(self, request_id: str) -> bool:
        """Abort a request, every choice of an n > 1 one; each ends with an "abort" output on the stream. False
        if unknown or finished."""
        with self._streams_lock:
            parallel = self._parallel.get(request_id)
        engine_ids = parallel.engine_ids if parallel is not None else (request_id,)
        aborted = [self.engine.abort(engine_id) for engine_id in engine_ids]
        if any(aborted):
            self._notify()
        return any(aborted)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block now (see Engine.reset_prefix_cache); subscribers get AllBlocksCleared."""
        count = self.engine.reset_prefix_cache()
        self._publish_kv_events()
        return count

    def subscribe_kv_events(self, *, max_pending: int = 1024) -> KvEventStream:
        """Subscribe to the prefix cache's KV events; must be called with a running event loop.

        The stream's first update is a snapshot (AllBlocksCleared, then every cached block); events that
        happened before it are already reflected in it, and every later change follows it exactly once.
        """
        if self._shutdown or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")
        stream = KvEventStream(self, asyncio.get_running_loop(), max_pending)
        with self._kv_lock:
            self.engine.kv_events_enabled = True
            pending, snapshot = self.engine.drain_kv_events_with_snapshot()
            self._deliver_kv(pending)  # to the earlier subscribers only
            self._kv_subscribers.append(stream)
        stream._queue.put_nowait(KvEventsUpdate(tuple(snapshot), is_snapshot=True, timestamp=time.time()))
        return stream

    @property
    def num_kv_subscribers(self) -> int:
        return len(self._kv_subscribers)

    async def load_weights(
        self,
        *,
        seed: int | None = None,
        path: str | Path | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
        version: int,
    ) -> None:
        """Returns once the new weights are in place: at the next step boundary, or at once when idle."""
        await asyncio.to_thread(self.engine.load_weights, seed=seed, path=path, state_dict=state_dict, version=version)
        self._publish_kv_events()  # the swap cleared the prefix cache

    async def prepare_weights(
        self,
        *,
        seed: int | None = None,
        path: str | Path | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> Qwen2Model:
        """Build new weights off the event loop, without swapping them in (see Engine.build_weights)."""
        return await asyncio.to_thread(self.engine.build_weights, seed=seed, path=path, state_dict=state_dict)

    async def swap_weights(self, model: Qwen2Model, *, version: int) -> None:
        """Swap in weights from prepare_weights; returns once they are in place (at a step boundary)."""
        await asyncio.to_thread(self.engine.swap_weights, model, version=version)
        self._publish_kv_events()

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    # ---- weight-sync pause ----------------------------------------------------------------------

    async def pause(
        self, mode: PauseMode, *, clear_cache: bool = False, reason: str = "generation is paused"
    ) -> list[SyncAbortedRequest]:
        """Close admission and pause generation; returns once the pause is in effect.

        ABORT ends every request now (each stream gets its "abort" output) and returns them; WAIT returns
        once every request finished normally (a KEEP pause's frozen requests run again to get there); KEEP
        freezes them until resume. Then no step runs until `resume()`. `clear_cache` drops the prefix cache
        once paused. Pausing again is allowed (e.g. ABORT after KEEP). If this coroutine is cancelled, the
        admission stays closed; call `resume()` or pause again.
        """
        self.engine.close_admission(reason)
        aborted: list[SyncAbortedRequest] = []
        if mode is PauseMode.WAIT:
            self.engine.unfreeze()
            self._notify()
            await self._wait_idle(drained=True)  # admission is closed: every request finishes, held ones too
            self.engine.freeze()
        else:
            self.engine.freeze()
            if mode is PauseMode.ABORT:
                aborted = self.engine.abort_all_for_sync()
                self._notify()  # the frozen step thread still hands out the abort outputs
            await self._wait_idle()
        if clear_cache:
            self.reset_prefix_cache()
        return aborted

    def resume(self) -> None:
        """Reopen admission and let frozen requests run again (also clears a `close_admission`)."""
        self.engine.unfreeze()
        self.engine.open_admission()
        self._notify()

    def close_admission(self, reason: str) -> None:
        """Refuse new requests (AdmissionClosedError from generate) without pausing anything."""
        self.engine.close_admission(reason)

    @property
    def paused(self) -> bool:
        """Whether a pause is in effect (set once `pause` froze the engine, cleared by `resume`)."""
        return self.engine.frozen

    @property
    def admission_closed_reason(self) -> str | None:
        return self.engine.admission_closed_reason

    async def _wait_idle(self, *, drained: bool = False) -> None:
        """Until the step thread waits with nothing it may run: no step in flight, every output dispatched;
        `drained`: and no request left, not even one held for its migrated KV (it runs once that lands)."""
        loop = asyncio.get_running_loop()
        while True:
            with self._wake:
                if self._shutdown or not self._thread.is_alive():
                    raise EngineDeadError("the engine is shut down")
                idle = self._idle and not self.engine.has_unfinished_requests()
                if idle and not (drained and self.engine.num_waiting):
                    return
                waiter = (loop, loop.create_future())
                self._idle_waiters.append(waiter)
            try:
                await waiter[1]
            finally:
                with self._wake:
                    if waiter in self._idle_waiters:
                        self._idle_waiters.remove(waiter)

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._shutdown

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the step thread; streams still open end with EngineDeadError."""
        with self._wake:
            self._shutdown = True
            self._wake.notify_all()
            self._wake_idle_waiters()  # they see the shutdown and raise EngineDeadError
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._streams_lock:
            streams, self._streams = self._streams, {}
            self._parallel.clear()
        for request_id in streams:
            self.engine.abort(request_id)
        self._deliver([(loop, queue, EngineDeadError("the engine was shut down")) for loop, queue in streams.values()])
        with self._kv_lock:
            subscribers, self._kv_subscribers = self._kv_subscribers, []
            self.engine.kv_events_enabled = False
        for sub in subscribers:
            _call_soon(sub._loop, sub._put, EngineDeadError("the engine was shut down"))

    # ---- KV events ------------------------------------------------------------------------------

    def _publish_kv_events(self) -> None:
        """Hand the engine's recorded KV events to every subscriber (from any thread)."""
        if not self.engine.kv_events_enabled:
            return  # nobody subscribed: nothing was recorded
        with self._kv_lock:
            events = self.engine.drain_kv_events()
            if events:
                self._deliver_kv(events)

    def _deliver_kv(self, events: list[KvEvent]) -> None:
        """Caller holds _kv_lock."""
        if not events or not self._kv_subscribers:
            return
        update = KvEventsUpdate(tuple(events), is_snapshot=False, timestamp=time.time())
        by_loop: dict[asyncio.AbstractEventLoop, list[KvEventStream]] = {}
        for sub in self._kv_subscribers:
            by_loop.setdefault(sub._loop, []).append(sub)
        for loop, subs in by_loop.items():
            _call_soon(loop, _put_kv_update, subs, update)

    def _unsubscribe_kv(self, stream: KvEventStream) -> None:
        with self._kv_lock:
            if stream in self._kv_subscribers:
                self._kv_subscribers.remove(stream)
            if not self._kv_subscribers:
                self.engine.kv_events_enabled = False  # stop recording: nobody listens

    # ---- step thread ----------------------------------------------------------------------------

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def _forget(self, stream: RequestStream) -> None:
        """A stream ended: an n > 1 request's id is free again."""
        with self._streams_lock:
            if self._parallel.get(stream.request_id) is stream:
                del self._parallel[stream.request_id]

    def _abort_quietly(self, stream: RequestStream) -> None:
        """A stream was left unfinished: abort its unfinished choices, except ids that now belong to a newer
        stream; their outputs go nowhere."""
        aborted = False
        try:
            self._forget(stream)
            with self._streams_lock:
                for engine_id in stream.engine_ids:
                    target = self._streams.get(engine_id)
                    if target is None or target[1] is not stream._queue:
                        continue  # already finished, failed or shut down
                    del self._streams[engine_id]
                    aborted = self.engine.abort(engine_id) or aborted
        except Exception:  # interpreter shutdown in __del__: nothing left to abort
            logger.debug("abort of %s on stream close failed", stream.request_id, exc_info=True)
        if aborted:
            self._notify()

    def _wake_idle_waiters(self) -> None:
        """Caller holds _wake."""
        waiters, self._idle_waiters = self._idle_waiters, []
        for loop, future in waiters:
            _call_soon(loop, _resolve, future)

    def _run(self) -> None:
        try:
            self._step_loop()
        finally:  # pause() waiters must not hang on a dead thread
            with self._wake:
                self._idle = False
                self._wake_idle_waiters()

    def _step_loop(self) -> None:
        while True:
            with self._wake:
                while not self._shutdown and not self.engine.has_unfinished_requests():
                    self._idle = True
                    self._wake_idle_waiters()
                    self._wake.wait()
                self._idle = False
                if self._shutdown:
                    return
            try:
                outputs: list[RequestOutput] = self.engine.step()
            except EngineStepError as exc:
                logger.exception("engine step failed; failing %d request(s)", len(exc.request_ids))
                self._publish_kv_events()
                self._fail(exc.request_ids, exc)
                continue
            except Exception as exc:  # a bug outside the forward: fail everyone rather than die silently
                logger.exception("engine step raised unexpectedly; failing all requests")
                self._publish_kv_events()
                self._fail_all(exc)
                continue
            # Events first: a client that sees a request finish can count on its blocks' events being queued.
            self._publish_kv_events()
            self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        items: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[_Item], _Item]] = []
        with self._streams_lock:
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is None:
                    continue  # the consumer went away; the request was aborted
                if out.finished:
                    del self._streams[out.request_id]
                items.append((target[0], target[1], out))
        self._deliver(items)

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        items = []
        with self._streams_lock:
            for request_id in request_ids:
                target = self._streams.pop(request_id, None)
                if target is not None:
                    items.append((target[0], target[1], exc))
        self._deliver(items)

    def _fail_all(self, exc: BaseException) -> None:
        with self._streams_lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.engine.abort(request_id)
        self._fail(request_ids, exc)

    @staticmethod
    def _deliver(items: Sequence[tuple[asyncio.AbstractEventLoop, asyncio.Queue[_Item], _Item]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]] = {}
        for loop, queue, item in items:
            by_loop.setdefault(loop, []).append((queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                logger.debug("dropping %d output(s) for a closed event loop", len(batch))


def _put_all(batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _put_kv_update(subs: list[KvEventStream], update: KvEventsUpdate) -> None:
    for sub in subs:
        sub._put(update)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        logger.debug("dropping a callback for a closed event loop")
