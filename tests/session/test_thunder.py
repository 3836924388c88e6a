"""The thunder_agent strategy's rounds as pure logic (psrl.session.thunder): state in, hang/continue out."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.session.config import ThunderConfig
from psrl.session.thunder import InstanceView, Resume, SessionView, ThunderScheduler, remaining_of
from psrl.session.thunder_driver import ReadError, ThunderDriver, instances_from, resume_item, session_from_summary

A0, A1, B0 = ("a", "0"), ("a", "1"), ("b", "0")


def inst(key: tuple[str, str] = A0, capacity: int = 1000, usage: float = 1.0) -> InstanceView:
    return InstanceView(key, capacity, usage)


def env(sid: str, tokens: int, at: tuple[str, str] | None = A0, **kw) -> SessionView:
    return SessionView(sid, at, False, tokens, **kw)


def gen(sid: str, tokens: int, at: tuple[str, str] | None = A0, **kw) -> SessionView:
    return SessionView(sid, at, True, tokens, **kw)


def hung(sid: str, tokens: int, at: tuple[str, str] | None = A0) -> SessionView:
    return SessionView(sid, at, False, tokens, hung=True)


def scheduler(**kw) -> ThunderScheduler:
    return ThunderScheduler(ThunderConfig(**kw))


def holding(s: ThunderScheduler, since: dict[str, float], *, served: bool = True) -> ThunderScheduler:
    """State in: sessions the strategy holds, since when (served: they had run a turn before)."""
    s.held.update(since)
    if served:
        s.admitted.update(since)
    return s


def resumed(plan) -> list[str]:
    return [r.session_id for r in plan.resume]


# ---- the capacity formula ------------------------------------------------------------------------------------


def test_remaining_is_capacity_minus_active_plus_shared_minus_buffers() -> None:
    cfg = ThunderConfig(env_token_weight=0.5, buffer_per_session=100)
    sessions = [gen("g1", 200), gen("g2", 100), env("e", 50)]
    # used 300 = generate tokens: nothing shared; active = 300 + 0.5 x 50
    assert remaining_of(inst(usage=0.3), sessions, cfg) == 1000 - (325 + 300)
    # used 100 < 300 generating: 200 of them are a shared prefix
    assert remaining_of(inst(usage=0.1), sessions, cfg) == 1000 - (325 - 200 + 300)
    assert remaining_of(inst(), [], cfg) == 1000


def test_without_the_shared_prefix_credit_generating_sessions_count_in_full() -> None:
    """Turns queued at the replica hold no KV yet: KV usage reads low, and the credit would take their tokens for
    a shared prefix. With the credit off they count in full, and the instance is seen to overflow."""
    sessions = [gen("g1", 400), gen("g2", 400), env("e", 100)]
    credited = ThunderConfig(buffer_per_session=0)
    assert remaining_of(inst(usage=0.4), sessions, credited) == 1000 - (900 - 400)
    plain = ThunderConfig(buffer_per_session=0, credit_shared_prefix=False)
    assert remaining_of(inst(usage=0.4), sessions, plain) == 1000 - 900
    over = [*sessions, env("e2", 200)]
    assert scheduler(buffer_per_session=0).plan([inst(usage=0.4)], over, now=0).hang == []
    assert scheduler(buffer_per_session=0, credit_shared_prefix=False).plan([inst(usage=0.4)], over, now=0).hang == [
        "e"
    ]


def test_nothing_happens_while_every_instance_fits() -> None:
    s = scheduler(buffer_per_session=100)
    plan = s.plan([inst(capacity=600)], [env("a", 200), gen("b", 100)], now=0)  # 600 - 500 = 100 >= 0
    assert plan.hang == [] and plan.resume == [] and plan.remaining == {A0: 100}
    plan = s.plan([inst(capacity=500)], [env("a", 200), gen("b", 100)], now=1)  # exactly 0: still fits
    assert plan.hang == [] and plan.remaining == {A0: 0}


# ---- hanging -------------------------------------------------------------------------------------------------


def test_env_sessions_hang_before_generate_sessions_smallest_first() -> None:
    s = scheduler(buffer_per_session=100)
    sessions = [env("e1", 300), env("e2", 100), gen("g1", 50), gen("g2", 400)]
    plan = s.plan([inst(capacity=1000, usage=1.0)], sessions, now=0)  # 1000 - (850 + 400) = -250
    # e2 -> 1000 - (750 + 300) = -50; e1 -> 1000 - (450 + 200) = 350
    assert plan.hang == ["e2", "e1"]
    assert set(s.held) == {"e1", "e2"}


def test_generate_sessions_hang_smallest_first_once_no_env_session_is_left() -> None:
    s = scheduler(buffer_per_session=100)
    sessions = [gen("g2", 400), env("e", 100), gen("g1", 50)]
    plan = s.plan([inst(capacity=600, usage=1.0)], sessions, now=0)  # 600 - (550 + 300) = -250
    assert plan.hang == ["e", "g1"]  # then 600 - (400 + 100) = 100


def test_equal_sizes_hang_in_session_id_order() -> None:
    s = scheduler(buffer_per_session=0)
    plan = s.plan([inst(capacity=250)], [env("b", 100), env("c", 100), env("a", 100)], now=0)
    assert plan.hang == ["a"]


def test_an_instances_last_session_is_never_hung() -> None:
    s = scheduler(buffer_per_session=100)
    plan = s.plan([inst(capacity=500)], [gen("big", 900), env("e", 50, closing=True)], now=0)
    assert plan.hang == [] and plan.remaining == {A0: 500 - (900 - 400 + 100)}  # 400 of 900 beyond what is used


def test_a_marked_session_is_not_counted_again() -> None:
    """A generate session marked to hang leaves the count at once: the next round does not hang another for it."""
    s = scheduler(buffer_per_session=100)
    plan = s.plan([inst(capacity=800, usage=1.0)], [gen("g1", 300), gen("g2", 400)], now=0)  # 800 - 900
    assert plan.hang == ["g1"]
    again = s.plan([inst(capacity=800, usage=1.0)], [gen("g1", 300, marked=True), gen("g2", 400)], now=1)
    assert again.hang == [] and again.resume == []
    # its turn ended: it is hung now and waits (400 + 100 + 300 + 100 > 800)
    later = s.plan([inst(capacity=800, usage=1.0)], [hung("g1", 310), env("g2", 420)], now=2)
    assert later.hang == [] and later.resume == [] and later.hung_now == 1


# ---- continuing ----------------------------------------------------------------------------------------------


def test_bucketed_continues_on_its_own_instance_smallest_first_while_it_fits() -> None:
    s = holding(scheduler(buffer_per_session=100), {"h1": 0, "h2": 0, "h3": 0, "h4": 0})
    sessions = [env("r", 100), hung("h3", 500), hung("h1", 200), hung("h2", 300), hung("h4", 10, at=B0)]
    instances = [inst(A0), inst(B0, capacity=1000)]
    sessions.append(env("rb", 900, at=B0))  # B0: 1000 - 1000 = 0: no room for h4
    plan = s.plan(instances, sessions, now=5)
    # A0 has 800: h1 takes 300, h2 400, h3 (600) does not fit the 100 left
    assert resumed(plan) == ["h1", "h2"]
    assert all(r.reason == "fits" and r.pin is None and r.held_s == 5 for r in plan.resume)
    assert set(s.held) == {"h3", "h4"} and plan.hung_now == 2


def test_bucketed_with_force_pin_pins_to_its_own_instance() -> None:
    s = holding(scheduler(buffer_per_session=100, continue_force_pin=True), {"h": 0})
    plan = s.plan([inst(A0), inst(B0)], [hung("h", 100, at=B0)], now=1)
    assert plan.resume == [Resume("h", B0, "fits", 1.0)]


def test_global_places_largest_first_where_it_fits_tightest() -> None:
    s = holding(
        scheduler(buffer_per_session=100, continue_scope="global", continue_force_pin=True), {"h1": 0, "h2": 0, "h3": 0}
    )
    instances = [inst(A0, capacity=1000), inst(B0, capacity=1000)]
    sessions = [hung("h1", 900, at=B0), hung("h2", 300), hung("h3", 200), env("rb", 400, at=B0)]  # B0: 500 left
    plan = s.plan(instances, sessions, now=3)
    # h1 needs 1000: only A0 -> A0 has 0; h2 needs 400: B0 -> 100; h3 needs 300: nowhere
    assert plan.resume == [Resume("h1", A0, "fits", 3.0), Resume("h2", B0, "fits", 3.0)]
    assert set(s.held) == {"h3"}


def test_global_prefers_the_tightest_fit_and_breaks_ties_by_instance() -> None:
    s = holding(scheduler(buffer_per_session=100, continue_scope="global", continue_force_pin=True), {"h": 0})
    plan = s.plan([inst(A0), inst(B0, capacity=400)], [hung("h", 200)], now=1)
    assert plan.resume[0].pin == B0  # 400 is tighter than 1000
    s = holding(scheduler(buffer_per_session=100, continue_scope="global", continue_force_pin=True), {"h": 0})
    plan = s.plan([inst(B0), inst(A1), inst(A0)], [hung("h", 200, at=None)], now=1)
    assert plan.resume[0].pin == A0  # equal room: a before b, rank 0 before 1


def test_global_without_force_pin_continues_unpinned() -> None:
    s = holding(scheduler(continue_scope="global"), {"h": 0})
    plan = s.plan([inst(A0), inst(B0)], [hung("h", 200)], now=1)
    assert plan.resume == [Resume("h", None, "fits", 1.0)]


def test_an_instance_running_nothing_takes_its_smallest_waiting_session_even_if_too_large() -> None:
    s = holding(scheduler(buffer_per_session=100), {"big": 0, "bigger": 0})
    plan = s.plan([inst(capacity=500)], [hung("bigger", 480), hung("big", 450)], now=1)
    assert resumed(plan) == ["big"]  # alone it runs; then nothing else fits
    s = holding(scheduler(buffer_per_session=100, continue_scope="global"), {"big": 0})
    assert resumed(s.plan([inst(capacity=500)], [hung("big", 450)], now=1)) == ["big"]


def test_a_session_just_hung_is_not_continued_in_the_same_round() -> None:
    s = holding(scheduler(buffer_per_session=0), {"old": 0})
    plan = s.plan([inst(capacity=300)], [env("a", 200), env("b", 150), hung("old", 10)], now=1)
    assert plan.hang == ["b"] and resumed(plan) == ["old"]  # 300 - 200 = 100 left: old fits, b waits


def test_the_strategy_continues_only_sessions_it_hung() -> None:
    s = scheduler()
    plan = s.plan([inst()], [hung("theirs", 10)], now=1)
    assert plan.resume == [] and plan.hung_now == 0
    # and one it hung that someone else continued is forgotten
    holding(s, {"mine": 0})
    s.plan([inst()], [env("mine", 10)], now=2)
    assert "mine" not in s.held


# ---- new sessions --------------------------------------------------------------------------------------------


def test_new_sessions_are_admitted_while_there_is_room_then_held_in_arrival_order() -> None:
    s = scheduler(buffer_per_session=100)
    assert s.admit_new("first", now=0)  # before any round: nothing known, nothing held
    s.plan([inst(capacity=350)], [SessionView("first")], now=1)  # 350 - 100 = 250 left
    assert s.admit_new("n1", now=2) and s.admit_new("n2", now=2)  # 50 left
    assert not s.admit_new("n3", now=2) and not s.admit_new("n4", now=2)
    assert s.held == {"n3": 2, "n4": 2}
    # n1 leaves: room for one, and n3 came first
    plan = s.plan(
        [inst(capacity=350)], [SessionView("first"), SessionView("n2"), hung("n4", 0, None), hung("n3", 0, None)], 3
    )
    assert plan.resume == [Resume("n3", None, "admitted", 1.0)] and s.held == {"n4": 2}


def test_a_held_new_session_is_admitted_once_room_appears() -> None:
    s = scheduler(buffer_per_session=100, continue_force_pin=True)
    s.plan([inst(capacity=150)], [env("r", 10)], now=0)
    assert not s.admit_new("n", now=1)
    plan = s.plan([inst(capacity=150)], [env("r", 10), hung("n", 0, at=None)], now=2)
    assert plan.resume == []  # 150 - 110 = 40: no room
    plan = s.plan([inst(capacity=150)], [hung("n", 0, at=None)], now=4)  # r is gone
    assert plan.resume == [Resume("n", A0, "admitted", 3.0)]
    assert "n" in s.admitted and not s.held


def test_new_sessions_wait_while_a_served_session_waits() -> None:
    """A new session seen running (the coordinator's layout: no admission at creation) is held when a served
    session waits, even though there is room for its buffer."""
    s = holding(scheduler(buffer_per_session=100), {"h": 0})
    plan = s.plan([inst(capacity=1000)], [env("r", 400), hung("h", 600), SessionView("n1"), SessionView("n2")], 1)
    # h needs 700 of the 500 left: it waits, so n1 and n2 are held (500 would hold their buffers)
    assert plan.resume == [] and plan.hang == ["n1", "n2"]
    plan = s.plan([inst(capacity=1000)], [hung("h", 600), hung("n1", 0, at=None), hung("n2", 0, at=None)], 2)
    assert resumed(plan) == ["h", "n1", "n2"] and [r.reason for r in plan.resume] == ["fits", "admitted", "admitted"]


def test_while_a_session_waits_a_session_just_created_is_held_whatever_the_room() -> None:
    s = holding(scheduler(buffer_per_session=100), {"h": 0})
    s.plan([inst(capacity=1000)], [env("r", 400), hung("h", 600)], now=1)  # 500 left; h needs 700
    assert not s.admit_new("n", now=1)


def test_a_new_session_generating_its_first_turn_is_marked_when_it_cannot_be_admitted() -> None:
    s = scheduler(buffer_per_session=100)
    plan = s.plan([inst(capacity=150)], [env("r", 0), SessionView("n", None, True, 0)], now=1)
    assert plan.hang == ["n"]  # the driver's request_hang defers it to the end of the turn


def test_admitted_sessions_without_an_instance_take_their_buffer_where_the_most_room_is() -> None:
    s = scheduler(buffer_per_session=100)
    assert s.admit_new("x", 0) and s.admit_new("y", 0)
    plan = s.plan([inst(A0, capacity=300), inst(B0, capacity=250)], [SessionView("x"), SessionView("y")], now=1)
    assert plan.remaining == {A0: 200, B0: 150} and plan.hang == []


# ---- the starvation bound ------------------------------------------------------------------------------------


def test_a_session_held_for_max_hold_is_continued_whatever_the_capacity() -> None:
    s = holding(scheduler(buffer_per_session=100, max_hold_s=60), {"h": 0})
    full = [inst(capacity=500)]
    assert s.plan(full, [env("r", 400), hung("h", 300)], now=59.9).resume == []
    plan = s.plan(full, [env("r", 400), hung("h", 300)], now=60)
    assert plan.resume == [Resume("h", None, "max_hold", 60.0)]
    assert plan.hang == ["r"]  # r makes room for it, though h is the smaller one
    # h has not run a turn yet: it is not hung again, and r does not fit back
    plan = s.plan(full, [hung("r", 400), env("h", 300)], now=61)
    assert plan.hang == [] and plan.resume == []
    # once it runs its turn it is an ordinary session again: the smallest generate session is marked
    plan = s.plan(full, [hung("r", 400), gen("h", 300), gen("x", 400)], now=62)
    assert plan.hang == ["h"] and s.protected == {}


def test_max_hold_admits_a_held_new_session() -> None:
    s = scheduler(buffer_per_session=100, max_hold_s=10)
    s.plan([inst(capacity=100)], [env("r", 0)], now=0)
    assert not s.admit_new("n", now=0)
    plan = s.plan([inst(capacity=100)], [env("r", 50), hung("n", 0, at=None)], now=10)
    assert plan.resume == [Resume("n", None, "max_hold", 10.0)] and "n" in s.admitted


def test_no_session_waits_longer_than_max_hold_under_constant_pressure() -> None:
    """Ten sessions on an instance that holds two: each round every session is either running or held, and
    none is held for more than max_hold_s plus one round."""
    s = scheduler(buffer_per_session=0, max_hold_s=5)
    state = {f"s{i}": env(f"s{i}", 100) for i in range(10)}
    longest = 0.0
    for now in range(0, 100):
        plan = s.plan([inst(capacity=250)], list(state.values()), now=float(now))
        for sid in plan.hang:
            state[sid] = hung(sid, state[sid].tokens)
        for r in plan.resume:
            longest = max(longest, r.held_s)
            state[r.session_id] = env(r.session_id, state[r.session_id].tokens + 1)  # ran a turn
    assert 0 < longest <= 6


# ---- closing sessions and disappearing instances -------------------------------------------------------------


def test_closing_sessions_are_neither_counted_hung_nor_continued() -> None:
    s = holding(scheduler(buffer_per_session=100), {"c": 0})
    sessions = [env("c", 900, closing=True), env("a", 300), env("b", 300, closing=True)]
    plan = s.plan([inst(capacity=500)], sessions, now=1)
    assert plan.hang == [] and plan.resume == [] and plan.remaining == {A0: 100}
    assert "c" not in s.held  # a held session that closes is forgotten


def test_a_session_whose_instance_is_gone_continues_where_the_most_room_is() -> None:
    s = holding(scheduler(buffer_per_session=100, continue_force_pin=True), {"h1": 0, "h2": 0, "h3": 0})
    instances = [inst(A0, capacity=500), inst(B0, capacity=800)]
    sessions = [hung("h2", 300, at=A1), hung("h1", 100, at=A1), hung("h3", 900, at=A1), env("rb", 100, at=B0)]
    plan = s.plan(instances, sessions, now=1)
    # smallest first, each to the most room: h1 -> B0 (600 left), h2 -> A0 (500 > 400 left); h3 fits nowhere
    assert plan.resume == [Resume("h1", B0, "fits", 1.0), Resume("h2", A0, "fits", 1.0)]


def test_running_sessions_on_a_gone_instance_count_where_the_most_room_is() -> None:
    s = scheduler(buffer_per_session=100)
    plan = s.plan([inst(A0, capacity=500), inst(B0, capacity=600)], [env("x", 100, at=A1)], now=1)
    assert plan.remaining == {A0: 500, B0: 400}


def test_with_no_instance_known_nothing_is_decided() -> None:
    s = holding(scheduler(max_hold_s=10), {"h": 0})
    plan = s.plan([], [env("a", 10**6), hung("h", 5), SessionView("n")], now=1)
    assert plan.hang == [] and plan.resume == [] and plan.remaining == {}
    assert s.admit_new("m", now=1)  # and a new session is not held on no information
    assert s.plan([], [hung("h", 5)], now=10).resume == [Resume("h", None, "max_hold", 10.0)]


def test_undo_holds_the_sessions_again_since_when_they_were() -> None:
    s = scheduler()
    s.undo([Resume("h", None, "fits", 4.0)], now=10)
    assert s.held == {"h": 6.0}


# ---- determinism and invariants ------------------------------------------------------------------------------


def _world(draw) -> tuple[list[InstanceView], list[SessionView], dict[str, float]]:
    keys = draw(st.lists(st.sampled_from([A0, A1, B0]), min_size=1, max_size=3, unique=True))
    instances = [inst(k, draw(st.integers(100, 2000)), draw(st.floats(0, 1))) for k in keys]
    sessions, held = [], {}
    for i in range(draw(st.integers(0, 12))):
        sid = f"s{i:02d}"
        at = draw(st.sampled_from([*keys, A1, None]))
        tokens = draw(st.integers(0, 1500))
        kind = draw(st.sampled_from(["env", "gen", "held", "theirs", "closing", "marked"]))
        if kind == "held":
            held[sid] = draw(st.floats(0, 100))
        view = SessionView(
            sid,
            at,
            kind in ("gen", "marked"),
            tokens,
            hung=kind in ("held", "theirs"),
            marked=kind == "marked",
            closing=kind == "closing",
        )
        sessions.append(view)
    return instances, sessions, held


@st.composite
def worlds(draw):
    return _world(draw)


@settings(max_examples=300, deadline=None)
@given(worlds(), st.sampled_from(("bucketed", "global")), st.booleans())
def test_every_plan_keeps_the_rules(world, scope: str, pin: bool) -> None:
    instances, sessions, held = world
    cfg = dict(buffer_per_session=100, continue_scope=scope, continue_force_pin=pin, max_hold_s=50)
    s = holding(scheduler(**cfg), held)
    plan = s.plan(instances, sessions, now=100.0)
    by_id = {x.session_id: x for x in sessions}
    hung_ids, resumed_ids = set(plan.hang), set(resumed(plan))
    assert not hung_ids & resumed_ids and len(plan.hang) == len(hung_ids)
    for sid in plan.hang:  # only running sessions of ours to judge, never closing or already marked
        x = by_id[sid]
        assert not x.hung and not x.closing and not x.marked
    for r in plan.resume:  # only sessions this strategy held
        assert r.session_id in held and by_id[r.session_id].hung and not by_id[r.session_id].closing
        assert (r.pin is not None) == (pin and r.reason != "max_hold")
        assert r.reason != "max_hold" or held[r.session_id] <= 50
    # the instances in another order give the same plan (sessions come in arrival order, which counts)
    shuffled = holding(scheduler(**cfg), held)
    other = shuffled.plan(random.Random(0).sample(instances, len(instances)), sessions, now=100.0)
    assert other.hang == plan.hang and other.resume == plan.resume and other.remaining == plan.remaining


# ---- what the driver reads -----------------------------------------------------------------------------------


def test_instances_come_from_the_capacity_label_and_each_ranks_usage() -> None:
    workers = {
        "workers": [
            {"worker_id": "w", "labels": {"max_model_len": "4096"}},
            {"worker_id": "nolabel", "labels": {}},
            {"worker_id": "bad", "labels": {"max_model_len": "lots"}},
        ]
    }
    stats = {
        "workers": [
            {"base_worker_id": "w", "dp_rank": 1, "kv_cache_usage": 0.5, "healthy": True, "paused": False},
            {"base_worker_id": "w", "dp_rank": 0, "kv_cache_usage": 7.0, "healthy": True, "paused": False},
            {"base_worker_id": "w", "dp_rank": 2, "kv_cache_usage": 0.1, "healthy": False, "paused": False},
            {"base_worker_id": "w", "dp_rank": 3, "kv_cache_usage": 0.1, "healthy": True, "paused": True},
            {"base_worker_id": "nolabel", "dp_rank": 0, "kv_cache_usage": 0.1},
            {"base_worker_id": "gone", "dp_rank": 0, "kv_cache_usage": 0.1},
        ]
    }
    assert instances_from(workers, stats) == [InstanceView(("w", "0"), 4096, 1.0), InstanceView(("w", "1"), 4096, 0.5)]
    with pytest.raises(ReadError):
        instances_from({"workers": [{"labels": {"max_model_len": "1"}}]}, stats)
    with pytest.raises(ReadError):
        instances_from(workers, {"nope": []})


def test_sessions_come_from_the_control_listing() -> None:
    entry = {
        "session_id": "s",
        "base_worker_id": "w",
        "target_dp_rank": "1",
        "status": "generate",
        "hang_state": "running",
        "inflight": 1,
        "total_tokens": 42,
        "marked_for_hang": True,
        "closing": False,
    }
    assert session_from_summary(entry) == SessionView("s", ("w", "1"), True, 42, marked=True)
    new = {"session_id": "n", "base_worker_id": None, "status": "env", "hang_state": "hung", "total_tokens": 0}
    assert session_from_summary(new) == SessionView("n", None, False, 0, hung=True)
    assert resume_item(Resume("s", ("w", "1"))) == {"session_id": "s", "base_worker_id": "w", "target_dp_rank": "1"}
    assert resume_item(Resume("s")) == {"session_id": "s"}


def test_the_config_refuses_nonsense() -> None:
    for bad in (
        {"check_interval_ms": 0},
        {"env_token_weight": -1},
        {"buffer_per_session": -1},
        {"continue_scope": "nearest"},
        {"max_hold_s": 0},
    ):
        with pytest.raises(ValueError):
            ThunderConfig(**bad).validate()


# ---- the driver's rounds over a SessionControl that fails ------------------------------------------------------


class _Control:
    """Sessions in memory; `fail` names the call that raises (the others are applied)."""

    def __init__(self, views: list[SessionView], fail: str | None = None) -> None:
        self.views = {v.session_id: v for v in views}
        self.fail = fail
        self.resumed: list[str] = []

    async def sessions(self) -> list[SessionView]:
        return list(self.views.values())

    async def hang(self, session_ids) -> None:
        if self.fail == "hang":
            raise RuntimeError("hang refused")

    async def resume(self, resumes) -> None:
        if self.fail == "resume":
            raise RuntimeError("continue refused")
        self.resumed += [r.session_id for r in resumes]

    async def aclose(self) -> None:
        pass


async def _router(path: str) -> dict:
    if path == "/workers":
        return {"workers": [{"worker_id": "a", "labels": {"max_model_len": "1000"}}]}
    return {"workers": [{"base_worker_id": "a", "dp_rank": 0, "kv_cache_usage": 0.0}]}


async def test_a_continue_that_fails_holds_the_sessions_again_and_the_next_round_retries() -> None:
    control = _Control([hung("h", 100)], fail="resume")
    driver = ThunderDriver(ThunderConfig(buffer_per_session=100), _router, control, clock=lambda: 5.0)
    holding(driver.scheduler, {"h": 1.0})
    plan = await driver.step()
    assert plan.resume == [] and driver.scheduler.held == {"h": 1.0}  # held again, since when it was
    control.fail = None
    plan = await driver.step()
    assert [r.session_id for r in plan.resume] == ["h"] and control.resumed == ["h"]
    assert "h" not in driver.scheduler.held


async def test_a_hang_that_fails_is_decided_again_next_round() -> None:
    """The refusal is only logged: the next round reads the session still running and hangs it again."""
    control = _Control([env("big", 2000), env("small", 100)], fail="hang")
    driver = ThunderDriver(ThunderConfig(buffer_per_session=0), _router, control)
    assert (await driver.step()).hang == ["small"]  # smallest first; the instance's last session stays
    control.fail = None
    assert (await driver.step()).hang == ["small"]
    assert driver.metrics.registry.get_sample_value("psrl_session_thunder_rounds_total") == 2
