"""Scripted agents, one per history pattern real clients have, through the SessionRouter with the official openai
client (real reference replicas + router + `python -m psrl.session`): an agent that keeps its replies, one that
drops its reply on errors (mini-swe-agent 2.x), one that rewrites earlier turns and retries, one that streams,
and one that uses tools. For each, every turn the model sampled is in the training data, exactly: the snapshot
exports each branch of the session's tree, and in build_all_training_arrays the mask-1 ids of every turn are
the ids the model sampled (replayed on the replica), with their log-probs, after the prompt the model received.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from _procs import Proc, start_named_replicas, start_router, start_session_router
from session._agent_model import LOOKUP_TOOL, TOOL_NAME, AgentModel, build_agent_model_folder

from psrl.gateway.processes import stop_processes
from psrl.tito import build_all_training_arrays, build_training_arrays
from psrl.tokenizer import Tokenizer

PLAIN, TOOLS = "tiny", "agent"  # served model names: the tiny random model, the scripted tool-calling one
MAX_TOKENS = 8
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


@dataclass
class Call:
    """One model call as the agent made and saw it."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    content: str | None
    tool_calls: list[dict[str, Any]]  # as the agent echoes them: {id, type, function: {name, arguments}}
    finish_reason: str
    usage: dict[str, Any] | None
    logprobs: list[tuple[str, float]] | None  # (token text, log-prob) per sampled token, as the client got them

    def reply(self) -> dict[str, Any]:
        """The assistant message an agent that keeps its reply appends."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


@dataclass
class Agent:
    """An OpenAI-client agent on one session; it keeps every call it made."""

    client: openai.OpenAI
    model: str = PLAIN
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    calls: list[Call] = field(default_factory=list)

    def chat(self, messages: list[dict[str, Any]], *, stream: bool | None = None) -> Call:
        kw: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        kw["logprobs"] = True  # to compare what the client got with what was recorded
        if self.tools:
            kw["tools"] = self.tools
        sent = copy.deepcopy(messages)
        if self.stream if stream is None else stream:
            call = self._streamed(sent, kw)
        else:
            completion = self.client.chat.completions.create(**kw)
            choice = completion.choices[0]
            calls = [
                {"id": c.id, "type": "function", "function": c.function.model_dump()}
                for c in choice.message.tool_calls or []
            ]
            entries = choice.logprobs.content if choice.logprobs else None
            call = Call(
                self.model,
                sent,
                self.tools,
                choice.message.content,
                calls,
                choice.finish_reason,
                completion.usage.model_dump() if completion.usage else None,
                None if entries is None else [(e.token, e.logprob) for e in entries],
            )
        self.calls.append(call)
        return call

    def _streamed(self, sent: list[dict[str, Any]], kw: dict[str, Any]) -> Call:
        content, calls, entries = "", {}, []
        finish, usage, saw_logprobs = None, None, False
        for chunk in self.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"id": "", "type": "function", "name": "", "arguments": ""})
                    call["id"] += delta.id or ""
                    if delta.function is not None:
                        call["name"] += delta.function.name or ""
                        call["arguments"] += delta.function.arguments or ""
                if choice.logprobs is not None and choice.logprobs.content is not None:
                    saw_logprobs = True
                    entries += [(e.token, e.logprob) for e in choice.logprobs.content]
                finish = choice.finish_reason or finish
        tool_calls = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())
        ]
        assert finish is not None
        return Call(
            self.model, sent, self.tools, content or None, tool_calls, finish, usage, entries if saw_logprobs else None
        )


@dataclass
class Stack:
    session_url: str
    router_url: str
    router: Proc
    tokenizers: dict[str, Tokenizer]
    agent_model: AgentModel
    replica_urls: list[str]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    agent_model = build_agent_model_folder(tmp_path_factory.mktemp("agent-model"))
    folders = {PLAIN: model_dir, TOOLS: agent_model.path}
    procs = []
    try:
        replicas = start_named_replicas(folders, log_dir, procs)
        # The router's TITO defaults: what a user gets without asking for anything.
        router = start_router(log_dir, [r.url for r in replicas])
        procs.insert(0, router.proc)
        session = start_session_router(log_dir, router.url)
        procs.insert(0, session.proc)
        tokenizers = {name: Tokenizer.from_folder(folder) for name, folder in folders.items()}
        yield Stack(session.url, router.url, router, tokenizers, agent_model, [r.url for r in replicas])
    finally:
        stop_processes(procs)


def _session(session_url: str) -> tuple[str, openai.OpenAI]:
    r = httpx.post(f"{session_url}/sessions")
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    client = openai.OpenAI(base_url=f"{session_url}/sessions/{sid}/v1", api_key="x", max_retries=0, timeout=120)
    return sid, client


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _turns_not_exported(router_url: str) -> dict[str, float]:
    text = httpx.get(f"{router_url}/metrics").text
    pattern = r'^psrl_router_tito_turns_not_exported_total\{reason="(\w+)"\} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


# --- the check every agent gets ------------------------------------------------------------------------------


def assert_every_turn_is_exact(stack: Stack, session_url: str, sid: str, calls: list[Call]) -> dict[str, Any]:
    """Every call is one sampled turn of the snapshot's exported branches, exact in build_all_training_arrays;
    returns the snapshot."""
    r = httpx.get(f"{session_url}/sessions/{sid}")
    assert r.status_code == 200, r.text
    snap: dict[str, Any] = r.json()
    entries = snap["trajectories"]
    every = build_all_training_arrays(snap)
    assert len(every) == len(entries)
    by_path = {a.path_node_ids: a for a in every}
    assert len(by_path) == len(entries)  # one sample per branch
    assert sum(e["final"] for e in entries) == len({e["trajectory_id"] for e in entries})

    turns: dict[int, tuple[list[int], list[int], list[float], dict[str, Any]]] = {}
    parents: dict[int, int | None] = {}
    for entry in entries:
        arrays = by_path[tuple(entry["path_node_ids"])]
        acc = entry["accumulated_token_ids"]
        full = np.concatenate([arrays.prompt_ids, arrays.response_ids]).tolist()
        assert full == acc[: len(full)]
        offset, masked = len(arrays.prompt_ids), 0
        path = entry["path_node_ids"]
        for depth, (node, rec) in enumerate(zip(path, entry["records"], strict=True)):
            parents[node] = path[depth - 1] if depth else None
            out = [tid for _, tid in rec["output_logprobs"]]
            lps = [lp for lp, _ in rec["output_logprobs"]]
            start = rec["prompt_token_count"]
            # The turn's sampled ids sit right after its prompt, masked 1, with their own log-probs.
            assert full[start : start + len(out)] == out
            window = slice(start - offset, start - offset + len(out))
            assert (arrays.response_mask[window] == 1).all()
            assert np.array_equal(arrays.rollout_logprobs[window], np.float32(lps))
            masked += len(out)
            turns.setdefault(node, (acc[:start], out, lps, rec))
        assert int(arrays.response_mask.sum()) == masked  # nothing else is masked 1
        assert (arrays.rollout_logprobs[arrays.response_mask == 0] == 0).all()

    # Node ids count recorded turns: one per call, in order, each in some exported branch.
    assert sorted(turns) == list(range(len(calls))), "a sampled turn is in no exported trajectory"
    with httpx.Client(base_url=stack.router_url, timeout=120) as http:
        for k, call in enumerate(calls):
            prompt, out, lps, rec = turns[k]
            tok = stack.tokenizers[call.model]
            assert_prompt_is_what_the_model_received(tok, calls, turns, k, parents[k])
            if call.usage is not None:
                assert (call.usage["prompt_tokens"], call.usage["completion_tokens"]) == (len(prompt), len(out))
            assert rec["finish_reason"] == ("stop" if call.finish_reason == "tool_calls" else call.finish_reason)
            if call.logprobs is not None:  # what the client got, token for token
                assert call.logprobs == [(tok.decode([i], skip_special_tokens=False), lp) for i, lp in zip(out, lps)]
            if call.tool_calls:
                expected = [{"q": stack.agent_model.query}]
                assert [json.loads(c["function"]["arguments"]) for c in call.tool_calls] == expected
                assert out == stack.agent_model.chain
            else:
                assert tok.decode(out).strip() == (call.content or "").strip()
            # The ids are what the model samples after exactly that prompt: a greedy replay on the replica.
            body = {
                "model": call.model,
                "input_ids": prompt,
                "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS},
                "return_logprob": True,
            }
            replay = http.post("/generate", json=body)
            assert replay.status_code == 200, replay.text
            assert replay.json()["output_ids"] == out, f"call {k}"
            for (lp_replay, _), lp in zip(replay.json()["meta_info"]["output_token_logprobs"], lps):
                assert math.isclose(lp_replay, lp, rel_tol=1e-3, abs_tol=1e-5), f"call {k}"
    return snap


def assert_prompt_is_what_the_model_received(
    tok: Tokenizer,
    calls: list[Call],
    turns: dict[int, tuple[list[int], list[int], list[float], dict[str, Any]]],
    k: int,
    parent: int | None,
) -> None:
    """Turn k's prompt is the conversation the agent sent: at a new root, the template's render, tokenized; after
    an earlier turn, that turn's exact ids (prompt and sampled, never re-tokenized) and then only the template's
    text after its reply (the reply as the model sampled it, not as the template would render it), tokenized."""
    call, prompt = calls[k], turns[k][0]
    full = tok.apply_chat_template(call.messages, tools=call.tools)
    if parent is None:
        assert prompt == tok.encode(full), f"call {k}"
        return
    parent_prompt, parent_out = turns[parent][0], turns[parent][1]
    reused = parent_prompt + parent_out
    assert prompt[: len(reused)] == reused, f"call {k}"
    base = tok.apply_chat_template(calls[parent].messages, tools=calls[parent].tools)
    assert full.startswith(base), f"call {k}"
    eot = "<|im_end|>"
    end = full.index(eot, len(base))  # the end of the reply as the template renders it
    ended = bool(parent_out) and tok.decode(parent_out[-1:], skip_special_tokens=False) == eot
    rest = full[end + len(eot) :] if ended else full[end:]  # a cut reply gets the template's own end-of-turn
    assert prompt[len(reused) :] == tok.encode(rest), f"call {k}"


def _branches(snap: dict[str, Any]) -> list[tuple[int, bool, list[int]]]:
    return [(e["trajectory_id"], e["final"], e["path_node_ids"]) for e in snap["trajectories"]]


# --- the agents ----------------------------------------------------------------------------------------------


def keeps_its_replies(agent: Agent) -> None:
    """A plain chat agent: every reply stays in the history."""
    messages = [SYSTEM, user("Hello! How are you today?")]
    for i in range(4):
        call = agent.chat(messages)
        messages += [call.reply(), user(f"Tell me more, part {i}.")]


def drops_its_reply_on_errors(agent: Agent) -> None:
    """mini-swe-agent 2.x: a reply it cannot parse is dropped and only the error message is appended; a reply it
    can parse (here: every third, by script) stays, with the command's output."""
    messages = [SYSTEM, user("Create a file hello.txt that contains the word hello.")]
    for k in range(6):
        call = agent.chat(messages)
        if k % 3 == 2:
            messages += [call.reply(), user(f"<returncode>0</returncode><output>step {k}</output>")]
        else:
            messages += [user(f"Format error {k}: reply with exactly one bash code block.")]


def rewrites_earlier_turns(agent: Agent) -> None:
    """Edits its second question and goes on from there, retries a turn with the same prompt, then restarts with
    another system prompt."""
    messages = [SYSTEM, user("What is the weather in Paris?")]
    first = agent.chat(messages)
    messages += [first.reply(), user("And in the east?")]
    second = agent.chat(messages)
    agent.chat([*messages, second.reply(), user("And in the west?")])
    edited = [*messages[:3], user("And in one short paragraph?")]
    rewritten = agent.chat(edited)
    edited += [rewritten.reply(), user("Why?")]
    agent.chat(edited)
    agent.chat(edited)  # the same prompt again: a retry
    agent.chat([{"role": "system", "content": "You answer step by step."}, *messages[1:2]])


def uses_tools(agent: Agent) -> None:
    """Tool calls and tool results in the history; every other turn streamed."""
    messages = [SYSTEM, user("Look the word up, again and again.")]
    for i in range(4):
        call = agent.chat(messages, stream=i % 2 == 1)
        assert call.finish_reason == "tool_calls" and call.content is None
        [tool_call] = call.tool_calls
        assert tool_call["function"]["name"] == TOOL_NAME
        messages += [call.reply(), {"role": "tool", "tool_call_id": tool_call["id"], "content": f"Result {i}."}]


AGENTS: dict[str, tuple[Callable[[Agent], None], dict[str, Any], list[tuple[int, bool, list[int]]]]] = {
    # name: (script, Agent options, the branches its history pattern makes: (trajectory id, final, path))
    "keeps-replies": (keeps_its_replies, {}, [(0, True, [0, 1, 2, 3])]),
    "drops-reply-on-errors": (
        drops_its_reply_on_errors,
        {},
        [(0, True, [2, 5]), (0, False, [0]), (0, False, [1]), (0, False, [2, 3]), (0, False, [2, 4])],
    ),
    "rewrites-earlier-turns": (
        rewrites_earlier_turns,
        {},
        [(0, True, [6]), (0, False, [0, 1, 2]), (0, False, [0, 3, 4]), (0, False, [0, 3, 5])],
    ),
    "streams": (keeps_its_replies, {"stream": True}, [(0, True, [0, 1, 2, 3])]),
    "uses-tools": (uses_tools, {"model": TOOLS, "tools": [LOOKUP_TOOL]}, [(0, True, [0, 1, 2, 3])]),
}


@pytest.mark.parametrize("name", list(AGENTS))
def test_every_sampled_turn_of_the_agent_is_exact_training_data(stack: Stack, name: str) -> None:
    script, options, branches = AGENTS[name]
    sid, client = _session(stack.session_url)
    agent = Agent(client, **options)
    script(agent)
    if agent.stream:  # the streamed replies carried their log-probs, so the check compares them too
        assert all(call.logprobs for call in agent.calls)
    snap = assert_every_turn_is_exact(stack, stack.session_url, sid, agent.calls)
    assert _branches(snap) == branches
    assert snap["turns_not_exported"] == 0
    final = build_training_arrays(snap)  # the single-trajectory call: the agent's final history
    assert final.final and list(final.path_node_ids) == branches[0][2]
    assert httpx.delete(f"{stack.session_url}/sessions/{sid}").status_code == 204
    assert _turns_not_exported(stack.router_url) == {"dropped_branch": 0, "session_expired": 0}


def test_dropping_branches_is_the_users_choice_and_is_counted(stack: Stack, log_dir: Path) -> None:
    router = start_router(log_dir, stack.replica_urls, args=["--tito-drop-dead-leaves"])
    procs = [router.proc]
    try:
        session = start_session_router(log_dir, router.url)
        procs.insert(0, session.proc)
        sid, client = _session(session.url)
        agent = Agent(client)
        drops_its_reply_on_errors(agent)
        snap = httpx.get(f"{session.url}/sessions/{sid}").json()
        # Only the final history is left; the four turns the agent's drops left behind are gone, and counted.
        assert _branches(snap) == [(0, True, [2, 5])] and snap["turns_not_exported"] == 4
        assert _turns_not_exported(router.url) == {"dropped_branch": 4, "session_expired": 0}
        lines = [line for line in router.log_text().splitlines() if "in no exported trajectory" in line]
        assert len(lines) == 4 and all(sid in line and "1 sampled turns" in line for line in lines)
    finally:
        stop_processes(procs)
