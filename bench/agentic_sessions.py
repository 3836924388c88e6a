"""Agent sessions over a tight KV cache: the SessionRouter's session strategy off against ThunderAgent, same load.

One run measures the same scripted agent load twice, each arm on a fresh fleet (every process is started for
the arm and stopped after it, all on 127.0.0.1 with --port 0 and their ready lines):

- fleet: --replicas reference replicas (`python -m psrl.worker --port 0 --model DIR --torch-threads 1
  --block-size B --num-blocks K --max-num-batched-tokens T`, each prints `PSRL_WORKER_READY grpc://...`), the
  router (`python -m psrl.router --port 0 --worker-urls ...`, `PSRL_ROUTER_READY`), and the SessionRouter in
  front of it (`python -m psrl.session --port 0 --router-url ...`, `PSRL_SESSION_READY`); arm `on` adds
  `--session-strategy thunder_agent` (and any --thunder-* flags given here) to the SessionRouter.
- model: the scripted tool-calling test model (tests/session/_agent_model.py: real Qwen2-shaped weights whose
  greedy reply to any prompt is one `lookup` tool call of 7 tokens), built under bench/out/, with
  max_position_embeddings raised to --max-model-len. Nothing is downloaded.
- KV: K = --kv-fraction (1/3) of the sessions' working set (the sum of their final context lengths, planned
  from the seeded script before anything starts), split over the replicas, in --block-size blocks.
- load: --sessions agents start at once. Each is an `openai.AsyncOpenAI` client on its own session base URL
  (`POST /sessions`, then `/sessions/{sid}/v1`): a system prompt with the tool, a task, then --turns turns of
  `chat.completions.create(tools=[lookup], temperature=0, max_tokens=16)`; the session carries x-prompt-id,
  x-request-id and x-is-sticky (--no-sticky: not), so the router runs every turn where the previous one ran
  (trajectory-sticky, as PSRL's rollouts do). After each answer the agent keeps
  the reply (its tool call), sleeps an env step of --env-min-s..--env-max-s (uniform, seeded per session and
  turn) and appends the tool result: seeded words, --tool-min-tokens..--tool-max-tokens tokens. At the end it
  deletes its session. The script (latencies, texts) is identical in both arms, and so is every reply.

Per arm: turns per minute (turns answered / the arm's makespan, first session created to last one deleted);
turn latency p50/p99 (the client's create() call; with the strategy on this includes the time a hung session
waits at its turn boundary); prompt tokens sent, computed (prompt - usage.prompt_tokens_details.cached_tokens)
and recomputed (whole blocks of context the session already had, prompt and sampled ids, that the replica did
not serve from its prefix cache); the replicas' own count of prompt positions computed (GetKvMigrationStats
prompt_tokens_computed, deltas), whose excess over the answers' computed tokens is prefill redone after a
preemption (the reference replica does not export its preemption count: the table shows these tokens instead);
sampled every 0.5 s, what the strategy itself reads: sessions hung and sessions in a turn (GET /control/sessions),
the replicas' KV usage and queued requests (the router's GET /workers/stats); and CPU use. The on/off ratio of
turns per minute is printed last.

Run from the repo root: python bench/agentic_sessions.py [--quick] [--sessions 48] [--turns 10]
Results: a table on stdout, JSON under bench/out/, process logs under bench/out/logs/agentic_sessions_<stamp>/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
from benchlib import (
    Procs,
    environment,
    fmt,
    install_signal_handlers,
    log_tail,
    machine_busy_s,
    own_cpu_s,
    percentile,
    ratio,
    tree_cpu_s,
    wait_for_log,
)

from psrl._proto import kv_migration_pb2 as kvm
from psrl._proto import kv_migration_pb2_grpc as kvm_grpc
from psrl.gateway.processes import stop_processes
from psrl.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "bench" / "out"
HOST = "127.0.0.1"
sys.path.insert(0, str(REPO / "tests"))  # the scripted agent model the tests use

from session._agent_model import LOOKUP_TOOL, build_agent_model_folder  # noqa: E402

MODEL_NAME = "agent"
ARMS = {"off": "strategy off", "on": "thunder_agent"}
THUNDER_FLAGS = ("check_interval_ms", "env_token_weight", "buffer_per_session", "continue_scope", "max_hold_s")
SYSTEM = "You are a careful research agent. Use the lookup tool to gather facts, then answer the task."
_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so no will what can more out up about who "
    "kernel cache block token session replica router prefix latency queue batch tensor shard gradient rollout "
    "policy reward episode agent tool result search file line error value branch commit merge build test"
)
WORDS = _WORD_TEXT.split()


# ---- the script ------------------------------------------------------------------------------------------------


def make_words(rng: random.Random, tok: Tokenizer, target_tokens: int) -> str:
    """Seeded text of about `target_tokens` tokens: plain words mixed with made-up ones (numbers, ids)."""
    parts: list[str] = []
    n = 0
    while n < target_tokens:
        chunk = []
        for _ in range(16):
            r = rng.random()
            if r < 0.8:
                chunk.append(rng.choice(WORDS))
            elif r < 0.9:
                chunk.append(str(rng.randint(0, 99999)))
            else:
                chunk.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 9))))
        piece = " ".join(chunk)
        n += len(tok.encode(" " + piece))
        parts.append(piece)
    return " ".join(parts)


@dataclass
class SessionScript:
    task: str
    tool_results: list[str]  # one per turn, appended after that turn's reply
    env_s: list[float]  # the env step after each turn


def plan(args: argparse.Namespace, tok: Tokenizer) -> list[SessionScript]:
    scripts = []
    for i in range(args.sessions):
        rng = random.Random(f"{args.seed}-{i}")
        task = f"Task {i}: " + make_words(rng, tok, 48)
        results = [
            f"lookup result {t}: " + make_words(rng, tok, rng.randint(args.tool_min_tokens, args.tool_max_tokens))
            for t in range(args.turns)
        ]
        env = [rng.uniform(args.env_min_s, args.env_max_s) for _ in range(args.turns)]
        scripts.append(SessionScript(task, results, env))
    return scripts


def initial_messages(script: SessionScript) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": script.task}]


def tool_reply(turn: int) -> dict[str, Any]:
    """The assistant message the scripted model's greedy answer parses to (what the agent echoes)."""
    call = {"id": f"call_{turn}", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def final_context_tokens(script: SessionScript, tok: Tokenizer) -> int:
    """The last turn's prompt plus its reply, rendered and tokenized here (the replica sees within a few tokens
    of it: TITO keeps the sampled ids, which tokenize the query differently)."""
    messages = initial_messages(script)
    for t in range(len(script.tool_results) - 1):
        messages += [tool_reply(t), {"role": "tool", "tool_call_id": f"call_{t}", "content": script.tool_results[t]}]
    return len(tok.encode(tok.apply_chat_template(messages, tools=[LOOKUP_TOOL]))) + 7


def prepare_model(args: argparse.Namespace) -> Path:
    folder = args.out_dir / "agentic-model"
    build_agent_model_folder(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = args.max_model_len
    config_file.write_text(json.dumps(config, indent=2))
    return folder


# ---- processes ------------------------------------------------------------------------------------------------


@dataclass
class Fleet:
    session_url: str
    router_url: str
    worker_urls: list[str]
    pids: dict[str, list[int]]  # replicas / router / session
    commands: list[list[str]]


def session_flags(arm: str, args: argparse.Namespace) -> list[str]:
    if arm == "off":
        return []
    flags = ["--session-strategy", "thunder_agent"]
    for name in THUNDER_FLAGS:
        value = getattr(args, f"thunder_{name}")
        if value is not None:
            flags += [f"--thunder-{name.replace('_', '-')}", str(value)]
    if args.thunder_credit_shared_prefix is not None:
        flags.append(f"--{'' if args.thunder_credit_shared_prefix else 'no-'}thunder-credit-shared-prefix")
    return flags


def start_fleet(procs: Procs, arm: str, args: argparse.Namespace) -> Fleet:
    """The router, then the replicas (started together, each registering itself with the router, as in PSRL's
    layout: the registration carries the `max_model_len` label, the KV capacity the strategy reads), then the
    SessionRouter once the router lists every replica."""
    commands: list[list[str]] = []
    argv = [sys.executable, "-m", "psrl.router", "--host", HOST, "--port", "0", "--log-level", "warning"]
    router = procs.start(f"{arm}-router", argv)
    commands.append(argv)
    ready = wait_for_log(procs, f"{arm}-router", router, r"PSRL_ROUTER_READY (http://\S+)", args.ready_timeout)
    router_url = ready.group(1)
    replicas = []
    for i in range(args.replicas):
        argv = [sys.executable, "-m", "psrl.worker", "--host", HOST, "--port", "0", "--model", str(args.model)]
        argv += ["--served-model-name", MODEL_NAME, "--torch-threads", "1", "--block-size", str(args.block_size)]
        argv += ["--num-blocks", str(args.num_blocks), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        argv += ["--router", router_url]
        if args.max_num_seqs:
            argv += ["--max-num-seqs", str(args.max_num_seqs)]
        name = f"{arm}-replica{i}"
        replicas.append((name, procs.start(name, argv)))
        commands.append(argv)
    urls = [
        wait_for_log(procs, name, proc, r"PSRL_WORKER_READY (grpc://\S+)", args.ready_timeout).group(1)
        for name, proc in replicas
    ]
    wait_registered(router_url, len(urls), router, procs.log_path(f"{arm}-router"), args.ready_timeout)
    argv = [sys.executable, "-m", "psrl.session", "--host", HOST, "--port", "0", "--router-url", router_url]
    argv += session_flags(arm, args)
    session = procs.start(f"{arm}-session", argv)
    commands.append(argv)
    match = wait_for_log(procs, f"{arm}-session", session, r"PSRL_SESSION_READY (http://\S+)", args.ready_timeout)
    pids = {"replicas": [p.pid for _, p in replicas], "router": [router.pid], "session": [session.pid]}
    return Fleet(match.group(1), router_url, urls, pids, commands)


def wait_registered(url: str, n: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with rc={proc.returncode}: {log_tail(log)}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if client.get(f"{url}/health").json()["workers"] >= n:
                    return
            time.sleep(0.2)
    raise TimeoutError(f"the router did not register {n} workers in {timeout_s:.0f}s: {log_tail(log)}")


def strategy_flag_parses() -> bool:
    """Whether this tree's SessionRouter knows --session-strategy (the ThunderAgent strategy)."""
    out = subprocess.run(
        [sys.executable, "-m", "psrl.session", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    return "--session-strategy" in out.stdout


# ---- replica counters -------------------------------------------------------------------------------------------


async def prompt_tokens_computed(urls: list[str]) -> int:
    """Prompt positions the replicas computed so far (rank 0 each: one rank per replica here)."""
    total = 0
    for url in urls:
        async with grpc.aio.insecure_channel(url.removeprefix("grpc://")) as ch:
            stats = await kvm_grpc.KvMigrationStub(ch).GetKvMigrationStats(
                kvm.GetKvMigrationStatsRequest(data_parallel_rank=0), timeout=10
            )
        total += stats.prompt_tokens_computed
    return total


# ---- the load ---------------------------------------------------------------------------------------------------


@dataclass
class Turn:
    session: int
    turn: int
    t_sent: float
    t_done: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    previous_context: int  # the previous turn's prompt + completion tokens (0 on the first turn)


@dataclass
class Counters:
    turns: list[Turn] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    hung_samples: list[int] = field(default_factory=list)
    generating_samples: list[int] = field(default_factory=list)  # sessions with a turn in flight
    kv_usage_samples: list[float] = field(default_factory=list)  # mean kv_cache_usage over the instances
    waiting_samples: list[int] = field(default_factory=list)  # requests queued on the replicas (no KV yet)
    session_makespans: list[float] = field(default_factory=list)


async def run_session(
    i: int, script: SessionScript, url: str, http: httpx.AsyncClient, counters: Counters, args: argparse.Namespace
) -> None:
    t_start = time.monotonic()
    # PSRL's rollout headers, kept by the session for every turn: with x-is-sticky the router pins each turn to
    # the instance the previous one ran on (trajectory-sticky); without it the policy places every turn anew.
    headers = {"x-prompt-id": str(i), "x-request-id": str(1_000_000 + i)}
    if args.sticky:
        headers["x-is-sticky"] = "true"
    r = await http.post(f"{url}/sessions", headers=headers)
    r.raise_for_status()
    sid = r.json()["session_id"]
    client = openai.AsyncOpenAI(
        base_url=f"{url}/sessions/{sid}/v1",
        api_key="none",
        max_retries=0,
        timeout=args.request_timeout,
        http_client=http,
    )
    messages = initial_messages(script)
    previous = 0
    try:
        for t in range(args.turns):
            sent = time.monotonic()
            completion = await client.chat.completions.create(
                model=MODEL_NAME, messages=messages, tools=[LOOKUP_TOOL], temperature=0, max_tokens=16
            )
            done = time.monotonic()
            usage = completion.usage
            details = usage.prompt_tokens_details if usage else None
            cached = (details.cached_tokens or 0) if details else 0
            prompt = usage.prompt_tokens if usage else 0
            out = usage.completion_tokens if usage else 0
            counters.turns.append(Turn(i, t, sent, done, prompt, cached, out, previous))
            previous = prompt + out
            message = completion.choices[0].message
            calls = [
                {"id": c.id, "type": "function", "function": c.function.model_dump()} for c in message.tool_calls or []
            ]
            reply: dict[str, Any] = {"role": "assistant", "content": message.content}
            if calls:
                reply["tool_calls"] = calls
            messages.append(reply)
            await asyncio.sleep(script.env_s[t])  # the env step: the tool runs
            result = script.tool_results[t]
            if calls:
                messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": result})
            else:  # the scripted model always calls the tool; keep the load the same if it ever does not
                messages.append({"role": "user", "content": result})
    except (openai.OpenAIError, httpx.HTTPError) as e:
        counters.errors.append(f"session {i}: {type(e).__name__}: {str(e)[:200]}")
    finally:
        with contextlib.suppress(httpx.HTTPError):
            await http.delete(f"{url}/sessions/{sid}")
        counters.session_makespans.append(time.monotonic() - t_start)


async def sample_state(fleet: Fleet, http: httpx.AsyncClient, counters: Counters) -> None:
    """Every 0.5 s: the SessionRouter's sessions (hung, generating) and the router's view of the replicas (KV
    usage, queued requests): what the strategy reads."""
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            sessions = (await http.get(f"{fleet.session_url}/control/sessions")).json()["sessions"]
            counters.hung_samples.append(sum(1 for s in sessions if s.get("hang_state") == "hung"))
            counters.generating_samples.append(
                sum(1 for s in sessions if s.get("status") == "generate" and s.get("hang_state") != "hung")
            )
            stats = (await http.get(f"{fleet.router_url}/workers/stats")).json()["workers"]
            if stats:
                counters.kv_usage_samples.append(statistics.fmean(float(w["kv_cache_usage"]) for w in stats))
                counters.waiting_samples.append(sum(int(w.get("waiting_requests") or 0) for w in stats))
        await asyncio.sleep(0.5)


# ---- CPU ------------------------------------------------------------------------------------------------------


def cpu_sample(fleet: Fleet) -> dict[str, float]:
    sample = {"t": time.monotonic(), "machine": machine_busy_s(), "bench": own_cpu_s()}
    for part, pids in fleet.pids.items():
        sample[part] = tree_cpu_s(pids)
    return sample


def cpu_cores(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    wall = max(after["t"] - before["t"], 1e-9)
    cores = {k: (after[k] - before[k]) / wall for k in before if k != "t"}
    cores["others"] = max(0.0, cores["machine"] - sum(v for k, v in cores.items() if k != "machine"))
    return cores


# ---- one arm --------------------------------------------------------------------------------------------------


@dataclass
class Arm:
    arm: str
    label: str
    sessions: int
    turns_done: int
    makespan_s: float
    turns_per_min: float
    turns_per_replica_cpu_s: float  # robust to other jobs on the box, blind to idle time
    latency_p50_s: float
    latency_p99_s: float
    latency_mean_s: float
    session_makespan_p50_s: float
    session_makespan_max_s: float
    prompt_tokens: int
    computed_tokens: int  # prompt - cached, over the answers
    new_tokens: int  # prompt - previous context: what any run must compute
    recomputed_tokens: int  # whole blocks of earlier context not served from the prefix cache
    replica_computed_tokens: int  # the replicas' own count (all admissions)
    preemption_recompute_tokens: int  # replica count - the answers' count
    hung_mean: float
    hung_max: int
    generating_mean: float
    kv_usage_mean: float
    replica_waiting_mean: float
    errors: int
    error_samples: list[str]
    cpu: dict[str, float]
    commands: list[list[str]]


def mean_of(values: list[int] | list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def recomputed(turn: Turn, block_size: int) -> int:
    """Whole blocks of the session's earlier context (its KV was computed last turn) not served from cache. The
    last sampled token of the previous turn never had its KV computed, and a prompt's last token never comes
    from the cache."""
    if turn.previous_context == 0:
        return 0
    reusable = min(turn.previous_context - 1, turn.prompt_tokens - 1) // block_size * block_size
    return max(0, reusable - turn.cached_tokens)


async def run_arm_load(arm: str, fleet: Fleet, scripts: list[SessionScript], args: argparse.Namespace) -> Arm:
    counters = Counters()
    limits = httpx.Limits(max_connections=args.sessions + 8, max_keepalive_connections=args.sessions + 8)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as http:
        computed0 = await prompt_tokens_computed(fleet.worker_urls)
        cpu0 = cpu_sample(fleet)
        sampler = asyncio.create_task(sample_state(fleet, http, counters))
        try:
            await asyncio.gather(
                *(run_session(i, s, fleet.session_url, http, counters, args) for i, s in enumerate(scripts))
            )
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        cpu1 = cpu_sample(fleet)
        computed1 = await prompt_tokens_computed(fleet.worker_urls)
    turns = counters.turns
    makespan = cpu1["t"] - cpu0["t"]
    cpu = cpu_cores(cpu0, cpu1)
    latencies = [t.t_done - t.t_sent for t in turns]
    computed = sum(t.prompt_tokens - t.cached_tokens for t in turns)
    replica_computed = computed1 - computed0
    return Arm(
        arm=arm,
        label=ARMS[arm],
        sessions=len(scripts),
        turns_done=len(turns),
        makespan_s=makespan,
        turns_per_min=len(turns) / makespan * 60.0,
        turns_per_replica_cpu_s=ratio(len(turns), cpu["replicas"] * makespan),
        latency_p50_s=percentile(latencies, 0.50),
        latency_p99_s=percentile(latencies, 0.99),
        latency_mean_s=statistics.fmean(latencies) if latencies else math.nan,
        session_makespan_p50_s=percentile(counters.session_makespans, 0.5),
        session_makespan_max_s=max(counters.session_makespans, default=math.nan),
        prompt_tokens=sum(t.prompt_tokens for t in turns),
        computed_tokens=computed,
        new_tokens=sum(t.prompt_tokens - t.previous_context for t in turns),
        recomputed_tokens=sum(recomputed(t, args.block_size) for t in turns),
        replica_computed_tokens=replica_computed,
        preemption_recompute_tokens=max(0, replica_computed - computed),
        hung_mean=mean_of(counters.hung_samples),
        hung_max=max(counters.hung_samples, default=0),
        generating_mean=mean_of(counters.generating_samples),
        kv_usage_mean=mean_of(counters.kv_usage_samples),
        replica_waiting_mean=mean_of(counters.waiting_samples),
        errors=len(counters.errors),
        error_samples=counters.errors[:5],
        cpu=cpu,
        commands=fleet.commands,
    )


def session_metrics(url: str) -> list[str]:
    """The SessionRouter's strategy metrics, if it exports any (GET /metrics)."""
    with contextlib.suppress(httpx.HTTPError):
        r = httpx.get(f"{url}/metrics", timeout=5.0, trust_env=False)
        if r.status_code == 200:
            return [
                line
                for line in r.text.splitlines()
                if line and not line.startswith("#") and re.search(r"thunder|hung|hang|continu|hold|remaining", line)
            ]
    return []


def run_arm(arm: str, scripts: list[SessionScript], args: argparse.Namespace, log_dir: Path) -> Arm:
    with Procs(log_dir) as procs:
        try:
            fleet = start_fleet(procs, arm, args)
            print(f"  fleet up: session {fleet.session_url}, replicas {' '.join(fleet.worker_urls)}", flush=True)
            result = asyncio.run(run_arm_load(arm, fleet, scripts, args))
            metrics = session_metrics(fleet.session_url)
            if metrics:
                print("  SessionRouter metrics:\n    " + "\n    ".join(metrics[:40]), flush=True)
            return result
        finally:
            stop_processes([p for _, p in procs.live.values()])
            procs.live.clear()


# ---- report ---------------------------------------------------------------------------------------------------


ROWS: list[tuple[str, str, str]] = [
    ("turns answered", "turns_done", "d"),
    ("makespan (s)", "makespan_s", ".1f"),
    ("turns per minute", "turns_per_min", ".1f"),
    ("turns / replica CPU-s", "turns_per_replica_cpu_s", ".2f"),
    ("turn latency p50 (s)", "latency_p50_s", ".2f"),
    ("turn latency p99 (s)", "latency_p99_s", ".2f"),
    ("turn latency mean (s)", "latency_mean_s", ".2f"),
    ("session time p50 (s)", "session_makespan_p50_s", ".1f"),
    ("session time max (s)", "session_makespan_max_s", ".1f"),
    ("prompt tokens sent", "prompt_tokens", "d"),
    ("  new to the session", "new_tokens", "d"),
    ("  computed (answers)", "computed_tokens", "d"),
    ("  recomputed context", "recomputed_tokens", "d"),
    ("  computed (replicas)", "replica_computed_tokens", "d"),
    ("  redone after preempt", "preemption_recompute_tokens", "d"),
    ("sessions hung, mean", "hung_mean", ".1f"),
    ("sessions hung, max", "hung_max", "d"),
    ("sessions in a turn, mean", "generating_mean", ".1f"),
    ("replica reqs queued, mean", "replica_waiting_mean", ".1f"),
    ("replica KV usage, mean", "kv_usage_mean", ".2f"),
    ("errors", "errors", "d"),
]


def print_report(arms: list[Arm], args: argparse.Namespace) -> float:
    print(
        f"\nload: {args.sessions} sessions x {args.turns} turns, tool results {args.tool_min_tokens}-"
        f"{args.tool_max_tokens} tokens, env step {args.env_min_s:g}-{args.env_max_s:g} s, seed {args.seed}; "
        f"working set {args.working_set} tokens (final contexts {args.context_min}-{args.context_max}); "
        f"{args.replicas} replicas x {args.num_blocks} blocks of {args.block_size} = "
        f"{args.replicas * args.num_blocks * args.block_size} tokens of KV ({args.kv_share:.0%} of the working set)"
    )
    by_arm = {a.arm: a for a in arms}
    head = f"{'':<24}" + "".join(f"{ARMS[a.arm]:>15}" for a in arms)
    both = "off" in by_arm and "on" in by_arm
    head += f"{'on/off':>9}" if both else ""
    print(head)
    print("-" * len(head))
    for label, key, spec in ROWS:
        line = f"{label:<24}" + "".join(f"{fmt(getattr(a, key), spec):>15}" for a in arms)
        if both:
            line += f"{fmt(ratio(getattr(by_arm['on'], key), getattr(by_arm['off'], key)), '.2f'):>9}"
        print(line)
    for part in ("replicas", "router", "session", "bench", "others"):
        line = f"{'cores: ' + part:<24}" + "".join(f"{a.cpu.get(part, math.nan):>15.2f}" for a in arms)
        print(line)
    print(
        "(latency: the client's create() call, a hung session's wait included; 'recomputed context': whole blocks "
        "of a session's\n earlier context its replica computed again (0 when nothing was evicted); 'redone after "
        "preempt': the replicas' own\n count of prompt positions computed minus the answers' (prefill repeated "
        "after a preemption); 'turns / replica CPU-s': steadier than\n turns per minute when other jobs share the "
        "box; 'in a turn', 'queued', 'KV usage': sampled every 0.5 s from /control/sessions\n and the router's "
        "/workers/stats (what the strategy reads); 'others': other jobs)"
    )
    for a in arms:
        if a.errors:
            print(f"  {a.label}: {a.errors} errors: {a.error_samples}")
    if not both:
        return math.nan
    r = ratio(by_arm["on"].turns_per_min, by_arm["off"].turns_per_min)
    print(f"turns per minute on/off = {fmt(r, '.2f')}")
    return r


def write_json(arms: list[Arm], r: float, args: argparse.Namespace) -> Path:
    path = args.out_dir / f"agentic_sessions_{args.stamp}.json"
    payload = {
        "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "environment": {**environment(), "loadavg_at_end": os.getloadavg()},
        "arms": [asdict(a) for a in arms],
        "turns_per_min_on_over_off": r,
    }
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


# ---- main -----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="off: no strategy; on: thunder")
    p.add_argument("--sessions", type=int, default=48, help="agent sessions, all started at once")
    p.add_argument("--turns", type=int, default=10, help="turns per session")
    p.add_argument("--tool-min-tokens", type=int, default=150, help="tool result size, tokens (uniform)")
    p.add_argument("--tool-max-tokens", type=int, default=350)
    p.add_argument("--env-min-s", type=float, default=0.3, help="env step between turns, s (uniform)")
    p.add_argument("--env-max-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0, help="seeds the script (texts, env steps)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--sticky",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sessions carry x-is-sticky (each turn on its previous turn's instance); no: round robin every turn",
    )
    p.add_argument("--kv-fraction", type=float, default=1 / 3, help="KV capacity over the sessions' working set")
    p.add_argument("--block-size", type=int, default=16, help="replica KV block, tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="replica tokens per step")
    p.add_argument("--max-num-seqs", type=int, default=0, help="replica sequences at once; 0: its default")
    p.add_argument("--max-model-len", type=int, default=8192, help="the model folder's max_position_embeddings")
    p.add_argument("--request-timeout", type=float, default=900.0, help="per turn, s")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="s to wait for a process's ready line")
    p.add_argument("--deadline", type=float, default=1500.0, help="abort (and clean up) after this many s")
    p.add_argument("--quick", action="store_true", help="16 sessions x 8 turns (~2 min)")
    p.add_argument("--thunder-check-interval-ms", type=int, default=None, help="passed to arm on if given")
    p.add_argument("--thunder-env-token-weight", type=float, default=None)
    p.add_argument("--thunder-buffer-per-session", type=int, default=None)
    p.add_argument("--thunder-continue-scope", choices=("bucketed", "global"), default=None)
    p.add_argument("--thunder-max-hold-s", type=float, default=None)
    p.add_argument(
        "--thunder-credit-shared-prefix",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="passed to arm on if given (--no-...: count generating sessions in full)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.turns = min(args.sessions, 16), min(args.turns, 8)
    if not 0 < args.env_min_s <= args.env_max_s or not 0 < args.tool_min_tokens <= args.tool_max_tokens:
        p.error("need 0 < --env-min-s <= --env-max-s and 0 < --tool-min-tokens <= --tool-max-tokens")
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out_dir = OUT_DIR
    return args


def size_kv(args: argparse.Namespace, scripts: list[SessionScript], tok: Tokenizer) -> None:
    contexts = [final_context_tokens(s, tok) for s in scripts]
    if max(contexts) + 16 > args.max_model_len:
        sys.exit(f"the longest session reaches {max(contexts)} tokens: raise --max-model-len or lower --turns")
    args.working_set, args.context_min, args.context_max = sum(contexts), min(contexts), max(contexts)
    per_replica = args.kv_fraction * args.working_set / args.replicas
    # At least one whole session plus a turn's growth per replica, or a single turn could never run.
    args.num_blocks = max(math.ceil(per_replica / args.block_size), math.ceil((max(contexts) + 512) / args.block_size))
    args.kv_share = args.replicas * args.num_blocks * args.block_size / args.working_set


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.model = prepare_model(args)
    tok = Tokenizer.from_folder(args.model)
    scripts = plan(args, tok)
    size_kv(args, scripts, tok)
    if "on" in args.arms and not strategy_flag_parses():
        print("arm on skipped: this tree's SessionRouter has no --session-strategy (ThunderAgent not built yet)")
        args.arms = [a for a in args.arms if a != "on"]
    log_dir = args.out_dir / "logs" / f"agentic_sessions_{args.stamp}"
    print(
        f"environment: {environment()}, load average {os.getloadavg()[0]:.2f}; {args.sessions} sessions x "
        f"{args.turns} turns, working set {args.working_set} tokens, KV {args.num_blocks} blocks x "
        f"{args.replicas} replicas ({args.kv_share:.0%})",
        flush=True,
    )
    install_signal_handlers(args.deadline)
    arms: list[Arm] = []
    try:
        for arm in args.arms:
            print(f"{ARMS[arm]}: starting {args.replicas} replicas, the router and the SessionRouter", flush=True)
            result = run_arm(arm, scripts, args, log_dir)
            arms.append(result)
            print(
                f"  {result.turns_done} turns in {result.makespan_s:.1f} s ({result.turns_per_min:.1f}/min), "
                f"{result.recomputed_tokens} context tokens recomputed, {result.errors} errors",
                flush=True,
            )
    finally:
        signal.alarm(0)
        r = math.nan
        if arms:
            r = print_report(arms, args)
            print(f"\nJSON: {write_json(arms, r, args).relative_to(REPO)}")
        print(f"logs: {log_dir.relative_to(REPO)}")
        if arms and not math.isnan(r):
            print(f"turns per minute, thunder_agent / off: {r:.2f}x")


if __name__ == "__main__":
    main()
