"""Real loopback processes for tests: reference replicas and routers, started and always stopped."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _wait import wait_for

from psrl.gateway.processes import stop_processes

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def silent_peer() -> Iterator[int]:
    """The port of a socket that listens and never reads: the kernel completes a connection to it, and nothing
    ever answers, so only a client's own timeout ends a call there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@dataclass
class Proc:
    proc: subprocess.Popen
    url: str
    log: Path
    extra: dict = field(default_factory=dict)

    def kill(self) -> None:
        stop_processes([self.proc], timeout_s=0.1) if self.proc.poll() is None else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


# Every process a test helper started: conftest stops those still running when the session ends, so a fixture
# that fails halfway (e.g. its router does not start) leaves no replica behind.
STARTED: list[subprocess.Popen] = []


def popen(cmd: list[str], **kwargs: object) -> subprocess.Popen:
    """subprocess.Popen, remembered in STARTED."""
    proc = subprocess.Popen(cmd, **kwargs)  # type: ignore[call-overload]
    STARTED.append(proc)
    return proc


def _spawn(module: str, args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=open(log, "wb"),
        env=env,
        start_new_session=True,
        cwd=REPO,
    )


def read_ready_line(proc: subprocess.Popen, log: Path, marker: str, timeout_s: float) -> str:
    """The address a process prints as `<marker> <address>` on stdout once it serves (stopped on a timeout)."""
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    out = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        if select.select([proc.stdout], [], [], 0.2)[0]:
            # os.read, not readline: a buffered reader would hide data from the next select()
            out += os.read(proc.stdout.fileno(), 65536).decode(errors="replace")
            for line in out.splitlines():
                if line.startswith(marker + " "):
                    return line.split()[1]
    stop_processes([proc])
    raise TimeoutError(f"{proc.args} not ready in {timeout_s}s:\n{log.read_text(errors='replace')}")


def _start_announced(module: str, args: list[str], log: Path, marker: str, timeout_s: float) -> Proc:
    """Start a process that prints `<marker> <address>` on stdout once it serves."""
    proc = _spawn(module, args, log)
    return Proc(proc, read_ready_line(proc, log, marker, timeout_s), log)


def start_replica(
    model_dir: Path, log_dir: Path, *, dp_size: int = 1, args: list[str] | None = None, timeout_s: float = 120.0
) -> Proc:
    log = log_dir / f"replica-{time.monotonic_ns()}.log"
    cmd = ["--port", "0", "--model", str(model_dir), "--dp-size", str(dp_size), "--torch-threads", "1", *(args or [])]
    return _start_announced("psrl.worker", cmd, log, "PSRL_WORKER_READY", timeout_s)


def start_named_replicas(folders: dict[str, Path], log_dir: Path, started: list[subprocess.Popen]) -> list[Proc]:
    """A replica per served model name (and its folder); each process joins `started` (the caller stops them)
    as soon as it runs, so one failing to start leaves none behind."""
    replicas = []
    for name, folder in folders.items():
        replicas.append(start_replica(folder, log_dir, args=["--served-model-name", name]))
        started.append(replicas[-1].proc)
    return replicas


def start_psmanager(log_dir: Path, *, port: int = 0, args: list[str] | None = None, timeout_s: float = 60.0) -> Proc:
    log = log_dir / f"psmanager-{time.monotonic_ns()}.log"
    cmd = ["--port", str(port), *(args or [])]
    return _start_announced("psrl.psmanager", cmd, log, "PSRL_PSMANAGER_READY", timeout_s)


def start_session_router(
    log_dir: Path, router_url: str, args: list[str] | None = None, timeout_s: float = 60.0
) -> Proc:
    log = log_dir / f"session-{time.monotonic_ns()}.log"
    cmd = ["--router-url", router_url, "--port", "0", *(args or [])]
    return _start_announced("psrl.session", cmd, log, "PSRL_SESSION_READY", timeout_s)


def start_router(
    log_dir: Path, worker_urls: list[str], *, args: list[str] | None = None, timeout_s: float = 60.0
) -> Proc:
    """A router on a port of its own (`--port 0`, read from its ready line), once every worker given registered."""
    log = log_dir / f"router-{time.monotonic_ns()}.log"
    cmd = ["--port", "0", "--health-interval-s", "0.5", "--health-failure-threshold", "1", *(args or [])]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    router = _start_announced("psrl.router", cmd, log, "PSRL_ROUTER_READY", timeout_s)

    def registered() -> bool:
        if not router.alive():
            raise RuntimeError(f"router exited with {router.proc.returncode}:\n{router.log_text()}")
        r = httpx.get(f"{router.url}/health", timeout=5.0)
        return r.status_code == 200 and r.json()["workers"] >= len(worker_urls)

    try:
        wait_for(registered, f"the router's {len(worker_urls)} workers registered", timeout_s=timeout_s, poll_s=0.2)
    except AssertionError as e:
        stop_processes([router.proc])
        raise AssertionError(f"{e}:\n{router.log_text()}") from None
    return router


def replica_busy(url: str, *, token: str | None = None) -> int:
    """Running + waiting requests over a replica's dp ranks (its GetLoads), by its grpc:// URL; `token`: the one
    the replica requires."""
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(url.removeprefix("grpc://")) as ch:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        loads = stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=5, metadata=metadata)
    return sum(e.num_running_reqs + e.num_waiting_reqs for e in loads.loads)


def process_alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (/proc/<pid>/stat)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    """A process's command line, its arguments joined by spaces."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
