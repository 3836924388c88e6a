"""Partial rollout vs abort-and-restart vs drain-before-sync: useful decoded tokens per second under weight syncs.

One run measures three strategies (and a no-sync ceiling) under the same load, each on a fresh fleet (every
process is started for the strategy and stopped after it, all on 127.0.0.1):

- fleet: --replicas reference replicas (`python -m psrl.worker --port 0 --torch-threads 1 --dp-size N`, each
  prints `PSRL_WORKER_READY grpc://host:port`) behind our router (`python -m psrl.router --port P --worker-urls
  ... --enable-routing-loop --policy least_load`).
- load: --concurrency clients, each in a loop: POST /generate with `x-request-id` / `x-prompt-id` (unique ints),
  --prompt-len input_ids, sampling_params {max_new_tokens: --max-new-tokens, temperature: 1.0, ignore_eos: true,
  detokenize: false}. With --min-new-tokens, each prompt's max_new_tokens is drawn uniformly from [min, max]
  (seeded by its prompt id): a long tail of rollout lengths, which is what a drain has to wait for.
- weight syncs: every --sync-interval seconds (start to start; an overrunning sync is followed at once by the
  next), to version v = 1, 2, ... with seed v (real weight changes on every replica).
- --engine vllm: the replicas are real vLLM ones of ours (`python -m psrl.worker --engine vllm --model DIR --
  --dtype float32 --enforce-eager ...`, vLLM's CPU build here); --model DIR (default: the tiny folder with
  seeded float32 weights, built under bench/out/) and each sync reloads a safetensors file in place, alternating
  between two seeded weight files written next to it (vLLM loads weights from files, not seeds).

Strategies:

  (a) partial   the router default (partial rollout on); sync = RolloutCoordinator.sync_weights(v, seed=v): pause
                the loop, pause the replicas (ABORT), wait for the loop-back, load, publish, resume. Interrupted
                requests come back through the router with their tokens and continue on the new weights.
  (b) restart   the router with --no-enable-partial-rollout; the same coordinator call. A request that comes back
                with meta_info.finish_reason.type == "abort" is resubmitted by its client from the prompt
                (same prompt and prompt id, a new request id); what the aborted attempt decoded is wasted.
  (c) drain     the router default; sync = `drain_sync` below: pause the routing loop (wait), pause the replicas
                with PAUSE_MODE_WAIT (returns once every running request finished normally), check the router
                holds no running request, load, publish, resume the replicas, then the loop.
  (n) ceiling   the same load with no syncs at all: the upper bound the others are compared with ('ceil').

Per strategy, over a measured window of --duration seconds that starts after --warmup seconds of load (syncs run
during the warm-up too, so the window sees the steady state): completed requests (finished in the window),
useful tokens/s (their output tokens), wasted tokens (decoded then thrown away: the aborted attempts of (b); for
(a) and (c) the output must be exactly max_new_tokens long, anything else is flagged), request latency (first
submission to the final answer, restarts included) mean/p50/p99, syncs started in the window and their mean
duration (the whole coordinator call) with its phases, and, for (a), how often requests were interrupted (from
meta_info.output_token_versions) and the tokens re-prefilled on loop-back (no KV migration between replicas
yet, so a looped-back request recomputes its prompt + output so far).

Run from the repo root: python bench/partial_rollout.py [--quick] [--strategies a b c] [--duration 30]
Results: a table on stdout, JSON under bench/out/, process logs under bench/out/logs/partial_rollout_<stamp>/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import httpx
from benchlib import (
    Procs,
    environment,
    fmt,
    free_port,
    install_signal_handlers,
    log_tail,
    machine_busy_s,
    own_cpu_s,
    percentile,
    ratio,
    tree_cpu_s,
    wait_for_log,
)

from psrl._proto import replica_control_pb2 as rc
from psrl._proto import replica_control_pb2_grpc as rc_grpc
from psrl.coordinator import ReplicaHandle, RolloutCoordinator

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "bench" / "out"
HOST = "127.0.0.1"

STRATEGIES: dict[str, str] = {
    "a": "(a) partial rollout",
    "b": "(b) abort+restart",
    "c": "(c) drain, then sync",
    "n": "(n) no syncs (ceiling)",
}
REPLICA_CPUS: set[int] = set()  # --pin: the replicas' CPUs (the router and the bench keep the others)
VLLM_ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "4096", "--enforce-eager"]


def weight_source(version: int, args: argparse.Namespace) -> dict[str, int | str]:
    """LoadWeights' source for a sync to `version`: a seed on the reference engine, a file on vLLM."""
    if args.engine == "vllm":
        return {"path": str(args.weight_files[version % len(args.weight_files)])}
    return {"seed": version}


def prepare_vllm_model(args: argparse.Namespace) -> None:
    """The model folder vLLM replicas serve (real weights) and the two weight files syncs alternate between."""
    from psrl.worker.model_folder import build_weighted_model_folder, write_seeded_weights

    if args.model is None:
        args.model = build_weighted_model_folder(args.out_dir / "vllm-model")
    args.weight_files = []
    for seed in (1, 2):
        path = args.out_dir / f"vllm-weights-{seed}.safetensors"
        if not path.is_file():
            write_seeded_weights(args.model, seed, path)
        args.weight_files.append(path)


# ---- processes ------------------------------------------------------------------------------------------------


@dataclass
class Fleet:
    router_url: str
    worker_urls: list[str]
    router_pid: int
    replica_pids: list[int]
    commands: list[list[str]]


def start_fleet(procs: Procs, strategy: str, args: argparse.Namespace) -> Fleet:
    """Replicas (started together, then awaited), then the router; ready once it lists every worker."""
    commands: list[list[str]] = []
    replicas = []
    for i in range(args.replicas):
        argv = [sys.executable, "-m", "psrl.worker", "--host", HOST, "--port", "0", "--dp-size", str(args.dp_size)]
        if args.engine == "vllm":
            argv += ["--engine", "vllm", "--model", str(args.model), "--", *VLLM_ENGINE_ARGS]
        else:
            argv += ["--torch-threads", "1"]
        replicas.append((f"{strategy}-replica{i}", procs.start(f"{strategy}-replica{i}", argv, REPLICA_CPUS or None)))
        commands.append(argv)
    urls = [
        wait_for_log(procs, name, proc, r"PSRL_WORKER_READY (grpc://\S+)", args.ready_timeout).group(1)
        for name, proc in replicas
    ]
    port = free_port()
    argv = [sys.executable, "-m", "psrl.router", "--host", HOST, "--port", str(port), "--worker-urls", *urls]
    argv += ["--enable-routing-loop", "--policy", "least_load", "--log-level", "warning"]
    if strategy == "b":
        argv.append("--no-enable-partial-rollout")
    router = procs.start(f"{strategy}-router", argv)
    commands.append(argv)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + args.ready_timeout
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while True:
            if router.poll() is not None:
                raise RuntimeError(
                    f"router exited with rc={router.returncode}: {log_tail(procs.log_path(f'{strategy}-router'))}"
                )
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                workers = client.get(f"{url}/workers").json()["workers"]
                if len(workers) >= len(urls) and all(w.get("healthy", True) for w in workers):
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"router not ready in {args.ready_timeout:.0f}s: {log_tail(procs.log_path(f'{strategy}-router'))}"
                )
            time.sleep(0.2)
    return Fleet(url, urls, router.pid, [p.pid for _, p in replicas], commands)


# ---- the drain-before-sync protocol (strategy c) --------------------------------------------------------------


@dataclass
class SyncResult:
    version: int
    start: float  # monotonic
    seconds: float
    phases: dict[str, float]
    aborted_requests: int = 0
    error: str | None = None


async def drain_sync(
    coordinator: RolloutCoordinator,
    http: httpx.AsyncClient,
    stubs: dict[str, rc_grpc.ReplicaControlStub],
    replicas: list[ReplicaHandle],
    version: int,
    *,
    source: dict[str, int | str],
    timeout_s: float,
) -> dict[str, float]:
    """Sync without interrupting anything: stop dispatching, let every running request finish, then swap.

    1. pause the routing loop and wait for its barrier (coordinator.pause_routing);
    2. PauseGeneration(PAUSE_MODE_WAIT) on every replica: returns once its running requests finished normally;
    3. poll GET /routing_loop/status until the router holds no running request (their answers went out);
    4. LoadWeights(version, source) everywhere; 5. publish the version for every rank;
    6. ResumeGeneration on every replica, then resume the routing loop (always, even on failure).
    Returns the phase durations.
    """
    loop = asyncio.get_running_loop()
    phases: dict[str, float] = {}
    t = loop.time()

    def mark(name: str) -> None:
        nonlocal t
        now = loop.time()
        phases[name] = now - t
        t = now

    await coordinator.pause_routing()
    mark("pause_routing")
    try:
        wait = rc.PauseGenerationRequest(mode=rc.PAUSE_MODE_WAIT)
        await asyncio.gather(*(stubs[r.worker_id].PauseGeneration(wait, timeout=timeout_s) for r in replicas))
        mark("drain_replicas")
        deadline = loop.time() + timeout_s
        while (await http.get("/routing_loop/status")).json().get("running_request_num", 0) != 0:
            if loop.time() > deadline:
                raise TimeoutError(f"the router still runs requests {timeout_s:.0f}s after the replicas drained")
            await asyncio.sleep(0.01)
        mark("drain_router")
        load = rc.LoadWeightsRequest(version=version, **source)
        await asyncio.gather(*(stubs[r.worker_id].LoadWeights(load, timeout=timeout_s) for r in replicas))
        mark("load_weights")
        updates = [
            {"worker_id": r.worker_id, "dp_rank": rank, "weight_version": version}
            for r in replicas
            for rank in range(r.dp_size)
        ]
        resp = await http.post("/workers/update_weight_version", json=updates)
        resp.raise_for_status()
        result = resp.json()
        if result["rejected"] or result["updated"] != len(updates):
            raise RuntimeError(f"router rejected the version update: {result}")
        mark("publish_version")
    finally:
        resume = rc.ResumeGenerationRequest()
        await asyncio.gather(
            *(stubs[r.worker_id].ResumeGeneration(resume, timeout=timeout_s) for r in replicas), return_exceptions=True
        )
        mark("resume_replicas")
        await coordinator.resume_routing()
        mark("resume_routing")
    return phases


# ---- load and syncs --------------------------------------------------------------------------------------------


@dataclass
class Done:
    """A request answered with its full output (possibly after restarts)."""

    t_first: float
    t_done: float
    tokens: int
    attempts: int  # submissions (b: 1 + restarts)
    interruptions: int  # (a): segments - 1 from output_token_versions
    reprefill_tokens: int  # (a): prompt + output so far, recomputed at each loop-back
    length_ok: bool


@dataclass
class Waste:
    t: float
    tokens: int


@dataclass
class Counters:
    done: list[Done] = field(default_factory=list)
    wasted: list[Waste] = field(default_factory=list)
    errors: list[tuple[float, str]] = field(default_factory=list)
    syncs: list[SyncResult] = field(default_factory=list)


def prompt_ids(prompt_id: int, n: int) -> list[int]:
    return [3 + (prompt_id * 131 + i * 37) % 600 for i in range(n)]


def new_tokens(prompt_id: int, args: argparse.Namespace) -> int:
    """This prompt's max_new_tokens: fixed, or uniform in [--min-new-tokens, --max-new-tokens] per prompt id."""
    low = args.max_new_tokens if args.min_new_tokens is None else args.min_new_tokens
    return random.Random(prompt_id).randint(low, args.max_new_tokens) if low < args.max_new_tokens else low


def interruptions_of(versions: list[int], prompt_len: int) -> tuple[int, int]:
    """Loop-backs seen in a merged answer (the version changes between its tokens) and the re-prefilled tokens."""
    count, reprefill = 0, 0
    for i in range(1, len(versions)):
        if versions[i] != versions[i - 1]:
            count += 1
            reprefill += prompt_len + i
    return count, reprefill


async def client_loop(
    http: httpx.AsyncClient, ids: itertools.count, strategy: str, counters: Counters, args: argparse.Namespace
) -> None:
    """One client: one request at a time, forever (cancelled at the end of the window)."""
    while True:
        prompt_id = next(ids)
        body = {
            "input_ids": prompt_ids(prompt_id, args.prompt_len),
            "sampling_params": {
                "max_new_tokens": new_tokens(prompt_id, args),
                "temperature": 1.0,
                "ignore_eos": True,
                "detokenize": False,
            },
        }
        t_first = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            request_id = prompt_id if attempts == 1 else next(ids)
            headers = {"x-request-id": str(request_id), "x-prompt-id": str(prompt_id)}
            try:
                resp = await http.post("/generate", json=body, headers=headers)
            except httpx.HTTPError as e:
                counters.errors.append((time.monotonic(), f"{type(e).__name__}: {e}"))
                await asyncio.sleep(0.1)
                break
            now = time.monotonic()
            if resp.status_code != 200:
                counters.errors.append((now, f"HTTP {resp.status_code}: {resp.text[:200]}"))
                await asyncio.sleep(0.1)
                break
            answer = resp.json()
            meta = answer["meta_info"]
            tokens = len(answer["output_ids"])
            if meta["finish_reason"]["type"] == "abort":
                if strategy != "b":
                    counters.errors.append((now, f"abort reached the client in strategy {strategy}"))
                counters.wasted.append(Waste(now, tokens))
                continue  # (b): start over from the prompt with a new request id
            n_int, reprefill = interruptions_of(meta.get("output_token_versions") or [], args.prompt_len)
            counters.done.append(
                Done(t_first, now, tokens, attempts, n_int, reprefill, tokens == new_tokens(prompt_id, args))
            )
            break


async def sync_loop(
    strategy: str,
    router_url: str,
    counters: Counters,
    t0: float,
    stop: asyncio.Event,
    args: argparse.Namespace,
    first_version: int,
) -> None:
    """Weight syncs every --sync-interval s (start to start) until `stop` is set; a sync under way always
    completes (cutting one in half would leave the fleet paused)."""
    async with (
        RolloutCoordinator(router_url, rpc_timeout_s=args.sync_timeout, loopback_timeout_s=args.sync_timeout) as coord,
        httpx.AsyncClient(base_url=router_url, timeout=args.sync_timeout, trust_env=False) as http,
    ):
        replicas = await coord.replicas()
        channels = {r.worker_id: grpc.aio.insecure_channel(r.target) for r in replicas}
        stubs = {wid: rc_grpc.ReplicaControlStub(ch) for wid, ch in channels.items()}
        try:
            version = first_version
            next_start = t0 + args.sync_interval
            while not stop.is_set() and strategy != "n":
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=max(0.0, next_start - time.monotonic()))
                if stop.is_set():
                    break
                start = time.monotonic()
                next_start = max(next_start + args.sync_interval, start)
                version += 1
                await one_sync(strategy, coord, http, stubs, replicas, version, start, counters, args)
        finally:
            for ch in channels.values():
                await ch.close()


async def one_sync(
    strategy: str,
    coord: RolloutCoordinator,
    http: httpx.AsyncClient,
    stubs: dict[str, rc_grpc.ReplicaControlStub],
    replicas: list[ReplicaHandle],
    version: int,
    start: float,
    counters: Counters,
    args: argparse.Namespace,
) -> None:
    try:
        if strategy == "c":
            source = weight_source(version, args)
            phases = await drain_sync(coord, http, stubs, replicas, version, source=source, timeout_s=args.sync_timeout)
            aborted = 0
        else:
            report = await coord.sync_weights(version, replicas=replicas, **weight_source(version, args))
            phases, aborted = report.phases, report.aborted_requests
        counters.syncs.append(SyncResult(version, start, time.monotonic() - start, phases, aborted))
    except Exception as e:  # recorded; the bench goes on (the coordinator resumed the loop)
        counters.syncs.append(SyncResult(version, start, time.monotonic() - start, {}, 0, f"{type(e).__name__}: {e}"))


# ---- one strategy ----------------------------------------------------------------------------------------------


@dataclass
class Leg:
    strategy: str
    label: str
    window_s: float
    completed: int
    useful_tokens: int
    useful_tok_s: float
    wasted_tokens: int
    wasted_attempts: int
    latency_mean_s: float
    latency_p50_s: float
    latency_p99_s: float
    syncs: int
    sync_failures: int
    sync_mean_s: float
    sync_max_s: float
    sync_phases_mean_s: dict[str, float]
    paused_share: float  # share of the window spent inside a sync call
    aborted_per_sync: float
    interrupted_requests: int
    interruptions: int
    reprefill_tokens: int
    restarts: int
    length_mismatches: int
    errors: int
    error_samples: list[str]
    cpu: CpuUse
    useful_tok_per_replica_cpu_s: float
    commands: list[list[str]]
    round: int = 1


@dataclass
class CpuUse:
    """Cores used over the window (CPU seconds / wall seconds)."""

    machine: float  # every non-idle core-second on the box (/proc/stat)
    router: float  # the router's process tree
    replicas: float  # the replicas' process trees (all of them together)
    bench: float  # this process: the clients and the coordinator
    others: float  # the rest: other people's jobs on a shared box skew the figures


CpuSample = tuple[float, float, float, float, float]


def cpu_sample(fleet: Fleet) -> CpuSample:
    machine, router, replicas = machine_busy_s(), tree_cpu_s([fleet.router_pid]), tree_cpu_s(fleet.replica_pids)
    return time.monotonic(), machine, router, replicas, own_cpu_s()


def cpu_use(before: CpuSample, after: CpuSample) -> CpuUse:
    wall = max(after[0] - before[0], 1e-9)
    machine, router, replicas, bench = ((after[i] - before[i]) / wall for i in (1, 2, 3, 4))
    return CpuUse(machine, router, replicas, bench, max(0.0, machine - router - replicas - bench))


async def run_load(strategy: str, fleet: Fleet, args: argparse.Namespace, first_version: int) -> Leg:
    counters = Counters()
    ids = itertools.count(args.id_base)
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    async with httpx.AsyncClient(base_url=fleet.router_url, limits=limits, timeout=timeout, trust_env=False) as http:
        t0 = time.monotonic()
        clients = [
            asyncio.create_task(client_loop(http, ids, strategy, counters, args)) for _ in range(args.concurrency)
        ]
        stop = asyncio.Event()
        syncer = asyncio.create_task(sync_loop(strategy, fleet.router_url, counters, t0, stop, args, first_version))
        tasks = [*clients, syncer]
        try:
            await _sleep_watching(tasks, t0 + args.warmup)
            cpu0 = cpu_sample(fleet)
            await _sleep_watching(tasks, cpu0[0] + args.duration)
            cpu1 = cpu_sample(fleet)
        finally:
            stop.set()  # the sync under way (if any) completes, so no replica or loop stays paused
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(syncer, return_exceptions=True), timeout=args.sync_timeout * 2)
    return summarize(strategy, counters, cpu0[0], cpu1[0], cpu_use(cpu0, cpu1), fleet)


async def _sleep_watching(tasks: list[asyncio.Task[None]], until: float) -> None:
    """Sleep until `until`, failing early if a client or the sync loop died with an exception."""
    while (left := until - time.monotonic()) > 0:
        await asyncio.sleep(min(left, 0.25))
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]


def summarize(
    strategy: str,
    counters: Counters,
    w0: float,
    w1: float,
    cpu: CpuUse,
    fleet: Fleet,
) -> Leg:
    window = w1 - w0
    done = [d for d in counters.done if w0 <= d.t_done < w1]
    wasted = [w for w in counters.wasted if w0 <= w.t < w1]
    syncs = [s for s in counters.syncs if w0 <= s.start < w1]
    ok_syncs = [s for s in syncs if s.error is None]
    errors = [e for t, e in counters.errors if w0 <= t < w1]
    latencies = [d.t_done - d.t_first for d in done]
    tokens = sum(d.tokens for d in done)
    phase_names = sorted({name for s in ok_syncs for name in s.phases}, key=lambda n: _PHASE_ORDER.get(n, 99))
    phases = {n: statistics.fmean(s.phases.get(n, 0.0) for s in ok_syncs) for n in phase_names}
    in_sync = sum(max(0.0, min(s.start + s.seconds, w1) - max(s.start, w0)) for s in counters.syncs)
    return Leg(
        strategy=strategy,
        label=STRATEGIES[strategy],
        window_s=window,
        completed=len(done),
        useful_tokens=tokens,
        useful_tok_s=tokens / window,
        wasted_tokens=sum(w.tokens for w in wasted),
        wasted_attempts=len(wasted),
        latency_mean_s=statistics.fmean(latencies) if latencies else math.nan,
        latency_p50_s=percentile(latencies, 0.50),
        latency_p99_s=percentile(latencies, 0.99),
        syncs=len(syncs),
        sync_failures=len(syncs) - len(ok_syncs),
        sync_mean_s=statistics.fmean(s.seconds for s in ok_syncs) if ok_syncs else math.nan,
        sync_max_s=max((s.seconds for s in ok_syncs), default=math.nan),
        sync_phases_mean_s=phases,
        paused_share=in_sync / window,
        aborted_per_sync=statistics.fmean(s.aborted_requests for s in ok_syncs) if ok_syncs else 0.0,
        interrupted_requests=sum(1 for d in done if d.interruptions),
        interruptions=sum(d.interruptions for d in done),
        reprefill_tokens=sum(d.reprefill_tokens for d in done),
        restarts=sum(d.attempts - 1 for d in done),
        length_mismatches=sum(1 for d in done if not d.length_ok),
        errors=len(errors),
        error_samples=[*dict.fromkeys(errors)][:5] + [s.error for s in syncs if s.error][:3],
        cpu=cpu,
        useful_tok_per_replica_cpu_s=tokens / (cpu.replicas * window) if cpu.replicas > 0 else math.nan,
        commands=fleet.commands,
    )


_PHASE_ORDER = {
    n: i
    for i, n in enumerate(
        [
            "pause_routing",
            "pause_replicas",
            "loop_back",
            "drain_replicas",
            "drain_router",
            "load_weights",
            "publish_version",
            "resume_replicas",
            "resume_routing",
        ]
    )
}


def run_strategy(strategy: str, args: argparse.Namespace, log_dir: Path, first_version: int) -> Leg:
    with Procs(log_dir) as procs:
        try:
            fleet = start_fleet(procs, strategy, args)
            print(f"  fleet up: router {fleet.router_url}, replicas {' '.join(fleet.worker_urls)}", flush=True)
            return asyncio.run(run_load(strategy, fleet, args, first_version))
        finally:
            procs.stop_all()


# ---- report ----------------------------------------------------------------------------------------------------


def print_report(legs: list[Leg], args: argparse.Namespace) -> dict[str, float]:
    lengths = (
        str(args.max_new_tokens) if args.min_new_tokens is None else f"{args.min_new_tokens}..{args.max_new_tokens}"
    )
    print(
        f"\nload: {args.concurrency} clients, {args.prompt_len} prompt ids, max_new_tokens {lengths}, "
        f"temperature 1.0, ignore_eos; {args.replicas} replica(s) x dp {args.dp_size}, policy least_load; "
        f"sync every {args.sync_interval:g} s; window {args.duration:g} s after {args.warmup:g} s warm-up"
    )
    median = {
        st: statistics.median(leg.useful_tok_s for leg in legs if leg.strategy == st)
        for st in STRATEGIES
        if any(leg.strategy == st for leg in legs)
    }
    head = (
        f"{'strategy':<25} {'done':>5} {'useful tok/s':>12} {'ceil':>4} {'tok/cpu-s':>9} {'wasted tok':>10} "
        f"{'lat mean':>8} {'p50':>5} {'p99':>5} {'syncs':>5} {'sync mean':>9} {'sync max':>8} {'in sync':>7} "
        f"{'repl':>4} {'rtr':>4} {'bnch':>4} {'othr':>4}"
    )
    print(head)
    print("-" * len(head))
    for leg in legs:
        label = leg.label + (f" #{leg.round}" if args.repeat > 1 else "")
        ceiling = fmt(leg.useful_tok_s / median["n"], ".0%") if median.get("n") else "-"
        print(
            f"{label:<25} {leg.completed:>5} {leg.useful_tok_s:>12.1f} {ceiling:>4} "
            f"{fmt(leg.useful_tok_per_replica_cpu_s, '.0f'):>9} {leg.wasted_tokens:>10} "
            f"{fmt(leg.latency_mean_s):>8} {fmt(leg.latency_p50_s):>5} {fmt(leg.latency_p99_s):>5} "
            f"{leg.syncs:>5} {fmt(leg.sync_mean_s, '.3f'):>9} {fmt(leg.sync_max_s, '.3f'):>8} "
            f"{leg.paused_share:>7.0%} {leg.cpu.replicas:>4.2f} {leg.cpu.router:>4.2f} {leg.cpu.bench:>4.2f} "
            f"{leg.cpu.others:>4.2f}"
        )
    print(
        "(latency, sync: seconds; 'ceil': share of the no-sync run's useful tok/s; 'tok/cpu-s': useful tokens "
        "per CPU second of the replicas\n (robust to other jobs, blind to idle time); 'in sync': share of the window "
        "inside a sync call; 'repl' / 'rtr' / 'bnch' / 'othr': cores used by the replicas / the router / this "
        "bench (clients, coordinator) / anything else, e.g. other jobs on a shared box)"
    )
    for leg in legs:
        phases = ", ".join(f"{k} {v * 1000:.0f}" for k, v in leg.sync_phases_mean_s.items())
        label = leg.label + (f" #{leg.round}" if args.repeat > 1 else "")
        if leg.strategy != "n":
            print(f"  {label}: sync phases (mean ms) {phases or '-'}")
        if leg.strategy == "a":
            print(
                f"      interrupted requests {leg.interrupted_requests} ({leg.interruptions} loop-backs, "
                f"{leg.reprefill_tokens} tokens re-prefilled), aborted/sync {leg.aborted_per_sync:.1f}"
            )
        if leg.strategy == "b":
            print(
                f"      restarts {leg.restarts} ({leg.wasted_attempts} aborted attempts in the window), "
                f"aborted/sync {leg.aborted_per_sync:.1f}"
            )
        if leg.length_mismatches:
            print(f"      {leg.length_mismatches} answers not max_new_tokens long")
        if leg.errors or leg.sync_failures:
            print(f"      errors {leg.errors}, failed syncs {leg.sync_failures}: {leg.error_samples}")
    ratios: dict[str, float] = {}
    what = "median useful tok/s" if args.repeat > 1 else "useful tok/s"
    for other in ("b", "c"):
        if "a" in median and other in median:
            ratios[f"a/{other}"] = ratio(median["a"], median[other])
            print(f"{what} (a)/({other}) = {fmt(ratios[f'a/{other}'])}")
    return ratios


def write_json(legs: list[Leg], ratios: dict[str, float], args: argparse.Namespace) -> Path:
    path = args.out_dir / f"partial_rollout_{args.stamp}.json"
    payload = {
        "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "environment": {**environment(), "loadavg_at_end": os.getloadavg()},
        "legs": [asdict(leg) for leg in legs],
        "ratios_useful_tok_s": ratios,
    }
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


# ---- main -----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--strategies",
        nargs="+",
        choices=list(STRATEGIES),
        default=list(STRATEGIES),
        help="a: partial rollout, b: abort+restart, c: drain, n: no syncs (the ceiling)",
    )
    p.add_argument("--duration", type=float, default=30.0, help="measured window per strategy, s")
    p.add_argument("--warmup", type=float, default=6.0, help="load (and syncs) before the window, s")
    p.add_argument("--sync-interval", type=float, default=3.0, help="s between sync starts")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent clients")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--min-new-tokens", type=int, default=None, help="draw each prompt's max_new_tokens from [min, max] (uniform)"
    )
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--engine", choices=("reference", "vllm"), default="reference", help="the replicas' engine")
    p.add_argument("--model", type=Path, default=None, help="--engine vllm: model folder with model.safetensors")
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=120.0, help="per request, s")
    p.add_argument("--sync-timeout", type=float, default=60.0, help="per sync RPC / drain / loop-back wait, s")
    p.add_argument("--ready-timeout", type=float, default=90.0, help="s to wait for a replica or the router")
    p.add_argument(
        "--pin",
        action="store_true",
        help="replicas on the last CPU, the router and the bench (and its clients) on the others",
    )
    p.add_argument("--deadline", type=float, default=900.0, help="abort (and clean up) after this many s")
    p.add_argument("--repeat", type=int, default=1, help="rounds over the strategies (order alternates)")
    p.add_argument("--quick", action="store_true", help="10 s window after 4 s warm-up, one round")
    args = p.parse_args(argv)
    if args.min_new_tokens is not None and not 1 <= args.min_new_tokens <= args.max_new_tokens:
        p.error("--min-new-tokens must be in [1, --max-new-tokens]")
    if args.quick:
        args.duration, args.warmup, args.repeat = min(args.duration, 10.0), min(args.warmup, 4.0), 1
    args.id_base = 1_000_000
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out_dir = OUT_DIR
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.pin:
        available = sorted(os.sched_getaffinity(0))
        if len(available) < 2:
            sys.exit("--pin needs at least 2 CPUs")
        REPLICA_CPUS.add(available[-1])
        os.sched_setaffinity(0, set(available[:-1]))  # the bench, and the router it starts
        print(f"pinned: replicas on CPU {available[-1]}, router and bench on {available[:-1]}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.engine == "vllm":
        prepare_vllm_model(args)
    log_dir = args.out_dir / "logs" / f"partial_rollout_{args.stamp}"
    install_signal_handlers(args.deadline)
    legs: list[Leg] = []
    try:
        for rnd in range(1, args.repeat + 1):
            order = args.strategies if rnd % 2 else args.strategies[::-1]  # alternate: drift hits both ends
            for strategy in order:
                tag = f" (round {rnd})" if args.repeat > 1 else ""
                print(f"{STRATEGIES[strategy]}{tag}: starting {args.replicas} replica(s) and the router", flush=True)
                args.id_base = 1_000_000 * (len(legs) + 1)
                leg = run_strategy(strategy, args, log_dir / f"r{rnd}", first_version=0)
                leg.round = rnd
                legs.append(leg)
                print(
                    f"  {leg.completed} done, {leg.useful_tok_s:.1f} useful tok/s, {leg.syncs} syncs "
                    f"(mean {fmt(leg.sync_mean_s, '.3f')} s), {leg.errors} errors",
                    flush=True,
                )
    finally:
        signal.alarm(0)
        if legs:
            ratios = print_report(legs, args)
            print(f"\nJSON: {write_json(legs, ratios, args).relative_to(REPO)}")
        print(f"logs: {log_dir.relative_to(REPO)}")


if __name__ == "__main__":
    main()
