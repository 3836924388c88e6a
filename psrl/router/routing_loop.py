"""The routing loop: every PSRL request waits in a priority queue; the loop selects, commits and hands it off.

A pass walks the queue in priority order and dispatches the first entries that can be placed now; one that
cannot (its version is not synced anywhere yet, its pinned instance is full) keeps its place and is tried
first again on the next pass, so it neither holds back the entries behind it nor loses its turn to them. An
entry whose caller went away (cancelled, e.g. the client disconnected) leaves the queue at once.

Pause/resume works by epochs (docs/compat.md section 7). A selection holds a decision permit stamped with the epoch it
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from psrl.router.config import RequestSortIndicator, RoutingLoopConfig
from psrl.router.errors import RouterError
from psrl.router.metadata import RoutingMeta
from psrl.router.policies.base import SelectionRequest
from psrl.router.registry import InstanceState
from psrl.router.selector import Selector, Ticket

logger = logging.getLogger(__name__)

_LAST = 2**63 - 1  # unversioned requests sort after every version
_PARTITION_UNVERSIONED = 2**31 - 1


# ---- the queue (pure) -------------------------------------------------------------------------------------


@dataclass(eq=False)
class QueueEntry:
    meta: RoutingMeta
    request: SelectionRequest
    instances: Callable[[], Sequence[InstanceState]]  # the candidates, read when the entry is selected
    future: asyncio.Future  # resolves to the committed Ticket (with its hand-off permit)
    seq: int = 0
    key: tuple = ()

    @property
    def partition(self) -> int:
        return self.meta.version_tag if self.meta.version_tag >= 0 else _PARTITION_UNVERSIONED


def priority_key(meta: RoutingMeta, prompt_len: int, indicator: str) -> tuple:
    """(validation first, version ascending with -1 last, the sort indicator); FIFO breaks ties (seq)."""
    if indicator == RequestSortIndicator.SMALL_ID:
        third = meta.request_id if meta.request_id is not None else _LAST
    elif indicator == RequestSortIndicator.SHORT_LENGTH:
        third = prompt_len
    else:  # long_length
        third = -prompt_len
    return (0 if meta.is_validate else 1, meta.version_tag if meta.version_tag >= 0 else _LAST, third)


class RequestQueue:
    """A priority queue, optionally partitioned by version (the lowest partition always drains first).
    `discard` takes an entry out in O(1): its heap slot is emptied and skipped when it comes up."""

    def __init__(self, indicator: str, partitioned: bool) -> None:
        self._indicator = indicator
        self._partitioned = partitioned
        self._heaps: dict[int, list[tuple[tuple, int, int, list[QueueEntry | None]]]] = {}
        self._seq = itertools.count()
        self._pushes = itertools.count()
        self._slots: dict[int, list[QueueEntry | None]] = {}  # id(entry) -> its heap slot, while queued
        self._lens: dict[int, int] = {}  # entries per partition

    def _part(self, entry: QueueEntry) -> int:
        return entry.partition if self._partitioned else 0

    def push(self, entry: QueueEntry, *, keep_seq: bool = False) -> None:
        if not keep_seq or not entry.seq:
            entry.seq = next(self._seq) + 1
            entry.key = priority_key(entry.meta, len(entry.request.prompt_ids), self._indicator)
        assert id(entry) not in self._slots, "an entry is in the queue once"
        slot: list[QueueEntry | None] = [entry]
        self._slots[id(entry)] = slot
        part = self._part(entry)
        heapq.heappush(self._heaps.setdefault(part, []), (entry.key, entry.seq, next(self._pushes), slot))
        self._lens[part] = self._lens.get(part, 0) + 1

    def discard(self, entry: QueueEntry) -> None:
        """Take an entry out of the queue (a no-op for one not in it)."""
        if id(entry) in self._slots:
            self._take(entry)

    def _take(self, entry: QueueEntry) -> None:
        self._slots.pop(id(entry))[0] = None
        part = self._part(entry)
        self._lens[part] -= 1
        if not self._lens[part]:
            del self._lens[part]

    def pop(self) -> QueueEntry | None:
        for part in sorted(self._heaps):
            heap = self._heaps[part]
            entry = None
            while heap and entry is None:
                entry = heapq.heappop(heap)[3][0]  # None: the slot of a discarded entry
            if not heap:
                del self._heaps[part]
            if entry is not None:
                self._take(entry)
                return entry
        return None

    def __len__(self) -> int:
        return len(self._slots)

    def entries(self) -> list[QueueEntry]:
        return [
            slot[0] for part in sorted(self._heaps) for *_, slot in sorted(self._heaps[part]) if slot[0] is not None
        ]

    def partition_lens(self) -> dict[str, int]:
        return {str(part): n for part, n in sorted(self._lens.items())} if self._partitioned else {}


# ---- the loop ---------------------------------------------------------------------------------------------


class RoutingLoop:
    def __init__(
        self,
        config: RoutingLoopConfig,
        selector: Selector,
        on_queue_length: Callable[[int], None] | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self._selector = selector
        self._on_queue_length = on_queue_length
        self._queue = RequestQueue(config.request_sort_indicator, config.enable_multi_priority_queue)
        self.paused = False
        self.epoch = 0
        self._decisions = 0
        self._handoffs = 0
        self.running = 0  # dispatched requests whose iteration has not ended
        # Entries taken from the queue that could not be placed: back in it once the queue has been tried through.
        self._held: list[QueueEntry] = []
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
        for entry in self._waiting():
            if not entry.future.done():
                entry.future.cancel()

    # ---- the request side --------------------------------------------------------------------------------

    async def acquire(
        self, meta: RoutingMeta, request: SelectionRequest, instances: Callable[[], Sequence[InstanceState]]
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
            else:
                self._queue.discard(entry)  # the caller left: out of the queue now (a held one is dropped later)
                self._queue_length_changed()
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

    def _waiting(self) -> list[QueueEntry]:
        """Every entry waiting for an instance, in priority order: those a pass holds come first."""
        return [e for e in self._held if not e.future.done()] + self._queue.entries()

    def _num_waiting(self) -> int:
        return len(self._queue) + sum(not e.future.done() for e in self._held)

    def status(self) -> dict[str, Any]:
        queued = self._num_waiting()
        partitions = self._queue.partition_lens()
        if self.config.enable_multi_priority_queue:
            for e in self._held:
                if not e.future.done():
                    partitions[str(e.partition)] = partitions.get(str(e.partition), 0) + 1
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
            "queue_keys": [list(e.key) for e in self._waiting()[:64]],
            "partition_queue_lens": dict(sorted(partitions.items(), key=lambda kv: int(kv[0]))),
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
            for e in self._waiting()
            if e.meta.version_tag <= max_version_tag
        ]

    # ---- internals -------------------------------------------------------------------------------------

    def _enqueue(self, entry: QueueEntry) -> None:
        self._queue.push(entry)
        self._queue_length_changed()
        self._wake.set()

    def _queue_length_changed(self) -> None:
        if self._on_queue_length is not None:
            self._on_queue_length(self._num_waiting())

    def _settle(self) -> None:
        if not self._decisions and not self._handoffs:
            self._idle.set()

    def _end_handoff(self) -> None:
        self._handoffs -= 1
        self._settle()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.paused:
                continue
            placed = await self._pass()
            if self._num_waiting() and self.running < self.config.max_running_dispatch_tasks:
                if not placed:  # nothing could be placed: rest a tick before trying again
                    await asyncio.sleep(self.config.check_interval_ms / 1000)
                self._wake.set()

    async def _pass(self) -> int:
        """Place up to the budget of entries, in priority order. Entries that cannot be placed now are set
        aside, at most `max_attempts_per_pass` a pass; the next pass goes on from there, and once the queue has
        nothing left to try the set-aside entries return to it with their old priority. Returns how many
        were placed."""
        budget = min(self.config.dispatch_batch_size, self.config.max_running_dispatch_tasks - self.running)
        placed = skipped = 0
        while placed < budget and skipped < self.config.max_attempts_per_pass and not self.paused:
            batch: list[QueueEntry] = []
            while len(batch) < budget - placed:
                entry = self._queue.pop()
                if entry is None:
                    break
                batch.append(entry)
                self._held.append(entry)
            if not batch:
                break
            for entry, ok in zip(batch, await asyncio.gather(*(self._place(e) for e in batch)), strict=True):
                if ok:
                    placed += 1
                if ok or entry.future.done():
                    self._held.remove(entry)
                else:
                    skipped += 1
        if not len(self._queue):  # every waiting entry was tried: the set-aside ones queue again
            for entry in self._held:
                if not entry.future.done():
                    self._queue.push(entry, keep_seq=True)
            self._held.clear()
        self._queue_length_changed()
        return placed

    async def _place(self, entry: QueueEntry) -> bool:
        if entry.future.done():  # the caller went away while queued
            return False
        epoch = self.epoch
        self._decisions += 1
        try:
            resolved = await self._selector.resolve(entry.instances(), entry.meta)
        except RouterError as e:  # a verdict on the request itself (e.g. aborted): answer it
            if not entry.future.done():
                entry.future.set_exception(e)
            return False
        except Exception:  # e.g. the PSManager is unreachable: the request waits, nothing is lost
            logger.warning("selection of request %s failed; it stays queued", entry.request.request_id, exc_info=True)
            return False
        finally:
            self._decisions -= 1
            self._settle()

        def current() -> bool:
            return not self.paused and epoch == self.epoch and not entry.future.done()

        selection = self._selector.select(resolved, entry.request)
        if selection.instance is None or not current():
            return False
        self._handoffs += 1
        try:
            ticket = await self._selector.place(selection.instance, entry.meta, entry.request)
        except Exception:  # the placement was not recorded (released already): the request stays queued
            self._end_handoff()
            logger.warning("commit of request %s failed; it stays queued", entry.request.request_id, exc_info=True)
            return False
        except BaseException:  # cancelled: the loop is stopping
            self._end_handoff()
            raise
        if not current():
            self._selector.release(ticket, success=True)
            self._end_handoff()
            return False
        self.running += 1

        def release_handoff() -> None:
            if ticket.release_handoff is not None:
                ticket.release_handoff = None
                self._end_handoff()

        ticket.release_handoff = release_handoff
        ticket.routed = True
        entry.future.set_result(ticket)
        return True
