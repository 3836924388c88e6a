"""Instance selection: PSRL's five steps as small pure functions, and the Selector that runs them in order.

  1. available   drop unhealthy, paused, breaker-open instances and those below the request's version floor
  2. hint        a sticky / force-pin-once hint hard-pins when the hinted instance survived step 1
  3. group       a prompt group stays on the instance its first request was placed on (write-once pin)
  4. admission   an admission hook (the PSManager) filters; candidates are sorted and grouped by
                 `candidate_sort_indicator`; the admission gate caps concurrent sequences per instance
  5. policy      the configured policy picks within the best group that passed the gate

With `worker_selection_strategy != "psrl"`, or for a request without PSRL metadata, step 1 (availability
only) and the policy run alone.

The admission hook's data is remote: `Selector.resolve` runs step 1 and, only when steps 2 and 3 leave the
choice open, fetches that data; `Selector.select` then runs steps 2 to 5 without waiting, so a selection never
suspends midway. `Selector.place` commits the choice and records it with the hook.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from psrl.router.config import CandidateSortIndicator, SelectionStrategy, SelectorConfig
from psrl.router.health import BreakerState, availability_changes
from psrl.router.metadata import RoutingMeta
from psrl.router.policies.base import Policy, SelectionRequest
from psrl.router.registry import InstanceId, InstanceState


class AdmissionHook(Protocol):
    """The admission step's seam and the commit/dispatch checks. The PSManager implements it; the default
    admits all."""

    async def admit(self, candidates: Sequence[InstanceState], meta: RoutingMeta) -> list[InstanceState]:
        """The candidates whose version can admit/reserve this request."""
        ...

    async def indicators(self, candidates: Sequence[InstanceState], meta: RoutingMeta) -> list[float] | None:
        """Reserve-capability indicator per candidate (lower is better), or None when unknown."""
        ...

    async def on_commit(self, instance: InstanceState, meta: RoutingMeta, pinned_version: int) -> None:
        """Record the placement (reserve it, or move a hinted request to its new instance)."""
        ...

    async def is_aborted(self, meta: RoutingMeta) -> bool:
        """Checked right before dispatch: an aborted request is answered 400 request_aborted."""
        ...


class PassThroughAdmission:
    async def admit(self, candidates: Sequence[InstanceState], meta: RoutingMeta) -> list[InstanceState]:
        return list(candidates)

    async def indicators(self, candidates: Sequence[InstanceState], meta: RoutingMeta) -> list[float] | None:
        return None

    async def on_commit(self, instance: InstanceState, meta: RoutingMeta, pinned_version: int) -> None:
        return None

    async def is_aborted(self, meta: RoutingMeta) -> bool:
        return False


# Step 1 results kept at once (one per served model and version floor in use); past it they are all dropped.
MAX_KEPT_SURVIVORS = 64


# ---- the steps (pure) ------------------------------------------------------------------------------------


def step_available(instances: Sequence[InstanceState], meta: RoutingMeta, now: float) -> list[InstanceState]:
    floor = meta.version_tag
    return [i for i in instances if i.available(now) and (floor < 0 or i.weight_version >= floor)]


def step_hint(candidates: Sequence[InstanceState], meta: RoutingMeta) -> list[InstanceState] | None:
    """The single hinted instance when the request is sticky/force-pinned and it survived; else None."""
    if not meta.pinned:
        return None
    hinted = [c for c in candidates if c.id == meta.hint]
    return hinted or None


def step_group(candidates: Sequence[InstanceState], meta: RoutingMeta, pins: GroupPins) -> list[InstanceState] | None:
    if meta.prompt_id is None:
        return None
    pinned = pins.get(meta.prompt_id)
    if pinned is None:
        return None
    hit = [c for c in candidates if c.id == pinned]
    return hit or None


def sort_into_groups(
    candidates: list[InstanceState], meta: RoutingMeta, indicators: list[float] | None
) -> list[list[InstanceState]]:
    """The candidates grouped by their key, best group first, each group in the candidates' order (a stable sort
    by the key, equal keys together). The key is the indicator, then the version: unversioned requests prefer the
    newest version, versioned ones the lowest acceptable one. Grouped in one pass, as a request's selection runs
    it over every admitted candidate."""
    sign = -1 if meta.version_tag < 0 else 1
    groups: dict[tuple[float, int], list[InstanceState]] = {}
    for ind, c in zip(itertools.repeat(0.0) if indicators is None else indicators, candidates):
        key = (ind, sign * c.weight_version)
        group = groups.get(key)
        if group is None:
            groups[key] = [c]
        else:
            group.append(c)
    return [groups[key] for key in sorted(groups)]


def admission_gate(group: list[InstanceState], config: SelectorConfig) -> list[InstanceState]:
    cap = config.max_concurrent_seqs_per_instance
    if config.admission_reject_on_waiting:
        return [c for c in group if c.inflight < cap and c.stats.num_waiting_reqs <= 0]
    return [c for c in group if c.inflight < cap]


# ---- group pins ------------------------------------------------------------------------------------------


@dataclass
class GroupPins:
    """prompt_id -> instance, written once by a group's first placement, released with its last request."""

    _pins: dict[int, InstanceId] = field(default_factory=dict)
    _active: dict[int, int] = field(default_factory=dict)

    def get(self, prompt_id: int) -> InstanceId | None:
        return self._pins.get(prompt_id)

    def acquire(self, prompt_id: int, instance: InstanceId) -> None:
        self._pins.setdefault(prompt_id, instance)
        self._active[prompt_id] = self._active.get(prompt_id, 0) + 1

    def release(self, prompt_id: int) -> None:
        left = self._active.get(prompt_id, 0) - 1
        if left > 0:
            self._active[prompt_id] = left
        else:
            self._active.pop(prompt_id, None)
            self._pins.pop(prompt_id, None)

    def __len__(self) -> int:
        return len(self._pins)


# ---- the selector -----------------------------------------------------------------------------------------


class Resolved(NamedTuple):
    """A selection's inputs once the remote data is in: the candidates step 1 left and, when steps 2 and 3
    leave the choice open, those the admission hook admitted and their indicators. (A named tuple, built once a
    request: a frozen dataclass costs three times as much to build.)"""

    meta: RoutingMeta
    candidates: Sequence[InstanceState]
    pinned: Selection | None = None  # steps 2 and 3 decided: the hinted or group-pinned candidate
    admitted: list[InstanceState] | None = None  # None: not fetched (steps 1 to 3 decide)
    indicators: list[float] | None = None


@dataclass
class Selection:
    instance: InstanceState | None
    step: str  # which step decided (or why nothing was chosen): for metrics and logs
    reason: str = ""


@dataclass
class Ticket:
    """A committed choice: released exactly once when the request ends."""

    instance: InstanceState
    meta: RoutingMeta
    pinned_version: int
    group_acquired: bool
    # Set when the routing loop handed this off: release it once the Generate is on the wire.
    release_handoff: Callable[[], None] | None = None
    routed: bool = False


class Selector:
    def __init__(self, config: SelectorConfig, policy: Policy, admission: AdmissionHook | None = None) -> None:
        config.validate()
        self.config = config
        self.policy = policy
        self.admission: AdmissionHook = admission or PassThroughAdmission()
        self.group_pins = GroupPins()
        # step 1's results: (id of the instances, version floor) -> (the instances, the change count, survivors)
        self._kept: dict[tuple[int, int], tuple[Sequence[InstanceState], int, tuple[InstanceState, ...]]] = {}

    def _psrl(self, meta: RoutingMeta) -> bool:
        return self.config.worker_selection_strategy == SelectionStrategy.PSRL and meta.has_psrl

    def _pinned(self, candidates: Sequence[InstanceState], meta: RoutingMeta) -> Selection | None:
        """Steps 2 and 3: the hinted or group-pinned candidate, when one decides."""
        pinned = step_hint(candidates, meta)
        if pinned is not None:
            return Selection(pinned[0], "hint")
        if self.config.enable_group_sticky:
            grouped = step_group(candidates, meta, self.group_pins)
            if grouped is not None:
                return Selection(grouped[0], "group")
        return None

    def available(self, instances: Sequence[InstanceState], meta: RoutingMeta) -> Resolved:
        """Step 1 alone: all a selection needs when the admission hook has no say (a request without PSRL
        headers), so it waits for nothing."""
        return Resolved(meta, self._survivors(instances, meta))

    def _survivors(self, instances: Sequence[InstanceState], meta: RoutingMeta) -> tuple[InstanceState, ...]:
        """Step 1's result, kept per list of instances and version floor until something that decides it changes
        (`availability_changes`): a request then costs no pass over the fleet. A result is not kept while an
        instance that is up and not paused has a breaker that is not closed: an open one turns half-open with time
        alone, and a half-open one's trial ends without a change counted. The breaker of an instance that is down
        or paused is not asked, so it cannot change the result before its health or pause does, which counts (a
        replica that stays down does not cost every request a pass)."""
        key = (id(instances), meta.version_tag)
        changes = availability_changes()
        kept = self._kept.get(key)
        if kept is not None and kept[0] is instances and kept[1] == changes:
            return kept[2]
        survivors = tuple(step_available(instances, meta, time.monotonic()))  # shared by the requests it serves
        if all(i.breaker.state is BreakerState.CLOSED or i.paused or not i.healthy for i in instances):
            if len(self._kept) >= MAX_KEPT_SURVIVORS:
                self._kept.clear()
            self._kept[key] = (instances, changes, survivors)
        return survivors

    async def resolve(self, instances: Sequence[InstanceState], meta: RoutingMeta) -> Resolved:
        """Step 1, then the admission hook's data when the admission step will run (a hint or group pin
        decides without it). The only part of a selection that waits."""
        resolved = self.available(instances, meta)
        candidates = resolved.candidates
        if not candidates or not self._psrl(meta):
            return resolved
        pinned = self._pinned(candidates, meta)
        if pinned is not None:
            return Resolved(meta, candidates, pinned)
        admitted = await self.admission.admit(candidates, meta)
        indicators = None
        if admitted and self.config.candidate_sort_indicator == CandidateSortIndicator.RESERVE_CAPABILITY:
            indicators = await self.admission.indicators(admitted, meta)
        return Resolved(meta, candidates, None, admitted, indicators)

    def select(self, resolved: Resolved, request: SelectionRequest) -> Selection:
        """Steps 2 to 5 over what `resolve` (or `available`) returned, in one go (call it right after)."""
        meta, candidates = resolved.meta, resolved.candidates
        if not candidates:
            floor = f" at version >= {meta.version_tag}" if meta.version_tag >= 0 else ""
            return Selection(None, "available", f"no available instance{floor}")
        if not self._psrl(meta):
            return Selection(self.policy.select(candidates, request), "policy")
        if resolved.pinned is not None:
            return resolved.pinned
        if self.config.enable_group_sticky:  # a group pin written while the admission data was fetched
            grouped = step_group(candidates, meta, self.group_pins)
            if grouped is not None:
                return Selection(grouped[0], "group")
        assert resolved.admitted is not None
        if not resolved.admitted:
            return Selection(None, "admission", "no instance's version can admit this request")
        for group in sort_into_groups(resolved.admitted, meta, resolved.indicators):
            open_group = admission_gate(group, self.config)
            if open_group:
                return Selection(self.policy.select(open_group, request), "policy")
        return Selection(None, "gate", "every candidate is at max_concurrent_seqs_per_instance")

    def commit(self, instance: InstanceState, meta: RoutingMeta, request: SelectionRequest) -> Ticket:
        """Record the choice: in-flight count, group pin, the policy's own bookkeeping, the pinned version."""
        instance.inflight += 1
        instance.breaker.on_dispatch()
        group = meta.prompt_id is not None and self.config.enable_group_sticky and self._psrl(meta)
        if group:
            assert meta.prompt_id is not None
            self.group_pins.acquire(meta.prompt_id, instance.id)
        self.policy.on_dispatched(instance, request)
        pinned_version = instance.weight_version if meta.version_tag < 0 else meta.version_tag
        return Ticket(instance, meta, pinned_version, group)

    async def place(self, instance: InstanceState, meta: RoutingMeta, request: SelectionRequest) -> Ticket:
        """Commit the chosen instance and, for a PSRL request, record the placement with the admission hook.
        PSRL placements, direct and from the routing loop, go through here (a request without PSRL headers has
        nothing to record, and `Dispatcher.acquire` commits it directly). If recording fails or is cancelled, the
        ticket is released and the error raised."""
        ticket = self.commit(instance, meta, request)
        if meta.has_psrl:
            try:
                await self.admission.on_commit(instance, meta, ticket.pinned_version)
            except BaseException:
                self.release(ticket, success=True)
                raise
        return ticket

    def release(self, ticket: Ticket, *, success: bool) -> None:
        ticket.instance.inflight -= 1
        ticket.instance.breaker.record(success, time.monotonic())
        if ticket.group_acquired:
            assert ticket.meta.prompt_id is not None
            self.group_pins.release(ticket.meta.prompt_id)
