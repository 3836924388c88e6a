"""Instructions per request of our router, the floor leg and smg, counted by valgrind's callgrind.

CPU time on a shared 2-core VM moves 20% from one run to the next, so a change worth a few percent needs many
paired windows (router_overhead.py --together). An instruction count moves about 2% (count two trees in one
run, --ab-src, to compare them): each router runs under callgrind behind the same two reference replicas, gets
--warmup requests on one kept-alive connection, then has its counters zeroed, gets --requests more, and has
them dumped. What it counts is user-space instructions of every thread of the process (its Python, the C
libraries it calls: curl, protobuf, msgspec, uvloop), not the kernel's system calls, cache misses or waits; so
it ranks changes of our own code closely, and compares routers only on the work their code does (a compiled
router does the same work in fewer instructions).

Per router and load: instructions per request, the ratio to our router's, and the shared objects the
instructions ran in (self cost: libpython is the interpreter running Python code).

Run from the repo root with the venv active (valgrind must be installed; about 2 minutes a router):
    python bench/router_instructions.py                      # ours and the floor on /generate
    python bench/router_instructions.py --ab-src /tmp/old    # also another tree of ours (git archive + _proto)
    python bench/router_instructions.py --smg --loads generate chat
Results: a table on stdout, JSON under bench/out/, logs and callgrind files under bench/out/logs/<stamp>/.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import router_overhead as ro
from benchlib import Procs, free_port, install_signal_handlers

_COST_LINE = re.compile(r"^(?:[+-]?\d+|\*)\s+(\d+)")  # a position (absolute, relative or the same) and its cost


def read_dump(path: Path) -> tuple[int, dict[str, float]]:
    """The dump's instructions (its `summary`: what ran between the zeroing and the dump) and each shared
    object's share of them (self cost: a call's inclusive line is skipped)."""
    names: dict[str, str] = {}
    by_object: collections.Counter[str] = collections.Counter()
    summary, obj, skip_next = 0, "?", False
    for line in path.read_text(errors="replace").splitlines():
        if not line:
            continue
        if line[0].isdigit() or line[0] in "+-*":
            if skip_next:  # the inclusive cost of the call named on the line before
                skip_next = False
                continue
            m = _COST_LINE.match(line)
            if m:
                by_object[obj] += int(m.group(1))
            continue
        key, _, value = line.partition("=")
        if key in ("ob", "cob"):
            m = re.match(r"\((\d+)\)(?: (.*))?", value)
            if m and m.group(2) is not None:
                names[m.group(1)] = m.group(2)
            if key == "ob":
                obj = (names.get(m.group(1), value) if m else value).rsplit("/", 1)[-1]
        elif key == "calls":
            skip_next = True
        elif line.startswith("summary:"):
            summary = int(line.split()[1])
    counted = sum(by_object.values()) or 1
    return summary, {o: n / counted for o, n in by_object.most_common(8)}


class Client:
    """One kept-alive HTTP connection sending the load's request, as wrk at 1 connection would."""

    def __init__(self, port: int, load: ro.Load) -> None:
        self.conn = http.client.HTTPConnection(ro.HOST, port, timeout=120)
        self.load = load

    def send(self, n: int) -> None:
        for _ in range(n):
            self.conn.request("POST", self.load.path, self.load.body, {"content-type": "application/json"})
            response = self.conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise ro.Unavailable(f"{self.load.path} answered {response.status}: {body[:200]!r}")


def count(
    procs: Procs, name: str, argv: list[str], port: int, loads: list[ro.Load], args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """Start `argv` under callgrind and count each load's instructions per request."""
    valgrind = ["valgrind", "--tool=callgrind", "--dump-instr=no", f"--callgrind-out-file={out / name}.%p.out"]
    print(f"{name}: {' '.join(argv)}", flush=True)
    workers = 2 if name.startswith("psrl") else 0
    proc = ro.launch_router(procs, name, [*valgrind, *argv], port, loads[0], args.ready_timeout, workers)
    result: dict[str, Any] = {}
    try:
        for load in loads:
            client = Client(port, load)
            client.send(args.warmup)
            subprocess.run(["callgrind_control", "--zero", str(proc.pid)], check=True, capture_output=True)
            client.send(args.requests)
            before = set(out.glob(f"{name}.{proc.pid}.out.*"))
            subprocess.run(["callgrind_control", "--dump", str(proc.pid)], check=True, capture_output=True)
            dumps = sorted(set(out.glob(f"{name}.{proc.pid}.out.*")) - before)
            client.conn.close()
            total, shares = read_dump(dumps[-1])
            per_request = total / args.requests
            result[load.name] = {
                "instructions_per_request": per_request,
                "by_object": {o: share * per_request for o, share in shares.items()},
            }
            print(f"  {load.name}: {total / args.requests:,.0f} instructions a request", flush=True)
    finally:
        procs.stop(proc, grace_s=30)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loads", nargs="+", choices=["generate", "chat"], default=["generate"])
    p.add_argument("--requests", type=int, default=300, help="requests counted, after the warm-up")
    p.add_argument("--warmup", type=int, default=300, help="requests before counting (caches, first calls)")
    p.add_argument("--ab-src", metavar="DIR", help="also count the router from DIR/psrl (see router_overhead.py)")
    p.add_argument("--smg", action="store_true", help="also count smg (slow under valgrind: its start takes ~1 min)")
    p.add_argument("--no-floor", action="store_true", help="skip bench/floor_router.py")
    p.add_argument("--prompt-words", type=int, default=200, help="the chat prompt's words, /generate's ids")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--ready-timeout", type=float, default=600.0, help="a router's start under valgrind, s")
    p.add_argument("--deadline", type=float, default=3600.0)
    args = p.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    install_signal_handlers(args.deadline)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = ro.OUT_DIR / "logs" / stamp
    out.mkdir(parents=True, exist_ok=True)
    ro_args = argparse.Namespace(torch_threads=args.torch_threads, router_src=None)

    results: dict[str, dict[str, Any]] = {}
    with Procs(out) as procs:
        replicas, model = ro.start_replicas(procs, ro_args, 2)
        urls = [url for _, url in replicas]
        loads = {
            "generate": ro.generate_load(model, args.prompt_words),
            "chat": ro.chat_load(model, args.prompt_words, 1),
        }
        chosen = [loads[name] for name in args.loads]
        ours = ["--host", ro.HOST, "--worker-urls", *urls, "--policy", "round_robin"]
        targets: list[tuple[str, list[str], list[ro.Load]]] = []
        for suffix, src in [("", None), *([("-b", args.ab_src)] if args.ab_src else [])]:
            targets.append((f"psrl-router{suffix}", [*ro.psrl_argv(ro_args, "psrl.router", src), *ours], chosen))
        if not args.no_floor and any(load.path == "/generate" for load in chosen):
            floor = [sys.executable, str(ro.REPO / "bench" / "floor_router.py"), "--host", ro.HOST]
            targets.append(("floor", [*floor, "--worker-urls", *urls], [loads["generate"]]))
        smg = ro.find_tool("smg")
        if args.smg and smg:
            argv = [smg, "launch", "--host", ro.HOST, "--worker-urls", *urls, "--policy", "round_robin"]
            targets.append(("smg", [*argv, "--log-level", "warn"], chosen))
        elif args.smg:
            print("smg is not installed (pip install smg): skipped", flush=True)
        for name, argv, target_loads in targets:
            port = free_port()
            results[name] = count(procs, name, [*argv, "--port", str(port)], port, target_loads, args, out)

    print(f"\nInstructions per request (callgrind, 1 connection, {args.requests} requests after {args.warmup})")
    print(f"{'target':18} {'load':9} {'instructions':>13} {'x ours':>7}  top shared objects (self)")
    for name, per_load in results.items():
        for load_name, row in per_load.items():
            base = results["psrl-router"].get(load_name, {}).get("instructions_per_request")
            ratio = f"{row['instructions_per_request'] / base:.2f}" if base else "-"
            top = ", ".join(f"{o} {n / 1000:.0f}K" for o, n in list(row["by_object"].items())[:4])
            print(f"{name:18} {load_name:9} {row['instructions_per_request']:13,.0f} {ratio:>7}  {top}")
    path = ro.OUT_DIR / f"router_instructions_{stamp}.json"
    path.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"\nJSON: {path.relative_to(ro.REPO)}\nlogs: {out.relative_to(ro.REPO)}")


if __name__ == "__main__":
    main()
