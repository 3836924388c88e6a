"""Child processes that die with their parent, and free ports."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own shutdown still stops its children


def first_free_port(start: int, host: str = "127.0.0.1", limit: int = 1000) -> int:
    for port in range(start, start + limit):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in [{start}, {start + limit}) on {host}")


def spawn_module(
    module: str, args: Sequence[str], *, log_file: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`python -m module args...` in its own process group, killed by the kernel if we die."""
    out: IO[bytes] | None = None
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_file, "ab")  # noqa: SIM115 - the child owns it; closed when we close the Popen
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=out,
        stderr=subprocess.STDOUT if out is not None else None,
        env=child_env,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        start_new_session=True,
    )
    if out is not None:
        out.close()  # the child holds its own descriptor
    return proc


def stop_processes(procs: Sequence[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """SIGTERM every child's group, then SIGKILL whatever is still alive after `timeout_s`."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
