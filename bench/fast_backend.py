"""A tiny, fast OpenAI-compatible HTTP/1.1 backend for router benchmarks (not a model: fixed answers).

One asyncio Protocol on uvloop (when installed), keep-alive, pipelining-safe, Content-Length and chunked
request bodies. It answers:

- POST /v1/chat/completions  a fixed chat.completion with usage (SSE chunks when the body says stream)
- POST /v1/completions       a fixed text_completion with usage
- POST /generate             a fixed SGLang-style /generate answer
- GET  /health, /health_generate, /v1/models, /get_model_info, /get_server_info, /server_info, /version,
  /metrics (empty)
- anything else: 404 with a JSON error (each unknown path is logged once to stderr)

Run: python bench/fast_backend.py [--host 127.0.0.1] [--port 0]
It prints `FAST_BACKEND_READY http://HOST:PORT` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from typing import Any, cast

MODEL = "bench-model"
_MAX_HEADER_BYTES = 64 << 10

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 413: "Payload Too Large"}

_USAGE = {"prompt_tokens": 200, "completion_tokens": 8, "total_tokens": 208}
_CHAT = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 1700000000,
    "model": MODEL,
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "This is a fixed benchmark answer."},
            "logprobs": None,
            "finish_reason": "length",
        }
    ],
    "usage": _USAGE,
}
_COMPLETION = {
    "id": "cmpl-bench",
    "object": "text_completion",
    "created": 1700000000,
    "model": MODEL,
    "choices": [{"index": 0, "text": " a fixed benchmark answer.", "logprobs": None, "finish_reason": "length"}],
    "usage": _USAGE,
}
_GENERATE = {
    "text": " a fixed benchmark answer.",
    "output_ids": [1, 2, 3, 4, 5, 6, 7, 8],
    "meta_info": {
        "id": "gen-bench",
        "finish_reason": {"type": "length", "length": 8},
        "prompt_tokens": 200,
        "completion_tokens": 8,
        "cached_tokens": 0,
    },
}
_MODELS = {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]}
_MODEL_INFO = {"model_path": MODEL, "tokenizer_path": None, "is_generation": True, "served_model_name": MODEL}
_SERVER_INFO = {"model_path": MODEL, "served_model_name": MODEL, "version": "bench"}


def _response(status: int, body: bytes, content_type: bytes = b"application/json", close: bool = False) -> bytes:
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (
        status,
        _REASONS.get(status, "OK").encode(),
        content_type,
        len(body),
    )
    if close:
        head += b"Connection: close\r\n"
    return head + b"\r\n" + body


def _json_response(payload: Any, status: int = 200) -> bytes:
    return _response(status, json.dumps(payload, separators=(",", ":")).encode())


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _sse_chat() -> bytes:
    """A whole streamed chat answer: role chunk, two content chunks, finish + usage, [DONE]; chunked encoding."""
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": MODEL}
    deltas: list[dict[str, Any]] = [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"content": "This is a fixed "}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"content": "benchmark answer."}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"},
    ]
    events = [{**base, "choices": [d]} for d in deltas] + [{**base, "choices": [], "usage": _USAGE}]
    body = b"".join(_chunk(b"data: %s\n\n" % json.dumps(e).encode()) for e in events)
    body += _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    return head + b"Transfer-Encoding: chunked\r\n\r\n" + body


class Answers:
    """Pre-serialized responses, built once."""

    def __init__(self) -> None:
        self.get = {
            b"/health": _response(200, b""),
            b"/health_generate": _response(200, b""),
            b"/v1/models": _json_response(_MODELS),
            b"/get_model_info": _json_response(_MODEL_INFO),
            b"/model_info": _json_response(_MODEL_INFO),
            b"/get_server_info": _json_response(_SERVER_INFO),
            b"/server_info": _json_response(_SERVER_INFO),
            b"/version": _json_response({"version": "bench"}),
            b"/metrics": _response(200, b"", b"text/plain; version=0.0.4"),
        }
        self.post = {
            b"/v1/chat/completions": _json_response(_CHAT),
            b"/v1/completions": _json_response(_COMPLETION),
            b"/generate": _json_response(_GENERATE),
        }
        self.chat_stream = _sse_chat()
        self.unknown: set[bytes] = set()

    def answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        path = path.split(b"?", 1)[0]
        table = self.get if method in (b"GET", b"HEAD") else self.post if method == b"POST" else None
        if table is not None and path in table:
            if path == b"/v1/chat/completions" and _wants_stream(body):
                return self.chat_stream
            return table[path]
        if path not in self.unknown:
            self.unknown.add(path)
            print(f"fast_backend: unknown {method.decode()} {path.decode(errors='replace')}", file=sys.stderr)
        return _json_response({"error": {"message": "not found", "type": "not_found"}}, 404)


def _wants_stream(body: bytes) -> bool:
    if b'"stream"' not in body:
        return False
    try:
        return json.loads(body).get("stream") is True
    except (ValueError, AttributeError):
        return False


class HttpProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive server side of one connection; parses as many requests as the buffer holds."""

    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio subclasses

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.transport is not None and self._handle_one():
            pass

    def _handle_one(self) -> bool:
        """Serve one complete request from the buffer; False when more bytes are needed."""
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > _MAX_HEADER_BYTES:
                self._fail(413)
            return False
        lines = bytes(self.buf[:end]).split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3:
            self._fail(400)
            return False
        method, path, version = parts
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        body_start = end + 4
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            parsed = _parse_chunked(self.buf, body_start)
            if parsed is None:
                return False
            body, consumed = parsed
        else:
            length = int(headers.get(b"content-length", b"0") or 0)
            if len(self.buf) < body_start + length:
                return False
            body, consumed = bytes(self.buf[body_start : body_start + length]), body_start + length
        del self.buf[:consumed]
        conn = headers.get(b"connection", b"").lower()
        close = conn == b"close" or (version == b"HTTP/1.0" and conn != b"keep-alive")
        assert self.transport is not None
        self.transport.write(self.answers.answer(method, path, body))
        if close:
            self.transport.close()
            self.transport = None
            return False
        return True

    def _fail(self, status: int) -> None:
        assert self.transport is not None
        self.transport.write(_response(status, b"", close=True))
        self.transport.close()
        self.transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


def _parse_chunked(buf: bytearray, start: int) -> tuple[bytes, int] | None:
    """Decode a chunked body starting at `start`; (body, end offset) or None when incomplete."""
    out = bytearray()
    pos = start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        pos = eol + 2
        if size == 0:
            trailer_end = buf.find(b"\r\n\r\n", pos - 2)
            if trailer_end < 0:
                return None
            return bytes(out), trailer_end + 4
        if len(buf) < pos + size + 2:
            return None
        out += buf[pos : pos + size]
        pos += size + 2


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    answers = Answers()
    server = await loop.create_server(lambda: HttpProtocol(answers), host, port, backlog=1024, reuse_address=True)
    bound = server.sockets[0].getsockname()[1]
    print(f"FAST_BACKEND_READY http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed at start)")
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.run(serve(args.host, args.port))
    except ImportError:
        asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
