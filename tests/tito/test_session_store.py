"""psrl.tito.TitoStore: incremental prompts over the tiny ChatML template, branches, limits, GC, snapshots."""

from __future__ import annotations

import copy
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

from psrl.tito import (
    InvalidTurn,
    PreparedTurn,
    SessionNotFound,
    TitoError,
    TitoStore,
    TooManySessions,
    TooManyTurns,
    TurnNotPrepared,
    TurnNotRecorded,
    build_all_training_arrays,
    build_training_arrays,
)
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer

EOT = "<|im_end|>"

TOOLS = [
    {
        "type": "function",
        "function": {"name": "read_file", "description": "Read a file", "parameters": {"type": "object"}},
    }
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return Tokenizer.from_folder(folder)


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str | None, *calls: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
            for i, (name, args) in enumerate(calls)
        ]
    return msg


def tool(text: str) -> dict[str, Any]:
    return {"role": "tool", "content": text}


def exact_output(tok: Tokenizer, prior: list[dict[str, Any]], reply: dict[str, Any], **kw: Any) -> list[int]:
    """The ids of the template's own rendering of `reply` up to and including <|im_end|> (what the model samples)."""
    before = tok.apply_chat_template(prior, add_generation_prompt=True, **kw)
    through = tok.apply_chat_template([*prior, reply], add_generation_prompt=False, **kw)
    assert through.startswith(before)
    text = through[len(before) :]
    assert text.endswith(EOT + "\n")
    return tok.encode(text[:-1])


def record(
    store: TitoStore, sid: str, tid: int, prepared: PreparedTurn, out: list[int], finish_reason: str = "stop", **kw: Any
) -> int:
    lps = [-(j + 1) / 100 for j in range(len(out))]
    return store.record_turn(sid, tid, prepared, output_ids=out, output_logprobs=lps, finish_reason=finish_reason, **kw)


def turn_script() -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """8 turns: (the messages the agent adds before the turn, the assistant reply)."""
    return [
        ([{"role": "system", "content": "You are a helpful assistant."}, user("Hello! How are you today?")],
         assistant("I am fine, thank you.")),
        ([user("Please call the tool to read the file.")],
         assistant(None, ("read_file", {"path": "/testbed/README.md"}))),
        ([tool("The quick brown fox jumps over the lazy dog.")],
         assistant("It says the fox jumps.", ("read_file", {"path": "/testbed/a.py"}), ("read_file", {"path": "b"}))),
        ([tool("def add(a, b):\n    return a + b"), tool("print(42)")],
         assistant("The answer is 42.")),
        ([user("What is the weather in Paris?")],
         assistant("It is sunny and warm.")),
        ([user("One, two, three?")],
         assistant("four, five, six.")),
        ([user("Summarize what it says in one short paragraph.")],
         assistant(None, ("read_file", {"path": "/testbed/README.md"}))),
        ([tool("Water boils at one hundred degrees.")],
         assistant("Water boils at one hundred degrees.")),
    ]  # fmt: skip


# --- incremental prompts -------------------------------------------------------------------------------------


def test_eight_turns_reuse_canonical_ids_and_tokenize_only_the_suffix(tok: Tokenizer) -> None:
    store = TitoStore(tok, debug=True)
    sid = store.create_session()
    messages: list[dict[str, Any]] = []
    canonical: list[int] = []
    prev_text = ""  # the prompt text of the previous turn + the text the model sampled
    outputs: list[list[int]] = []
    env: list[int] = []
    for i, (added, reply) in enumerate(turn_script()):
        messages += added
        prepared = store.prepare_turn(sid, 0, messages, tools=TOOLS)
        full = tok.apply_chat_template(messages, add_generation_prompt=True, tools=TOOLS)
        if i == 0:
            assert prepared.parent_node_id is None and prepared.reused_tokens == 0
            assert prepared.prompt_ids == tok.encode(full)
        else:
            assert prepared.parent_node_id == i - 1 and not prepared.branched
            assert prepared.reused_tokens == len(canonical)
            assert prepared.prompt_ids[: len(canonical)] == canonical
            # The suffix is the rest of the render after what the model sampled, starting with ChatML's "\n".
            assert full.startswith(prev_text)
            suffix = full[len(prev_text) :]
            assert suffix.startswith("\n<|im_start|>")
            assert prepared.prompt_ids[len(canonical) :] == tok.encode(suffix)
            env += tok.encode(suffix)
        # The outputs are exact renderings, so the incremental prompt equals a full re-tokenization.
        assert prepared.prompt_ids == tok.encode(full)
        assert prepared.mismatch_report == []

        out = exact_output(tok, messages, reply, tools=TOOLS)
        assert out[-1] == tok.token_to_id(EOT)
        record(store, sid, 0, prepared, out, weight_version=i)
        outputs.append(out)
        canonical = prepared.prompt_ids + out
        prev_text = full + tok.decode(out, skip_special_tokens=False)
        messages.append(reply)

    snap = store.snapshot(sid)
    (traj,) = snap["trajectories"]
    assert traj["accumulated_token_ids"] == canonical
    assert len(traj["records"]) == 8
    assert all(r["mismatch_report"] == [] for r in traj["records"])

    arrays = build_training_arrays(snap)
    sampled = [t for out in outputs for t in out]
    assert arrays.response_ids[arrays.response_mask == 1].tolist() == sampled
    assert arrays.response_ids[arrays.response_mask == 0].tolist() == env
    assert arrays.prompt_ids.tolist() == tok.encode(tok.apply_chat_template(messages[:2], tools=TOOLS))
    expected_lps = [-(j + 1) / 100 for out in outputs for j in range(len(out))]
    np.testing.assert_allclose(arrays.rollout_logprobs[arrays.response_mask == 1], expected_lps, rtol=1e-6)
    assert arrays.token_versions[arrays.response_mask == 1].tolist() == [
        i for i, out in enumerate(outputs) for _ in out
    ]
    assert arrays.num_turns == 8


def test_length_cut_output_gets_the_templates_end_of_turn(tok: Tokenizer) -> None:
    store = TitoStore(tok, debug=True)
    sid = store.create_session()
    first = [user("Please call the tool.")]
    p1 = store.prepare_turn(sid, 0, first)
    out = tok.encode("The quick brown")  # cut by max_tokens: no <|im_end|>
    record(store, sid, 0, p1, out, finish_reason="length")

    messages = [*first, assistant("The quick brown"), user("Go on.")]
    p2 = store.prepare_turn(sid, 0, messages)
    suffix = p2.prompt_ids[p2.reused_tokens :]
    assert p2.prompt_ids[: p2.reused_tokens] == p1.prompt_ids + out
    assert suffix[0] == tok.token_to_id(EOT)
    assert tok.decode(suffix, skip_special_tokens=False) == "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    assert p2.prompt_ids == tok.encode(tok.apply_chat_template(messages))
    assert p2.mismatch_report == []

    record(store, sid, 0, p2, tok.encode("Done.<|im_end|>"))
    snap = store.snapshot(sid)
    assert snap["tree"]["nodes"][0]["truncated"] is True
    arrays = build_training_arrays(snap)
    sampled = out + tok.encode("Done.<|im_end|>")
    assert arrays.response_ids[arrays.response_mask == 1].tolist() == sampled
    assert arrays.response_ids[arrays.response_mask == 0].tolist() == suffix
    assert arrays.finish_reason == "stop"


# --- branches and trajectories -------------------------------------------------------------------------------


def three_turns(store: TitoStore, tok: Tokenizer, sid: str, tid: int = 0) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for added, reply in turn_script()[:3]:
        messages += added
        prepared = store.prepare_turn(sid, tid, messages)
        record(store, sid, tid, prepared, exact_output(tok, messages, reply))
        messages.append(reply)
    return messages


def test_history_rewrite_branches_and_keeps_the_old_branch(tok: Tokenizer) -> None:
    store = TitoStore(tok, debug=True)
    sid = store.create_session()
    messages = three_turns(store, tok, sid)
    before = store.snapshot(sid)
    old_nodes = before["tree"]["nodes"]
    old_traj = before["trajectories"][0]

    # The agent edits the second user message: continue from turn 1 (node 0), a new branch of the tree.
    rewritten = [*messages[:3], user("Please read the file instead.")]
    prepared = store.prepare_turn(sid, 0, rewritten)
    assert prepared.parent_node_id == 0 and prepared.branched
    assert prepared.reused_tokens == before["tree"]["nodes"][0]["num_tokens"]
    assert prepared.prompt_ids[: prepared.reused_tokens] == old_traj["accumulated_token_ids"][: prepared.reused_tokens]
    assert prepared.prompt_ids == tok.encode(tok.apply_chat_template(rewritten))
    record(store, sid, 0, prepared, tok.encode("Sure.<|im_end|>"))

    after = store.snapshot(sid)
    # The old branch's nodes are untouched and still reachable from a dead leaf.
    by_id = {n["id"]: n for n in after["tree"]["nodes"]}
    for node in old_nodes:
        assert {k: v for k, v in by_id[node["id"]].items() if k != "trajectory_ids"} == {
            k: v for k, v in node.items() if k != "trajectory_ids"
        }
    dead = [leaf for leaf in after["tree"]["leaves"] if leaf["dead"]]
    assert [(d["node_id"], d["path_node_ids"]) for d in dead] == [(2, [0, 1, 2])]
    (live,) = [leaf for leaf in after["tree"]["leaves"] if not leaf["dead"]]
    assert live["path_node_ids"] == [0, 3] and live["parent"] == 0
    # Both branches are exported: the final history first, then the branch the rewrite left behind, unchanged.
    traj, left = after["trajectories"]
    assert (traj["final"], traj["path_node_ids"]) == (True, [0, 3])
    assert (left["final"], left["path_node_ids"]) == (False, [0, 1, 2])
    assert len(traj["records"]) == 2
    assert traj["records"][0] == old_traj["records"][0]
    assert {**left, "final": True} == old_traj
    assert [(a.final, a.num_turns) for a in build_all_training_arrays(after)] == [(True, 2), (False, 3)]
    assert build_training_arrays(after).path_node_ids == (0, 3)  # one trajectory id: its final history

    # No common prefix at all: a new root, fully tokenized.
    fresh = [user("Water boils at one hundred degrees.")]
    prepared = store.prepare_turn(sid, 0, fresh)
    assert prepared.parent_node_id is None and prepared.reused_tokens == 0 and prepared.branched
    assert prepared.prompt_ids == tok.encode(tok.apply_chat_template(fresh))


def test_two_trajectories_share_the_tree_and_leave_each_other_unchanged(tok: Tokenizer) -> None:
    store = TitoStore(tok, debug=True)
    sid = store.create_session()
    messages = three_turns(store, tok, sid, tid=0)
    traj0 = store.snapshot(sid)["trajectories"][0]

    # Trajectory 1 starts from trajectory 0's first turn with a different follow-up.
    branch = [*messages[:3], user("What is the weather in Paris?")]
    prepared = store.prepare_turn(sid, 1, branch)
    assert prepared.parent_node_id == 0 and prepared.branched
    record(store, sid, 1, prepared, tok.encode("It is sunny.<|im_end|>"))

    # Trajectory 2 is an unrelated conversation.
    other = [user("One, two, three?")]
    prepared = store.prepare_turn(sid, 2, other)
    assert prepared.parent_node_id is None and not prepared.branched
    record(store, sid, 2, prepared, tok.encode("four.<|im_end|>"))

    snap = store.snapshot(sid)
    assert [t["trajectory_id"] for t in snap["trajectories"]] == [0, 1, 2]
    assert snap["trajectories"][0] == traj0
    nodes = {n["id"]: n for n in snap["tree"]["nodes"]}
    assert nodes[0]["trajectory_ids"] == [0, 1]
    assert nodes[3]["parent"] == 0 and nodes[3]["trajectory_ids"] == [1]
    assert not any(leaf["dead"] for leaf in snap["tree"]["leaves"])

    arrays = build_all_training_arrays(snap)
    assert [a.trajectory_id for a in arrays] == [0, 1, 2]
    first_output = [tok_id for _, tok_id in traj0["records"][0]["output_logprobs"]]
    sampled = arrays[1].response_ids[arrays[1].response_mask == 1].tolist()
    assert sampled == first_output + tok.encode("It is sunny.<|im_end|>")
    assert arrays[2].prompt_ids.tolist() == tok.encode(tok.apply_chat_template(other))


def test_same_prompt_on_two_trajectories_follows_each_ones_own_output(tok: Tokenizer) -> None:
    store = TitoStore(tok)
    sid = store.create_session()
    first = [user("Hello!")]
    outs = {0: tok.encode("Hi.<|im_end|>"), 1: tok.encode("Hello there.<|im_end|>")}
    for tid, out in outs.items():
        record(store, sid, tid, store.prepare_turn(sid, tid, first), out)
    for tid, text in ((0, "Hi."), (1, "Hello there.")):
        prepared = store.prepare_turn(sid, tid, [*first, assistant(text), user("And?")])
        assert prepared.parent_node_id == tid and not prepared.branched


# --- matching the history to the recorded path --------------------------------------------------------------
#
# prepare_turn takes the chain hashes of the messages that match the trajectory's recorded path from the path
# (only the rest is hashed) and checks the history's render against the path's recorded render tails. A match
# must mean exactly what hashing again would say, or a changed message could reuse a node recorded for another.


NUMBERS_CALL = ("read_file", {"path": "/testbed/a.py", "limit": 1, "offset": 0.0})


def two_turns_with_replies(store: TitoStore, tok: Tokenizer, sid: str) -> list[dict[str, Any]]:
    """Two recorded turns (node 0, node 1) with their assistant messages given to record_turn; node 1's reply is a
    tool call whose arguments hold numbers. Returns the history with both replies."""
    script = [
        ([{"role": "system", "content": "You are a helpful assistant."}, user("Hello! How are you today?")],
         assistant("I am fine, thank you.")),
        ([user("Please read the file.")], assistant("Reading it.", NUMBERS_CALL)),
    ]  # fmt: skip
    messages: list[dict[str, Any]] = []
    for added, reply in script:
        messages += added
        prepared = store.prepare_turn(sid, 0, messages)
        record(store, sid, 0, prepared, exact_output(tok, messages, reply), assistant_message=reply)
        messages.append(reply)
    return messages


def _arguments(message: dict[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = message["tool_calls"][0]["function"]["arguments"]
    return args


@pytest.mark.parametrize(
    ("edit", "parent"),
    [
        pytest.param(lambda m: None, 1, id="unchanged"),
        pytest.param(lambda m: m[1].update(content="Hello! How are you tonight?"), None, id="first-user-text"),
        pytest.param(lambda m: m[3].update(name="bob"), 0, id="added-field"),
        pytest.param(lambda m: m[3].update(name=None), 1, id="added-None-field-is-the-same"),
        pytest.param(lambda m: m[2].update(content="I am fine."), None, id="earlier-reply-text"),
        pytest.param(lambda m: m[4].update(name=None), 1, id="reply-with-a-None-field-is-the-same"),
        pytest.param(lambda m: _arguments(m[4]).update(limit=True), 0, id="reply-int-to-bool"),
        pytest.param(
            lambda m: (m[4].update(name=None), _arguments(m[4]).update(limit=True)),
            0,
            id="reply-None-field-int-to-bool",
        ),
        pytest.param(lambda m: _arguments(m[4]).update(limit=1.0), 0, id="reply-int-to-float"),
        pytest.param(lambda m: _arguments(m[4]).update(offset=-0.0), 0, id="reply-float-sign"),
        pytest.param(lambda m: _arguments(m[4]).update(limit=2), 0, id="reply-other-int"),
    ],
)
def test_a_resent_message_with_a_changed_field_does_not_reuse_its_node(
    tok: Tokenizer, edit: Any, parent: int | None
) -> None:
    store = TitoStore(tok, debug=True)
    sid = store.create_session()
    history = copy.deepcopy(two_turns_with_replies(store, tok, sid))
    edit(history)
    messages = [*history, tool("def add(a, b):\n    return a + b")]
    prepared = store.prepare_turn(sid, 0, messages)
    assert prepared.parent_node_id == parent
    assert prepared.branched == (parent != 1)
    assert prepared.prompt_ids == tok.encode(tok.apply_chat_template(messages))
    assert prepared.mismatch_report == []
    # The chain matched against the recorded path is the one hashing every message again gives (a trajectory
    # without a recorded path hashes them all).
    fresh = store.prepare_turn(sid, 1, messages)
    assert fresh.parent_node_id == parent
    assert fresh.draft.hashes[-1] == prepared.draft.hashes[-1]


def test_the_tools_and_template_kwargs_are_part_of_the_history(tok: Tokenizer) -> None:
    strict = [{**TOOLS[0], "strict": True, "max_calls": 3}]  # not only strings: compared type by type
    for tools in (TOOLS, strict):
        store = TitoStore(tok, debug=True)
        sid = store.create_session()
        first = [user("Hello!")]
        p1 = store.prepare_turn(sid, 0, first, tools=tools)
        out = exact_output(tok, first, assistant("Hi."), tools=tools)
        record(store, sid, 0, p1, out)
        messages = [*first, assistant("Hi."), user("And?")]
        for changed, kwargs in (({**tools[0], "type": "other"}, {}), (tools[0], {"enable_thinking": True})):
            other = store.prepare_turn(sid, 0, messages, tools=[changed], template_kwargs=kwargs)
            assert other.parent_node_id is None and other.reused_tokens == 0
            store.abandon_turn(sid, 0)
        if tools is strict:
            retyped = [{**tools[0], "max_calls": 3.0}]
            assert store.prepare_turn(sid, 0, messages, tools=retyped).parent_node_id is None
            store.abandon_turn(sid, 0)
        same = store.prepare_turn(sid, 0, messages, tools=copy.deepcopy(tools))
        assert same.parent_node_id == 0 and same.reused_tokens == len(p1.prompt_ids) + len(out)
        assert same.prompt_ids == tok.encode(tok.apply_chat_template(messages, tools=tools))
        assert same.mismatch_report == []


def test_mappings_that_are_not_dicts_match_the_recorded_path(tok: Tokenizer) -> None:
    store = TitoStore(tok, debug=True)
    sid = store.create_session()
    messages = three_turns(store, tok, sid)
    proxied = [MappingProxyType(m) for m in [*messages, user("Next?")]]
    prepared = store.prepare_turn(sid, 0, proxied)
    assert prepared.parent_node_id == 2 and not prepared.branched
    assert prepared.prompt_ids == tok.encode(tok.apply_chat_template([dict(m) for m in proxied]))


def test_a_session_keeps_each_message_and_render_once_along_a_path(tok: Tokenizer) -> None:
    # Each node keeps only what its turn added (messages, hashes, render tail): linear in the conversation.
    store = TitoStore(tok)
    sid = store.create_session()
    messages: list[dict[str, Any]] = []
    for added, reply in turn_script():
        messages += added
        prepared = store.prepare_turn(sid, 0, messages, tools=TOOLS)
        record(store, sid, 0, prepared, exact_output(tok, messages, reply, tools=TOOLS))
        last = messages.copy()
        messages.append(reply)
    nodes = list(store._sessions[sid].nodes.values())
    assert sum(len(n.items) for n in nodes) == 1 + len(last)  # the header (tools, kwargs) + each message once
    assert sum(len(n.hashes) for n in nodes) == 1 + len(last)
    assert "".join(n.rendered_tail for n in nodes) == tok.apply_chat_template(last, tools=TOOLS)


# --- debug validator -----------------------------------------------------------------------------------------


def test_debug_reports_sampled_ids_that_do_not_retokenize_the_same(tok: Tokenizer) -> None:
    canonical_word = tok.encode("Paris")
    split = [t for ch in "Paris" for t in tok.encode(ch)]
    assert split != canonical_word and tok.decode(split) == "Paris"
    for debug in (True, False):
        store = TitoStore(tok, debug=debug)
        sid = store.create_session()
        first = [user("What is the weather in Paris?")]
        p1 = store.prepare_turn(sid, 0, first)
        out = [*split, *tok.encode(" is sunny.<|im_end|>")]
        retokenized = tok.encode("Paris is sunny.<|im_end|>")
        assert tok.decode(out, skip_special_tokens=False) == "Paris is sunny.<|im_end|>" and out != retokenized
        record(store, sid, 0, p1, out)
        p2 = store.prepare_turn(sid, 0, [*first, assistant("Paris is sunny."), user("Thanks!")])
        # The sampled ids stay in the prompt whatever the validator says.
        assert p2.prompt_ids[: p2.reused_tokens] == p1.prompt_ids + out
        record(store, sid, 0, p2, tok.encode("You are welcome.<|im_end|>"))
        report = store.snapshot(sid)["trajectories"][0]["records"][1]["mismatch_report"]
        if not debug:
            assert report == []
            continue
        (entry,) = report
        assert entry["mismatch_type"] == "token_mismatch"
        first_diff = next(i for i, (a, b) in enumerate(zip(out, retokenized)) if a != b)
        assert entry["position"] == len(p1.prompt_ids) + first_diff
        assert set(entry) == {"mismatch_type", "position", "detail"}


# --- limits, errors, GC, deletion ----------------------------------------------------------------------------


def test_limits_and_typed_errors(tok: Tokenizer) -> None:
    store = TitoStore(tok, max_sessions=2, max_turns_per_session=2)
    a, b = store.create_session(), store.create_session()
    assert a != b and len(a) >= 24
    with pytest.raises(TooManySessions) as exc:
        store.create_session()
    assert exc.value.code == "too_many_sessions" and isinstance(exc.value, TitoError | ValueError)

    with pytest.raises(SessionNotFound) as nf:
        store.prepare_turn("nope", 0, [user("hi")])
    assert nf.value.code == "session_not_found"

    p = store.prepare_turn(a, 0, [user("Hello!")])
    with pytest.raises(TurnNotRecorded) as nr:
        store.prepare_turn(a, 0, [user("Hello!")])
    assert nr.value.code == "turn_not_recorded"
    store.abandon_turn(a, 0)
    with pytest.raises(TurnNotPrepared):
        record(store, a, 0, p, [5])  # abandoned: no longer pending
    p = store.prepare_turn(a, 0, [user("Hello!")])
    with pytest.raises(InvalidTurn):
        store.record_turn(a, 0, p, output_ids=[5, 6], output_logprobs=[-1.0], finish_reason="stop")
    record(store, a, 0, p, tok.encode("Hi.<|im_end|>"))
    with pytest.raises(TurnNotPrepared):
        record(store, a, 0, p, [5])  # recorded twice
    record(store, a, 1, store.prepare_turn(a, 1, [user("Hey!")]), [5])
    with pytest.raises(TooManyTurns) as tm:
        store.prepare_turn(a, 2, [user("Again")])
    assert tm.value.code == "too_many_turns"

    for bad in ([], [{"content": "no role"}]):
        with pytest.raises(InvalidTurn):
            store.prepare_turn(b, 0, bad)
    with pytest.raises(InvalidTurn):
        store.prepare_turn(b, -1, [user("hi")])


def test_gc_prunes_nodes_no_live_leaf_reaches(tok: Tokenizer) -> None:
    # drop_dead_leaves: a rewrite leaves its old branch to GC (threshold 0: GC after every turn).
    store = TitoStore(tok, drop_dead_leaves=True)
    sid = store.create_session()
    messages = three_turns(store, tok, sid)
    assert store.num_nodes(sid) == 3

    # Trajectory 1 prepares a turn on top of node 2 and holds it while trajectory 0 rewrites its history.
    pending = store.prepare_turn(sid, 1, [*messages, user("More?")])
    assert pending.parent_node_id == 2
    rewritten = [*messages[:3], user("Something else.")]
    record(store, sid, 0, store.prepare_turn(sid, 0, rewritten), tok.encode("Ok.<|im_end|>"))
    assert store.num_nodes(sid) == 4  # nodes 1 and 2 survive: trajectory 1's pending turn needs them
    record(store, sid, 1, pending, tok.encode("No.<|im_end|>"))
    store.abandon_turn(sid, 1)

    fresh = [user("Hello!")]
    record(store, sid, 1, store.prepare_turn(sid, 1, fresh), tok.encode("Hi.<|im_end|>"))
    snap = store.snapshot(sid)
    assert sorted(n["id"] for n in snap["tree"]["nodes"]) == [0, 3, 5]
    assert all(not leaf["dead"] for leaf in snap["tree"]["leaves"])
    build_all_training_arrays(snap)  # still consistent

    # Above the threshold nothing is pruned.
    lazy = TitoStore(tok, drop_dead_leaves=True, gc_threshold=100)
    sid = lazy.create_session()
    messages = three_turns(lazy, tok, sid)
    record(lazy, sid, 0, lazy.prepare_turn(sid, 0, [user("New start")]), tok.encode("Ok.<|im_end|>"))
    assert lazy.num_nodes(sid) == 4

    # Kept dead leaves (the default) keep their branch.
    keep = TitoStore(tok)
    sid = keep.create_session()
    three_turns(keep, tok, sid)
    record(keep, sid, 0, keep.prepare_turn(sid, 0, [user("New start")]), tok.encode("Ok.<|im_end|>"))
    assert keep.num_nodes(sid) == 4


def test_delete_frees_the_session(tok: Tokenizer) -> None:
    store = TitoStore(tok, max_sessions=1)
    sid = store.create_session()
    three_turns(store, tok, sid)
    store.delete_session(sid)
    assert sid not in store and len(store) == 0
    with pytest.raises(SessionNotFound):
        store.snapshot(sid)
    with pytest.raises(SessionNotFound):
        store.delete_session(sid)
    assert store.create_session() != sid


def test_snapshot_shape(tok: Tokenizer) -> None:
    store = TitoStore(tok, max_trim_tokens=1)
    sid = store.create_session()
    p = store.prepare_turn(sid, 7, [user("Hello!")])
    out = tok.encode("Hi.<|im_end|>")
    store.record_turn(
        sid, 7, p, output_ids=out, output_logprobs=None, finish_reason="stop", weight_version=3,
        token_versions=[3] * len(out),
    )  # fmt: skip
    snap = store.snapshot(sid)
    assert set(snap) == {"session_id", "max_trim_tokens", "trajectories", "turns_not_exported", "tree"}
    assert snap["session_id"] == sid and snap["max_trim_tokens"] == 1 and snap["turns_not_exported"] == 0
    (traj,) = snap["trajectories"]
    assert set(traj) == {"trajectory_id", "accumulated_token_ids", "records", "final", "path_node_ids"}
    assert traj["final"] is True and traj["path_node_ids"] == [0]
    (rec,) = traj["records"]
    assert rec == {
        "prompt_token_count": len(p.prompt_ids),
        "output_logprobs": None,
        "finish_reason": "stop",
        "mismatch_report": [],
        "routed_experts": None,
        "weight_version": 3,
        "output_token_versions": [3] * len(out),
    }
    (node,) = snap["tree"]["nodes"]
    assert set(node) == {"id", "hash", "parent", "finish_reason", "truncated", "num_tokens", "trajectory_ids"}
    assert node["num_tokens"] == len(p.prompt_ids) + len(out) and node["trajectory_ids"] == [7]
    (leaf,) = snap["tree"]["leaves"]
    assert leaf == {"trajectory_id": 7, "node_id": 0, "parent": None, "path_node_ids": [0], "dead": False}


def test_a_template_that_is_not_prefix_stable_falls_back_to_a_full_tokenization(tmp_path) -> None:
    import json as _json

    from psrl.tito import TitoStore
    from psrl.tokenizer import Tokenizer, build_tiny_tokenizer

    folder = build_tiny_tokenizer(tmp_path / "tok")
    config = _json.loads((folder / "tokenizer_config.json").read_text())
    # Renders the number of messages first: every earlier turn's render changes when a message is added.
    config["chat_template"] = "{{ messages | length }}" + config["chat_template"]
    (folder / "tokenizer_config.json").write_text(_json.dumps(config))
    tok = Tokenizer.from_folder(folder)
    store = TitoStore(tok)
    sid = store.create_session()
    first = [{"role": "user", "content": "Hello there"}]
    prepared = store.prepare_turn(sid, 0, first)
    reply = tok.encode("Hi!<|im_end|>")
    store.record_turn(sid, 0, prepared, output_ids=reply, output_logprobs=[-0.5] * len(reply), finish_reason="stop")
    second = [*first, {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "more"}]
    nxt = store.prepare_turn(sid, 0, second)
    assert nxt.parent_node_id is None and nxt.reused_tokens == 0
    assert nxt.prompt_ids == tok.encode(tok.apply_chat_template(second))
    assert [m["mismatch_type"] for m in nxt.mismatch_report] == ["template_not_prefix_stable"]


def test_the_echoed_reply_picks_the_turn_that_sampled_it(tok: Tokenizer) -> None:
    """Sibling samples of one prompt, a retry, an edited reply: the echo decides which recorded ids are reused
    (the router records each turn with the reply it returned)."""
    store = TitoStore(tok)
    sid = store.create_session()
    prompt = [user("Hello there")]
    replies = {0: "The quick brown fox.", 1: "Water boils at one hundred degrees."}
    outs = {}
    for tid, text in replies.items():  # two trajectories, two different samples of the same prompt
        prepared = store.prepare_turn(sid, tid, prompt)
        outs[tid] = exact_output(tok, prompt, assistant(text))
        record(store, sid, tid, prepared, outs[tid], assistant_message=assistant(text))
    follow = [user("and then?")]
    # a third trajectory continues trajectory 0's sample: its ids, not the newest sibling's
    prepared = store.prepare_turn(sid, 2, [*prompt, assistant(replies[0]), *follow])
    assert prepared.parent_node_id == 0 and prepared.prompt_ids[: prepared.reused_tokens][-len(outs[0]) :] == outs[0]
    store.abandon_turn(sid, 2)
    # re-serialized tool-call arguments and a missing id still echo the same reply; an edited text does not
    call_reply = assistant(None, ("search", '{"q": "fox", "n": 2}'))
    prepared = store.prepare_turn(sid, 3, prompt)
    out = exact_output(tok, prompt, call_reply)
    node = record(store, sid, 3, prepared, out, assistant_message=call_reply)
    echo = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "search", "arguments": '{"n":2,"q":"fox"}'}}],
    }
    assert store.prepare_turn(sid, 3, [*prompt, echo, *follow]).parent_node_id == node
    store.abandon_turn(sid, 3)
    edited = assistant("The quick brown fox jumps.")
    prepared = store.prepare_turn(sid, 0, [*prompt, edited, *follow])
    assert prepared.parent_node_id is None and prepared.reused_tokens == 0  # no recorded turn sampled that
    assert prepared.prompt_ids == tok.encode(
        tok.apply_chat_template([*prompt, edited, *follow], add_generation_prompt=True)
    )


def test_an_end_of_turn_text_inside_the_reply_is_not_its_end(tok: Tokenizer) -> None:
    store = TitoStore(tok)
    sid = store.create_session()
    prompt = [user("How does ChatML end a message?")]
    text = f"Each message ends with {EOT} and a newline."
    prepared = store.prepare_turn(sid, 0, prompt)
    out = [*tok.encode(text), tok.token_to_id(EOT)]
    record(store, sid, 0, prepared, out, assistant_message=assistant(text))
    follow = [user("Thanks")]
    prepared = store.prepare_turn(sid, 0, [*prompt, assistant(text), *follow])
    assert prepared.parent_node_id == 0 and prepared.prompt_ids[: prepared.reused_tokens][-len(out) :] == out
    full = tok.apply_chat_template([*prompt, assistant(text), *follow], add_generation_prompt=True)
    suffix = full.split(f"{text}{EOT}", 1)[1]  # what follows the whole reply, not its inner end-of-turn text
    assert tok.decode(prepared.prompt_ids[prepared.reused_tokens :], skip_special_tokens=False) == suffix
