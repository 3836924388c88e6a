"""The bench's own tools, where a wrong answer would pass unnoticed: `router_instructions.py`'s reading of a
callgrind dump (a miscount skews every instruction figure it prints), `floor_router.py`, the floor leg of
`router_overhead.py --floor` in both sections (a floor that answered wrong would make our router look dear),
`router_middle.py`'s loop (one that failed its requests, or never reached the faked edge, would count the
wrong work), and `router_overhead.py`'s second build of our router (`--ab-python`: a leg that ran the first
interpreter again would report a ratio of one)."""

from __future__ import annotations

import importlib
import json
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _procs import REPO, Proc, free_port, popen, read_ready_line, start_router

from psrl import _kvx, _wire
from psrl.gateway.processes import stop_processes
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer

sys.path.insert(0, str(REPO / "bench"))
router_instructions = importlib.import_module("router_instructions")
floor_router = importlib.import_module("floor_router")
router_middle = importlib.import_module("router_middle")
router_overhead = importlib.import_module("router_overhead")
benchlib = importlib.import_module("benchlib")

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


FLOOR = REPO / "bench" / "floor_router.py"


def _start_script(script: Path, args: list[str], marker: str, log: Path) -> tuple[subprocess.Popen, str]:
    """One of bench/'s servers, and the address it announces."""
    argv = [sys.executable, str(script), "--host", "127.0.0.1", "--port", "0", *args]
    with open(log, "wb") as stderr:  # the child keeps its own copy
        proc = popen(argv, stdout=subprocess.PIPE, stderr=stderr, cwd=REPO, start_new_session=True)
    try:
        return proc, read_ready_line(proc, log, marker, 60)
    except BaseException:
        stop_processes([proc])
        raise


def _start_floor(worker_urls: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    return _start_script(FLOOR, ["--worker-urls", *worker_urls], floor_router.READY_MARKER, log)


@pytest.fixture(scope="module")
def floor(replica: Proc, log_dir: Path) -> Iterator[str]:
    proc, url = _start_floor([replica.url], log_dir / "floor_router.log")
    try:
        yield url
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


@pytest.fixture(scope="module")
def fast_backend(log_dir: Path) -> Iterator[str]:
    proc, url = _start_script(REPO / "bench" / "fast_backend.py", [], "FAST_BACKEND_READY", log_dir / "backend.log")
    try:
        yield url
    finally:
        stop_processes([proc])


def test_the_http_floor_proxies_as_the_router_does(fast_backend: str, log_dir: Path) -> None:
    """The http section's floor leg: a chat request, plain or streamed, through the floor, through our router (a
    model served only over HTTP) and straight to the backend gets the same answer (the backend answers a stream
    only when the body it was sent asks for one); what the backend refuses reaches the client as it was; a
    backend that is gone is a 502 naming it."""
    floor, floor_url = _start_floor([fast_backend], log_dir / "floor_http.log")
    procs = [floor]
    try:
        router = start_router(log_dir, [fast_backend], args=["--connection-mode", "http"])
        procs.append(router.proc)
        body = {"model": "bench-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        for sent in (body, {**body, "stream": True}):
            direct = httpx.post(f"{fast_backend}/v1/chat/completions", json=sent, timeout=10)
            for url in (floor_url, router.url):
                r = httpx.post(f"{url}/v1/chat/completions", json=sent, timeout=10)
                assert (r.status_code, r.content) == (200, direct.content), url
                assert r.headers["content-type"] == direct.headers["content-type"]
        assert direct.content.startswith(b"data: ") and direct.headers["content-type"] == "text/event-stream"
        refused = httpx.post(f"{floor_url}/no/such/path", json=body, timeout=10)
        assert refused.status_code == 404
        assert refused.content == httpx.post(f"{fast_backend}/no/such/path", json=body, timeout=10).content
        assert httpx.get(f"{floor_url}/v1/models", timeout=10).status_code == 405
    finally:
        stop_processes(procs)
    gone, gone_url = _start_floor([f"http://127.0.0.1:{free_port()}"], log_dir / "floor_gone.log")
    try:
        r = httpx.post(f"{gone_url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 502 and "the backend at 127.0.0.1:" in r.json()["error"]["message"]
    finally:
        stop_processes([gone])


@pytest.mark.parametrize(
    ("urls", "why"),
    [
        (["grpc://a:1", "http://b:2"], "all gRPC replicas or all http:// backends"),
        (["http://b"], "not http://HOST:PORT: http://b"),
        (["http://b:2/v1"], "not http://HOST:PORT: http://b:2/v1"),
    ],
)
def test_the_floor_refuses_worker_urls_it_cannot_use(urls: list[str], why: str) -> None:
    done = subprocess.run(
        [sys.executable, str(FLOOR), "--worker-urls", *urls], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.returncode == 2 and why in done.stderr


@pytest.mark.parametrize("load", router_middle.LOADS)
@pytest.mark.parametrize(("workers", "psrl"), [(2, []), (16, ["--psrl"])])
def test_the_middle_s_loop_runs_the_router_s_requests_to_its_faked_edge(load: str, workers: int, psrl: list) -> None:
    """What router_middle.py counts: every request answered 200 by the router's own app, each one reaching the
    faked client once, with the answer the endpoint shapes, spread over the --workers registered (with PSRL's
    routing headers too)."""
    argv = [sys.executable, str(REPO / "bench" / "router_middle.py"), "--child", load, "7", "--workers", str(workers)]
    done = subprocess.run(
        [*argv, *psrl],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["status"] == 200 and result["upstream_calls"] == router_middle.warmup(workers) + 7
    assert result["workers_reached"] == workers  # round_robin: every one of them, within 57 requests
    if load == "generate":
        assert result["body"]["output_ids"] == [42] and result["body"]["meta_info"]["prompt_tokens"] == 200
    elif load == "chat":  # the faked Generate's one token, id 42, as the router detokenizes it
        text = Tokenizer.from_folder(build_tiny_tokenizer()).decode([42])
        assert result["body"]["choices"][0]["message"]["content"] == text
        assert result["body"]["usage"]["completion_tokens"] == 1
    else:
        assert result["body"]["choices"][0]["message"]["content"] == "hi"


@pytest.mark.parametrize("tree", ["installed", "source"])
def test_the_b_leg_runs_our_router_on_the_interpreter_it_names(
    tree: str, replica: Proc, log_dir: Path, tmp_path: Path
) -> None:
    """`router_overhead.py --ab-python` (alone, or with --ab-src): the b leg's router is started by that
    interpreter, from the installed code or a source tree (made as bench/README.md says), and serves the
    section's load."""
    src = tmp_path / "tree"
    if tree == "source":
        shutil.copytree(REPO / "psrl", src / "psrl", ignore=shutil.ignore_patterns("__pycache__"))
        for native in (_wire, _kvx):  # the built modules, which a `git archive` lacks
            shutil.copy(str(native.__file__), src / "psrl")
    # Another interpreter, as far as the bench can tell: a script that leaves a mark and runs this one.
    marker = tmp_path / "ran"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\ntouch {marker}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    flags = ["--ab-python", str(python), *(["--ab-src", str(src)] if tree == "source" else [])]
    targets = router_overhead.router_targets(router_overhead.parse_args(flags), "grpc", [replica.url])
    legs = {name: argv for name, argv, _ in targets}
    assert legs["psrl-router-grpc"][0] == sys.executable  # the a leg keeps the bench's own
    argv = legs["psrl-router-grpc-b"]
    assert isinstance(argv, list) and argv[0] == str(python)
    if tree == "installed":
        assert argv[1:3] == ["-m", "psrl.router"]
    else:
        assert argv[1:4] == ["-c", router_overhead._RUN_FROM_SRC, str(src)]
    log = log_dir / f"b-leg-{tree}.log"
    with open(log, "wb") as stderr:
        proc = popen(argv, stdout=subprocess.PIPE, stderr=stderr, cwd=REPO, start_new_session=True)
    try:
        url = read_ready_line(proc, log, "PSRL_ROUTER_READY", 60)
        body = {"input_ids": list(range(11, 31)), "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        for _ in range(100):  # until the replica given on its command line is registered
            r = httpx.post(f"{url}/generate", json=body, timeout=60)
            if r.status_code != 503:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 2
        assert marker.exists()
    finally:
        stop_processes([proc])


def test_an_interpreter_s_build_is_read_from_the_interpreter_itself() -> None:
    """What the bench records of each interpreter: this one's version, and whether it runs on a shared libpython
    as this process's own memory map shows it."""
    build = benchlib.interpreter(sys.executable)
    assert build["version"] == platform.python_version()
    with open("/proc/self/maps") as maps:
        assert build["libpython_loaded"] == ("libpython" in maps.read())
    with pytest.raises(RuntimeError, match="could not be run"):
        benchlib.interpreter(str(REPO / "no-such-python"))
