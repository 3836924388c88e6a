"""The bench's own tools, where a wrong answer would pass unnoticed: `router_instructions.py`'s reading of a
callgrind dump (a miscount skews every instruction figure it prints) and `floor_router.py`, the floor leg of
`router_overhead.py --floor` (a floor that answered wrong would make our router look dear)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _procs import REPO, Proc, popen, read_ready_line

from psrl.gateway.processes import stop_processes

sys.path.insert(0, str(REPO / "bench"))
router_instructions = importlib.import_module("router_instructions")
floor_router = importlib.import_module("floor_router")

# A callgrind dump in the shape valgrind writes it: names compressed to "(id) name" on first use and "(id)"
# after, positions absolute, relative (+/-) or the same (*), and a call's inclusive cost on the line after its
# `calls=`, which is not the caller's own.
_DUMP = """\
version: 1
creator: callgrind-3.19.0
positions: line
events: Ir
summary: 1000

ob=(1) /usr/lib/libpython3.11.so.1.0
fl=(1) ceval.c
fn=(1) _PyEval_EvalFrameDefault
10 300
+2 100
cob=(2) /usr/lib/x86_64-linux-gnu/libc.so.6
cfi=(2) memcpy.S
cfn=(2) __memcpy_avx_unaligned
calls=5 0
* 500
ob=(2)
fl=(2)
fn=(2)
-1 200
* 50
ob=(1)
fl=(1)
fn=(3) PyObject_Malloc
3 25
"""


def test_a_dump_s_instructions_are_its_summary_and_each_object_s_share_its_self_cost(tmp_path: Path) -> None:
    dump = tmp_path / "callgrind.out"
    dump.write_text(_DUMP)
    total, shares = router_instructions.read_dump(dump)
    assert total == 1000
    assert shares == pytest.approx({"libpython3.11.so.1.0": 425 / 675, "libc.so.6": 250 / 675})
    assert list(shares) == ["libpython3.11.so.1.0", "libc.so.6"]  # largest first


@pytest.fixture(scope="module")
def floor(replica: Proc, log_dir: Path) -> Iterator[str]:
    log = log_dir / "floor_router.log"
    script = REPO / "bench" / "floor_router.py"
    argv = [sys.executable, str(script), "--host", "127.0.0.1", "--port", "0", "--worker-urls", replica.url]
    with open(log, "wb") as stderr:  # the child keeps its own copy
        proc = popen(argv, stdout=subprocess.PIPE, stderr=stderr, cwd=REPO, start_new_session=True)
    try:
        yield read_ready_line(proc, log, floor_router.READY_MARKER, 60)
    finally:
        stop_processes([proc])


def test_the_floor_answers_generate_as_the_router_does(floor: str, router: Proc) -> None:
    """The same greedy `/generate`, through the floor and through our router in front of the same replica: the
    same ids, counts and finish reason (the floor writes the reason as a bare string, not SGLang's object)."""
    ids = list(range(11, 31))
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    r = httpx.post(f"{floor}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    ours = httpx.post(f"{router.url}/generate", json=body, timeout=60).json()
    assert len(answer["output_ids"]) == 3 and answer["output_ids"] == ours["output_ids"]
    for key in ("prompt_tokens", "completion_tokens"):
        assert answer["meta_info"][key] == ours["meta_info"][key], key
    assert answer["meta_info"]["finish_reason"] == ours["meta_info"]["finish_reason"]["type"] == "length"
    assert answer["meta_info"]["prompt_tokens"] == len(ids)


def test_the_floor_refuses_what_it_does_not_serve(floor: str) -> None:
    bad = httpx.post(f"{floor}/generate", content=b'{"input_ids": ', timeout=10)
    assert bad.status_code == 400 and "unreadable /generate body" in bad.json()["error"]["message"]
    missing = httpx.post(f"{floor}/generate", json={"text": "no ids"}, timeout=10)
    assert missing.status_code == 400
    other = httpx.get(f"{floor}/v1/models", timeout=10)
    assert other.status_code == 404 and other.json()["error"]["code"] == "floor_error"
