"""Router overhead: the same request load against a backend directly, through our router, smg and vllm-router.

Two sections, each self-contained (it starts its backends and routers on 127.0.0.1 and stops all of them):

- http: two fast fixed-answer OpenAI-compatible backends (bench/fast_backend.py). Legs: B1 directly (baseline);
  `python -m psrl.router --connection-mode http`; `smg launch`; `vllm-router` (when installed). Load: POST
  /v1/chat/completions with a ~200-word user message, non-streaming.
- grpc: two reference replicas (`python -m psrl.worker`, VllmEngine over gRPC). Legs: our router and smg in gRPC
  mode. Loads: chat completions with max_tokens=1, and POST /generate with ~200 input_ids (where the router
  serves it). The tiny CPU model takes a share of the machine here, so read the router's CPU per request,
  not the request rate. With --floor, also bench/floor_router.py on /generate: the least a router on our
  HTTP server and gRPC client does per request, so what our router spends beyond it is its middle.

With --floor the http section also runs bench/floor_router.py as a plain proxy (each POST forwarded as it came
over our HTTP client): the least our two HTTP edges cost, against which the proxied path's middle shows.

Every leg runs at each --connections value (default 64 and 1): a warm-up, then --repeat measured windows of
--duration seconds (median reported, min-max shown). Before each window the bench waits (up to --quiet-wait s)
until the rest of the machine is quiet, and it reports how many cores others used during the window, since on
a shared box other jobs skew both the rates and the CPU figures. The load generator is wrk (with a generated
Lua script) when installed, else an asyncio raw-socket client. --interleave runs the windows in rounds over
the routers; --together loads every router of a section in the same windows, each through its own load
generator, and reports the per-window ratios (see bench/README.md).

Per leg: req/s, p50/p99 latency, errors (socket errors, timeouts and non-2xx answers), and the CPU the router's
process tree spent in the window (utime+stime from /proc/<pid>/stat, all threads, summed over the process and
its descendants) divided by the requests completed: microseconds of router CPU per request. The same figure
for the backends shows they are not the bottleneck. With --profile, our router is also sampled with py-spy
under the highest concurrency (a separate, unmeasured window) and its hot spots printed.

Run from the repo root: python bench/router_overhead.py [--quick] [--sections http grpc] [--profile]
Results: a table on stdout, JSON under bench/out/, process logs under bench/out/logs/<stamp>/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import benchlib
from benchlib import (
    CLK_TCK,
    Procs,
    free_port,
    install_signal_handlers,
    log_tail,
    machine_busy_s,
    signal_group,
    wait_for_log,
)

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "bench" / "out"
HOST = "127.0.0.1"
HTTP_MODEL = "bench-model"  # what bench/fast_backend.py serves
ROUTER_CPUS: set[int] = set()  # --pin: the routers' CPUs (everything else keeps the bench's, the rest)

_PROSE = (
    "the router keeps every rollout alive while weights change and replicas answer requests from agents that "
    "want tokens back quickly so each trajectory moves forward through prompt groups versions and caches"
)
WORDS = _PROSE.split()

# Runs a module from another source tree, bypassing the editable install's import redirect (for --router-src).
_RUN_FROM_SRC = (
    "import runpy,sys;src,mod=sys.argv[1],sys.argv[2];"
    "sys.meta_path[:]=[f for f in sys.meta_path if 'ScikitBuild' not in type(f).__name__];"
    "sys.path.insert(0,src);sys.argv=[mod,*sys.argv[3:]];runpy.run_module(mod,run_name='__main__',alter_sys=True)"
)


class Unavailable(Exception):
    """A leg that cannot run here (tool not installed, router would not start, probe failed)."""


# ---- request bodies -------------------------------------------------------------------------------------------


def prompt_text(n_words: int) -> str:
    return " ".join(WORDS[(i * 7 + i // len(WORDS)) % len(WORDS)] for i in range(n_words))


@dataclass(frozen=True)
class Load:
    name: str
    path: str
    body: bytes
    expect: str  # a key the JSON answer (for a stream: its last event before [DONE]) must carry
    tokens: int = 1  # tokens each request generates (a stream's us/token is its us/req over this)


def chat_load(model: str, n_words: int, max_tokens: int) -> Load:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt_text(n_words)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": False,
    }
    return Load("chat", "/v1/chat/completions", json.dumps(body).encode(), "choices")


def stream_load(model: str, n_words: int, max_tokens: int) -> Load:
    """Chat streamed: every one of `max_tokens` tokens (ignore_eos) is an SSE event; the usage comes last."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt_text(n_words)}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return Load("stream", "/v1/chat/completions", json.dumps(body).encode(), "usage", max_tokens)


def generate_load(model: str, n_ids: int) -> Load:
    ids = [3 + (i * 37) % 600 for i in range(n_ids)]
    body = {"model": model, "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    return Load("generate", "/generate", json.dumps(body).encode(), "output_ids")


# ---- processes ------------------------------------------------------------------------------------------------


def find_tool(name: str) -> str | None:
    """A console script from this venv first, then PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


# ---- HTTP helpers ---------------------------------------------------------------------------------------------

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only: never via a proxy


def http(method: str, url: str, body: bytes | None = None, timeout_s: float = 10.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e).encode()


def probe(base_url: str, load: Load, timeout_s: float = 30.0) -> dict[str, Any]:
    """One request of the load; its JSON answer, or Unavailable with what came back."""
    status, raw = http("POST", base_url + load.path, load.body, timeout_s)
    try:
        answer = json.loads(last_sse_event(raw) if raw.startswith(b"data:") else raw) if status == 200 else None
    except ValueError:
        answer = None
    if isinstance(answer, dict) and load.tokens > 1 and answer.get("usage", {}).get("completion_tokens") != load.tokens:
        raise Unavailable(f"probe POST {load.path}: wanted {load.tokens} tokens, usage says {answer.get('usage')}")
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]  # smg answers /generate with a one-element batch
    if not isinstance(answer, dict) or load.expect not in answer:
        raise Unavailable(f"probe POST {load.path} -> {status}: {raw[:300].decode(errors='replace')}")
    return answer


def last_sse_event(raw: bytes) -> bytes:
    """The data of a stream's last event before `[DONE]` (b"" when it did not end with one)."""
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    return events[-2] if len(events) >= 2 and events[-1] == b"[DONE]" else b""


def wait_until(fn: Any, timeout_s: float, proc: subprocess.Popen[bytes] | None, what: str, log: Path) -> Any:
    """Call fn() until it returns without Unavailable; the last error when the time runs out or proc exits."""
    deadline = time.monotonic() + timeout_s
    last = "not tried"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise Unavailable(f"{what} exited with rc={proc.returncode}: {log_tail(log)}")
        try:
            return fn()
        except Unavailable as e:
            last = str(e)
        time.sleep(0.25)
    raise Unavailable(f"{what} not ready within {timeout_s:.0f}s: {last}")


# ---- CPU accounting -------------------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # fields from the 3rd on (comm may hold spaces)


def tree_pids(root: int) -> list[int]:
    """root and all its descendants (by ppid), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_ticks(pids: list[int]) -> dict[int, int]:
    """utime+stime per pid (all threads of each process, including exited ones), in clock ticks."""
    out = {}
    for pid in pids:
        fields = _stat_fields(pid)
        if fields:
            out[pid] = int(fields[11]) + int(fields[12])  # stat fields 14 and 15
    return out


class CpuMeter:
    """CPU seconds spent by process trees between start() and stop()."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = roots
        self.before: dict[int, int] = {}

    def _sample(self) -> dict[int, int]:
        return cpu_ticks([p for root in self.roots for p in tree_pids(root)])

    def start(self) -> None:
        self.before = self._sample()

    def stop(self) -> float:
        after = self._sample()
        ticks = sum(t - self.before.get(pid, 0) for pid, t in after.items())
        return ticks / CLK_TCK


def own_cpu_s() -> float:
    """This process plus its reaped children (the wrk runs): the load generator's side."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class CpuSplit:
    wall_s: float
    router_s: float
    backend_s: float
    loadgen_s: float
    machine_s: float

    @property
    def foreign_cores(self) -> float:
        """Cores busy with anything else on the machine (other people's jobs, the kernel's own work)."""
        return max(0.0, self.machine_s - self.router_s - self.backend_s - self.loadgen_s) / max(self.wall_s, 1e-9)


class CpuWindow:
    """Router tree, backend trees, load generator and the whole machine, over one window."""

    def __init__(self, router_pid: int | None, backend_pids: list[int]) -> None:
        self.router = CpuMeter([router_pid] if router_pid else [])
        self.backends = CpuMeter(backend_pids)
        self.t0 = self.own0 = self.machine0 = 0.0

    def start(self) -> None:
        self.router.start()
        self.backends.start()
        self.own0, self.machine0, self.t0 = own_cpu_s(), machine_busy_s(), time.monotonic()

    def stop(self) -> CpuSplit:
        wall, machine, own = time.monotonic() - self.t0, machine_busy_s() - self.machine0, own_cpu_s() - self.own0
        return CpuSplit(wall, self.router.stop(), self.backends.stop(), own, machine)


def wait_quiet(router_pid: int | None, backend_pids: list[int], args: argparse.Namespace) -> float:
    """Wait (at most --quiet-wait s) until others use under --quiet-cores; returns the last figure seen."""
    deadline = time.monotonic() + args.quiet_wait
    waited = False
    while True:
        window = CpuWindow(router_pid, backend_pids)
        window.start()
        time.sleep(0.5)
        foreign = window.stop().foreign_cores
        if foreign <= args.quiet_cores or time.monotonic() >= deadline:
            if waited:
                print(f"    (waited for a quieter machine: others now use {foreign:.2f} cores)", flush=True)
            return foreign
        waited = True


# ---- load generators ------------------------------------------------------------------------------------------


@dataclass
class LoadResult:
    requests: int
    duration_s: float
    p50_ms: float
    p99_ms: float
    socket_errors: int
    non2xx: int

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def ok(self) -> int:
        return max(0, self.requests - self.non2xx)


_WRK_DONE = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK_RESULT {\"requests\":%d,\"duration_us\":%d,\"p50_us\":%.0f,\"p99_us\":%.0f," ..
    "\"connect\":%d,\"read\":%d,\"write\":%d,\"timeout\":%d,\"status\":%d}\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect, e.read, e.write, e.timeout, e.status))
end
"""


class Wrk:
    """wrk with a generated Lua script: fixed POST body, results printed as one JSON line by done()."""

    name = "wrk"

    def __init__(self, exe: str, tmp_dir: Path) -> None:
        self.exe = exe
        self.tmp_dir = tmp_dir
        self.scripts: dict[Load, Path] = {}
        self._lock = threading.Lock()  # --together runs one wrk per router from threads

    def _script(self, load: Load) -> Path:
        with self._lock:
            if load not in self.scripts:
                path = self.tmp_dir / f"wrk_{load.name}_{len(self.scripts)}.lua"
                body = load.body.decode()
                assert "]==]" not in body
                path.write_text(
                    'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                    f"wrk.body = [==[{body}]==]\n{_WRK_DONE}"
                )
                self.scripts[load] = path
            return self.scripts[load]

    def run(self, base_url: str, load: Load, conns: int, duration_s: float, timeout_s: float) -> LoadResult:
        threads = 1 if conns < 128 else 2  # one wrk thread drives 64 keep-alive connections far past any router here
        argv = [self.exe, f"-t{threads}", f"-c{conns}", f"-d{max(1, round(duration_s))}s", f"--timeout={timeout_s:g}s"]
        argv += ["-s", str(self._script(load)), base_url + load.path]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + timeout_s + 30)
        match = re.search(r"WRK_RESULT (\{.*\})", done.stdout)
        if done.returncode != 0 or not match:
            raise RuntimeError(f"wrk failed (rc={done.returncode}): {done.stdout[-500:]} {done.stderr[-500:]}")
        r = json.loads(match.group(1))
        return LoadResult(
            requests=r["requests"],
            duration_s=r["duration_us"] / 1e6,
            p50_ms=r["p50_us"] / 1e3,
            p99_ms=r["p99_us"] / 1e3,
            socket_errors=r["connect"] + r["read"] + r["write"] + r["timeout"],
            non2xx=r["status"],
        )


class PyLoad:
    """Fallback load generator: asyncio raw sockets, HTTP/1.1 keep-alive, one request in flight per connection."""

    name = "python-asyncio"

    def run(self, base_url: str, load: Load, conns: int, duration_s: float, timeout_s: float) -> LoadResult:
        host, port = base_url.removeprefix("http://").rsplit(":", 1)
        head = f"POST {load.path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        request = head.encode() + b"Content-Length: %d\r\n\r\n" % len(load.body) + load.body
        return asyncio.run(self._run(host, int(port), request, conns, duration_s, timeout_s))

    async def _run(
        self, host: str, port: int, request: bytes, conns: int, duration_s: float, timeout_s: float
    ) -> LoadResult:
        latencies: list[float] = []
        counts = Counter[str]()
        start = time.perf_counter()
        deadline = start + duration_s
        await asyncio.gather(
            *(self._conn(host, port, request, deadline, timeout_s, latencies, counts) for _ in range(conns))
        )
        elapsed = time.perf_counter() - start
        latencies.sort()
        return LoadResult(
            requests=counts["done"],
            duration_s=elapsed,
            p50_ms=_percentile(latencies, 50) * 1e3,
            p99_ms=_percentile(latencies, 99) * 1e3,
            socket_errors=counts["error"],
            non2xx=counts["non2xx"],
        )

    async def _conn(
        self,
        host: str,
        port: int,
        request: bytes,
        deadline: float,
        timeout_s: float,
        latencies: list[float],
        counts: Counter[str],
    ) -> None:
        writer = None
        while time.perf_counter() < deadline:
            try:
                if writer is None:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
                t0 = time.perf_counter()
                writer.write(request)
                status = await asyncio.wait_for(_read_response(reader), timeout_s)
                latencies.append(time.perf_counter() - t0)
                counts["done"] += 1
                counts["non2xx"] += not 200 <= status < 300
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
                counts["error"] += 1
                if writer is not None:
                    writer.close()
                writer = None
        if writer is not None:
            writer.close()


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    else:
        await reader.readexactly(int(headers.get("content-length", "0")))
    return status


def _percentile(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * pct / 100))]


LoadGen = Wrk | PyLoad


def pick_loadgen(choice: str, tmp_dir: Path) -> LoadGen:
    exe = shutil.which("wrk")
    if choice == "wrk" and not exe:
        sys.exit("wrk not found (Debian: apt-get install wrk)")
    if exe and choice in ("auto", "wrk"):
        return Wrk(exe, tmp_dir)
    if choice == "auto":
        print("note: wrk not found (apt-get install wrk); using the slower asyncio client, which shares the CPU")
    return PyLoad()


# ---- measurement ----------------------------------------------------------------------------------------------


@dataclass
class Target:
    section: str
    name: str
    base_url: str
    router_pid: int | None  # None for the direct leg
    command: list[str]
    loads: list[Load]


@dataclass
class Window:
    """One measured window of a leg."""

    requests: int
    duration_s: float
    rps: float
    p50_ms: float
    p99_ms: float
    socket_errors: int
    non2xx: int
    router_us_per_req: float | None
    router_cores: float | None
    backend_us_per_req: float
    loadgen_cores: float
    foreign_cores: float


@dataclass
class LegResult:
    """A leg: the median window by router CPU per request (by req/s for the direct leg), and the spread."""

    section: str
    target: str
    load: str
    conns: int
    rps: float
    p50_ms: float
    p99_ms: float
    socket_errors: int
    non2xx: int
    router_us_per_req: float | None
    router_us_min: float | None
    router_us_max: float | None
    router_cores: float | None
    backend_us_per_req: float
    foreign_cores: float  # the most seen in any window
    windows: list[Window]
    tokens: int = 1  # tokens each request generated
    vs_smg: float | None = None


@dataclass
class Skip:
    section: str
    target: str
    reason: str


@dataclass
class Run:
    legs: list[LegResult] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    commands: dict[str, list[str]] = field(default_factory=dict)
    profiles: dict[str, Any] = field(default_factory=dict)
    probes: dict[str, Any] = field(default_factory=dict)  # usage / meta_info of each load's probe answer


def measure_window(
    target: Target, load: Load, conns: int, backend_pids: list[int], gen: LoadGen, args: argparse.Namespace
) -> Window:
    window = CpuWindow(target.router_pid, backend_pids)
    window.start()
    res = gen.run(target.base_url, load, conns, args.duration, args.timeout)
    cpu = window.stop()
    router_s = cpu.router_s if target.router_pid is not None else None
    return window_of(res, router_s, cpu.wall_s, cpu.backend_s / max(res.requests, 1), cpu.loadgen_s, cpu.foreign_cores)


def window_of(
    res: LoadResult, router_s: float | None, wall_s: float, backend_s_per_req: float, loadgen_s: float, foreign: float
) -> Window:
    """A window's figures from its load result and CPU seconds (`router_s` None: no router in the path)."""
    done = max(res.requests, 1)
    return Window(
        requests=res.requests,
        duration_s=round(res.duration_s, 3),
        rps=round(res.rps, 1),
        p50_ms=round(res.p50_ms, 3),
        p99_ms=round(res.p99_ms, 3),
        socket_errors=res.socket_errors,
        non2xx=res.non2xx,
        router_us_per_req=round(router_s / done * 1e6, 1) if router_s is not None else None,
        router_cores=round(router_s / wall_s, 2) if router_s is not None else None,
        backend_us_per_req=round(backend_s_per_req * 1e6, 1),
        loadgen_cores=round(loadgen_s / wall_s, 2),
        foreign_cores=round(foreign, 2),
    )


def measure(
    target: Target, load: Load, conns: int, backend_pids: list[int], gen: LoadGen, args: argparse.Namespace
) -> LegResult:
    """Warm up once, then --repeat measured windows (each after waiting for a quiet machine)."""
    if args.warmup > 0:
        gen.run(target.base_url, load, conns, args.warmup, args.timeout)
    windows = []
    for _ in range(args.repeat):
        wait_quiet(target.router_pid, backend_pids, args)
        windows.append(measure_window(target, load, conns, backend_pids, gen, args))
    return aggregate(target, load, conns, windows)


def aggregate(target: Target, load: Load, conns: int, windows: list[Window]) -> LegResult:
    us = [w.router_us_per_req for w in windows if w.router_us_per_req is not None]

    def rank(w: Window) -> float:
        return w.router_us_per_req if w.router_us_per_req is not None else -w.rps

    rep = sorted(windows, key=rank)[(len(windows) - 1) // 2]
    return LegResult(
        section=target.section,
        target=target.name,
        load=load.name,
        conns=conns,
        rps=rep.rps,
        p50_ms=rep.p50_ms,
        p99_ms=rep.p99_ms,
        socket_errors=sum(w.socket_errors for w in windows),
        non2xx=sum(w.non2xx for w in windows),
        router_us_per_req=round(statistics.median(us), 1) if us else None,
        router_us_min=min(us) if us else None,
        router_us_max=max(us) if us else None,
        router_cores=rep.router_cores,
        backend_us_per_req=rep.backend_us_per_req,
        foreign_cores=max(w.foreign_cores for w in windows),
        windows=windows,
        tokens=load.tokens,
    )


def run_target(target: Target, backend_pids: list[int], gen: LoadGen, args: argparse.Namespace, run: Run) -> None:
    """Probe each load once, then measure it at every concurrency; loads the target cannot serve are skipped."""
    run.commands[f"{target.section}/{target.name}"] = target.command
    for load in probe_loads(target, run):
        for conns in args.connections:
            leg = measure(target, load, conns, backend_pids, gen, args)
            run.legs.append(leg)
            print(f"  {format_row(leg)}", flush=True)
        if args.profile and target.router_pid and target.name.startswith("psrl"):
            key = f"{target.section}/{target.name}/{load.name}"
            run.profiles[key] = profile(target, load, max(args.connections), gen, args)


def note(run: Run, section: str, target: str, reason: str) -> None:
    run.skips.append(Skip(section, target, reason))
    print(f"  SKIP {section}/{target}: not available: {reason}", flush=True)


# ---- py-spy ---------------------------------------------------------------------------------------------------


def profile(target: Target, load: Load, conns: int, gen: LoadGen, args: argparse.Namespace) -> dict[str, Any]:
    """Sample the router with py-spy under load (a separate, unmeasured window).

    py-spy runs with --gil (only samples where a thread holds the GIL: Python work; idle threads blocked in
    native waits are otherwise sampled as busy here). The per-thread CPU split (/proc/<pid>/task/*/stat), which
    says how much of the process's CPU the GIL-holding thread explains, comes from a window of its own before
    py-spy attaches: py-spy stops every thread for each sample, and that alone bills idle threads (gRPC's
    event_engine threads showed 7-12% of the router's CPU sampled, none unsampled).
    """
    exe = find_tool("py-spy")
    if exe is None:
        return {"error": "py-spy not installed (pip install py-spy)"}
    pid = target.router_pid
    assert pid is not None
    out = args.out_dir / f"pyspy_{args.stamp}_{target.section}_{target.name}_{load.name}.txt"
    seconds = max(2, round(args.profile_duration))
    before = thread_ticks(pid)
    gen.run(target.base_url, load, conns, seconds - 1, args.timeout)
    split = thread_split(pid, before, thread_ticks(pid))
    argv = [exe, "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--function", "--gil"]
    argv += ["--duration", str(seconds), "--output", str(out)]
    spy = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        time.sleep(0.5)
        res = gen.run(target.base_url, load, conns, seconds - 1, args.timeout)
        spy_out, _ = spy.communicate(timeout=seconds + 30)
    finally:
        if spy.poll() is None:
            signal_group(spy, signal.SIGKILL)
            spy.wait()
    if not out.exists():
        return {"error": f"py-spy wrote nothing: {spy_out.decode(errors='replace')[-400:]}"}
    summary = summarize_stacks(out.read_text(), args.profile_top)
    summary["raw_stacks"] = str(out.relative_to(REPO))
    summary["rps_while_sampled"] = round(res.rps, 1)
    summary["thread_cpu_pct"] = split
    return summary


def thread_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """(name, utime+stime ticks) per thread of a process."""
    out = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                out[int(tid)] = (name, int(fields[11]) + int(fields[12]))
    return out


def thread_split(pid: int, before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, float]:
    """Share of the window's process CPU per thread name (the main thread named 'main')."""
    by_name: Counter[str] = Counter()
    for tid, (name, ticks) in after.items():
        by_name["main" if tid == pid else name] += ticks - before.get(tid, (name, 0))[1]
    total = max(sum(by_name.values()), 1)
    return {name: round(100 * n / total, 1) for name, n in by_name.most_common() if n > 0}


def _frame_module(frame: str) -> str:
    """'func (path/to/file.py:12)' -> 'psrl/router/app.py' for our code, else the top-level package."""
    path = frame.rpartition(" (")[2].rstrip(")").rsplit(":", 1)[0]
    return path if path.startswith("psrl/") else path.split("/", 1)[0].removesuffix(".py")


def summarize_stacks(raw: str, top: int) -> dict[str, Any]:
    """From py-spy's collapsed stacks: top functions by self and inclusive samples, and self samples per module."""
    self_n: Counter[str] = Counter()
    incl_n: Counter[str] = Counter()
    module_n: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if frames:
            self_n[frames[-1]] += n
            module_n[_frame_module(frames[-1])] += n
        for frame in set(frames):
            incl_n[frame] += n

    def pct(c: Counter[str], skip_roots: bool = False) -> list[tuple[float, str]]:
        rows = [(round(100 * n / max(total, 1), 1), f) for f, n in c.most_common()]
        return [r for r in rows if not (skip_roots and r[0] >= 98.0)][:top]  # drop frames on every stack

    return {
        "samples": total,
        "self_pct": pct(self_n),
        "inclusive_pct": pct(incl_n, skip_roots=True),
        "self_by_module_pct": pct(module_n),
    }


# ---- launchers ------------------------------------------------------------------------------------------------


def psrl_argv(args: argparse.Namespace, module: str, src: str | None = None, python: str | None = None) -> list[str]:
    """How to start one of our modules: the installed code, or the router from --router-src (or `src`); with
    this interpreter, or `python` (one whose environment has our dependencies installed)."""
    src = src or (args.router_src if module == "psrl.router" else None)
    exe = python or sys.executable
    if src:
        return [exe, "-c", _RUN_FROM_SRC, str(Path(src).resolve()), module]
    return [exe, "-m", module]


def b_leg(args: argparse.Namespace) -> bool:
    """Whether a second build of our router runs beside the first (--ab-src, --ab-python)."""
    return bool(args.ab_src or args.ab_python)


def start_fast_backends(procs: Procs, count: int) -> list[tuple[int, str]]:
    started = []
    for i in range(count):
        name = f"backend{i + 1}"
        proc = procs.start(name, [sys.executable, str(REPO / "bench" / "fast_backend.py"), "--host", HOST])
        started.append((name, proc))
    out = []
    for name, proc in started:
        match = wait_for_log(procs, name, proc, r"FAST_BACKEND_READY (http://\S+)", 30, error=Unavailable)
        out.append((proc.pid, match.group(1)))
    return out


def start_replicas(procs: Procs, args: argparse.Namespace, count: int) -> tuple[list[tuple[int, str]], str]:
    started = []
    for i in range(count):
        name = f"replica{i + 1}"
        argv = [*psrl_argv(args, "psrl.worker"), "--host", HOST, "--port", "0", "--dp-size", "1"]
        started.append((name, procs.start(name, [*argv, "--torch-threads", str(args.torch_threads)])))
    out, model = [], ""
    for name, proc in started:
        match = wait_for_log(
            procs, name, proc, r"PSRL_WORKER_READY (grpc://\S+)\s.*model=(\S+)", 180, error=Unavailable
        )
        out.append((proc.pid, match.group(1)))
        model = match.group(2)
    return out, model


def launch_router(
    procs: Procs, name: str, argv: list[str], port: int, ready_load: Load, ready_s: float, expect_workers: int = 0
) -> subprocess.Popen[bytes]:
    """Start a router and wait until it answers the load's probe (and, for ours, /workers lists the workers)."""
    proc = procs.start(name, argv, ROUTER_CPUS or None)
    base = f"http://{HOST}:{port}"
    log = procs.log_path(name)

    def ready() -> None:
        if expect_workers:
            status, raw = http("GET", base + "/workers", timeout_s=2)
            workers = json.loads(raw).get("workers", []) if status == 200 else []
            if len(workers) < expect_workers:
                raise Unavailable(f"/workers shows {len(workers)} of {expect_workers} workers (status {status})")
        probe(base, ready_load, timeout_s=10)

    try:
        wait_until(ready, ready_s, proc, name, log)
    except Unavailable:
        procs.stop(proc)
        raise
    return proc


def router_targets(args: argparse.Namespace, section: str, urls: list[str]) -> list[tuple[str, list[str] | str, int]]:
    """(name, argv or the reason it cannot run, port) for every router of a section."""
    out: list[tuple[str, list[str] | str, int]] = []
    for suffix, src, python in [("", None, None), *([("-b", args.ab_src, args.ab_python)] if b_leg(args) else [])]:
        port = free_port()
        ours = [*psrl_argv(args, "psrl.router", src, python), "--host", HOST, "--port", str(port)]
        ours += ["--worker-urls", *urls]
        ours += ["--policy", "round_robin"] + (["--connection-mode", "http"] if section == "http" else [])
        out.append((f"psrl-router-{section}{suffix}", ours, port))

    smg = find_tool("smg")
    port = free_port()
    if smg is None:
        out.append((f"smg-{section}", "smg is not installed (pip install smg)", port))
    else:
        argv = [smg, "launch", "--host", HOST, "--port", str(port), "--worker-urls", *urls, "--policy", "round_robin"]
        argv += ["--prometheus-host", HOST, "--prometheus-port", str(free_port()), "--log-level", "warn"]
        out.append((f"smg-{section}", argv + (["--disable-tokenizer-autoload"] if section == "http" else []), port))

    if args.floor:
        port = free_port()
        argv = [sys.executable, str(REPO / "bench" / "floor_router.py"), "--host", HOST, "--port", str(port)]
        out.append((f"floor-{section}", [*argv, "--worker-urls", *urls], port))

    if section == "http":
        vr = find_tool("vllm-router")
        port = free_port()
        if vr is None:
            out.append(("vllm-router-http", "vllm-router is not installed (pip install vllm-router)", port))
        else:
            argv = [vr, "--host", HOST, "--port", str(port), "--worker-urls", *urls, "--policy", "round_robin"]
            argv += ["--prometheus-host", HOST, "--prometheus-port", str(free_port()), "--log-level", "warning"]
            out.append(("vllm-router-http", argv, port))
    return out


def run_routers(
    procs: Procs,
    section: str,
    urls: list[str],
    loads: list[Load],
    backend_pids: list[int],
    gen: LoadGen,
    args: argparse.Namespace,
    run: Run,
) -> None:
    routers: list[tuple[str, list[str], int]] = []
    for name, argv, port in router_targets(args, section, urls):
        if isinstance(argv, str):
            note(run, section, name, argv)
        else:
            routers.append((name, argv, port))
    if args.together:
        together(procs, section, routers, len(urls), loads, backend_pids, gen, args, run)
        return
    if args.interleave:
        interleaved(procs, section, routers, len(urls), loads, backend_pids, gen, args, run)
        return
    for name, argv, port in routers:
        started = start_target(procs, section, name, argv, port, len(urls), loads, args, run)
        if started is None:
            continue
        target, proc = started
        try:
            run_target(target, backend_pids, gen, args, run)
        finally:
            procs.stop(proc)


def start_target(
    procs: Procs,
    section: str,
    name: str,
    argv: list[str],
    port: int,
    workers: int,
    loads: list[Load],
    args: argparse.Namespace,
    run: Run,
) -> tuple[Target, subprocess.Popen[bytes]] | None:
    """Launch one router and wait until it serves; None (noted) if it cannot."""
    if name == "floor-grpc":  # it serves /generate only
        loads = [load for load in loads if load.path == "/generate"]
        if not loads:
            note(run, section, name, "it serves /generate only (add `generate` to --loads)")
            return None
    print(f"[{section}] {name}: {' '.join(argv)}", flush=True)
    expect = workers if name.startswith("psrl") else 0
    try:
        proc = launch_router(procs, name, argv, port, loads[0], args.ready_timeout, expect)
    except Unavailable as e:
        note(run, section, name, str(e))
        return None
    return Target(section, name, f"http://{HOST}:{port}", proc.pid, argv, loads), proc


def interleaved(
    procs: Procs,
    section: str,
    routers: list[tuple[str, list[str], int]],
    workers: int,
    loads: list[Load],
    backend_pids: list[int],
    gen: LoadGen,
    args: argparse.Namespace,
    run: Run,
) -> None:
    """--interleave: --repeat rounds; each round starts every router in turn (the order reversed every other
    round) and measures one window of each load at each concurrency. A drift of the machine over the run then
    reaches every router alike, which matters when the figures to compare differ by a few percent."""
    windows: dict[tuple[str, str, int], list[Window]] = {}
    served: dict[str, list[Load]] = {}  # the loads each router answered in the first round
    for round_no in range(args.repeat):
        order = routers if round_no % 2 == 0 else routers[::-1]
        for name, argv, port in order:
            if round_no and name not in served:
                continue  # it did not start in the first round
            started = start_target(procs, section, name, argv, port, workers, loads, args, run)
            if started is None:
                continue
            target, proc = started
            try:
                if name not in served:
                    run.commands[f"{section}/{name}"] = argv
                    served[name] = probe_loads(target, run)
                for load in served[name]:
                    for conns in args.connections:
                        if args.warmup > 0:
                            gen.run(target.base_url, load, conns, args.warmup, args.timeout)
                        wait_quiet(target.router_pid, backend_pids, args)
                        window = measure_window(target, load, conns, backend_pids, gen, args)
                        windows.setdefault((name, load.name, conns), []).append(window)
                        print(f"  round {round_no + 1}: {name} {load.name} @{conns}: {window.router_us_per_req} us/req")
                if args.profile and round_no == args.repeat - 1 and name.startswith("psrl"):
                    for load in served[name]:
                        key = f"{section}/{name}/{load.name}"
                        run.profiles[key] = profile(target, load, max(args.connections), gen, args)
            finally:
                procs.stop(proc)
    add_legs(run, section, loads, windows)


def add_legs(run: Run, section: str, loads: list[Load], windows: dict[tuple[str, str, int], list[Window]]) -> None:
    """One leg per (router, load, concurrency) from the windows of all rounds."""
    for (name, load_name, conns), measured in windows.items():
        target = Target(section, name, "", None, [], [])
        leg = aggregate(target, next(x for x in loads if x.name == load_name), conns, measured)
        run.legs.append(leg)
        print(f"  {format_row(leg)}", flush=True)


def together(
    procs: Procs,
    section: str,
    routers: list[tuple[str, list[str], int]],
    workers: int,
    loads: list[Load],
    backend_pids: list[int],
    gen: LoadGen,
    args: argparse.Namespace,
    run: Run,
) -> None:
    """--together: every router of the section runs at once, and each of --repeat windows per leg loads them all
    at the same time, each through a load generator of its own. Whatever the shared machine does during a window
    then reaches every router alike, so the ratio of two routers' windows holds where sequential windows of one
    router drift by tens of percent. The backends are shared: each router gets a share of them, and their CPU
    per request is over all the routers' requests."""
    started: list[tuple[Target, subprocess.Popen[bytes]]] = []
    windows: dict[tuple[str, str, int], list[Window]] = {}
    try:
        for name, argv, port in routers:
            one = start_target(procs, section, name, argv, port, workers, loads, args, run)
            if one is not None:
                started.append(one)
        served: dict[str, list[Load]] = {}
        for target, _ in started:
            run.commands[f"{section}/{target.name}"] = target.command
            served[target.name] = probe_loads(target, run)
        for load in loads:
            group = [t for t, _ in started if load in served[t.name]]
            for conns in args.connections if group else []:
                if args.warmup > 0:
                    load_together(group, load, conns, args.warmup, gen, args)
                for round_no in range(args.repeat):
                    wait_quiet(None, [*backend_pids, *(t.router_pid for t in group if t.router_pid)], args)
                    measured = measure_together(group, load, conns, backend_pids, gen, args)
                    for target, window in zip(group, measured, strict=True):
                        windows.setdefault((target.name, load.name, conns), []).append(window)
                        us = window.router_us_per_req
                        print(f"  window {round_no + 1}: {target.name} {load.name} @{conns}: {us} us/req", flush=True)
    finally:
        for _, proc in started:
            procs.stop(proc)
    add_legs(run, section, loads, windows)


def load_together(
    group: list[Target], load: Load, conns: int, duration_s: float, gen: LoadGen, args: argparse.Namespace
) -> list[LoadResult]:
    """`load` at `conns` connections against every router of `group` at the same time."""
    with ThreadPoolExecutor(len(group)) as pool:
        return list(pool.map(lambda t: gen.run(t.base_url, load, conns, duration_s, args.timeout), group))


def measure_together(
    group: list[Target], load: Load, conns: int, backend_pids: list[int], gen: LoadGen, args: argparse.Namespace
) -> list[Window]:
    """One window of `load` on every router of `group` at once: each router's CPU over its own requests."""
    meters = [CpuMeter([t.router_pid] if t.router_pid else []) for t in group]
    backends = CpuMeter(backend_pids)
    for meter in (*meters, backends):
        meter.start()
    own0, machine0, t0 = own_cpu_s(), machine_busy_s(), time.monotonic()
    results = load_together(group, load, conns, args.duration, gen, args)
    wall, machine, own = time.monotonic() - t0, machine_busy_s() - machine0, own_cpu_s() - own0
    router_s = [m.stop() for m in meters]
    backend_s = backends.stop()
    backend_per_req = backend_s / max(sum(r.requests for r in results), 1)  # the backends serve them all
    foreign = max(0.0, machine - sum(router_s) - backend_s - own) / max(wall, 1e-9)
    return [
        window_of(res, cpu if target.router_pid else None, wall, backend_per_req, own, foreign)
        for target, res, cpu in zip(group, results, router_s, strict=True)
    ]


def probe_loads(target: Target, run: Run) -> list[Load]:
    """The loads the target answers (its answers recorded); the others are noted and skipped."""
    served = []
    for load in target.loads:
        try:
            answer = probe(target.base_url, load)
        except Unavailable as e:
            note(run, target.section, f"{target.name} {load.name}", str(e))
            continue
        run.probes[f"{target.section}/{target.name}/{load.name}"] = answer.get("usage") or answer.get("meta_info")
        served.append(load)
    return served


def http_section(procs: Procs, gen: LoadGen, args: argparse.Namespace, run: Run) -> None:
    print("[http] starting two fast backends", flush=True)
    backends = start_fast_backends(procs, 2)
    pids = [pid for pid, _ in backends]
    urls = [url for _, url in backends]
    loads = [chat_load(HTTP_MODEL, args.prompt_words, 16)]
    direct = Target("http", "direct-backend", urls[0], None, ["bench/fast_backend.py"], loads)
    print(f"[http] direct-backend: {urls[0]}", flush=True)
    run_target(direct, pids[:1], gen, args, run)
    run_routers(procs, "http", urls, loads, pids, gen, args, run)


def grpc_section(procs: Procs, gen: LoadGen, args: argparse.Namespace, run: Run) -> None:
    print("[grpc] starting two reference replicas", flush=True)
    try:
        replicas, model = start_replicas(procs, args, 2)
    except Unavailable as e:
        note(run, "grpc", "reference replicas", str(e))
        return
    by_name = {
        "chat": chat_load(model, args.prompt_words, 1),
        "generate": generate_load(model, args.prompt_words),
        "stream": stream_load(model, args.prompt_words, args.stream_tokens),
    }
    loads = [by_name[name] for name in args.loads]
    pids = [pid for pid, _ in replicas]
    run_routers(procs, "grpc", [url for _, url in replicas], loads, pids, gen, args, run)


# ---- report ---------------------------------------------------------------------------------------------------

_COLUMNS = (
    ("section", 7, "s"),
    ("target", 18, "s"),
    ("load", 8, "s"),
    ("conns", 5, "d"),
    ("rps", 8, ".0f"),
    ("p50_ms", 8, ".2f"),
    ("p99_ms", 8, ".2f"),
    ("errors", 6, "d"),
    ("router_us_per_req", 8, ".0f"),
    ("us_range", 11, "r"),
    ("router_cores", 5, ".2f"),
    ("backend_us_per_req", 8, ".0f"),
    ("foreign_cores", 6, ".2f"),
    ("vs_smg", 6, ".2f"),
)
_HEADERS = {
    "rps": "req/s",
    "p50_ms": "p50 ms",
    "p99_ms": "p99 ms",
    "router_us_per_req": "us/req",
    "us_range": "min-max",
    "router_cores": "cores",
    "backend_us_per_req": "be us/rq",
    "foreign_cores": "others",
    "vs_smg": "x smg",
}


def format_row(leg: LegResult) -> str:
    values = {k: v for k, v in vars(leg).items() if k != "windows"}
    values["errors"] = leg.socket_errors + leg.non2xx
    lo, hi = leg.router_us_min, leg.router_us_max
    values["us_range"] = None if lo is None or hi is None else f"{lo:.0f}-{hi:.0f}"
    cells = []
    for key, width, fmt in _COLUMNS:
        v = values[key]
        if fmt == "s":
            cells.append(str(v).ljust(width))
        else:
            text = "-" if v is None else str(v) if fmt == "r" else format(v, fmt)
            cells.append(text.rjust(width))
    return " ".join(cells)


def format_header() -> str:
    return " ".join(
        _HEADERS.get(k, k).rjust(w) if fmt != "s" else _HEADERS.get(k, k).ljust(w) for k, w, fmt in _COLUMNS
    )


def add_smg_ratios(legs: list[LegResult]) -> None:
    """Router CPU per request relative to smg's for the same section, load and concurrency."""
    smg = {(x.section, x.load, x.conns): x.router_us_per_req for x in legs if x.target.startswith("smg")}
    for leg in legs:
        base = smg.get((leg.section, leg.load, leg.conns))
        if leg.router_us_per_req is not None and base and not leg.target.startswith("smg"):
            leg.vs_smg = round(leg.router_us_per_req / base, 2)


def print_report(run: Run, gen: LoadGen, args: argparse.Namespace) -> None:
    print()
    print(
        f"Router overhead ({gen.name}, {args.duration:g}s per leg after {args.warmup:g}s warm-up, "
        f"{args.prompt_words}-word prompt, round_robin over 2 backends; 'us/req' = CPU microseconds per request)"
    )
    print(
        "us/req: the router's CPU microseconds per request (its process tree, utime+stime), median of "
        f"{args.repeat} window(s), min-max across them; cores: router CPU / wall time; be us/rq: the backends' "
        "CPU per request; others: cores busy with anything else on the machine during the window (max); "
        "x smg: us/req relative to smg on the same section, load and concurrency."
    )
    print(format_header())
    for leg in run.legs:
        print(format_row(leg))
    for skip in run.skips:
        print(f"not available: {skip.section}/{skip.target}: {skip.reason}")
    for leg in run.legs:
        if leg.tokens > 1 and leg.router_us_per_req is not None:
            ratio = "" if leg.vs_smg is None else f" ({leg.vs_smg:.2f} x smg)"
            print(
                f"per token: {leg.section} {leg.target} {leg.load} @{leg.conns}: "
                f"{leg.router_us_per_req / leg.tokens:.1f} us/token over {leg.tokens} tokens{ratio}"
            )
    for line in [*paired_ratios(run.legs, args), *ab_ratios(run.legs)]:
        print(line)
    for key, prof in run.profiles.items():
        print_profile(key, prof)


def window_ratios(leg: LegResult, base: LegResult) -> str:
    """With --together or --interleave the legs' windows pair up (the same round): the median of the per-window
    ratios of CPU per request, and their range; "" otherwise."""
    pairs = [
        (w.router_us_per_req, b.router_us_per_req)
        for w, b in zip(leg.windows, base.windows)
        if w.router_us_per_req and b.router_us_per_req
    ]
    if len(pairs) < 2 or len(leg.windows) != len(base.windows):
        return ""
    ratios = sorted(x / y for x, y in pairs)
    return f"per window {statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def paired_ratios(legs: list[LegResult], args: argparse.Namespace) -> list[str]:
    """Per-window ratios (--together or --interleave) of ours over smg and vllm-router, per section, load and
    concurrency."""
    if not (args.together or args.interleave):
        return []
    ours = [x for x in legs if x.target.startswith(("psrl", "floor"))]
    others = [x for x in legs if x.target.startswith(("smg", "vllm-router"))]
    pairs = [(a, b) for a in ours for b in others if (a.section, a.load, a.conns) == (b.section, b.load, b.conns)]
    return [f"{a.target} / {b.target} {a.load} @{a.conns}: {r}" for a, b in pairs if (r := window_ratios(a, b))]


def ab_ratios(legs: list[LegResult]) -> list[str]:
    """--ab-src, --ab-python: the b leg's CPU per request over the a leg's, per section, load and concurrency."""
    a = {(x.section, x.load, x.conns): x for x in legs if x.target == f"psrl-router-{x.section}"}
    lines = []
    for leg in legs:
        base = a.get((leg.section, leg.load, leg.conns))
        if leg.target.endswith("-b") and base and base.router_us_per_req and leg.router_us_per_req:
            ratio = leg.router_us_per_req / base.router_us_per_req
            lines.append(
                f"b/a {leg.section} {leg.load} @{leg.conns}: {leg.router_us_per_req:.0f} / "
                f"{base.router_us_per_req:.0f} us/req = {ratio:.2f}"
                + (f"; {paired}" if (paired := window_ratios(leg, base)) else "")
            )
    return lines


def print_profile(key: str, prof: dict[str, Any]) -> None:
    if "error" in prof:
        print(f"\npy-spy {key}: {prof['error']}")
        return
    print(
        f"\npy-spy {key}: {prof['samples']} GIL-held samples at {prof['rps_while_sampled']} req/s, {prof['raw_stacks']}"
    )
    print(f"  process CPU by thread: {prof['thread_cpu_pct']}")
    for title in ("self_by_module_pct", "self_pct", "inclusive_pct"):
        print(f"  top by {title.removesuffix('_pct').replace('_', ' ')} (% of GIL-held samples):")
        for share, frame in prof[title]:
            print(f"    {share:5.1f}%  {frame}")


def router_source(src: str | None) -> dict[str, Any]:
    """Which router code ran: a digest of psrl/router/**/*.py (others edit it while benches run) and git state."""
    root = Path(src).resolve() if src else REPO
    digest = hashlib.sha256()
    for path in sorted((root / "psrl" / "router").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "psrl/router"], cwd=REPO, capture_output=True, text=True
    ).stdout
    return {"root": str(root), "sha256": digest.hexdigest()[:16], "git_dirty_files": len(dirty.splitlines())}


def environment(gen: LoadGen) -> dict[str, Any]:
    def version(pkg: str) -> str | None:
        from importlib import metadata

        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        **benchlib.environment(),
        "loadavg_at_start": os.getloadavg(),
        "loadgen": gen.name,
        "smg": version("smg"),
        "vllm_router": version("vllm-router"),
        "clk_tck": CLK_TCK,
    }


def write_json(run: Run, env: dict[str, Any], args: argparse.Namespace) -> Path:
    path = args.out_dir / f"router_overhead_{args.stamp}.json"
    settings = {k: v for k, v in vars(args).items() if k not in ("out_dir",)}
    payload = {
        "settings": settings,
        "environment": env,
        "legs": [asdict(x) for x in run.legs],
        "skipped": [asdict(s) for s in run.skips],
        "commands": run.commands,
        "profiles": run.profiles,
        "probe_answers": run.probes,
    }
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


# ---- main -----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", nargs="+", choices=("http", "grpc"), default=["http", "grpc"])
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per leg")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds before each measured window")
    p.add_argument("--connections", type=int, nargs="+", default=[64, 1])
    p.add_argument("--prompt-words", type=int, default=200, help="the chat prompt's words, /generate's ids")
    p.add_argument(
        "--loads",
        nargs="+",
        choices=("chat", "generate", "stream"),
        default=["chat", "generate", "stream"],
        help="the grpc section's loads",
    )
    p.add_argument("--stream-tokens", type=int, default=32, help="tokens each request of the stream load generates")
    p.add_argument("--timeout", type=float, default=10.0, help="per-request timeout of the load generator, s")
    p.add_argument("--loadgen", choices=("auto", "wrk", "python"), default="auto")
    p.add_argument("--repeat", type=int, default=3, help="measured windows per leg (median reported)")
    p.add_argument("--quiet-wait", type=float, default=20.0, help="max s to wait for a quiet machine per window")
    p.add_argument("--quiet-cores", type=float, default=0.3, help="'quiet': others use at most this many cores")
    p.add_argument(
        "--pin",
        type=int,
        nargs="?",
        const=-1,
        default=None,
        metavar="CPU",
        help="run routers alone on CPU (default: the last one) and everything else on the other CPUs",
    )
    p.add_argument("--quick", action="store_true", help="one 2 s window per leg after 0.5 s warm-up")
    p.add_argument("--profile", action="store_true", help="py-spy our router under the highest concurrency")
    p.add_argument(
        "--floor",
        action="store_true",
        help="add bench/floor_router.py: grpc section /generate only; http section a bare proxy",
    )
    p.add_argument("--profile-duration", type=float, default=8.0)
    p.add_argument("--profile-top", type=int, default=15)
    p.add_argument("--torch-threads", type=int, default=1, help="for the reference replicas")
    p.add_argument("--ready-timeout", type=float, default=60.0, help="s to wait for a router to answer")
    p.add_argument("--deadline", type=float, default=1200.0, help="abort (and clean up) after this many s")
    p.add_argument(
        "--router-src",
        default=None,
        help="run psrl.router from this source tree (e.g. a `git archive` of another commit), not the installed one",
    )
    p.add_argument(
        "--ab-src",
        default=None,
        metavar="DIR",
        help="also run psrl.router from this source tree (legs named psrl-router-<section>-b), and print b/a ratios",
    )
    p.add_argument(
        "--ab-python",
        default=None,
        metavar="PYTHON",
        help="run the b leg's router with this interpreter (a venv's bin/python with our dependencies installed): "
        "with --ab-src that tree, else the a leg's code; compares interpreter builds",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="--repeat rounds, each starting every router in turn for one window per leg (for A/B comparisons)",
    )
    p.add_argument(
        "--together",
        action="store_true",
        help="run every router of a section at once, each window loading them all at the same time (for A/B "
        "comparisons on a noisy machine; the backends are shared)",
    )
    args = p.parse_args(argv)
    if args.together and args.interleave:
        p.error("--together and --interleave are two ways to order the run: pick one")
    if args.quick:
        args.duration, args.warmup, args.profile_duration = min(args.duration, 2.0), min(args.warmup, 0.5), 4.0
        args.repeat, args.quiet_wait = 1, min(args.quiet_wait, 5.0)
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out_dir = OUT_DIR
    return args


@contextlib.contextmanager
def _tmp_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="router_overhead_") as d:
        yield Path(d)


def pin_cpus(choice: int | None) -> None:
    """--pin: routers on one CPU, the bench (and so the backends, replicas and wrk it starts) on the others."""
    if choice is None:
        return
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        sys.exit("--pin needs at least 2 CPUs")
    router_cpu = available[choice] if choice < 0 else choice
    if router_cpu not in available:
        sys.exit(f"--pin {choice}: CPU not available (have {available})")
    ROUTER_CPUS.add(router_cpu)
    os.sched_setaffinity(0, set(available) - ROUTER_CPUS)
    print(f"pinned: routers on CPU {router_cpu}, everything else on {sorted(set(available) - ROUTER_CPUS)}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pin_cpus(args.pin)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    install_signal_handlers(args.deadline)
    run = Run()
    with _tmp_dir() as tmp, Procs(args.out_dir / "logs" / args.stamp) as procs:
        gen = pick_loadgen(args.loadgen, tmp)
        env = {**environment(gen), "router_source": router_source(args.router_src)}
        if b_leg(args):
            env["router_source_b"] = router_source(args.ab_src or args.router_src)
        if args.ab_python:
            env["python_b"] = benchlib.interpreter(args.ab_python)
        try:
            if "http" in args.sections:
                http_section(procs, gen, args, run)
                procs.stop_all()
            if "grpc" in args.sections:
                grpc_section(procs, gen, args, run)
        finally:
            signal.alarm(0)
            procs.stop_all()
            add_smg_ratios(run.legs)
            print_report(run, gen, args)
            print(f"\nJSON: {write_json(run, env, args).relative_to(REPO)}")
            print(f"logs: {procs.log_dir.relative_to(REPO)}")


if __name__ == "__main__":
    main()
