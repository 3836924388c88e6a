"""The thunder_agent session strategy (PSRL's port of ThunderAgent) as pure logic: what the replicas' KV holds
and what the sessions need go in, which sessions to hang and which to continue come out. No I/O; the driver
(`psrl.session.thunder_driver`) reads the router and the sessions and carries the decisions out.

Per instance (one dp rank of a worker): total = its KV token capacity, used = kv_cache_usage x total. A session
is `generate` while a turn is in flight and `env` between turns, and its size is its total_tokens. Over the
sessions an instance holds: active = sum(generate) + env_token_weight x sum(env), shared = max(0, sum(generate) -
used) (what the generating sessions share as a prefix; 0 with `credit_shared_prefix` off), and remaining =
total - (active - shared + buffer_per_session x sessions).

Each round:
  1. a session the strategy has held for max_hold_s or more is continued, whatever the capacity, and is not
     hung again before it has run a turn (the starvation bound);
  2. while an instance's remaining is below 0 it hangs env sessions before generate sessions, smallest first (a
     generate session is marked: it hangs when its turn ends); an instance's last session is never hung;
  3. hung sessions are continued: `bucketed` readmits each on its own instance, smallest first, while it fits
     (tokens + buffer <= remaining); `global` places them largest first, each on the instance it fits tightest
     (best fit decreasing); sessions whose instance is gone go, smallest first, where the most room is; an
     instance running no session takes its smallest waiting session even when it does not fit;
  4. a new session (one that has not been served yet) is admitted, in arrival order, only while no session
     waits and an instance has room for its buffer; otherwise it is held (hung) until it is.

Ties are broken by session id, and instances by (base_worker_id, dp_rank). The strategy continues only
sessions it hung itself; a closing session is neither counted, hung nor continued.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from psrl.session.config import ThunderConfig

InstanceKey = tuple[str, str]  # (base_worker_id, dp_rank), as the SessionRouter's headers carry them
ResumeReason = Literal["fits", "max_hold", "admitted"]


@dataclass(frozen=True)
class InstanceView:
    """One instance the strategy may place sessions on: its KV capacity and how full the engine reports it."""

    key: InstanceKey
    capacity: int  # tokens
    kv_cache_usage: float  # 0..1


@dataclass(frozen=True)
class SessionView:
    """One session as the strategy sees it (the SessionRouter's /control/sessions entry)."""

    session_id: str
    instance: InstanceKey | None = None  # where its last turn was served; None before its first
    generating: bool = False
    tokens: int = 0
    hung: bool = False
    marked: bool = False  # marked for hang: hangs when its turn ends
    closing: bool = False


@dataclass(frozen=True)
class Resume:
    """Continue a session; `pin`: arm the one-shot pin of its next turn to that instance."""

    session_id: str
    pin: InstanceKey | None = None
    reason: ResumeReason = "fits"
    held_s: float = 0.0  # how long the strategy held it


@dataclass
class Plan:
    """One round's decisions, in the order they are to be applied."""

    hang: list[str] = field(default_factory=list)
    resume: list[Resume] = field(default_factory=list)
    remaining: dict[InstanceKey, float] = field(default_factory=dict)  # as observed, before the decisions
    hung_now: int = 0  # sessions the strategy holds hung once the decisions are applied


def instance_order(key: InstanceKey) -> tuple[str, int, str]:
    """Instances sort by base worker id, then dp rank as a number."""
    rank = key[1]
    return (key[0], int(rank) if rank.isdigit() else -1, rank)


def remaining_of(instance: InstanceView, sessions: Iterable[SessionView], config: ThunderConfig) -> float:
    """The capacity an instance has left with `sessions` on it (ThunderAgent's formula; below 0: overfull)."""
    gen = env = count = 0
    for s in sessions:
        count += 1
        if s.generating:
            gen += s.tokens
        else:
            env += s.tokens
    active = gen + config.env_token_weight * env
    # What the generating sessions need beyond the KV in use is taken for a prefix they share; but a turn that waits
    # in the replica's queue holds no KV yet, so where turns queue, that credit hides real need.
    shared = max(0.0, gen - instance.kv_cache_usage * instance.capacity) if config.credit_shared_prefix else 0.0
    return instance.capacity - (active - shared + config.buffer_per_session * count)


def _by_size(s: SessionView) -> tuple[int, str]:
    return (s.tokens, s.session_id)


class ThunderScheduler:
    """The strategy's memory between rounds (which sessions it holds and since when, which it admitted) and the
    round itself. `plan` is called with what was read and the time; the caller applies the plan."""

    def __init__(self, config: ThunderConfig) -> None:
        config.validate()
        self.config = config
        self.held: dict[str, float] = {}  # sessions it hung or marked -> when
        self.admitted: set[str] = set()  # new sessions it let run (a served session is admitted anyway)
        self.protected: dict[str, int] = {}  # continued by the hold bound -> its tokens then
        self._arrival: dict[str, int] = {}
        self._counter = itertools.count()
        self._room: dict[InstanceKey, float] | None = None  # remaining after the last round's decisions
        self._waiting = False  # whether a session waited after the last round

    # ---- the round ----------------------------------------------------------------------------------

    def plan(self, instances: Sequence[InstanceView], sessions: Sequence[SessionView], now: float) -> Plan:
        cfg = self.config
        buffer = cfg.buffer_per_session
        live = [s for s in sessions if not s.closing]
        self._forget({s.session_id: s for s in live})
        for s in live:
            self._arrival.setdefault(s.session_id, next(self._counter))
            if s.instance is not None:
                self.admitted.add(s.session_id)
        table = {i.key: i for i in sorted(instances, key=lambda i: instance_order(i.key))}
        plan = Plan()
        if not table:  # nothing known to place on: no decision (a held session still waits for max_hold_s)
            self._expire(live, now, plan)
            self._room, self._waiting = None, False
            plan.hung_now = self._hung_count(live, plan)
            return plan

        # 1. the starvation bound
        forced = self._expire(live, now, plan)

        # Who sits where: served sessions on their instance; admitted ones without a known instance where the
        # most room is (where a new one would be placed).
        residents: dict[InstanceKey, list[SessionView]] = {k: [] for k in table}
        floating: list[SessionView] = []
        new: list[SessionView] = []
        waiting: list[SessionView] = []
        for s in live:
            sid = s.session_id
            if s.hung and sid not in forced:
                if sid in self.held:
                    waiting.append(s)
                continue  # hung by us (waiting) or by someone else (not ours to count or continue)
            if s.marked:
                continue  # on its way out: it hangs when its turn ends
            view = SessionView(sid, s.instance, False, s.tokens) if sid in forced else s
            if sid not in self.admitted:
                new.append(view)
            elif s.instance is not None and s.instance in residents:
                residents[s.instance].append(view)
            else:
                floating.append(view)
        for s in sorted(floating, key=lambda s: (self._arrival[s.session_id], s.session_id)):
            key = min(table, key=lambda k: (-remaining_of(table[k], residents[k], cfg), instance_order(k)))
            residents[key].append(s)
        remaining = {k: remaining_of(table[k], residents[k], cfg) for k in table}
        plan.remaining = dict(remaining)

        # 2. hang until every instance fits
        for key in table:
            while remaining[key] < 0 and len(residents[key]) > 1:
                candidates = [s for s in residents[key] if s.session_id not in self.protected]
                if not candidates:
                    break
                victim = min(candidates, key=lambda s: (s.generating, s.tokens, s.session_id))
                residents[key].remove(victim)
                plan.hang.append(victim.session_id)
                self.held[victim.session_id] = now
                remaining[key] = remaining_of(table[key], residents[key], cfg)

        # 3. continue who fits
        room = remaining
        occupied = {k for k in table if residents[k]}
        served = [s for s in waiting if s.session_id in self.admitted]
        bound = [s for s in served if s.instance in table]
        unbound = [s for s in served if s.instance not in table]
        placed: set[str] = set()

        def place(s: SessionView, key: InstanceKey, reason: ResumeReason) -> None:
            room[key] -= s.tokens + buffer
            occupied.add(key)
            placed.add(s.session_id)
            self.admitted.add(s.session_id)
            since = self.held.pop(s.session_id, now)
            pin = key if cfg.continue_force_pin else None
            plan.resume.append(Resume(s.session_id, pin, reason, now - since))

        def fits(s: SessionView, key: InstanceKey) -> bool:
            return s.tokens + buffer <= room[key]

        def where(s: SessionView) -> InstanceKey | None:
            """Where a session without an instance of its own goes: the most room if it fits there, else an
            instance running nothing."""
            key = min(table, key=lambda k: (-room[k], instance_order(k)))
            if fits(s, key):
                return key
            return next((k for k in table if k not in occupied), None)

        if cfg.continue_scope == "bucketed":
            for key in table:
                for s in sorted((s for s in bound if s.instance == key), key=_by_size):
                    if not (fits(s, key) or key not in occupied):
                        break
                    place(s, key, "fits")
            for s in sorted(unbound, key=_by_size):
                target = where(s)
                if target is None:
                    break
                place(s, target, "fits")
        else:
            for s in sorted(served, key=lambda s: (-s.tokens, s.session_id)):
                tight = [k for k in table if fits(s, k)]
                if tight:
                    place(s, min(tight, key=lambda k: (room[k], instance_order(k))), "fits")
                else:
                    target = next((k for k in table if k not in occupied), None)
                    if target is not None:
                        place(s, target, "fits")

        # 4. admit new sessions while none waits
        still_waiting = any(s.session_id not in placed for s in served)
        held_new = [s for s in waiting if s.session_id not in self.admitted and s.session_id not in placed]
        for s in sorted([*new, *held_new], key=lambda s: (self._arrival[s.session_id], s.session_id)):
            target = None if still_waiting else where(s)
            if target is not None:
                if s.hung:
                    place(s, target, "admitted")
                else:
                    room[target] -= s.tokens + buffer
                    occupied.add(target)
                    self.admitted.add(s.session_id)
                continue
            still_waiting = True  # first come, first served: nobody overtakes a held session
            if not s.hung:
                plan.hang.append(s.session_id)
                self.held[s.session_id] = now
        self._room, self._waiting = dict(room), still_waiting
        plan.hung_now = self._hung_count(live, plan)
        return plan

    def _expire(self, live: Sequence[SessionView], now: float, plan: Plan) -> set[str]:
        """Continue what was held for max_hold_s (step 1); those are not hung again before they run a turn."""
        forced: set[str] = set()
        for s in sorted(live, key=lambda s: s.session_id):
            since = self.held.get(s.session_id)
            if s.hung and since is not None and now - since >= self.config.max_hold_s:
                del self.held[s.session_id]
                self.protected[s.session_id] = s.tokens
                self.admitted.add(s.session_id)
                forced.add(s.session_id)
                plan.resume.append(Resume(s.session_id, None, "max_hold", now - since))
        return forced

    def _forget(self, live: Mapping[str, SessionView]) -> None:
        """Drop what the sessions no longer need: gone or closing, continued by someone else, protected ones that
        have run a turn since."""
        for sid in list(self.held):
            s = live.get(sid)
            if s is None or not (s.hung or s.marked):
                del self.held[sid]
        for sid, tokens in list(self.protected.items()):
            s = live.get(sid)
            if s is None or s.generating or s.tokens != tokens:
                del self.protected[sid]
        self.admitted &= live.keys()
        for sid in list(self._arrival):
            if sid not in live:
                del self._arrival[sid]

    def _hung_count(self, live: Sequence[SessionView], plan: Plan) -> int:
        """Sessions held hung once the plan is applied (a marked generate session counts once it hangs)."""
        resumed = {r.session_id for r in plan.resume}
        generating = {s.session_id for s in live if s.generating and not s.hung}
        return sum(1 for sid in self.held if sid not in resumed and sid not in generating)

    # ---- between rounds -----------------------------------------------------------------------------

    def admit_new(self, session_id: str, now: float) -> bool:
        """A session just created: may it run its first turn now? Judged on the last round's room (before the
        first round: yes). No: it is held; the caller hangs it and a later round continues it."""
        self._arrival.setdefault(session_id, next(self._counter))
        room = self._room
        if not room:
            self.admitted.add(session_id)
            return True
        key = min(room, key=lambda k: (-room[k], instance_order(k)))
        if not self._waiting and self.config.buffer_per_session <= room[key]:
            room[key] -= self.config.buffer_per_session
            self.admitted.add(session_id)
            return True
        self._waiting = True
        self.held[session_id] = now
        return False

    def undo(self, resumes: Iterable[Resume], now: float) -> None:
        """Continues that could not be carried out: the sessions are held again, since when they were."""
        for r in resumes:
            self.held[r.session_id] = now - r.held_s
