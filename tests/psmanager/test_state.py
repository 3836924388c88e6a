"""PSManagerState, the pure bookkeeping: capacity, staleness, indicators, reserve, moves, aborts, validation, status."""

from __future__ import annotations

import math
import threading

import pytest

from psrl.psmanager import InvalidArgument, PSManagerConfig, PSManagerState, RequestStatus, UnknownBuffer

INF = math.inf
A = ("worker-a", 0)
B = ("worker-b", 1)


def make(rollout_n: int = 2, entries: int = 2, pending: int = 2, staleness: int = 1) -> PSManagerState:
    return PSManagerState(
        PSManagerConfig(
            rollout_n=rollout_n, entries_per_buffer=entries, max_pending_buffers=pending, max_staleness=staleness
        )
    )


def where(state: PSManagerState, rid: int, is_validate: bool = False) -> tuple[int, int, int] | None:
    rec = state.request(rid, is_validate=is_validate)
    return None if rec is None else (rec.version, rec.buffer_id, rec.entry_id)


def test_config_is_validated() -> None:
    for bad in (
        PSManagerConfig(rollout_n=0),
        PSManagerConfig(entries_per_buffer=0),
        PSManagerConfig(max_pending_buffers=0),
        PSManagerConfig(max_staleness=-1),
    ):
        with pytest.raises(ValueError):
            PSManagerState(bad)


# ---- capacity --------------------------------------------------------------------------------------------


def test_groups_fill_entries_then_buffers_up_to_the_pending_limit() -> None:
    s = make(rollout_n=2, entries=2, pending=2)
    placed = {}
    for rid in (0, 1, 2, 4, 6):  # groups 0, 0, 1, 2, 3
        r = s.reserve([A], [rid], [0])
        assert r.success, r.error_message
        placed[rid] = (r.buffer_ids[0], r.entry_ids[0])
    assert placed == {0: (0, 0), 1: (0, 0), 2: (0, 1), 4: (1, 0), 6: (1, 1)}

    # Both pending buffers are full: a fifth group is refused, members of started groups still fit.
    assert s.can_reserve([8, 7, 3], [0]) == [[False], [True], [True]]
    refused = s.reserve([A], [8], [0])
    assert not refused.success and "pending buffers are full" in refused.error_message
    assert refused.buffer_ids == [-1] and refused.entry_ids == [-1]
    assert s.request(8) is None

    # without_new_reserve_entry only admits requests whose group already has an entry.
    s2 = make()
    s2.reserve([A], [0], [0])
    assert s2.can_reserve([1, 2], [0], without_new_reserve_entry=True) == [[True], [False]]
    assert s2.can_reserve([1, 2], [0]) == [[True], [True]]


def test_can_reserve_is_row_major_over_versions_and_checks_is_validate_length() -> None:
    s = make(rollout_n=1, entries=1, pending=1, staleness=100)
    s.reserve([A], [0], [1])  # version 1's only buffer is now full
    assert s.can_reserve([0, 5], [0, 1, 2]) == [[False, True, False], [True, False, True]]
    assert s.can_reserve([5], [-1]) == [[False]]  # unversioned requests hold no reservation
    assert s.can_reserve([], [0]) == []
    assert s.can_reserve([5, 6], [1], is_validate=[True]) == [[True], [True]]
    with pytest.raises(InvalidArgument):
        s.can_reserve([1, 2, 3], [0], is_validate=[True, False])


# ---- indicators ------------------------------------------------------------------------------------------


def test_indicators_rank_existing_entry_then_pending_buffer_then_cannot() -> None:
    s = make(rollout_n=2, entries=2, pending=2, staleness=100)
    assert s.reserve_indicators(0, [0, 1]) == [-1.0, -1.0]  # a first buffer would open
    s.reserve([A], [0], [0])
    assert s.reserve_indicators(1, [0, 1]) == [-INF, -1.0]  # group 0 has an entry on version 0
    assert s.reserve_indicators(2, [0]) == [-1.0]  # buffer 0 still has a free entry
    s.reserve([A], [2], [0])
    assert s.reserve_indicators(4, [0]) == [-2.0]  # buffer 0 full: a second buffer opens
    s.reserve([A], [4, 6], [0])
    assert s.reserve_indicators(8, [0]) == [INF]
    assert s.reserve_indicators(7, [0]) == [-INF]
    assert s.reserve_indicators(0, [0, 1]) == [-INF, INF]  # already reserved on 0: only 0
    assert s.reserve_indicators(9, [-1]) == [INF]


def test_a_freed_slot_in_the_oldest_buffer_is_preferred() -> None:
    s = make(rollout_n=1, entries=2, pending=2)
    s.reserve([A], [0, 1, 2], [0])  # buffer 0: entries 0, 1; buffer 1: entry 0
    s.abort_requests([1])
    s.check_aborted_requests([1], remove=True)  # acknowledged: its slot is released
    assert s.reserve_indicators(3, [0]) == [-1.0]
    r = s.reserve([A], [3], [0])
    assert (r.buffer_ids, r.entry_ids) == ([0], [1])


# ---- staleness -------------------------------------------------------------------------------------------


def test_stale_versions_finish_started_groups_but_take_no_new_entries() -> None:
    s = make(rollout_n=2, entries=4, pending=2, staleness=1)
    assert s.reserve([A], [0], [1]).success  # group 0 on version 1
    s.set_latest_version(3)
    assert s.latest_version == 3
    assert s.can_reserve([1, 2], [1, 2, 3]) == [[True, True, True], [False, True, True]]
    assert s.reserve([A], [1], [1]).success  # completes group 0
    refused = s.reserve([A], [2], [1])
    assert not refused.success and "stale" in refused.error_message


def test_reserve_and_instance_versions_raise_latest() -> None:
    s = make(rollout_n=1, staleness=1)
    assert s.latest_version == -1
    s.reserve([A], [0], [5])
    assert s.latest_version == 5
    assert s.can_reserve([1], [3, 4]) == [[False, True]]
    s.set_instance_model_version(B, 7)
    assert s.latest_version == 7 and s.instance_model_version(B) == 7
    assert s.can_reserve([1], [5, 6]) == [[False, True]]
    # A refused reserve leaves latest alone.
    s.abort_model_version(9)
    assert not s.reserve([A], [2], [9], guarantee_not_aborted=True).success
    assert s.latest_version == 7
    # Admin may set latest back.
    s.set_latest_version(0)
    assert s.can_reserve([1], [0]) == [[True]]
    with pytest.raises(InvalidArgument):
        s.set_latest_version(-2)


# ---- reserve ---------------------------------------------------------------------------------------------


def test_reserve_is_idempotent_and_never_moves_a_request() -> None:
    s = make(rollout_n=2, entries=2, pending=1, staleness=5)
    first = s.reserve([A], [0, 2], [0])
    again = s.reserve([B], [0, 2], [0])
    assert first.success and again.success
    assert (first.buffer_ids, first.entry_ids) == (again.buffer_ids, again.entry_ids)
    snap = s.snapshot()["inventories"]["train"]
    assert snap["requests"] == 2 and len(snap["versions"]["0"]["pending_buffers"][0]["entries"]) == 2
    rec = s.request(0)
    assert rec is not None and rec.instance == B  # the latest reserve's instance is recorded

    other = s.reserve([A], [0], [1])
    assert not other.success and "already reserved on version 0" in other.error_message
    assert where(s, 0) == (0, 0, 0)
    assert s.can_reserve([0], [0, 1]) == [[True, False]]


def test_reserve_is_all_or_nothing() -> None:
    s = make(rollout_n=1, entries=2, pending=1)
    s.reserve([A], [0], [0])
    before = s.snapshot()
    r = s.reserve([A], [1, 2], [0])  # 1 fits, 2 does not
    assert not r.success and r.buffer_ids == [-1, -1]
    assert s.snapshot() == before
    # A call that opened a buffer and then failed leaves no trace of it either.
    s2 = make(rollout_n=1, entries=1, pending=1)
    r = s2.reserve([A], [0, 1], [3])
    assert not r.success
    assert s2.snapshot()["inventories"]["train"]["versions"] == {}
    assert s2.latest_version == -1
    assert s2.reserve([A], [1], [3]).buffer_ids == [0]


def test_reserve_broadcasts_length_one_lists_and_validates_arguments() -> None:
    s = make(rollout_n=3, entries=4)
    r = s.reserve([A], [0, 1, 2, 3], [0])
    assert r.success and r.buffer_ids == [0, 0, 0, 0] and r.entry_ids == [0, 0, 0, 1]
    r = s.reserve([A, B], [6, 9], [0, 1])
    assert r.success and s.request(9) is not None and s.request(9).instance == B  # type: ignore[union-attr]
    assert s.reserve([], [12], [0]).success  # no instance is fine
    assert s.request(12) is not None and s.request(12).instance is None  # type: ignore[union-attr]
    assert s.reserve([A], [], [0]) == s.reserve([A], [], []) and s.reserve([A], [], []).success
    with pytest.raises(InvalidArgument):
        s.reserve([A], [20, 21], [0, 1, 2])
    with pytest.raises(InvalidArgument):
        s.reserve([A, B, A], [20, 21], [0])
    with pytest.raises(InvalidArgument):
        s.reserve([A], [20], [])
    with pytest.raises(InvalidArgument):
        s.reserve([A], [20], [-1])


def test_reserve_records_instance_versions() -> None:
    s = make(rollout_n=1, staleness=10)
    assert s.instance_model_version(A) == -1
    s.reserve([A], [0], [3])
    s.reserve([A], [1], [2])  # an older reserve does not move the instance back
    assert s.instance_model_version(A) == 3
    s.set_instance_model_version(A, 1)  # the admin may
    assert s.instance_model_version(A) == 1
    assert s.update_request_instance(0, B)
    assert s.request(0).instance == B  # type: ignore[union-attr]
    assert not s.update_request_instance(99, B)


# ---- version-tag move ------------------------------------------------------------------------------------


def test_update_request_version_tag_moves_the_reservation() -> None:
    s = make(rollout_n=2, entries=2, pending=1, staleness=10)
    s.reserve([A], [0, 1], [0])
    s.update_request_status([0], "RUNNING")
    assert s.update_request_version_tag(0, 0)  # no-op
    assert s.update_request_version_tag(0, 1)
    moved = s.request(0)
    assert moved is not None and (moved.version, moved.buffer_id, moved.entry_id) == (1, 0, 0)
    assert moved.status is RequestStatus.RUNNING and moved.instance == A
    assert where(s, 1) == (0, 0, 0)  # its group-mate stays
    assert s.latest_version == 1
    # Group 0 now has an entry on both versions; the rest of the group joins either.
    assert s.reserve_indicators(1, [0, 1]) == [-INF, INF]  # 1 is reserved on 0
    assert s.update_request_version_tag(1, 1)
    assert where(s, 1) == (1, 0, 0)
    train = s.snapshot()["inventories"]["train"]["versions"]
    assert train["0"]["pending_buffers"][0]["entries"] == []  # the emptied entry was freed

    # A move the target cannot admit fails and keeps the old reservation.
    s.reserve([A], [2, 4], [2])  # version 2's single buffer is now full
    assert not s.update_request_version_tag(0, 2)
    assert where(s, 0) == (1, 0, 0)
    assert not s.update_request_version_tag(99, 1)
    with pytest.raises(InvalidArgument):
        s.update_request_version_tag(0, -1)


# ---- aborts ----------------------------------------------------------------------------------------------


def test_aborted_requests_are_refused_skipped_and_acknowledged() -> None:
    s = make(rollout_n=1)
    assert s.abort_requests([5]) == [False]  # unknown ids may be aborted ahead of time
    assert s.check_aborted_requests([5, 6]) == [True, False]
    assert s.can_reserve([5], [0]) == [[False]]
    assert s.reserve_indicators(5, [0]) == [INF]
    strict = s.reserve([A], [5, 6], [0], guarantee_not_aborted=True)
    assert not strict.success and "aborted" in strict.error_message and s.request(6) is None
    lenient = s.reserve([A], [5, 6], [0])
    assert lenient.success and lenient.buffer_ids[0] == -1 and lenient.entry_ids[0] == -1
    assert lenient.buffer_ids[1] == 0

    assert s.abort_requests([6]) == [True]
    assert s.request(6).status is RequestStatus.ABORTED  # type: ignore[union-attr]
    assert s.update_request_status([6], "RUNNING") == [False]
    assert s.check_aborted_requests([5, 6], remove=True) == [True, True]
    assert s.check_aborted_requests([5, 6]) == [False, False]
    assert s.request(6) is None  # released
    assert s.reserve([A], [6], [0]).success  # and may start over


def test_aborting_a_model_version() -> None:
    s = make(rollout_n=2, staleness=10)
    s.reserve([A], [0, 1, 2], [3])
    s.reserve([A], [4], [3], is_validate=True)
    s.reserve([B], [10], [4])
    assert s.abort_model_version(3) == [0, 1, 2, 4]
    assert s.check_aborted_model_versions([3, 4, -1]) == [True, False, False]
    assert s.check_aborted_requests([0, 1, 2, 4, 10]) == [True, True, True, True, False]
    assert s.can_reserve([3, 20], [3, 4]) == [[False, True], [False, True]]
    assert s.can_reserve([20], [3], is_validate=[True]) == [[False]]
    r = s.reserve([A], [20], [3])
    assert r.success and r.buffer_ids == [-1]
    assert not s.reserve([A], [20], [3], guarantee_not_aborted=True).success
    with pytest.raises(InvalidArgument):
        s.abort_model_version(-1)


# ---- validation inventory --------------------------------------------------------------------------------


def test_validation_inventory_is_separate_and_never_capacity_limited() -> None:
    s = make(rollout_n=1, entries=1, pending=1, staleness=0)
    assert s.reserve([A], [0], [0]).success
    assert s.can_reserve([1], [0]) == [[False]]  # training inventory is full
    r = s.reserve([A], list(range(100)), [0], is_validate=True)  # same ids, own namespace, no limit
    assert r.success and set(r.buffer_ids) == {0} and r.entry_ids == list(range(100))
    assert s.can_reserve([500], [0], is_validate=[True]) == [[True]]
    assert s.reserve_indicators(500, [0], is_validate=True) == [-1.0]
    assert s.reserve_indicators(7, [0, 1], is_validate=True) == [-INF, INF]
    s.set_latest_version(10)  # staleness does not apply to validation
    assert s.can_reserve([500, 1], [0], is_validate=[True, False]) == [[True], [False]]
    assert where(s, 0) == (0, 0, 0) and where(s, 0, is_validate=True) == (0, 0, 0)
    assert s.update_request_status([5], "FINISHED", is_validate=True) == [True]
    assert s.update_request_status([5], "FINISHED") == [False]
    assert s.consume_buffer(0, 0, is_validate=True) == list(range(100))
    assert s.request(0, is_validate=True) is None and s.request(0) is not None
    assert s.reserve([A], [3], [0], is_validate=True).buffer_ids == [1]


# ---- status and buffers ----------------------------------------------------------------------------------


def test_update_request_status() -> None:
    s = make(rollout_n=2, entries=1, pending=1)
    s.reserve([A], [0, 1], [0])
    assert s.update_request_status([0, 1, 9], "RUNNING") == [True, True, False]
    assert s.update_request_status([0], "finished", model_versions=[0], instances=[B]) == [True]
    assert s.request(0).status is RequestStatus.FINISHED and s.request(0).instance == B  # type: ignore[union-attr]
    assert s.update_request_status([1], "PSRL_RequestStatus.FINISHED", model_versions=[5]) == [False]  # mismatch
    buf = s.snapshot()["inventories"]["train"]["versions"]["0"]["pending_buffers"][0]
    assert buf["full"] and not buf["complete"] and buf["entries"][0]["finished"] == 1
    assert s.update_request_status([1], RequestStatus.FINISHED, model_versions=[-1]) == [True]
    buf = s.snapshot()["inventories"]["train"]["versions"]["0"]["pending_buffers"][0]
    assert buf["complete"]
    assert s.request(1) is not None  # FINISHED frees nothing
    with pytest.raises(InvalidArgument):
        s.update_request_status([0], "DONE")
    with pytest.raises(InvalidArgument):
        s.update_request_status([0, 1, 2], "RUNNING", model_versions=[0, 0])
    assert s.update_request_status([1, 77], "ABORTED") == [True, True]
    assert s.check_aborted_requests([1, 77]) == [True, True]
    assert s.request(1).status is RequestStatus.ABORTED  # type: ignore[union-attr]


def test_consume_buffer_frees_a_pending_slot() -> None:
    s = make(rollout_n=1, entries=1, pending=2)
    s.reserve([A], [0, 1], [0])
    assert s.can_reserve([2], [0]) == [[False]]
    with pytest.raises(UnknownBuffer):
        s.consume_buffer(0, 5)
    with pytest.raises(UnknownBuffer):
        s.consume_buffer(9, 0)
    assert s.consume_buffer(0, 0) == [0]
    assert s.request(0) is None and s.request(1) is not None
    assert s.reserve_indicators(2, [0]) == [-2.0]  # buffer 1 is now the oldest pending one; a new one opens
    assert s.reserve([A], [2], [0]).buffer_ids == [2]  # ids are never reused
    book = s.snapshot()["inventories"]["train"]["versions"]["0"]
    assert [b["buffer_id"] for b in book["pending_buffers"]] == [1, 2] and book["consumed_buffers"] == 1
    # The group of a consumed buffer starts a new entry if more of it arrives.
    assert s.consume_buffer(0, 1) == [1]
    assert s.reserve_indicators(1, [0]) == [-2.0]


def test_snapshot_is_json_ready() -> None:
    import json

    s = make()
    s.reserve([A], [0], [0])
    s.abort_requests([3])
    snap = json.loads(json.dumps(s.snapshot()))
    assert snap["config"]["rollout_n"] == 2
    assert snap["aborted_requests"] == [3]
    assert snap["instance_versions"] == [{"worker_id": "worker-a", "dp_rank": 0, "model_version": 0}]
    entry = snap["inventories"]["train"]["versions"]["0"]["pending_buffers"][0]["entries"][0]
    assert entry["requests"] == [{"request_id": 0, "status": "RESERVED", "instance": ["worker-a", 0]}]


def test_concurrent_reserves_never_exceed_capacity() -> None:
    s = make(rollout_n=1, entries=10, pending=3)
    wins: list[int] = []
    lock = threading.Lock()

    def worker(base: int) -> None:
        for rid in range(base, base + 20):
            if s.reserve([A], [rid], [0]).success:
                with lock:
                    wins.append(rid)

    threads = [threading.Thread(target=worker, args=(i * 100,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 30
    snap = s.snapshot()["inventories"]["train"]
    assert snap["requests"] == 30
    assert all(len(b["entries"]) == 10 for b in snap["versions"]["0"]["pending_buffers"])
