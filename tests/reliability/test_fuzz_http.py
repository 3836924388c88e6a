"""Hypothesis over every HTTP endpoint of the router and the SessionRouter, against real processes: the
README's request shapes plus mutations (wrong types, missing fields, numbers beyond int32/uint32/int64, deep
nesting, lone surrogates and invalid UTF-8 as raw bytes, empty and non-JSON bodies, wrong content types), with
and without PSRL headers and with malformed header values.

Every answer must be a success or a 4xx with the service's JSON error: never a 5xx, never a dropped connection,
never silence. Afterwards nothing may stay counted (routing loop, in-flight per instance, the replica's
running and waiting requests, the SessionRouter's in-flight turns) and `POST /routing_loop/pause?wait=true`
must return. Each test is one endpoint group; it reports every distinct failure it met, with the request.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from _fuzz import (
    FuzzRequest,
    FuzzRun,
    Target,
    build_request,
    chat_body,
    clamp_cost,
    completion_body,
    control_body,
    fuzz_settings,
    generate_body,
    header_value,
    leak_problems,
    messages_body,
    normalize,
    odd_text,
    pause_body,
    psrl_headers,
    quoted,
    responses_body,
    update_stats_body,
    update_weight_version_body,
    weird_value,
    worker_body,
)
from _procs import Proc, start_replica, start_router, start_session_router
from hypothesis import given
from hypothesis import strategies as st

from psrl.gateway.processes import stop_processes

pytestmark = pytest.mark.fuzz

ROUTER_ARGS = ["--enable-routing-loop", "--enable-partial-rollout"]


@dataclass
class Stack:
    """A reference replica, a router with the routing loop (and partial rollout) in front of it, a SessionRouter
    in front of that, and a second router for the registry endpoints (whose fuzz pauses, re-versions and
    re-registers workers) on the same replica. Restarted between groups when one left something counted, so a
    leak is reported once, by the group that caused it."""

    model_dir: Path
    log_dir: Path
    replica: Proc | None = None
    router: Proc | None = None
    session: Proc | None = None
    admin: Proc | None = None
    dirty: bool = False
    model: str = ""  # the served model's name (the model folder's)
    sessions: list[str] = field(default_factory=list)  # live SessionRouter sessions for the turn groups

    def start(self) -> None:
        self.replica = start_replica(self.model_dir, self.log_dir, dp_size=2)
        self.router = start_router(self.log_dir, [self.replica.url], args=ROUTER_ARGS)
        self.admin = start_router(self.log_dir, [self.replica.url], args=ROUTER_ARGS)
        self.session = start_session_router(self.log_dir, self.router.url)
        self.model = httpx.get(f"{self.router.url}/v1/models", timeout=10).json()["data"][0]["id"]
        self.sessions = []
        self.dirty = False

    def stop(self) -> None:
        stop_processes([p.proc for p in (self.session, self.admin, self.router, self.replica) if p is not None])

    def ensure_clean(self) -> None:
        procs = (self.replica, self.router, self.admin, self.session)
        if self.dirty or not all(p is not None and p.alive() for p in procs):
            self.stop()
            self.start()

    def router_target(self) -> Target:
        assert self.router is not None
        return Target("router", self.router.url, self.router.log, self.router.alive)

    def session_target(self) -> Target:
        assert self.session is not None
        return Target("session", self.session.url, self.session.log, self.session.alive)

    def live_session(self, i: int) -> str:
        """One of a few live SessionRouter sessions (made when the pool is short)."""
        assert self.session is not None
        while len(self.sessions) < 3:
            r = httpx.post(f"{self.session.url}/sessions", timeout=10)
            r.raise_for_status()
            self.sessions.append(r.json()["session_id"])
        return self.sessions[i % len(self.sessions)]


@pytest.fixture(scope="module")
def stack(model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    s = Stack(model_dir, log_dir)
    s.start()
    yield s
    s.stop()


def _fuzz(
    stack: Stack,
    run: FuzzRun,
    requests: st.SearchStrategy[FuzzRequest],
    max_examples: int,
    *,
    after_each: Callable[[FuzzRequest, httpx.Response | None], None] | None = None,
    on_response: Callable[[FuzzRequest, httpx.Response], None] | None = None,
    routers: tuple[str, ...] = ("router",),
    explicit: list[FuzzRequest] | None = None,
    allow: str | None = None,
) -> None:
    """Send the `explicit` requests (edges a bug was once found at), then `max_examples` drawn ones, then check
    for leaks; fail with every distinct problem found."""

    def send(req: FuzzRequest) -> None:
        r = run.send(req, on_response)
        if after_each is not None and not run.stopped:
            after_each(req, r)

    @fuzz_settings(max_examples)
    @given(req=requests)
    def one(req: FuzzRequest) -> None:
        send(req)

    try:
        for req in explicit or []:
            send(req)
        one()
    finally:
        run.close()
    if allow is not None:  # a signature the caller expects, with no traceback behind it
        for sig in [sig for sig in run.failures if sig == allow]:
            del run.failures[sig]
    assert stack.replica is not None
    problems: list[str] = []
    for name in routers:
        proc = getattr(stack, name)
        assert proc is not None
        if not proc.alive():
            problems.append(f"the {name} process exited: {proc.log_text()[-2000:]}")
            continue
        session_url = stack.session.url if name == "router" and stack.session is not None else None  # in front of it
        problems.extend(f"{name}: {p}" for p in leak_problems(proc.url, [stack.replica.url], session_url))
    if problems:
        stack.dirty = True
    report = run.report()
    print(report)
    if run.failures or problems or run.stopped:
        pytest.fail(f"{report}\n" + "\n".join(f"LEAK: {p}" for p in problems), pytrace=False)


PSRL = {"x-request-id": "11", "x-prompt-id": "11"}
DEEP = b"[" * 5000 + b"]" * 5000
BIG_INT = b"9" * 5000


def raw(
    method: str, path: str, body: bytes, headers: dict[str, str] | None = None, route: str | None = None
) -> FuzzRequest:
    return FuzzRequest(method, path, route or path, body, headers or {}, "application/json")


def _chat(extra: bytes = b"", content: bytes = b'"hi"') -> bytes:
    return b'{"messages": [{"role": "user", "content": ' + content + b'}], "max_tokens": 4' + extra + b"}"


def router_edges(path: str) -> list[FuzzRequest]:
    """The inputs issue 12 found 5xx at, and their neighbours, on each generation endpoint."""
    if path == "/generate":
        gen = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4%s}}'
        return [
            raw("POST", path, gen % b', "seed": 2147483648', PSRL),
            raw("POST", path, gen % b', "sampling_seed": -2147483649', PSRL),
            raw("POST", path, gen % b', "top_k": 4294967296', PSRL),
            raw("POST", path, gen % b', "n": 4294967297, "temperature": 1', PSRL),
            raw("POST", path, gen % b', "temperature": NaN', PSRL),
            raw("POST", path, gen % b', "temperature": 1e999'),
            raw("POST", path, gen % (b', "max_new_tokens": ' + BIG_INT)),
            raw("POST", path, gen % b', "stop_token_ids": [18446744073709551616]'),
            raw("POST", path, b'{"input_ids": [4294967296], "sampling_params": {"max_new_tokens": 2}}'),
            raw("POST", path, b'{"input_ids": [1, true], "sampling_params": {"max_new_tokens": 2}}'),
            raw("POST", path, b'{"input_ids": [[1, 2], [false]], "sampling_params": {"max_new_tokens": 2}}'),
            raw("POST", path, gen % b', "stop_token_ids": [true]'),
            raw("POST", path, b'{"input_ids": ' + DEEP + b"}"),
            raw("POST", path, b'{"text": "\\ud800 \\ud800", "sampling_params": {"max_new_tokens": 2}}'),
            raw("POST", path, b'{"text": "\xed\xa0\x80", "sampling_params": {"max_new_tokens": 2}}'),
            raw("POST", path, gen % b"", {**PSRL, "x-version-tag": "99999999999999999999"}),
            raw("POST", path, gen % b"", {**PSRL, "x-target-dp-rank": "99999999999999999999", "x-base-worker-id": "0"}),
        ]
    if path == "/v1/chat/completions":
        return [
            raw("POST", path, _chat(b', "seed": 2147483648'), PSRL),
            raw("POST", path, _chat(b', "top_k": 4294967296'), PSRL),
            raw("POST", path, _chat(b', "max_tokens": 4294967296')),
            raw("POST", path, _chat(b', "n": 129')),
            raw("POST", path, _chat(b', "stream": [1]')),
            raw("POST", path, _chat(b', "logprobs": true, "top_logprobs": 21')),
            raw("POST", path, _chat(b', "temperature": NaN')),
            raw("POST", path, _chat(b"", b'"\\ud800"')),
            raw("POST", path, _chat(b"", b'"\xed\xa0\x80"')),
            raw("POST", path, _chat(b"", b'[{"type": "text", "text": "\\udfff"}]')),
            raw("POST", path, _chat(b"", DEEP)),
            raw("POST", path, _chat(b', "max_tokens": ' + BIG_INT)),
            raw("POST", path, _chat(b', "chat_template_kwargs": {"messages": []}')),
            raw("POST", path, _chat(b', "chat_template_kwargs": {"tools": 1}')),
            raw("POST", path, _chat(b', "chat_template_kwargs": {"add_generation_prompt": false}')),
            raw("POST", path, _chat(b', "tools": [{"type": "function", "function": {"name": "\\ud800"}}]')),
            raw("POST", path, _chat(b', "stop": ["a", ""]')),
            raw("POST", path, _chat(b', "stop_token_ids": [true]')),
            raw("POST", path, _chat(), {**PSRL, "x-prompt-id": "9" * 5000}),
        ]
    if path == "/v1/completions":
        return [
            raw("POST", path, b'{"prompt": [[1, 2], [4294967296]], "max_tokens": 2}'),
            raw("POST", path, b'{"prompt": "\\ud800", "max_tokens": 2}'),
            raw("POST", path, b'{"prompt": [1, true], "max_tokens": 2}'),
            raw("POST", path, b'{"prompt": "a", "max_tokens": 2, "logprobs": 21}'),
            raw("POST", path, b'{"prompt": "a", "max_tokens": 2, "seed": 2147483648}', PSRL),
            raw("POST", path, b'{"prompt": ' + DEEP + b', "max_tokens": 2}'),
        ]
    if path == "/v1/responses":
        return [
            raw("POST", path, b'{"input": "\\ud800", "max_output_tokens": 2}'),
            raw("POST", path, b'{"input": [{"role": "user", "content": "\\udfff"}], "max_output_tokens": 2}'),
            raw("POST", path, b'{"input": "a", "max_output_tokens": 4294967296}'),
            raw("POST", path, b'{"input": "a", "max_output_tokens": 2, "previous_response_id": "r"}'),
            raw(
                "POST",
                path,
                b'{"input": [{"type": "function_call", "call_id": "1", "name": "f", "arguments": "{"}], '
                b'"max_output_tokens": 2}',
            ),
        ]
    assert path == "/v1/messages"
    return [
        raw("POST", path, b'{"messages": [{"role": "user", "content": "a"}]}'),
        raw("POST", path, b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
        raw("POST", path, b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "stop_sequences": [""]}'),
        raw(
            "POST",
            path,
            b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "top_k": 4294967296}',
            PSRL,
        ),
        raw("POST", path, b'{"system": "\\udfff", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}'),
    ]


def _router_request(path: str, body: st.SearchStrategy[Any]) -> st.SearchStrategy[FuzzRequest]:
    return build_request("POST", path, body, headers=psrl_headers(), clamp=clamp_cost)


# ---- the router's data plane ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "shape", "examples"),
    [
        ("/v1/chat/completions", chat_body, 250),
        ("/v1/completions", completion_body, 150),
        ("/v1/responses", responses_body, 150),
        ("/v1/messages", messages_body, 150),
        ("/generate", generate_body, 250),
    ],
)
def test_router_generation_endpoints(stack: Stack, path: str, shape: Callable, examples: int) -> None:
    stack.ensure_clean()
    requests = _router_request(path, shape(stack.model))
    _fuzz(stack, FuzzRun(stack.router_target()), requests, examples, explicit=router_edges(path))


def test_router_tito_sessions_and_turns(stack: Stack) -> None:
    """POST/GET/DELETE /tito/sessions[/{sid}] with live, deleted and made-up ids, and chat turns that name a
    session (x-smg-tito-session-id) with fuzzed bodies and trajectory ids."""
    stack.ensure_clean()
    assert stack.router is not None
    live = [httpx.post(f"{stack.router.url}/tito/sessions", timeout=10).json()["session_id"] for _ in range(3)]
    sid = st.one_of(st.sampled_from(live), st.sampled_from(live), odd_text(30), st.just(""), st.just("../workers"))
    sid_header = st.one_of(st.sampled_from(live), st.sampled_from(live), odd_text(30).map(header_value))
    session_path = sid.map(lambda s: f"/tito/sessions/{quoted(s)}")

    @st.composite
    def requests(draw: st.DrawFn) -> FuzzRequest:
        kind = draw(st.sampled_from(["create", "get", "delete", "turn", "turn", "turn"]))
        if kind == "create":
            return draw(build_request("POST", "/tito/sessions", weird_value(), mutate=False, headers=psrl_headers()))
        if kind in ("get", "delete"):
            path = draw(session_path)
            method = "GET" if kind == "get" else "DELETE"
            return FuzzRequest(method, path, "/tito/sessions/{session_id}", b"", draw(psrl_headers()), None)
        headers = {
            "x-smg-tito-session-id": draw(sid_header),
            **draw(psrl_headers({"x-smg-tito-trajectory-id": ["0", "1", "2"]})),
        }
        req = draw(build_request("POST", "/v1/chat/completions", chat_body(stack.model), clamp=clamp_cost))
        req.headers.update(headers)
        req.route = "/v1/chat/completions (TITO turn)"
        return req

    _fuzz(stack, FuzzRun(stack.router_target()), requests(), 200)


def test_router_unknown_paths_and_wrong_methods(stack: Stack) -> None:
    """Every route with a method it does not take, and paths no route has: a JSON 404/405."""
    stack.ensure_clean()
    routes = {
        "/health": "GET",
        "/metrics": "GET",
        "/v1/models": "GET",
        "/v1/chat/completions": "POST",
        "/v1/completions": "POST",
        "/v1/responses": "POST",
        "/v1/messages": "POST",
        "/generate": "POST",
        "/tito/sessions": "POST",
        "/workers/stats": "GET",
        "/workers/update_stats": "POST",
        "/routing_loop/status": "GET",
        "/routing_loop/filter": "GET",
    }

    @st.composite
    def requests(draw: st.DrawFn) -> FuzzRequest:
        if draw(st.booleans()):
            path = draw(st.sampled_from(sorted(routes)))
            method = draw(
                st.sampled_from([m for m in ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS") if m != routes[path]])
            )
        else:
            path = "/" + "/".join(quoted(p) for p in draw(st.lists(odd_text(10), min_size=1, max_size=4)))
            path = draw(st.sampled_from([path, "/v1" + path, "/v1/chat/completions" + path, "/tito/sessions/a" + path]))
            method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
        content = draw(st.sampled_from([b"", b"{}", b'{"messages": []}', b"\xff"]))
        return FuzzRequest(
            method,
            path,
            f"{method} (any)",
            content,
            draw(psrl_headers()),
            draw(st.sampled_from([None, "application/json"])),
        )

    _fuzz(stack, FuzzRun(stack.router_target()), requests(), 150)


def test_router_routing_loop_endpoints(stack: Stack) -> None:
    """/routing_loop/{pause,resume,status,filter} with fuzzed query strings and bodies; resumed after each."""
    stack.ensure_clean()
    assert stack.router is not None
    router_url = stack.router.url
    query_value = st.one_of(
        st.sampled_from(["true", "false", "1", "0", "yes", "", "-1", "7", "9" * 30, "9" * 5000, "x", "%ff", "1e3"]),
        odd_text(8),
    )

    @st.composite
    def requests(draw: st.DrawFn) -> FuzzRequest:
        method, path, key = draw(
            st.sampled_from(
                [
                    ("POST", "/routing_loop/pause", "wait"),
                    ("POST", "/routing_loop/resume", "wait"),
                    ("GET", "/routing_loop/status", "x"),
                    ("GET", "/routing_loop/filter", "version_tag"),
                ]
            )
        )
        query = ""
        if draw(st.booleans()):
            pairs = [
                (draw(st.sampled_from([key, key, "x"])), draw(query_value)) for _ in range(draw(st.integers(1, 3)))
            ]
            query = "?" + "&".join(f"{quoted(k)}={quoted(v)}" for k, v in pairs)
        body = draw(st.sampled_from([b"", b"{}", b"[1]", b"\xff"]))
        return FuzzRequest(method, path + query, path, body, draw(psrl_headers()), "application/json")

    def resume(req: FuzzRequest, r: httpx.Response | None) -> None:
        if req.route == "/routing_loop/pause":
            httpx.post(f"{router_url}/routing_loop/resume", timeout=10)

    _fuzz(stack, FuzzRun(stack.router_target()), requests(), 120, after_each=resume)


def test_router_worker_registry_endpoints(stack: Stack) -> None:
    """/workers (register, list), /workers/{id} DELETE, /workers/stats, update_stats, update_weight_version,
    pause and resume on the second router; after each example its worker is registered, resumed and at
    version 0 again. A registration the body names correctly but whose worker cannot be reached is the one 5xx
    allowed (503 worker_unavailable): the router reports a real upstream failure there."""
    stack.ensure_clean()
    assert stack.admin is not None and stack.replica is not None
    admin_url, real_url = stack.admin.url, stack.replica.url
    ids = ["0", "1", "nope", ""]

    @st.composite
    def requests(draw: st.DrawFn) -> FuzzRequest:
        kind = draw(st.sampled_from(["register", "stats", "weight", "pause", "resume", "delete", "list", "list_stats"]))
        if kind == "register":
            return draw(build_request("POST", "/workers", worker_body([real_url])))
        if kind == "stats":
            return draw(build_request("POST", "/workers/update_stats", update_stats_body(ids)))
        if kind == "weight":
            return draw(build_request("POST", "/workers/update_weight_version", update_weight_version_body(ids)))
        if kind in ("pause", "resume"):
            return draw(build_request("POST", f"/workers/{kind}", pause_body(ids)))
        if kind == "delete":
            wid = draw(st.one_of(st.sampled_from(["1", "nope", "0x", "%00"]), odd_text(10)))
            return FuzzRequest("DELETE", f"/workers/{quoted(wid)}", "/workers/{worker_id}", b"", {}, None)
        path = "/workers" if kind == "list" else "/workers/stats"
        return FuzzRequest("GET", path, path, draw(st.sampled_from([b"", b"{}", b"\xff"])), {}, None)

    def restore(req: FuzzRequest, r: httpx.Response | None) -> None:
        if req.method == "GET":
            return
        with httpx.Client(base_url=admin_url, timeout=10) as c:
            workers = c.get("/workers").json()["workers"]
            real = [w for w in workers if w["url"] == real_url]
            for w in workers:
                if w["url"] != real_url:
                    c.delete(f"/workers/{quoted(w['worker_id'])}")
            if not real or real[0]["worker_id"] != "0":
                assert c.post("/workers", json={"url": real_url, "id": "0"}).status_code == 200
            c.post("/workers/resume", json=[{"base_worker_id": "0"}]).raise_for_status()
            updates = [{"worker_id": "0", "dp_rank": r, "weight_version": 0} for r in range(2)]
            c.post("/workers/update_weight_version", json=updates).raise_for_status()

    run = FuzzRun(Target("router", admin_url, stack.admin.log, stack.admin.alive))
    edges = [
        raw("POST", "/workers", b'{"url": "grpc://127.0.0.1:99999"}'),
        raw("POST", "/workers", b'{"url": "grpc://[::1:1"}'),
        raw("POST", "/workers", b'{"url": "grpc://127.0.0.1:1", "labels": {"weight_version": "' + BIG_INT + b'"}}'),
        raw("POST", "/workers", b'{"url": "grpc://127.0.0.1:1", "labels": {"x": ' + DEEP + b"}}"),
        raw("POST", "/workers/pause", b'[{"base_worker_id": "0", "dp_rank": [[0]]}]'),
        raw("POST", "/workers/resume", b'[{"base_worker_id": "0", "dp_rank": {"a": 1}}]'),
        raw("POST", "/workers/update_stats", _stats(b'{"num_running_reqs": 1e999}')),
        raw("POST", "/workers/update_stats", _stats(b'{"num_running_reqs": NaN}')),
        raw("POST", "/workers/update_stats", _stats(b'{"req_id_to_prompt_token_num": {"a": 1e999}}')),
        raw("POST", "/workers/update_stats", b'[{"worker_id": "0", "dp_rank": 0, "timestamp": "9999-99-99"}]'),
        raw("POST", "/workers/update_weight_version", b'{"updates": [{"worker_id": ["0"], "dp_rank": 0}]}'),
        raw("DELETE", "/workers/%00", b"", route="/workers/{worker_id}"),
    ]
    # The one 5xx allowed: registering a well-formed URL nobody answers at is the upstream's failure (503).
    unreachable = "router POST /workers: 503 (worker_unavailable)"
    _fuzz(stack, run, requests(), 250, after_each=restore, routers=("admin",), explicit=edges, allow=unreachable)


def _stats(scheduler_stats: bytes) -> bytes:
    head = b'[{"worker_id": "0", "dp_rank": 0, "timestamp": "2030-01-01T00:00:00Z", "scheduler_stats": '
    return head + scheduler_stats + b"}]"


# ---- HTTP framing (both servers) -------------------------------------------------------------------------------


FRAMING_TEMPLATES = [
    b"G@T /health HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET /health HTTX/1.1\r\nHost: x\r\n\r\n",
    b"GET  /health  HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /he alth HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /h\xffealth HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nBadHeader\r\nContent-Length: 2\r\n\r\n{}",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}x",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n{}",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nContent-Length: 67108865\r\n\r\n{}",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nContent-Length: 0x10\r\n\r\n{}",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n{}",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\n\r\n{}",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\n{}",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nX-A: a\r\n folded\r\nContent-Length: 2\r\n\r\n{}",
    b"POST %(path)s HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nX-Long: %(long)s\r\nContent-Length: 2\r\n\r\n{}",
    b"POST %(path)s HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
    b"POST http://x%(path)s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}GARBAGE / HTTP/1.1\r\n\r\n",
    b"POST %(path)s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n{}",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
]


@st.composite
def framing_requests(draw: st.DrawFn, paths: list[str]) -> bytes:
    """A request whose framing is wrong (method, version, header syntax, lengths, chunking), or random bytes
    that start like one."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.sampled_from([b"GET ", b"POST /", b""])) + draw(st.binary(min_size=1, max_size=64)) + b"\r\n\r\n"
    template = draw(st.sampled_from(FRAMING_TEMPLATES))
    long = b"a" * draw(st.sampled_from([10, 9000, 100_000]))
    return template % {b"path": draw(st.sampled_from(paths)).encode(), b"long": long} if b"%(" in template else template


def _first_answer(url: str, payload: bytes, timeout_s: float = 10.0) -> tuple[int | None, dict[str, str], bytes]:
    """Send raw bytes and read the first answer (status, headers, body); status None when none came."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = b""
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(payload)
        try:
            while b"\r\n\r\n" not in data or not _complete(data):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    while data.startswith(b"HTTP/1.1 100 "):  # an interim answer to Expect: 100-continue
        data = data.partition(b"\r\n\r\n")[2]
    if not data.startswith(b"HTTP/"):
        return None, {}, data
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    headers = {k.lower(): v for k, v in headers.items()}
    return int(lines[0].split()[1]), headers, body[: int(headers.get("content-length", len(body)))]


def _complete(data: bytes) -> bool:
    while data.startswith(b"HTTP/1.1 100 ") and data.count(b"\r\n\r\n") > 1:
        data = data.partition(b"\r\n\r\n")[2]
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return False  # chunked or close-delimited: read until the server closes


@pytest.mark.parametrize("service", ["router", "session"])
def test_http_framing_errors_get_the_json_error(stack: Stack, service: str) -> None:
    """Malformed HTTP (a parser error, a bad length, bad chunking, a header too long) is answered with the
    service's JSON error and x-smg-error-code, never a text/plain 400, a 5xx or silence."""
    stack.ensure_clean()
    target = stack.router_target() if service == "router" else stack.session_target()
    sid = stack.live_session(0)
    paths = ["/generate", "/v1/chat/completions"] if service == "router" else [f"/sessions/{sid}/v1/chat/completions"]
    failures: dict[str, list[str]] = {}

    @fuzz_settings(80)
    @given(payload=framing_requests(paths))
    def one(payload: bytes) -> None:
        status, headers, body = _first_answer(target.url, payload)
        problem = None
        if status is None:
            problem = f"no answer ({body[:60]!r})"
        elif status >= 500:
            problem = f"{status}"
        elif status >= 400:
            try:
                err = json.loads(body).get("error")
            except ValueError:
                err = None
            ok_shape = (isinstance(err, dict) and isinstance(err.get("message"), str)) or (
                service == "session" and isinstance(err, str)
            )
            if not ok_shape or "x-smg-error-code" not in headers:
                problem = f"{status} {headers.get('content-type')} {body[:80]!r}"
        if problem is not None:
            key = f"{service} framing: {problem.split(' ', 1)[0]} {normalize(problem, 70)}"
            if len(failures.setdefault(key, [])) < 2:
                failures[key].append(f"sent {payload[:300]!r} -> {problem}")

    one()
    assert target.alive(), f"the {service} died"
    if failures:
        lines = [f"- {k}\n    " + "\n    ".join(v) for k, v in failures.items()]
        pytest.fail("\n".join(lines), pytrace=False)


# ---- the SessionRouter ----------------------------------------------------------------------------------------


def _session_id(stack: Stack) -> st.SearchStrategy[str]:
    """A live session seven times in ten, else a made-up id (odd text, empty, very long)."""

    @st.composite
    def sid(draw: st.DrawFn) -> str:
        if draw(st.integers(0, 9)) < 7:
            return stack.live_session(draw(st.integers(0, 7)))
        return draw(st.one_of(odd_text(30), st.just(""), st.just("x" * 300)))

    return sid()


def _forget_deleted(stack: Stack) -> Callable[[FuzzRequest, httpx.Response], None]:
    def on_response(req: FuzzRequest, r: httpx.Response) -> None:
        if req.method == "DELETE" and (r.is_success or r.status_code == 404):
            for s in list(stack.sessions):
                if req.path.endswith("/" + quoted(s)):
                    stack.sessions.remove(s)

    return on_response


def test_session_router_sessions(stack: Stack) -> None:
    """POST /sessions (with PSRL headers to keep), GET and DELETE /sessions/{sid}, count_tokens."""
    stack.ensure_clean()

    @st.composite
    def requests(draw: st.DrawFn) -> FuzzRequest:
        kind = draw(st.sampled_from(["create", "create", "get", "delete", "count"]))
        headers = draw(psrl_headers({"x-smg-tito-session-id": ["abc", ""]}))
        if kind == "create":
            req = draw(build_request("POST", "/sessions", weird_value(), mutate=False))
            req.headers.update(headers)
            return req
        sid = draw(_session_id(stack))
        if kind == "count":
            req = draw(
                build_request("POST", f"/sessions/{quoted(sid)}/v1/messages/count_tokens", messages_body(stack.model))
            )
            req.route = "/sessions/{sid}/v1/messages/count_tokens"
            return req
        method = "GET" if kind == "get" else "DELETE"
        return FuzzRequest(method, f"/sessions/{quoted(sid)}", "/sessions/{sid}", b"", headers, None)

    sid = stack.live_session(0)
    latin1 = {"x-request-id": "\xbd"}  # a header value that is latin-1, not ASCII
    edges = [
        FuzzRequest("GET", "/sessions/%0B", "/sessions/{sid}", b"", {}, None),
        FuzzRequest("DELETE", "/sessions/a%7Fb", "/sessions/{sid}", b"", {}, None),
        FuzzRequest("GET", f"/sessions/{sid}/", "/sessions/{sid}", b"", {}, None),
        FuzzRequest("POST", "/sessions", "/sessions", b"", latin1, None),
        FuzzRequest("GET", f"/sessions/{sid}", "/sessions/{sid}", b"", latin1, None),
    ]
    run = FuzzRun(stack.session_target(), extra_logs=[stack.router.log] if stack.router else [])
    _fuzz(stack, run, requests(), 150, on_response=_forget_deleted(stack), explicit=edges)


@pytest.mark.parametrize(
    ("api", "shape", "examples"),
    [
        ("v1/chat/completions", chat_body, 200),
        ("v1/responses", responses_body, 120),
        ("v1/messages", messages_body, 120),
    ],
)
def test_session_router_turns(stack: Stack, api: str, shape: Callable, examples: int) -> None:
    """Turns under /sessions/{sid}/v1/...: fuzzed bodies (streamed or not), trajectory ids and PSRL headers."""
    stack.ensure_clean()

    @st.composite
    def requests(draw: st.DrawFn) -> FuzzRequest:
        sid = draw(_session_id(stack))
        req = draw(build_request("POST", f"/sessions/{quoted(sid)}/{api}", shape(stack.model), clamp=clamp_cost))
        req.headers.update(draw(psrl_headers({"x-smg-tito-trajectory-id": ["0", "1", "2"]})))
        req.route = f"/sessions/{{sid}}/{api}"
        return req

    sid = stack.live_session(0)
    body = _chat() if api == "v1/chat/completions" else b'{"input": "a", "max_output_tokens": 2}'
    if api == "v1/messages":
        body = b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}'
    route = f"/sessions/{{sid}}/{api}"
    edges = [
        raw("POST", f"/sessions//{api}", body, route=route),
        raw("POST", f"/sessions/{sid}/{api}", body, {"x-request-id": "\xbd", "x-prompt-id": "1"}, route),
        raw("POST", f"/sessions/{sid}/{api}", body, {"x-smg-tito-trajectory-id": "\xe9"}, route),
        raw("POST", f"/sessions/{sid}/{api}", body[:-1] + b', "stream": [1]}', route=route),
        raw("POST", f"/sessions/{sid}/{api}", b"[" * 5000 + b"]" * 5000, route=route),
    ]
    if api == "v1/chat/completions":  # a version floor beyond int64 (once: today it is never answered)
        edges.append(raw("POST", f"/sessions/{sid}/{api}", body, {**PSRL, "x-version-tag": "9" * 20}, route))
    run = FuzzRun(stack.session_target(), extra_logs=[stack.router.log] if stack.router else [])
    _fuzz(stack, run, requests(), examples, explicit=edges)


def test_session_router_forwarded_paths(stack: Stack) -> None:
    """Other paths under a session go to the router as they are (a POST counts as a turn): completions,
    /generate, models and made-up paths, with any method. The registry and routing-loop paths are left out:
    the SessionRouter forwards those too, and a fuzzed DELETE /workers/0 would take the fleet away."""
    stack.ensure_clean()
    forwarded = {
        "v1/completions": completion_body(stack.model),
        "generate": generate_body(stack.model),
        "v1/models": st.just({}),
        "health": st.just({}),
        "tito/sessions": st.just({}),
        "v1/embeddings": st.just({"input": "x"}),
    }

    @st.composite
    def requests(draw: st.DrawFn) -> FuzzRequest:
        sid = draw(_session_id(stack))
        path = draw(st.one_of(st.sampled_from(sorted(forwarded)), odd_text(10).map(quoted)))
        body = forwarded.get(path, weird_value())
        method = draw(st.sampled_from(["POST", "POST", "GET", "PUT", "PATCH", "DELETE"]))
        req = draw(
            build_request(method, f"/sessions/{quoted(sid)}/{path}", body, clamp=clamp_cost, headers=psrl_headers())
        )
        req.route = f"/sessions/{{sid}}/{path if path in forwarded else '<other>'}"
        return req

    sid = stack.live_session(0)
    gen = b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}'
    edges = [
        FuzzRequest("GET", f"/sessions/{sid}/%0B", "/sessions/{sid}/<other>", b"", {}, None),
        FuzzRequest("POST", f"/sessions/{sid}/a%0Ab", "/sessions/{sid}/<other>", b"{}", {}, "application/json"),
        raw("POST", f"/sessions/{sid}/generate", gen, {"x-smg-routing-key": "\xe9"}, "/sessions/{sid}/generate"),
        raw("POST", f"/sessions/{sid}/generate/", gen, route="/sessions/{sid}/generate"),
    ]
    run = FuzzRun(stack.session_target(), extra_logs=[stack.router.log] if stack.router else [])
    _fuzz(stack, run, requests(), 150, explicit=edges)


def test_session_router_control(stack: Stack) -> None:
    """/control/sessions, /control/hang and /control/continue (with pins to real, made-up and malformed
    instances), interleaved with turns; every session is continued after each example."""
    stack.ensure_clean()
    assert stack.session is not None
    session_url = stack.session.url

    @st.composite
    def requests(draw: st.DrawFn) -> FuzzRequest:
        kind = draw(st.sampled_from(["hang", "continue", "continue", "list", "turn"]))
        if kind == "list":
            return FuzzRequest("GET", "/control/sessions", "/control/sessions", b"", {}, None)
        if kind == "turn":
            sid = stack.live_session(draw(st.integers(0, 7)))
            req = draw(
                build_request(
                    "POST",
                    f"/sessions/{sid}/v1/chat/completions",
                    chat_body(stack.model),
                    mutate=False,
                    clamp=clamp_cost,
                )
            )
            req.route = "/sessions/{sid}/v1/chat/completions (after control)"
            return req
        live = list(stack.sessions) or [stack.live_session(0)]
        return draw(build_request("POST", f"/control/{kind}", control_body(lambda: live)))

    def continue_all(req: FuzzRequest, r: httpx.Response | None) -> None:
        if req.route.startswith("/control/") and req.method == "POST":
            sessions = httpx.get(f"{session_url}/control/sessions", timeout=10).json()["sessions"]
            httpx.post(f"{session_url}/control/continue", json=[s["session_id"] for s in sessions], timeout=10)

    edges = [
        raw("POST", "/control/continue", b'["\\ud800"]'),
        raw("POST", "/control/hang", b'[{"session_id": "\\udfff"}]'),
        raw("POST", "/control/continue", b'{"sessions": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        raw("GET", "/control/hang", b""),
    ]
    run = FuzzRun(stack.session_target(), extra_logs=[stack.router.log] if stack.router else [])
    _fuzz(stack, run, requests(), 150, after_each=continue_all, explicit=edges)
