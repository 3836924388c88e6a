"""A 10-turn tool-using agent through the SessionRouter (real replica + router + `python -m psrl.session`) with
the official openai client, on a scripted checkpoint (tests/session/_agent_model.py) that answers every turn
with a tool call whose sampled ids the tokenizer would not reproduce from the text.

What the trainer gets from the session (build_training_arrays) must be exactly what the model sampled: the ids,
their log-probs (checked against a replay on the replica), and mask 0 for everything the environment added.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from _procs import start_replica, start_router, start_session_router

from psrl.gateway.processes import stop_processes
from psrl.tito import build_training_arrays
from psrl.tokenizer import Tokenizer

from ._agent_model import LOOKUP_TOOL, TOOL_NAME, AgentModel, build_agent_model_folder

TURNS = 10
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


@dataclass
class Stack:
    session_url: str
    router_url: str
    model_name: str
    agent: AgentModel
    tok: Tokenizer


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[Stack]:
    agent = build_agent_model_folder(tmp_path_factory.mktemp("agent-model"))
    replica = start_replica(agent.path, log_dir)
    procs = [replica.proc]
    try:
        # Dead leaves kept, so a history rewrite on the same trajectory leaves the old branch in the tree.
        router = start_router(log_dir, [replica.url], args=["--no-tito-drop-dead-leaves"])
        procs.insert(0, router.proc)
        session = start_session_router(log_dir, router.url)
        procs.insert(0, session.proc)
        name = httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"]
        yield Stack(session.url, router.url, name, agent, Tokenizer.from_folder(agent.path))
    finally:
        stop_processes(procs)


def _client(stack: Stack, sid: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.session_url}/sessions/{sid}/v1", api_key="x", max_retries=0, timeout=60)


def _tool_turn(stack: Stack, client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> tuple[Any, Any]:
    """One assistant turn; checks it is the scripted lookup call and returns (choice, the call)."""
    completion = client.chat.completions.create(
        model=stack.model_name, messages=messages, tools=[LOOKUP_TOOL], max_tokens=16, temperature=0, **kw
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == TOOL_NAME
    assert json.loads(call.function.arguments) == {"q": stack.agent.query}
    assert completion.usage.completion_tokens == len(stack.agent.chain)
    return choice, call


def _assistant(call: Any) -> dict[str, Any]:
    fn = {"name": call.function.name, "arguments": call.function.arguments}
    return {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": fn}]}


def _tool(call: Any, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call.id, "content": text}


def _sampled(trajectory: dict[str, Any]) -> list[int]:
    return [tid for rec in trajectory["records"] for _, tid in rec["output_logprobs"]]


def test_ten_turn_tool_agent_records_exactly_the_sampled_ids(stack: Stack) -> None:
    agent, tok = stack.agent, stack.tok
    chain = agent.chain
    r = httpx.post(f"{stack.session_url}/sessions")
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    client = _client(stack, sid)
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Look the word up, again and again."}]
    results: list[str] = []
    client_logprobs: list[list[float]] = []
    for turn in range(TURNS):
        choice, call = _tool_turn(stack, client, messages, logprobs=True)
        # Asked for: one entry per sampled token, texts of the chain ids (the session forces none).
        entries = choice.logprobs.content
        assert [e.token for e in entries] == [tok.decode([i], skip_special_tokens=False) for i in chain]
        client_logprobs.append([e.logprob for e in entries])
        results.append(f"Result {turn}: the word {agent.query!r} is listed {turn + 1} times.")
        messages += [_assistant(call), _tool(call, results[-1])]

    r = httpx.get(f"{stack.session_url}/sessions/{sid}")
    assert r.status_code == 200 and r.headers["x-base-worker-id"]
    snap = r.json()
    [trajectory] = snap["trajectories"]
    acc: list[int] = trajectory["accumulated_token_ids"]
    records = trajectory["records"]
    assert len(records) == TURNS
    assert all(rec["finish_reason"] == "stop" for rec in records)

    # --- the training arrays ---
    arrays = build_training_arrays(snap)
    assert arrays.num_turns == TURNS
    first_prompt = tok.encode(tok.apply_chat_template(messages[:2], tools=[LOOKUP_TOOL]))
    assert arrays.prompt_ids.tolist() == acc[: records[0]["prompt_token_count"]] == first_prompt
    assert len(arrays.prompt_ids) + len(arrays.response_ids) == len(acc)  # the last turn's output ends acc
    assert np.array_equal(np.concatenate([arrays.prompt_ids, arrays.response_ids]), acc)
    mask = arrays.response_mask == 1
    assert arrays.response_ids[mask].tolist() == chain * TURNS
    lps = arrays.rollout_logprobs[mask]
    assert len(lps) == len(chain) * TURNS and np.isfinite(lps).all() and (lps < 0).all()
    assert np.allclose(lps, agent.chain_logprob, rtol=1e-2, atol=0)  # near 0 by the margin, but real numbers
    # The client saw the same log-probs the record holds (both are the replica's floats, JSON round-tripped).
    assert [[lp for lp, _ in rec["output_logprobs"]] for rec in records] == client_logprobs
    assert np.array_equal(lps, np.float32([lp for turn_lps in client_logprobs for lp in turn_lps]))

    # Environment tokens: between one turn's output and the next prompt's end, mask 0, logprob 0.
    env = ~mask
    assert (arrays.rollout_logprobs[env] == 0).all()
    expected_env: list[int] = []
    for i in range(1, TURNS):
        start = records[i - 1]["prompt_token_count"] + len(chain)
        segment = acc[start : records[i]["prompt_token_count"]]
        text = tok.decode(segment, skip_special_tokens=False)
        # the template's end of the assistant turn, the tool result, the next generation prompt
        assert text.startswith("\n<|im_start|>user\n<tool_response>\n" + results[i - 1])
        assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
        expected_env += segment
    assert arrays.response_ids[env].tolist() == expected_env
    assert int(env.sum()) == len(acc) - len(first_prompt) - len(chain) * TURNS

    # --- the counterfactual: the ids are not recoverable from text ---
    sampled_text = tok.decode(chain)
    assert sampled_text == f'<tool_call>{{"name": "{TOOL_NAME}", "arguments": {{"q": "{agent.query}"}}}}</tool_call>'
    retokenized = tok.encode(sampled_text + "<|im_end|>")
    assert retokenized != chain and agent.merged_id in retokenized
    # Re-rendering the whole conversation through the template and tokenizing it gives other ids again.
    rerendered = tok.encode(tok.apply_chat_template(messages[:-1], tools=[LOOKUP_TOOL], add_generation_prompt=False))
    assert rerendered != acc
    # Same first prompt and <tool_call>; then the template writes "\n" where the model sampled J1.
    assert rerendered[: len(first_prompt) + 1] == first_prompt + chain[:1]
    assert tok.decode(rerendered[len(first_prompt) + 1 : len(first_prompt) + 2]) == "\n" != tok.decode(chain[1:2])

    # --- replay each record's prompt on the replica (greedy) and compare ids and log-probs ---
    with httpx.Client(base_url=stack.router_url, timeout=60) as http:
        for i, rec in enumerate(records):
            body = {
                "model": stack.model_name,
                "input_ids": acc[: rec["prompt_token_count"]],
                "sampling_params": {"temperature": 0, "max_new_tokens": 16},
                "return_logprob": True,
            }
            r = http.post("/generate", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["output_ids"] == chain, f"turn {i}"
            replay = out["meta_info"]["output_token_logprobs"]
            assert [int(t) for _, t in replay] == [t for _, t in rec["output_logprobs"]] == chain
            for (lp_replay, _), (lp_rec, _) in zip(replay, rec["output_logprobs"]):
                assert math.isfinite(lp_rec) and math.isclose(lp_replay, lp_rec, rel_tol=1e-3, abs_tol=1e-7)

    assert httpx.delete(f"{stack.session_url}/sessions/{sid}").status_code == 204
    assert httpx.get(f"{stack.session_url}/sessions/{sid}").status_code == 404


def test_history_rewrite_branches_and_keeps_the_old_trajectory(stack: Stack) -> None:
    """An agent that edits an earlier user message continues from the last shared turn: a new branch of the
    session's tree, on another trajectory id or on the same one, while what was recorded stays as it was."""
    tok, chain = stack.tok, stack.agent.chain
    sid = httpx.post(f"{stack.session_url}/sessions").json()["session_id"]
    client = _client(stack, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Look one word up."}]
    calls = []
    for i in range(3):
        _, call = _tool_turn(stack, client, messages)
        calls.append(call)
        messages += [_assistant(call), _tool(call, f"result {i}")]
        if i == 0:
            messages.append({"role": "user", "content": "Now another word."})
    before = httpx.get(f"{stack.session_url}/sessions/{sid}").json()
    [old] = before["trajectories"]
    assert len(old["records"]) == 3 and [n["id"] for n in before["tree"]["nodes"]] == [0, 1, 2]

    # Trajectory 1 edits the second user message: it continues trajectory 0's first turn (node 0).
    edited = [*messages[:3], {"role": "user", "content": "Now a different word."}]
    _tool_turn(stack, client, edited, extra_headers={"x-smg-tito-trajectory-id": "1"})
    snap = httpx.get(f"{stack.session_url}/sessions/{sid}").json()
    assert [t["trajectory_id"] for t in snap["trajectories"]] == [0, 1]
    assert snap["trajectories"][0] == old  # the old trajectory, records and ids, unchanged
    nodes = {n["id"]: n for n in snap["tree"]["nodes"]}
    assert nodes[0]["trajectory_ids"] == [0, 1] and nodes[3]["parent"] == 0 and nodes[3]["trajectory_ids"] == [1]
    leaves = {(leaf["trajectory_id"], leaf["dead"]): leaf["path_node_ids"] for leaf in snap["tree"]["leaves"]}
    assert leaves == {(0, False): [0, 1, 2], (1, False): [0, 3]}
    branch = snap["trajectories"][1]
    n0 = old["records"][0]["prompt_token_count"] + len(chain)
    assert branch["accumulated_token_ids"][:n0] == old["accumulated_token_ids"][:n0]  # shared ids, not re-tokenized
    arrays = build_training_arrays(snap, trajectory_id=1)
    assert arrays.num_turns == 2 and arrays.response_ids[arrays.response_mask == 1].tolist() == chain * 2
    env_text = tok.decode(arrays.response_ids[arrays.response_mask == 0].tolist())
    assert "Now a different word." in env_text and "Now another word." not in env_text

    # The same edit on trajectory 0 itself: its leaf moves to the new branch, the old one stays as a dead leaf.
    edited = [*messages[:3], {"role": "user", "content": "Now a third word."}]
    _tool_turn(stack, client, edited)
    after = httpx.get(f"{stack.session_url}/sessions/{sid}").json()
    nodes_after = {n["id"]: n for n in after["tree"]["nodes"]}
    for node in before["tree"]["nodes"]:
        assert {k: v for k, v in nodes_after[node["id"]].items() if k != "trajectory_ids"} == {
            k: v for k, v in node.items() if k != "trajectory_ids"
        }
    leaves = {(leaf["trajectory_id"], leaf["dead"]): leaf["path_node_ids"] for leaf in after["tree"]["leaves"]}
    assert leaves == {(0, False): [0, 4], (0, True): [0, 1, 2], (1, False): [0, 3]}
    # Each branch is exported: trajectory 0's final history, the branch its rewrite left behind, trajectory 1.
    traj0, left, traj1 = after["trajectories"]
    assert (left["trajectory_id"], left["final"], left["path_node_ids"]) == (0, False, [0, 1, 2])
    assert left["records"] == old["records"] and left["accumulated_token_ids"] == old["accumulated_token_ids"]
    assert traj1 == branch
    assert traj0["records"][0] == old["records"][0] and len(traj0["records"]) == 2
    assert _sampled(traj0) == chain * 2
    assert httpx.delete(f"{stack.session_url}/sessions/{sid}").status_code == 204


def test_streamed_tool_calls_on_the_router_in_all_three_apis(stack: Stack) -> None:
    """Streaming straight from the router (no SessionRouter): the call is parsed out of the stream as it is
    generated, on chat, Responses and Messages alike, and equals the non-streamed parse."""
    agent = stack.agent
    expected_args = {"q": agent.query}
    messages = [SYSTEM, {"role": "user", "content": "Look the word up."}]
    kw: dict[str, Any] = {"model": stack.model_name, "temperature": 0}
    client = openai.OpenAI(base_url=f"{stack.router_url}/v1", api_key="x", max_retries=0, timeout=60)

    chunks = list(
        client.chat.completions.create(
            messages=messages, tools=[LOOKUP_TOOL], max_tokens=16, logprobs=True, stream=True, **kw
        )
    )
    calls = [c for ch in chunks for c in ch.choices[0].delta.tool_calls or []]
    assert [(c.index, c.type, c.function.name) for c in calls] == [(0, "function", TOOL_NAME)]
    assert json.loads(calls[0].function.arguments) == expected_args and calls[0].id.startswith("call_")
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)  # the call's text is not content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    entries = [e for ch in chunks for e in (ch.choices[0].logprobs.content if ch.choices[0].logprobs else [])]
    assert len(entries) == len(agent.chain)  # every sampled token's log-prob, also those of the call

    tools = [{"type": "function", "name": TOOL_NAME, "parameters": LOOKUP_TOOL["function"]["parameters"]}]
    plain = client.responses.create(input=messages[1:], instructions=SYSTEM["content"], tools=tools, **kw)
    with client.responses.stream(input=messages[1:], instructions=SYSTEM["content"], tools=tools, **kw) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" not in kinds
    for response in (plain, final):
        [item] = response.output
        assert item.type == "function_call" and item.name == TOOL_NAME
        assert json.loads(item.arguments) == expected_args
    assert final.usage.output_tokens == len(agent.chain) and final.status == "completed"

    claude = anthropic.Anthropic(base_url=stack.router_url, api_key="x", max_retries=0, timeout=60)
    anthropic_tools = [{"name": TOOL_NAME, "input_schema": LOOKUP_TOOL["function"]["parameters"]}]
    body: dict[str, Any] = {"model": stack.model_name, "max_tokens": 16, "system": SYSTEM["content"]}
    body |= {"messages": messages[1:], "tools": anthropic_tools, "extra_body": {"temperature": 0}}
    with claude.messages.stream(**body) as s:
        message = s.get_final_message()
    [block] = message.content
    assert block.type == "tool_use" and block.name == TOOL_NAME and block.input == expected_args
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == len(agent.chain)
    assert message.usage.input_tokens > 0
