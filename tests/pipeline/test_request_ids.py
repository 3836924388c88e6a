"""Request ids: 128 random bits in hex, unique across threads, and not repeated by a forked child."""

from __future__ import annotations

import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

from psrl.router.pipeline.prepare import new_request_id


def test_an_id_is_its_prefix_and_32_hex_digits() -> None:
    ids = {new_request_id("gen") for _ in range(10_000)}
    assert len(ids) == 10_000
    assert all(re.fullmatch(r"gen-[0-9a-f]{32}", i) for i in ids)


def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.write(write, new_request_id("x").encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    assert status == 0
    assert child != new_request_id("x")  # the same generator state would give the same next id


def test_threads_draw_ids_at_once_without_error_or_repeat() -> None:
    """The read-ahead ids are shared: a thread drawing one while another refills must get its own."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can, to meet the refill
    try:
        with ThreadPoolExecutor(8) as pool:
            batches = list(pool.map(lambda _: [new_request_id("t") for _ in range(20_000)], range(8)))
    finally:
        sys.setswitchinterval(interval)
    ids = [i for batch in batches for i in batch]
    assert len(set(ids)) == len(ids) == 160_000
