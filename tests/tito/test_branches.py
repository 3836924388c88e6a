"""Every sampled turn is exported: each branch of a session's tree is its own trajectory entry in the snapshot
(and its own sample in build_all_training_arrays); only an explicit drop or an expired session loses turns,
and those are counted and logged."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from psrl.tito import TitoStore, build_all_training_arrays, build_training_arrays
from psrl.tito.store import NotExported
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TASK = {"role": "user", "content": "Please call the tool to read the file."}


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return Tokenizer.from_folder(folder)


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def reply(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def turn(store: TitoStore, sid: str, messages: list[dict[str, Any]], text: str, tid: int = 0) -> tuple[Any, list[int]]:
    """One turn whose model output is `text` + <|im_end|>; (the prepared turn, the sampled ids)."""
    prepared = store.prepare_turn(sid, tid, messages)
    out = store.tokenizer.encode(text + "<|im_end|>")  # type: ignore[union-attr]
    lps = [-(j + 1) / 64 for j in range(len(out))]
    store.record_turn(
        sid, tid, prepared, output_ids=out, output_logprobs=lps, finish_reason="stop", assistant_message=reply(text)
    )
    return prepared, out


def drop_reply_agent(store: TitoStore, sid: str, turns: int) -> list[tuple[list[dict[str, Any]], list[int]]]:
    """mini-swe-agent 2.x on format errors: it drops its own reply and appends only the error message, so every
    turn is a new root. Returns each turn's (messages, sampled ids)."""
    history = [SYSTEM, TASK]
    calls = []
    for k in range(turns):
        prepared, out = turn(store, sid, history, f"junk {k}")
        assert prepared.parent_node_id is None
        calls.append((history, out))
        history = [*history, user(f"Format error {k}: reply with exactly one bash block.")]
    return calls


def sampled(arrays: Any) -> list[int]:
    return arrays.response_ids[arrays.response_mask == 1].tolist()


def test_an_agent_that_drops_its_replies_keeps_every_turn_by_default(tok: Tokenizer) -> None:
    store = TitoStore(tok)
    sid = store.create_session()
    calls = drop_reply_agent(store, sid, 11)
    snap = store.snapshot(sid)

    trajectories = snap["trajectories"]
    assert len(trajectories) == 11 and {t["trajectory_id"] for t in trajectories} == {0}
    # The final history is the agent's last turn; the ten branches it left behind follow, oldest first.
    assert [(t["final"], t["path_node_ids"]) for t in trajectories] == [(True, [10])] + [
        (False, [k]) for k in range(10)
    ]
    assert snap["turns_not_exported"] == 0 and store.turns_not_exported == {
        NotExported.DROPPED_BRANCH: 0,
        NotExported.SESSION_EXPIRED: 0,
    }

    every = build_all_training_arrays(snap)
    assert len(every) == 11 and sum(a.num_turns for a in every) == 11
    by_node = {a.path_node_ids: a for a in every}
    for k, (messages, out) in enumerate(calls):
        arrays = by_node[(k,)]
        assert arrays.final == (k == 10) and arrays.trajectory_id == 0 and len(arrays.records) == 1
        assert arrays.prompt_ids.tolist() == tok.encode(tok.apply_chat_template(messages))
        assert arrays.response_ids.tolist() == sampled(arrays) == out
        assert arrays.rollout_logprobs.tolist() == pytest.approx([lp for lp, _ in arrays.records[0]["output_logprobs"]])
    # The single-trajectory call still works and gives the final history.
    assert build_training_arrays(snap).path_node_ids == (10,)
    assert [a.path_node_ids for a in build_all_training_arrays(snap, final_only=True)] == [(10,)]


def test_dropping_branches_is_explicit_and_counted(tok: Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    store = TitoStore(tok, drop_dead_leaves=True)
    sid = store.create_session()
    with caplog.at_level(logging.INFO, logger="psrl.tito.store"):
        calls = drop_reply_agent(store, sid, 11)
    snap = store.snapshot(sid)
    [final] = snap["trajectories"]
    assert final["final"] and final["path_node_ids"] == [10]
    assert snap["turns_not_exported"] == 10 and store.turns_not_exported[NotExported.DROPPED_BRANCH] == 10
    assert store.num_nodes(sid) == 1  # GC freed the dropped ones (threshold 0)
    lines = [r.getMessage() for r in caplog.records if "in no exported trajectory" in r.getMessage()]
    assert len(lines) == 10 and all("1 sampled turns" in line for line in lines)
    assert f"({len(calls[0][1])} tokens, nodes [0])" in lines[0]


def test_a_dropped_branch_is_counted_once_and_never_continued(tok: Tokenizer) -> None:
    # GC only above 100 nodes: the dropped nodes stay in memory, but they are gone from every branch.
    store = TitoStore(tok, drop_dead_leaves=True, gc_threshold=100)
    sid = store.create_session()
    history = [SYSTEM, TASK]
    turn(store, sid, history, "First.")
    turn(store, sid, [*history, reply("First."), user("Go on.")], "Second.")
    turn(store, sid, [SYSTEM, user("Another task.")], "Rewritten.")  # a new root: nodes 0 and 1 are dropped
    assert store.num_nodes(sid) == 3 and store.turns_not_exported[NotExported.DROPPED_BRANCH] == 2
    # Echoing the dropped reply does not bring its ids back: a new root.
    prepared, _ = turn(store, sid, [*history, reply("First."), user("Go on.")], "Again.")
    assert prepared.parent_node_id is None
    snap = store.snapshot(sid)
    assert [t["path_node_ids"] for t in snap["trajectories"]] == [[3]]
    assert store.turns_not_exported[NotExported.DROPPED_BRANCH] == 3 and snap["turns_not_exported"] == 3
    nodes = {n["id"]: n["trajectory_ids"] for n in snap["tree"]["nodes"]}
    assert nodes == {0: [], 1: [], 2: [], 3: [0]}


def test_a_branch_the_agent_goes_back_to_is_exported_once(tok: Tokenizer) -> None:
    store = TitoStore(tok)
    sid = store.create_session()
    history = [SYSTEM, TASK]
    turn(store, sid, history, "A.")  # node 0
    b = [*history, reply("A."), user("Then B?")]
    turn(store, sid, b, "B.")  # node 1
    turn(store, sid, [*history, reply("A."), user("Then C?")], "C.")  # node 2: node 1 is left behind
    turn(store, sid, [*b, reply("B."), user("Then D?")], "D.")  # node 3 continues node 1: node 2 is left behind
    snap = store.snapshot(sid)
    assert [(t["final"], t["path_node_ids"]) for t in snap["trajectories"]] == [(True, [0, 1, 3]), (False, [0, 2])]
    dead = sorted(leaf["node_id"] for leaf in snap["tree"]["leaves"] if leaf["dead"])
    assert dead == [1, 2]  # the tree still says which leaves were left behind
    every = build_all_training_arrays(snap)
    assert [a.num_turns for a in every] == [3, 2]
    assert {node for a in every for node in a.path_node_ids} == {0, 1, 2, 3}


def test_other_trajectories_and_branches_are_separate_samples(tok: Tokenizer) -> None:
    store = TitoStore(tok)
    sid = store.create_session()
    history = [SYSTEM, TASK]
    turn(store, sid, history, "A.")  # node 0 on trajectory 0
    turn(store, sid, [*history, reply("A."), user("More?")], "B.", tid=1)  # node 1: trajectory 1 continues node 0
    turn(store, sid, [SYSTEM, user("Something else.")], "C.")  # node 2: trajectory 0 starts over
    snap = store.snapshot(sid)
    entries = [(t["trajectory_id"], t["final"], t["path_node_ids"]) for t in snap["trajectories"]]
    # Node 0, left behind by trajectory 0, is continued by trajectory 1: no entry of its own.
    assert entries == [(0, True, [2]), (1, True, [0, 1])]
    nodes = {n["id"]: n["trajectory_ids"] for n in snap["tree"]["nodes"]}
    assert nodes == {0: [1], 1: [1], 2: [0]}
    with pytest.raises(ValueError, match="pass trajectory_id"):
        build_training_arrays(snap)
    assert build_training_arrays(snap, trajectory_id=1).path_node_ids == (0, 1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_expired_session_counts_the_turns_no_snapshot_exported(
    tok: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    store = TitoStore(tok, session_ttl_s=10.0, clock=clock)
    history = [SYSTEM, TASK]
    kept = store.create_session()
    turn(store, kept, history, "A.")
    turn(store, kept, [*history, reply("A."), user("More?")], "B.")
    store.snapshot(kept)  # both exported
    turn(store, kept, [*history, reply("A."), user("Other?")], "C.")  # not yet
    deleted = store.create_session()
    turn(store, deleted, history, "A.")
    store.delete_session(deleted)  # its owner asked: not a loss
    clock.now += 11
    with caplog.at_level(logging.WARNING, logger="psrl.tito.store"):
        store.create_session()
    assert kept not in store and store.sessions_expired == 1
    assert store.turns_not_exported == {NotExported.DROPPED_BRANCH: 0, NotExported.SESSION_EXPIRED: 1}
    [line] = [r.getMessage() for r in caplog.records if "expired" in r.getMessage()]
    assert "1 sampled turns no snapshot exported" in line
