"""Process handling shared by the benchmarks: every process in its own group, logged to a file, stopped on
exit (and by the kernel if the bench dies), plus free ports and log helpers."""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import platform
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent


class Procs:
    """Every process the bench starts: own session (process group), output to a log file, stopped on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.live: dict[int, tuple[str, subprocess.Popen[bytes]]] = {}

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self, name: str, argv: list[str], cpus: set[int] | None = None) -> subprocess.Popen[bytes]:
        """Start argv in its own session; `cpus` pins it (else it inherits the bench's affinity)."""

        def setup() -> None:
            _die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path(name), "wb") as log:
            proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=setup,
            )
        self.live[proc.pid] = (name, proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
        self.live.pop(proc.pid, None)
        signal_group(proc, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        signal_group(proc, signal.SIGKILL)  # the leader may be gone while group members linger
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)

    def stop_all(self) -> None:
        for _, proc in reversed(list(self.live.values())):
            self.stop(proc)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the bench dies without cleaning up (even by SIGKILL)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the leader's pid


def log_tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    return " | ".join(line.strip()[:300] for line in text.strip().splitlines()[-lines:]) or "(empty log)"


def wait_for_log(
    procs: Procs,
    name: str,
    proc: subprocess.Popen[bytes],
    pattern: str,
    timeout_s: float,
    error: type[Exception] = RuntimeError,
) -> re.Match:
    """Wait until the process's log matches `pattern`; `error` if it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    regex = re.compile(pattern)
    while time.monotonic() < deadline:
        match = regex.search(procs.log_path(name).read_text(errors="replace"))
        if match:
            return match
        if proc.poll() is not None:
            raise error(f"{name} exited with rc={proc.returncode}: {log_tail(procs.log_path(name))}")
        time.sleep(0.1)
    raise error(f"{name} printed no {pattern!r} within {timeout_s:.0f}s: {log_tail(procs.log_path(name))}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def install_signal_handlers(deadline_s: float) -> None:
    """SIGTERM/SIGHUP end the bench (its finally blocks stop every child); SIGALRM enforces the deadline."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    def expire(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"bench deadline of {deadline_s:.0f}s passed")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, int(deadline_s)))


_INTERPRETER = (
    "import json,platform,sys,sysconfig;"
    "maps=open('/proc/self/maps').read() if sys.platform=='linux' else '';"
    "print(json.dumps({'executable':sys.executable,'version':platform.python_version(),"
    "'libpython_loaded':'libpython' in maps,'config_args':sysconfig.get_config_var('CONFIG_ARGS')}))"
)


def interpreter(python: str) -> dict[str, object]:
    """How an interpreter was built, as far as it tells: its version, whether its executable runs on a shared
    libpython (read from its own memory map: the field to trust), and the configure arguments sysconfig
    reports. Those may not describe the executable: Debian's static python3.11 reports the `--enable-shared`
    build made beside it, and neither `--enable-optimizations` nor `--with-lto`."""
    try:
        done = subprocess.run([python, "-c", _INTERPRETER], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise RuntimeError(f"{python} could not be run: {e}") from e
    if done.returncode != 0:
        raise RuntimeError(f"{python} could not be run: {done.stderr[-500:]}")
    return json.loads(done.stdout)


def environment() -> dict[str, object]:
    """Where a benchmark ran: Python, CPUs, and the commit (with how many files under psrl/ differ from it)."""
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "psrl"], cwd=REPO, capture_output=True, text=True)
    return {
        "python": platform.python_version(),
        "python_build": interpreter(sys.executable),
        "cpus": os.cpu_count(),
        "git_head": rev.stdout.strip(),
        "git_dirty_psrl_files": len(dirty.stdout.splitlines()),
    }


CLK_TCK = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """Non-idle CPU seconds of the whole machine since boot, all cores (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def tree_cpu_s(roots: list[int]) -> float:
    """utime+stime of the process trees under roots, from /proc (children found by ppid)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
        ticks[int(entry)] = int(fields[11]) + int(fields[12])
    total, todo = 0, list(roots)
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total / CLK_TCK


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    return math.inf if a > 0 else math.nan


def fmt(x: float, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
