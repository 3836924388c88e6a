"""Raw-socket HTTP for tests that need what a client library will not send: a bad frame, a stall, a body
that never ends. Plus the memory a process has used, read from /proc."""

from __future__ import annotations

import json
import select
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


def connect(url: str, timeout_s: float = 30.0) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's timeout bounds each wait)."""
    out = b""
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not data:
            return out
        out += data


def exchange(url: str, data: bytes) -> bytes:
    """Send `data` as is, then read until the server closes."""
    with connect(url) as sock:
        sock.sendall(data)
        return read_until_closed(sock)


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def json_error(raw: bytes) -> tuple[int, str, Any]:
    """(status, x-smg-error-code, JSON body) of a raw error answer; asserts it is JSON."""
    status, headers, body = parse(raw)
    assert headers["content-type"] == "application/json", raw
    return status, headers["x-smg-error-code"], json.loads(body)


def send_chunked_until_answered(url: str, path: str, total_bytes: int, chunk_bytes: int = 1 << 16) -> bytes:
    """POST a chunked body of `total_bytes`, stopping as soon as the server answers; returns the answer."""
    with connect(url) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"%x\r\n" % chunk_bytes + b"1" * chunk_bytes + b"\r\n"
        sent = 0
        try:
            while sent < total_bytes:
                if select.select([sock], [], [], 0)[0]:
                    break  # answered before the body ended
                sock.sendall(chunk)
                sent += chunk_bytes
            else:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        return read_until_closed(sock)


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss(pid: int) -> int:
    """Reset the process's peak RSS (VmHWM) to its current RSS; returns that, in KiB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_kib(pid, "VmRSS")


def peak_rss_kib(pid: int) -> int:
    return _status_kib(pid, "VmHWM")
