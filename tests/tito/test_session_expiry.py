"""TitoStore limits over an injected clock: idle sessions expire, turns in flight never do, per-client caps."""

from __future__ import annotations

from pathlib import Path

import pytest

from psrl.tito import InvalidTurn, SessionNotFound, TitoStore, TooManyClientSessions, TooManySessions
from psrl.tito.store import EXPIRE_BATCH
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer

HELLO = [{"role": "user", "content": "Hello"}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return Tokenizer.from_folder(folder)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _store(tok: Tokenizer, clock: Clock, **kw) -> TitoStore:
    return TitoStore(tok, clock=clock, **{"max_sessions": 3, "session_ttl_s": 100.0, **kw})


def _record(store: TitoStore, sid: str, prepared) -> None:
    out = store.tokenizer.encode("Hi.<|im_end|>")
    store.record_turn(sid, 0, prepared, output_ids=out, output_logprobs=[-0.1] * len(out), finish_reason="stop")


def test_a_full_store_takes_new_sessions_again_once_the_idle_ones_expire(tok: Tokenizer, clock: Clock) -> None:
    store = _store(tok, clock)
    sids = [store.create_session() for _ in range(3)]
    with pytest.raises(TooManySessions, match="expire after 100 s"):
        store.create_session()
    clock.now += 100  # exactly the TTL: still alive
    with pytest.raises(TooManySessions):
        store.create_session()
    clock.now += 1
    fresh = store.create_session()
    assert len(store) == 1 and fresh in store and store.sessions_expired == 3
    for sid in sids:
        with pytest.raises(SessionNotFound):
            store.snapshot(sid)


def test_use_restarts_the_idle_time(tok: Tokenizer, clock: Clock) -> None:
    store = _store(tok, clock)
    kept, dropped = store.create_session(), store.create_session()
    clock.now += 60
    store.snapshot(kept)
    clock.now += 60  # dropped: idle 120 s; kept: 60 s
    assert store.expire_idle() == 1
    assert kept in store and dropped not in store


def test_a_session_named_after_its_ttl_is_gone_even_before_a_sweep(tok: Tokenizer, clock: Clock) -> None:
    store = _store(tok, clock)
    sid = store.create_session()
    clock.now += 101
    with pytest.raises(SessionNotFound):
        store.prepare_turn(sid, 0, HELLO)
    assert store.sessions_expired == 1 and len(store) == 0


def test_a_turn_in_flight_never_expires(tok: Tokenizer, clock: Clock) -> None:
    store = _store(tok, clock)
    sid, other = store.create_session(), store.create_session()
    prepared = store.prepare_turn(sid, 0, HELLO)
    clock.now += 10_000  # a very long generation
    store.create_session()  # the sweep at creation passes the busy session by
    assert sid in store and other not in store and store.sessions_expired == 1
    clock.now += 50
    _record(store, sid, prepared)  # and the turn is recorded
    clock.now += 99  # idle time counts from the turn's end
    assert store.expire_idle() == 1  # the session created meanwhile, idle for 149 s
    assert sid in store
    clock.now += 2
    assert store.expire_idle() == 1 and sid not in store


def test_an_abandoned_turn_ends_the_in_flight_state(tok: Tokenizer, clock: Clock) -> None:
    store = _store(tok, clock)
    sid = store.create_session()
    store.prepare_turn(sid, 0, HELLO)
    clock.now += 500
    store.abandon_turn(sid, 0)
    clock.now += 101
    assert store.expire_idle() == 1 and sid not in store


def test_one_trajectory_in_flight_keeps_the_whole_session(tok: Tokenizer, clock: Clock) -> None:
    store = _store(tok, clock)
    sid = store.create_session()
    first = store.prepare_turn(sid, 0, HELLO)
    store.prepare_turn(sid, 1, HELLO)
    _record(store, sid, first)
    clock.now += 500
    assert store.expire_idle() == 0  # trajectory 1 is still generating
    store.abandon_turn(sid, 1)
    clock.now += 101
    assert store.expire_idle() == 1


def test_no_ttl_no_expiry(tok: Tokenizer, clock: Clock) -> None:
    store = _store(tok, clock, session_ttl_s=0)
    sid = store.create_session()
    clock.now += 10**9
    assert store.expire_idle() == 0 and sid in store
    store.snapshot(sid)


def test_creation_sweeps_a_bounded_batch(tok: Tokenizer, clock: Clock) -> None:
    store = _store(tok, clock, max_sessions=EXPIRE_BATCH * 3)
    for _ in range(EXPIRE_BATCH * 3):
        store.create_session()
    clock.now += 101
    store.create_session()
    assert store.sessions_expired == EXPIRE_BATCH  # one call holds the lock for a bounded time
    assert len(store) == EXPIRE_BATCH * 2 + 1
    assert store.expire_idle() == EXPIRE_BATCH * 2 and len(store) == 1


def test_per_client_cap(tok: Tokenizer, clock: Clock) -> None:
    store = _store(tok, clock, max_sessions=10, max_sessions_per_client=2)
    a1, _ = store.create_session("a"), store.create_session("a")
    with pytest.raises(TooManyClientSessions) as exc:
        store.create_session("a")
    assert exc.value.code == "too_many_client_sessions"
    store.create_session("b")
    store.create_session()  # no client named: only the store's cap applies
    store.create_session()
    store.create_session()
    store.delete_session(a1)  # a deleted session frees the client's slot
    store.create_session("a")
    assert store.client_sessions("a") == 2
    clock.now += 101
    assert store.expire_idle() == 6
    assert store.client_sessions("a") == 0  # so does an expired one
    store.create_session("a")


def test_bad_limits_are_refused(tok: Tokenizer) -> None:
    for kw in ({"session_ttl_s": -1}, {"session_ttl_s": float("nan")}, {"max_sessions_per_client": -1}):
        with pytest.raises(ValueError):
            TitoStore(tok, **kw)


def test_untokenizable_turns_are_refused_and_leave_nothing_pending(tok: Tokenizer, clock: Clock) -> None:
    store = _store(tok, clock)
    sid = store.create_session()
    with pytest.raises(InvalidTurn, match="lone surrogate"):
        store.prepare_turn(sid, 0, [{"role": "user", "content": "bad \ud800"}])
    with pytest.raises(InvalidTurn, match="add_generation_prompt"):
        store.prepare_turn(sid, 0, HELLO, template_kwargs={"add_generation_prompt": False})
    _record(store, sid, store.prepare_turn(sid, 0, HELLO))
    clock.now += 101
    assert store.expire_idle() == 1  # nothing was left in flight
