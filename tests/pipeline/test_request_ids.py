"""Request ids: 128 random bits in hex, unique, and not repeated by a forked child."""

from __future__ import annotations

import os
import re

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
