"""The routing loop: every PSRL request waits in a priority queue; the loop selects, commits and hands it off.

Pause/resume works by epochs (COMPAT section 5). A selection holds a decision permit stamped with the epoch it
started in; commit and dispatch need a hand-off permit for the same, unpaused epoch, otherwise the selection is
dropped and the request re-enqueued (never dispatched). `pause(wait=True)` returns once no decision or
hand-off of the old epoch is active, so after it no new Generate reaches a replica until `resume()`.

The queue (`RequestQueue`) is pure; `RoutingLoop` is the asyncio shell around it and the selector.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from psrl.router.errors import RouterError
from psrl.router.metadata import RoutingMeta
from psrl.router.policies.base import SelectionRequest
from psrl.router.registry import InstanceState
from psrl.router.selector import Selection, Selector, Ticket

logger = logging.getLogger(__name__)

SORT_INDICATORS = ("small_id", "short_length", "long_length")
_LAST = 2**63 - 1  # unversioned requests sort after every version
_PARTITION_UNVERSIONED = 2**31 - 1


@dataclass
class RoutingLoopConfig:
    enable_routing_loop: bool = False
    dispatch_batch_size: int = 1
    max_running_dispatch_tasks: int = 4096
    request_sort_indicator: str = "small_id"
    enable_multi_priority_queue: bool = False
    check_interval_ms: int = 10  # how long the loop rests when a pass could place nothing

    def validate(self) -> None:
        if self.request_sort_indicator not in SORT_INDICATORS:
            raise ValueError(f"request_sort_indicator must be one of {SORT_INDICATORS}")
        if self.dispatch_batch_size < 1 or self.max_running_dispatch_tasks < 1:
            raise ValueError("dispatch_batch_size and max_running_dispatch_tasks must be >= 1")
        if self.check_interval_ms < 1:
            raise ValueError("check_interval_ms must be >= 1")


# ---- the queue (pure) -------------------------------------------------------------------------------------


@dataclass(eq=False)
class QueueEntry:
    meta: RoutingMeta
    request: SelectionRequest
    instances: Callable[[], list[InstanceState]]  # the candidates, read when the entry is selected
    future: asyncio.Future  # resolves to the committed Ticket (with its hand-off permit)
    seq: int = 0
    key: tuple = ()

    @property
    def partition(self) -> int:
        return self.meta.version_tag if self.meta.version_tag >= 0 else _PARTITION_UNVERSIONED


def priority_key(meta: RoutingMeta, prompt_len: int, indicator: str) -> tuple:
    """(validation first, version ascending with -1 last, the sort indicator); FIFO breaks ties (seq)."""
    if indicator == "small_id":
        third = meta.request_id if meta.request_id is not None else _LAST
    elif indicator == "short_length":
        third = prompt_len
    else:
        third = -prompt_len
    return (0 if meta.is_validate else 1, meta.version_tag if meta.version_tag >= 0 else _LAST, third)


class RequestQueue:
    """A priority queue, optionally partitioned by version (the lowest partition always drains first)."""

    def __init__(self, indicator: str, partitioned: bool) -> None:
        self._indicator = indicator
        self._partitioned = partitioned
        self._heaps: dict[int, list[tuple[tuple, int, QueueEntry]]] = {}
        self._seq = itertools.count()

    def push(self, entry: QueueEntry, *, keep_seq: bool = False) -> None:
        if not keep_seq or not entry.seq:
            entry.seq = next(self._seq) + 1
            entry.key = priority_key(entry.meta, len(entry.request.prompt_ids), self._indicator)
        part = entry.partition if self._partitioned else 0
        heapq.heappush(self._heaps.setdefault(part, []), (entry.key, entry.seq, entry))

    def pop(self) -> QueueEntry | None:
        for part in sorted(self._heaps):
            heap = self._heaps[part]
            if heap:
                entry = heapq.heappop(heap)[2]
                if not heap:
                    del self._heaps[part]
                return entry
        return None

    def __len__(self) -> int:
        return sum(len(h) for h in self._heaps.values())

    def entries(self) -> list[QueueEntry]:
        return [e for part in sorted(self._heaps) for _, _, e in sorted(self._heaps[part])]

    def partition_lens(self) -> dict[str, int]:
        return {str(part): len(h) for part, h in sorted(self._heaps.items())} if self._partitioned else {}


# ---- the loop ---------------------------------------------------------------------------------------------


CommitHook = Callable[[Ticket], Awaitable[None]]


class RoutingLoop:
    def __init__(
        self,
        config: RoutingLoopConfig,
        selector: Selector,
        on_commit: CommitHook | None = None,
        on_queue_length: Callable[[int], None] | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self._selector = selector
        self._on_commit = on_commit
        self._on_queue_length = on_queue_length
        self._queue = RequestQueue(config.request_sort_indicator, config.enable_multi_priority_queue)
        self.paused = False
        self.epoch = 0
        self._decisions = 0
        self._handoffs = 0
        self.running = 0  # dispatched requests whose iteration has not ended
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None

    # ---- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for entry in self._queue.entries():
            if not entry.future.done():
                entry.future.cancel()

    # ---- the request side --------------------------------------------------------------------------------

    async def acquire(
        self, meta: RoutingMeta, request: SelectionRequest, instances: Callable[[], list[InstanceState]]
    ) -> Ticket:
        """Wait in the queue until the loop has selected and committed an instance for this request. The
        ticket holds a hand-off permit: call `ticket.release_handoff()` once the Generate is sent, and
        `finished(ticket)` when the iteration ends."""
        entry = QueueEntry(meta, request, instances, asyncio.get_running_loop().create_future())
        self._enqueue(entry)
        try:
            return await entry.future
        except asyncio.CancelledError:
            if entry.future.done() and not entry.future.cancelled() and entry.future.exception() is None:
                ticket: Ticket = entry.future.result()  # handed off just as the caller went away
                self.finished(ticket, success=True)
            raise

    def finished(self, ticket: Ticket, *, success: bool) -> None:
        """One dispatched iteration ended: free its running slot and its selector bookkeeping."""
        if ticket.release_handoff is not None:
            ticket.release_handoff()
        self._selector.release(ticket, success=success)
        self.running -= 1
        self._wake.set()

    # ---- pause / resume -------------------------------------------------------------------------------

    async def pause(self, wait: bool) -> None:
        if not self.paused:
            self.paused = True
            self.epoch += 1
        if wait:
            while self._decisions or self._handoffs:
                self._idle.clear()
                await self._idle.wait()

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    # ---- status --------------------------------------------------------------------------------------

    @staticmethod
    def disabled_status() -> dict[str, Any]:
        """status() of a router that runs no routing loop: the same keys, all idle."""
        return {
            "enabled": False,
            "paused": False,
            "routing": False,
            "selecting": False,
            "routing_epoch": 0,
            "active_dispatch_handoffs": 0,
            "queue_len": 0,
            "pending_request_num": 0,
            "running_tasks": 0,
            "running_request_num": 0,
            "max_running_dispatch_tasks": 0,
            "queue_keys": [],
            "partition_queue_lens": {},
        }

    def status(self) -> dict[str, Any]:
        queued = len(self._queue)
        return {
            "enabled": True,
            "paused": self.paused,
            "routing": self._task is not None and not self._task.done() and not self.paused,
            "selecting": self._decisions > 0,
            "routing_epoch": self.epoch,
            "active_dispatch_handoffs": self._handoffs,
            "queue_len": queued,
            "pending_request_num": queued + self._decisions,
            "running_tasks": self.running,
            "running_request_num": self.running,
            "max_running_dispatch_tasks": self.config.max_running_dispatch_tasks,
            "queue_keys": [list(e.key) for e in self._queue.entries()[:64]],
            "partition_queue_lens": self._queue.partition_lens(),
        }

    def queued(self, max_version_tag: int) -> list[dict[str, Any]]:
        """Queued entries with version_tag <= N (so -1 is included), for a status-based sync strategy."""
        return [
            {
                "request_id": e.meta.request_id,
                "version_tag": e.meta.version_tag,
                "prompt_id": e.meta.prompt_id,
                "is_validate": e.meta.is_validate,
            }
            for e in self._queue.entries()
            if e.meta.version_tag <= max_version_tag
        ]

    # ---- internals -------------------------------------------------------------------------------------

    def _enqueue(self, entry: QueueEntry, *, requeue: bool = False) -> None:
        self._queue.push(entry, keep_seq=requeue)
        if self._on_queue_length is not None:
            self._on_queue_length(len(self._queue))
        self._wake.set()

    def _settle(self) -> None:
        if not self._decisions and not self._handoffs:
            self._idle.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.paused:
                continue
            budget = min(self.config.dispatch_batch_size, self.config.max_running_dispatch_tasks - self.running)
            popped: list[QueueEntry] = []
            while len(popped) < budget:
                entry = self._queue.pop()
                if entry is None:
                    break
                popped.append(entry)
            if self._on_queue_length is not None:
                self._on_queue_length(len(self._queue))
            if not popped:
                continue
            placed = await asyncio.gather(*(self._place(e) for e in popped))
            if len(self._queue) and self.running < self.config.max_running_dispatch_tasks:
                if not any(placed):  # nothing could be placed: rest a tick before trying again
                    await asyncio.sleep(self.config.check_interval_ms / 1000)
                self._wake.set()

    async def _place(self, entry: QueueEntry) -> bool:
        if entry.future.done():  # the caller went away while queued
            return False
        epoch = self.epoch
        self._decisions += 1
        try:
            selection: Selection = await self._selector.select(entry.instances(), entry.meta, entry.request)
        except RouterError as e:  # a verdict on the request itself (e.g. aborted): answer it
            if not entry.future.done():
                entry.future.set_exception(e)
            return False
        except Exception:  # e.g. the PSManager is unreachable: the request waits, nothing is lost
            logger.warning("selection of request %s failed; it stays queued", entry.request.request_id, exc_info=True)
            selection = Selection(None, "error")
        finally:
            self._decisions -= 1
            self._settle()
        if selection.instance is None or self.paused or epoch != self.epoch or entry.future.done():
            if not entry.future.done():
                self._enqueue(entry, requeue=True)
            return False
        self._handoffs += 1
        ticket = self._selector.commit(selection.instance, entry.meta, entry.request)
        try:
            if self._on_commit is not None:
                await self._on_commit(ticket)
        except Exception:
            logger.warning("commit of request %s failed; it stays queued", entry.request.request_id, exc_info=True)
            self._selector.release(ticket, success=True)
            self._handoffs -= 1
            self._settle()
            self._enqueue(entry, requeue=True)
            return False
        if self.paused or epoch != self.epoch or entry.future.done():
            self._selector.release(ticket, success=True)
            self._handoffs -= 1
            self._settle()
            if not entry.future.done():
                self._enqueue(entry, requeue=True)
            return False
        self.running += 1

        def release_handoff() -> None:
            if ticket.release_handoff is not None:
                ticket.release_handoff = None
                self._handoffs -= 1
                self._settle()

        ticket.release_handoff = release_handoff
        ticket.routed = True
        entry.future.set_result(ticket)
        return True
