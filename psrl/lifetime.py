"""Processes that end with their parent, by Linux's PR_SET_PDEATHSIG.

- `die_with_parent`: what a launcher's children arm between fork and exec.
- `end_with_us`: a watcher for children that start other children and do not watch them: vLLM's EngineCore,
  spawned by a replica, keeps running (holding the KV cache and a GPU) when the replica is killed outright. The
  watcher (`python -m psrl.lifetime PARENT PID:START ...`) arms itself, so the kernel tells it when the replica
  ends, however it ends; it then ends those processes.

The kernel sends the signal when the *thread* that forked the child ends, so start these children from a thread
that lives as long as its process (the main one).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
GRACE_S = 10.0  # from SIGTERM to SIGKILL, for the watched processes


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send this process `sig` when its parent ends (a no-op off Linux). Safe between fork and
    exec."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass  # the launcher's own shutdown still stops its children


def _start_time(pid: int) -> str | None:
    """A running process's start time (field 22 of /proc/<pid>/stat; with the pid, it names one process for
    good); None once it ended (a zombie included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def end_with_us(pids: Sequence[int]) -> subprocess.Popen | None:
    """Start the watcher that ends `pids` (SIGTERM, SIGKILL after GRACE_S) once this process ends; None off Linux
    or with nothing to watch. Processes that ended by then are left alone (their pids may have been reused)."""
    named = [f"{pid}:{start}" for pid in pids if (start := _start_time(pid)) is not None]
    if not named or not sys.platform.startswith("linux"):
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "psrl.lifetime", str(os.getpid()), *named],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a signal to our group (Ctrl-C) must not end it before we do
    )  # no preexec_fn: Python code between fork and exec is unsafe in a process with gRPC threads


def _wait_for_parent(parent: int) -> None:
    """Return once `parent` has ended."""
    signal.signal(signal.SIGTERM, lambda *_: None)  # the parent's death: return from pause()
    die_with_parent()
    if os.getppid() == parent:  # else the parent died before the signal was armed
        signal.pause()


def _end(named: Sequence[str]) -> None:
    """End the processes named `PID:START` that are still those processes: SIGTERM, SIGKILL after GRACE_S."""
    targets = [(int(pid), start) for pid, start in (n.split(":") for n in named)]
    alive = [pid for pid, start in targets if _start_time(pid) == start]
    deadline = time.monotonic() + GRACE_S
    sig = signal.SIGTERM
    while alive:
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        time.sleep(0.1)
        alive = [pid for pid, start in targets if pid in alive and _start_time(pid) == start]
        if time.monotonic() > deadline:
            sig = signal.SIGKILL


if __name__ == "__main__":
    _wait_for_parent(int(sys.argv[1]))
    _end(sys.argv[2:])
