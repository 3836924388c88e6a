"""psrl.lifetime: a watched process ends when the process that watches it is killed outright (what keeps vLLM's
EngineCore from outliving its replica), and a pid that now names another process is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from _procs import process_alive
from _wait import wait_for

from psrl import lifetime

PARENT = """
import subprocess, sys, time
from psrl.lifetime import end_with_us
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
watcher = end_with_us([child.pid])
print(child.pid, watcher.pid, flush=True)
time.sleep(300)
"""


def test_the_watched_process_ends_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child, watcher = map(int, parent.stdout.readline().split())
    try:
        assert process_alive(child) and process_alive(watcher)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_for(lambda: not process_alive(child), "the watched process ended")
        wait_for(lambda: not process_alive(watcher), "the watcher ended")
    finally:
        for pid in (child, watcher):
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_only_the_process_that_was_named_is_ended() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        lifetime._end([f"{proc.pid}:not-its-start-time"])
        assert proc.poll() is None  # the pid names another process than the one watched: left alone
        lifetime._end([f"{proc.pid}:{lifetime._start_time(proc.pid)}"])
        assert proc.wait(5) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
