"""Child processes that die with their parent, and free ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from psrl.lifetime import die_with_parent


def first_free_port(start: int, host: str = "127.0.0.1", limit: int = 1000) -> int:
    for port in range(start, start + limit):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in [{start}, {start + limit}) on {host}")


def _popen(module: str, args: Sequence[str], env: dict[str, str] | None, stdout: IO[bytes] | int | None):
    """`python -m module args...` in its own process group, killed by the kernel if we die."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        start_new_session=True,
    )


def spawn_module(
    module: str, args: Sequence[str], *, log_file: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`python -m module args...` in its own process group, killed by the kernel if we die; its output goes to
    `log_file` (appended), else to ours."""
    if log_file is None:
        return _popen(module, args, env, None)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:  # the child holds its own descriptor
        return _popen(module, args, env, out)


class AnnouncedProcess:
    """A child (as `spawn_module` starts it) that prints one ready line, `<marker> <address> ...`, once it
    serves. A thread copies its output, line by line, to our stdout (a Ray actor's log) and watches for that line.
    """

    def __init__(self, module: str, args: Sequence[str], marker: str, *, env: dict[str, str] | None = None) -> None:
        self.name = module
        self.proc = _popen(module, args, env, subprocess.PIPE)
        self._marker = marker
        self._address = ""
        self._ready = threading.Event()  # set by the ready line, or by the end of the output
        threading.Thread(target=self._copy_output, name=f"{module}-output", daemon=True).start()

    def _copy_output(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            sys.stdout.write(line)
            sys.stdout.flush()
            words = line.split()
            if not self._ready.is_set() and len(words) > 1 and words[0] == self._marker:
                self._address = words[1]
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_s: float) -> str:
        """The address on the ready line; RuntimeError if the child exits first, TimeoutError after `timeout_s`."""
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"{self.name} printed no {self._marker} line within {timeout_s}s")
        if not self._address:
            raise RuntimeError(f"{self.name} exited with code {self.proc.wait()} before it was ready")
        return self._address


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
