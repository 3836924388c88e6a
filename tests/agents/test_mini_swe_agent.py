"""The PyPI mini-swe-agent itself through the SessionRouter: every model call it makes is a training turn.

A pinned mini-swe-agent runs as its `mini` command builds it (DefaultAgent, LocalEnvironment, LitellmModel with
the bundled mini.yaml), in a child process (tests/agents/_mini_swe.py) with a throwaway working folder, a step
limit and no network: litellm's OpenAI provider talks only to the session URL on 127.0.0.1. On the tiny
reference model every reply is junk, so every step is a format error, and mini-swe-agent 2.x then drops its own
reply from the history and appends only the error message: each call starts a new branch of the session's tree.
None of those sampled turns may be lost: the snapshot exports each branch, and build_training_arrays gives each
call's sampled ids (mask 1) after the exact prompt the model received.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from _procs import start_replica, start_router, start_session_router
from prometheus_client.parser import text_string_to_metric_families

from psrl.gateway.processes import stop_processes
from psrl.tito import build_all_training_arrays, build_training_arrays
from psrl.tito.training import TrainingArrays
from psrl.tokenizer import Tokenizer

from ._mini_swe import Spec

pytestmark = pytest.mark.slow

MINI_SWE_AGENT = "2.4.6"  # the version users run, pinned: the format-error history pattern is 2.x's
STEP_LIMIT = 8  # model calls; the prompts grow from ~2.2k to ~3.2k tokens, inside the tiny model's 4096
MAX_TOKENS = 12
DRIVER = Path(__file__).with_name("_mini_swe.py")
# mini-swe-agent's one tool (minisweagent.models.utils.actions_toolcall.BASH_TOOL), sent with every call.
BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Execute a bash command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command to execute"}},
            "required": ["command"],
        },
    },
}


@dataclass
class Stack:
    session_url: str
    router_url: str
    model_name: str


@pytest.fixture(scope="module")
def stack(model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    try:
        installed = version("mini-swe-agent")
    except PackageNotFoundError:
        installed = None
    assert installed == MINI_SWE_AGENT, f"pip install mini-swe-agent=={MINI_SWE_AGENT} (found {installed})"
    replica = start_replica(model_dir, log_dir)
    procs = [replica.proc]
    try:
        # The router's TITO defaults: what a user gets without asking for anything.
        router = start_router(log_dir, [replica.url])
        procs.insert(0, router.proc)
        session = start_session_router(log_dir, router.url)
        procs.insert(0, session.proc)
        name = httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"]
        yield Stack(session.url, router.url, name)
    finally:
        stop_processes(procs)


def _run_agent(spec: Spec, tmp_path: Path) -> dict[str, Any]:
    """One mini-swe-agent run in a child process; what it saw (see _mini_swe.run)."""
    spec_file, out_file = tmp_path / "spec.json", tmp_path / "out.json"
    spec_file.write_text(json.dumps(asdict(spec)))
    proxies = {"http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"}
    env = {k: v for k, v in os.environ.items() if k not in proxies}
    # Its global config (.env) and anything written under ~ stay in the throwaway folder.
    env |= {"MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mswea-config"), "HOME": str(tmp_path / "home")}
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(spec_file), str(out_file)],
        cwd=spec.cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out_file.exists(), f"driver exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(out_file.read_text())
    assert proc.returncode == 0 and "error" not in result, result.get("error") or proc.stderr[-4000:]
    return result


def _metric(router_url: str, family_name: str, **labels: str) -> float | None:
    """The router's counter `family_name` summed over the samples with these labels (None: no such family)."""
    for family in text_string_to_metric_families(httpx.get(f"{router_url}/metrics").text):
        if family.name == family_name:
            return sum(
                s.value for s in family.samples if s.name.endswith("_total") and labels.items() <= s.labels.items()
            )
    return None


def _chat_completions(router_url: str) -> float:
    """Chat completions the router answered 200 (each SessionRouter turn is one)."""
    return _metric(router_url, "psrl_router_requests", route="/v1/chat/completions", status="200") or 0.0


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's text as the router writes it in a chat logprobs entry."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _sampled_runs(arrays: TrainingArrays) -> list[tuple[list[int], list[float]]]:
    """The response's maximal runs of mask 1, in order: one per turn that sampled any token."""
    mask = arrays.response_mask.astype(bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
    return [
        (arrays.response_ids[a:b].tolist(), arrays.rollout_logprobs[a:b].tolist())
        for a, b in zip(edges[::2], edges[1::2])
    ]


def _same_arrays(a: TrainingArrays, b: TrainingArrays) -> bool:
    return all(
        np.array_equal(getattr(a, f), getattr(b, f))
        for f in ("prompt_ids", "response_ids", "response_mask", "rollout_logprobs", "token_versions")
    ) and (a.num_turns, a.finish_reason) == (b.num_turns, b.finish_reason)


def test_every_model_call_of_mini_swe_agent_is_a_training_turn(
    stack: Stack, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    sid = httpx.post(f"{stack.session_url}/sessions").json()["session_id"]
    before = _chat_completions(stack.router_url)
    spec = Spec(
        session_base_url=f"{stack.session_url}/sessions/{sid}/v1",
        model_name=stack.model_name,
        cwd=str(work),
        task="Create a file hello.txt that contains the word hello.",
        step_limit=STEP_LIMIT,
        max_tokens=MAX_TOKENS,
    )
    result = _run_agent(spec, tmp_path)

    # --- the agent's side: STEP_LIMIT calls, each a format error, nothing but loopback reached ---
    assert result["blocked"] == [], "the agent tried to reach the network"
    assert result["exit_status"] == "LimitsExceeded"
    calls = result["calls"]
    assert result["n_calls"] == len(calls) == STEP_LIMIT
    history = result["history"]
    answered = [m for m in history if "response" in m.get("extra", {})]
    assert [m["extra"]["response"]["id"] for m in answered] == [c["response"]["id"] for c in calls]
    # The pattern under test: each reply is dropped and only the error message stays in the history, so each
    # call resends the previous one's messages plus one user message, and never the model's reply.
    assert all(m["role"] == "user" and m["extra"]["interrupt_type"] == "FormatError" for m in answered)
    assert not any(m["role"] == "assistant" for m in history)
    for previous, call in itertools.pairwise(calls):
        assert call["messages"][:-1] == previous["messages"] and call["messages"][-1]["role"] == "user"
    assert list(work.iterdir()) == []  # no command ran: the junk never parsed as a bash call

    # --- the router's side: every call came through the session as one chat completion ---
    assert _chat_completions(stack.router_url) - before == STEP_LIMIT

    # --- the snapshot: every call is a sampled turn of an exported branch ---
    r = httpx.get(f"{stack.session_url}/sessions/{sid}")
    assert r.status_code == 200, r.text
    snap = r.json()
    branches = snap["trajectories"]
    exported = {node for b in branches for node in b["path_node_ids"]}
    assert len(exported) == STEP_LIMIT, f"{STEP_LIMIT} model calls, {len(exported)} sampled turns exported"
    assert snap["turns_not_exported"] == 0
    assert _metric(stack.router_url, "psrl_router_tito_turns_not_exported") == 0
    # Each call started its own branch (its reply was dropped), so no two branches share a turn.
    listed = [node for b in branches for node in b["path_node_ids"]]
    assert len(listed) == len(set(listed))
    assert all(len(b["records"]) == len(b["path_node_ids"]) == 1 for b in branches)
    assert [b["final"] for b in branches].count(True) == 1  # one agent, one trajectory id: one final history

    # --- the training arrays: one sample per branch; each call's sampled ids are its turn's mask-1 run ---
    samples = build_all_training_arrays(snap)
    assert len(samples) == len(branches) == STEP_LIMIT
    assert sum(a.num_turns for a in samples) == STEP_LIMIT
    turn_of: dict[tuple, tuple[TrainingArrays, int]] = {}  # (prompt ids, sampled (text, logprob)s) -> sample, turn
    for a in samples:
        runs = _sampled_runs(a)
        assert len(runs) == a.num_turns == len(a.records) == len(a.path_node_ids)
        sequence = np.concatenate([a.prompt_ids, a.response_ids]).tolist()
        for k, (rec, (ids, lps)) in enumerate(zip(a.records, runs)):
            assert ids == [tid for _, tid in rec["output_logprobs"]]
            assert np.array_equal(np.float32(lps), np.float32([lp for lp, _ in rec["output_logprobs"]]))
            prompt = sequence[: rec["prompt_token_count"]]
            key = (tuple(prompt), tuple((_text(tokenizer, tid), lp) for lp, tid in rec["output_logprobs"]))
            assert key not in turn_of
            turn_of[key] = (a, k)

    for i, call in enumerate(calls):
        choice = call["response"]["choices"][0]
        client = tuple((e["token"], e["logprob"]) for e in choice["logprobs"]["content"])
        # A new branch: its prompt is the whole conversation the agent sent, rendered and tokenized.
        prompt = tokenizer.encode(tokenizer.apply_chat_template(call["messages"], tools=[BASH_TOOL]))
        assert call["response"]["usage"]["prompt_tokens"] == len(prompt)
        found = turn_of.pop((tuple(prompt), client), None)
        assert found is not None, f"model call {i} of {STEP_LIMIT} is in no training sample"
        a, k = found
        ids, lps = _sampled_runs(a)[k]
        assert len(ids) == call["response"]["usage"]["completion_tokens"] == MAX_TOKENS
        assert [_text(tokenizer, tid) for tid in ids] == [text for text, _ in client]
        assert np.array_equal(np.float32(lps), np.float32([lp for _, lp in client]))
        assert a.records[k]["finish_reason"] == choice["finish_reason"] == "length"
        # The agent's final history is the branch of its last call.
        assert a.final == (i == STEP_LIMIT - 1)
    assert not turn_of  # and no turn that the agent did not ask for

    [final] = build_all_training_arrays(snap, final_only=True)
    assert _same_arrays(final, build_training_arrays(snap)) and final.final
    assert next(b for b in branches if b["final"])["path_node_ids"] == list(final.path_node_ids)

    assert httpx.delete(f"{stack.session_url}/sessions/{sid}").status_code == 204
