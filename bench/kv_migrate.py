"""Host KV-block gather/scatter bandwidth (psrl.kv) against a plain memcpy of the same bytes.

Gathers and scatters blocks at random ids of a larger paged cache (vLLM layout, all layers per call)
and compares with `np.copyto` between two contiguous buffers of the same size; reports medians.
Run: python bench/kv_migrate.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import psrl.kv as kv
from psrl import _kvx


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
    return Row(num_ids, nbytes, nbytes / t_memcpy / 1e9, nbytes / t_gather / 1e9, nbytes / t_scatter / 1e9)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller cache, fewer sizes and repeats")
    parser.add_argument("--threads", type=int, default=0, help="gather/scatter threads (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    cfg = BenchConfig(num_threads=args.threads)
    if args.quick:
        cfg = BenchConfig(cache_blocks=512, id_counts=(64, 256), repeats=5, num_threads=args.threads)
    rng = np.random.default_rng(args.seed)
    shape = (2, cfg.cache_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_size)
    caches = []
    for _ in range(cfg.num_layers):
        cache = np.empty(shape, dtype=np.float16)
        cache.fill(1)  # touch every page before timing
        caches.append(cache)
    rows = [measure(cfg, caches, n, rng) for n in cfg.id_counts]
    print_table(cfg, rows)


if __name__ == "__main__":
    main()
