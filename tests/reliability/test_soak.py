"""A soak over real processes (a reference replica, a router with the routing loop and partial rollout, a
SessionRouter): normal requests, bad bodies, clients that leave at every phase of a request and session churn,
all at once for about two minutes. Afterwards the router's and the SessionRouter's memory and open file
descriptors must be back near where they were after the warm-up, nothing may stay counted, and the router must
still serve.

Bounds (stated, not tuned to pass): RSS may grow by less than RSS_GROWTH_MIB over the soak (the same mix ran
in the warm-up, so caches and pools are already full), and once every client connection is closed the open fds
may exceed the warm-up's by at most FD_SLACK.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from _fuzz import leak_problems
from _procs import Proc, start_replica, start_router, start_session_router

from psrl.gateway.processes import stop_processes

pytestmark = pytest.mark.slow

WARMUP_S = float(os.environ.get("PSRL_SOAK_WARMUP_S", "15"))
SOAK_S = float(os.environ.get("PSRL_SOAK_S", "90"))
RSS_GROWTH_MIB = 64
FD_SLACK = 16
CHAT = [{"role": "user", "content": "Tell me a story about a small gateway."}]


# ---- what a process holds ---------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Usage:
    rss_mib: float
    fds: int

    @classmethod
    def of(cls, proc: Proc) -> Usage:
        return cls(rss_mib(proc.proc.pid), open_fds(proc.proc.pid))


# ---- outcomes -----------------------------------------------------------------------------------------------


@dataclass
class Tally:
    """What each kind of traffic got; `bad` holds the unexpected outcomes (first few of each)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: dict[str, int] = field(default_factory=dict)
    bad: dict[str, list[str]] = field(default_factory=dict)

    def ok(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def fail(self, kind: str, what: str, detail: str) -> None:
        with self.lock:
            key = f"{kind}: {what}"
            self.counts[key] = self.counts.get(key, 0) + 1
            items = self.bad.setdefault(key, [])
            if len(items) < 3:
                items.append(detail[:600])


def _expect(tally: Tally, kind: str, r: httpx.Response, statuses: Callable[[int], bool]) -> None:
    if statuses(r.status_code):
        tally.ok(kind)
    else:
        tally.fail(kind, f"status {r.status_code}", r.text)


# ---- raw sockets: clients that leave ---------------------------------------------------------------------------


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def _head(method: str, path: str, host: str, length: int, extra: dict[str, str] | None = None) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/json",
        f"Content-Length: {length}",
    ]
    lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def leave(url: str, phase: str, path: str, body: dict, headers: dict[str, str] | None = None) -> None:
    """Send a request over a raw socket and close the connection at `phase`: before the body, halfway through
    it, right after it, after the first streamed bytes, or (for a request the routing loop holds) while queued.
    The sleeps are the client holding its connection a moment before it leaves: the traffic being soaked."""
    host, port = _address(url)
    raw = json.dumps(body).encode()
    with socket.create_connection((host, port), timeout=10) as s:
        if phase == "idle":
            time.sleep(0.2)
            return
        if phase == "partial_head":
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Le".encode())
            time.sleep(0.5)
            return
        s.sendall(_head("POST", path, host, len(raw), headers))
        if phase == "before_body":
            time.sleep(0.1)
            return
        if phase == "mid_body":
            s.sendall(raw[: len(raw) // 2])
            time.sleep(0.2)
            return
        s.sendall(raw)
        if phase == "after_send":
            time.sleep(0.05)
        elif phase == "mid_stream":
            seen = b""
            deadline = time.monotonic() + 10
            while b"data:" not in seen and time.monotonic() < deadline:
                chunk = s.recv(4096)
                if not chunk:
                    break
                seen += chunk
        elif phase == "queued":
            time.sleep(0.3)
        s.shutdown(socket.SHUT_RDWR)


PHASES = ["idle", "partial_head", "before_body", "mid_body", "after_send", "mid_stream", "queued"]
_ids = itertools.count(1_000_000)


def _disconnect_case(phase: str) -> tuple[str, dict, dict[str, str]]:
    """The path, body and headers a client leaving at `phase` sends (long generations, so it leaves mid-work)."""
    rid = next(_ids)
    if phase == "mid_stream":
        return "/v1/chat/completions", {"messages": CHAT, "max_tokens": 400, "stream": True}, {}
    if phase == "queued":  # version 9 is synced nowhere: the routing loop holds it
        headers = {"x-request-id": str(rid), "x-prompt-id": str(rid), "x-version-tag": "9"}
        return "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}, headers
    headers = {"x-request-id": str(rid), "x-prompt-id": str(rid)} if rid % 2 else {}
    return "/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 400}}, headers


# ---- the traffic ---------------------------------------------------------------------------------------------------


BAD_BODIES: list[tuple[str, bytes, dict[str, str]]] = [
    ("/v1/chat/completions", b"{", {}),
    ("/v1/chat/completions", b"", {}),
    ("/v1/chat/completions", b"[" * 50_000 + b"]" * 50_000, {}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', {}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}], "max_tokens": 2}', {}),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": ' + b"9" * 5000 + b"}}", {}),
    (
        "/generate",
        b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "seed": 2147483648}}',
        {"x-request-id": "7", "x-prompt-id": "7"},
    ),
    (
        "/generate",
        b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "top_k": 4294967296}}',
        {"x-request-id": "8", "x-prompt-id": "8"},
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "chat_template_kwargs": {"messages": []}}',
        {},
    ),
    ("/v1/chat/completions", b'{"messages": "hi"}', {"x-request-id": "x"}),
    ("/v1/completions", b'{"prompt": [1, "a"], "max_tokens": 2}', {}),
    ("/v1/messages", b'{"messages": [{"role": "user", "content": "x"}]}', {}),  # no max_tokens
    (
        "/generate",
        b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}',
        {"x-version-tag": "99999999999999999999999", "x-request-id": "1", "x-prompt-id": "1"},
    ),
]


@dataclass
class Soak:
    replica: Proc
    router: Proc
    session: Proc
    model: str
    tally: Tally = field(default_factory=Tally)
    stop: threading.Event = field(default_factory=threading.Event)

    def _loop(self, body: Callable[[httpx.Client, random.Random], None], seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=httpx.Timeout(60, connect=10)) as client:
            while not self.stop.is_set():
                try:
                    body(client, rng)
                except httpx.HTTPError as e:
                    self.tally.fail(body.__name__, type(e).__name__, repr(e))

    def normal(self, c: httpx.Client, rng: random.Random) -> None:
        r = self.router.url
        k = rng.randrange(4)
        if k == 0:
            resp = c.post(f"{r}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8})
        elif k == 1:
            rid = next(_ids)
            resp = c.post(
                f"{r}/generate",
                json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}},
                headers={"x-request-id": str(rid), "x-prompt-id": str(rid)},
            )
        elif k == 2:
            resp = c.post(f"{r}/v1/completions", json={"prompt": "once upon", "max_tokens": 8, "stream": True})
            if resp.status_code == 200 and "[DONE]" not in resp.text:
                self.tally.fail("normal", "stream without [DONE]", resp.text)
                return
        else:
            resp = c.post(f"{r}/v1/messages", json={"model": self.model, "max_tokens": 8, "messages": CHAT})
        _expect(self.tally, "normal", resp, lambda s: s == 200)

    def bad(self, c: httpx.Client, rng: random.Random) -> None:
        path, raw, headers = rng.choice(BAD_BODIES)
        base = self.router.url if rng.random() < 0.7 else None
        timeout = 15  # far above what a refusal takes; a bad body that is never answered shows as ReadTimeout
        if base is None:  # the same bodies as SessionRouter turns
            sid = c.post(f"{self.session.url}/sessions").json()["session_id"]
            try:
                resp = c.post(f"{self.session.url}/sessions/{sid}{path}", content=raw, headers=headers, timeout=timeout)
            finally:
                c.delete(f"{self.session.url}/sessions/{sid}")
        else:
            headers = {"content-type": "application/json", **headers}
            resp = c.post(f"{base}{path}", content=raw, headers=headers, timeout=timeout)
        _expect(self.tally, "bad body", resp, lambda s: 400 <= s < 500)

    def leaving(self, c: httpx.Client, rng: random.Random) -> None:
        phase = rng.choice(PHASES)
        path, body, headers = _disconnect_case(phase)
        try:
            if rng.random() < 0.25 and phase in ("after_send", "before_body", "mid_body"):
                sid = c.post(f"{self.session.url}/sessions").json()["session_id"]
                turn = {"messages": CHAT, "max_tokens": 400}
                leave(self.session.url, phase, f"/sessions/{sid}/v1/chat/completions", turn)
                c.delete(f"{self.session.url}/sessions/{sid}")  # waits for the abandoned turn
            else:
                leave(self.router.url, phase, path, body, headers)
            self.tally.ok(f"left {phase}")
        except OSError as e:
            self.tally.fail("leaving", f"{phase}: {type(e).__name__}", repr(e))

    def session_churn(self, c: httpx.Client, rng: random.Random) -> None:
        s = self.session.url
        created = c.post(f"{s}/sessions", headers={"x-prompt-id": str(rng.randrange(100))})
        if created.status_code != 200:
            self.tally.fail("session", f"create {created.status_code}", created.text)
            return
        sid = created.json()["session_id"]
        messages = [{"role": "user", "content": "hi"}]
        for _ in range(rng.randrange(1, 4)):
            api = rng.choice(["v1/chat/completions", "v1/messages"])
            body = {"model": self.model, "messages": messages, "max_tokens": 6, "stream": rng.random() < 0.3}
            turn = c.post(f"{s}/sessions/{sid}/{api}", json=body)
            _expect(self.tally, "session turn", turn, lambda st: st == 200)
            if turn.status_code != 200 or body["stream"] or api != "v1/chat/completions":
                break
            reply = turn.json()["choices"][0]["message"]
            messages = [
                *messages,
                {"role": "assistant", "content": reply["content"]},
                {"role": "user", "content": "go on"},
            ]
        _expect(self.tally, "session get", c.get(f"{s}/sessions/{sid}"), lambda st: st == 200)
        _expect(self.tally, "session delete", c.delete(f"{s}/sessions/{sid}"), lambda st: st in (200, 204))

    def tito_churn(self, c: httpx.Client, rng: random.Random) -> None:
        r = self.router.url
        sid = c.post(f"{r}/tito/sessions").json()["session_id"]
        turn = c.post(
            f"{r}/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 6},
            headers={"x-smg-tito-session-id": sid},
        )
        _expect(self.tally, "tito turn", turn, lambda st: st == 200)
        _expect(self.tally, "tito delete", c.delete(f"{r}/tito/sessions/{sid}"), lambda st: st == 204)

    def run(self, seconds: float) -> None:
        self.stop.clear()
        workers = [self.normal, self.normal, self.bad, self.leaving, self.leaving, self.session_churn, self.tito_churn]
        threads = [threading.Thread(target=self._loop, args=(w, i), daemon=True) for i, w in enumerate(workers)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        self.stop.set()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a soak worker did not stop within 120s"

    def quiesce(self) -> list[str]:
        """Every counter back at 0 (and pause?wait answering), then a moment for closed sockets to go."""
        problems = leak_problems(self.router.url, [self.replica.url], self.session.url, settle_s=30)
        time.sleep(1.0)
        return problems


@pytest.fixture(scope="module")
def soak(model_dir: Path, log_dir: Path) -> Iterator[Soak]:
    replica = start_replica(model_dir, log_dir, dp_size=2)
    router = start_router(log_dir, [replica.url], args=["--enable-routing-loop", "--enable-partial-rollout"])
    session = start_session_router(log_dir, router.url)
    model = httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"][0]["id"]
    yield Soak(replica, router, session, model)
    stop_processes([session.proc, router.proc, replica.proc])


def test_soak_memory_fds_and_counters_come_back(soak: Soak) -> None:
    soak.run(WARMUP_S)
    warm_problems = soak.quiesce()
    warm = {"router": Usage.of(soak.router), "session": Usage.of(soak.session)}

    soak.run(SOAK_S)
    end_problems = soak.quiesce()
    end = {"router": Usage.of(soak.router), "session": Usage.of(soak.session)}

    report = [f"traffic: {dict(sorted(soak.tally.counts.items()))}"]
    for name in warm:
        w, e = warm[name], end[name]
        report.append(f"{name}: RSS {w.rss_mib:.0f} -> {e.rss_mib:.0f} MiB, fds {w.fds} -> {e.fds}")
    problems = [f"after the warm-up: {p}" for p in warm_problems] + [f"after the soak: {p}" for p in end_problems]
    for name in warm:
        if end[name].rss_mib - warm[name].rss_mib >= RSS_GROWTH_MIB:
            problems.append(
                f"{name} RSS grew {end[name].rss_mib - warm[name].rss_mib:.0f} MiB (bound {RSS_GROWTH_MIB})"
            )
        if end[name].fds > warm[name].fds + FD_SLACK:
            problems.append(f"{name} holds {end[name].fds} fds, {warm[name].fds} after the warm-up (slack {FD_SLACK})")
    for key, items in soak.tally.bad.items():
        problems.append(f"unexpected outcome {key} (x{soak.tally.counts[key]}): {items[0]}")
    sessions = httpx.get(f"{soak.session.url}/control/sessions", timeout=10).json()["sessions"]
    if sessions:
        problems.append(f"{len(sessions)} SessionRouter sessions left after every one was deleted: {sessions[:3]}")
    r = httpx.post(f"{soak.router.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}, timeout=60)
    if r.status_code != 200:
        problems.append(f"the router no longer serves: {r.status_code} {r.text[:300]}")
    for proc in (soak.router, soak.session, soak.replica):
        if not proc.alive():
            problems.append(f"{proc.log.name} exited")
    print("\n".join(report))
    if problems:
        pytest.fail("\n".join(report + problems), pytrace=False)
