"""The floor of a router built on our two edges, for `router_overhead.py --floor` (not a router: no checks, no
selection, no partial rollout, no metrics). Given gRPC replicas, it answers `POST /generate` the cheapest way
those edges allow: `psrl.serving.http1` reads the request, msgspec decodes its body, a Generate with its ids
(appended packed, as the router appends them: `tokenized_field`) and two sampling settings goes round-robin to
the replicas over the router's libcurl client (`psrl.router.grpc_stream`), and msgspec writes the answer from
the complete frame. Given HTTP backends, it forwards each POST as it came (path, body, content type)
round-robin over the router's HTTP client (`psrl.router.http_client`) and returns the backend's status, body
and content type, as our router proxies a model served only over HTTP (a stream's answer comes back whole).
What our router spends beyond this leg is its middle: the pipeline, the checks, selection and shaping.

Run: python bench/floor_router.py --host 127.0.0.1 --port 0 --worker-urls grpc://R1 grpc://R2
     python bench/floor_router.py --host 127.0.0.1 --port 0 --worker-urls http://B1 http://B2
It prints `FLOOR_ROUTER_READY http://HOST:PORT` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any
from urllib.parse import urlsplit

import msgspec
import uvicorn
from smg_grpc_proto.generated import vllm_engine_pb2

from psrl.router.errors import BadRequest
from psrl.router.grpc_stream import CurlGrpc
from psrl.router.http_client import HttpClient
from psrl.router.pipeline.context import tokenized_field
from psrl.router.pipeline.execute import TRAILERS_GRACE_S
from psrl.router.worker_client import GENERATE_METHOD
from psrl.serving.http1 import Request, Response, http1_protocol
from psrl.serving.limits import HttpLimits
from psrl.serving.server import AnnouncingServer, run_server

READY_MARKER = "FLOOR_ROUTER_READY"


class FloorRouter:
    """`/generate` over gRPC."""

    def __init__(self, worker_urls: list[str]) -> None:
        self._targets = itertools.cycle([url.removeprefix("grpc://") for url in worker_urls])
        self._ids = itertools.count()
        self._curl = CurlGrpc()
        self._decode = msgspec.json.Decoder().decode
        self._encode = msgspec.json.Encoder().encode

    async def handle(self, request: Request) -> Response:
        if (request.method, request.path) != ("POST", "/generate"):
            return _error(404, f"only POST /generate is served, not {request.method} {request.path}")
        try:
            body = self._decode(request.body)
            sampling = body.get("sampling_params") or {}
            generate = vllm_engine_pb2.GenerateRequest(request_id=f"floor-{next(self._ids)}")
            generate.sampling_params.max_tokens = sampling.get("max_new_tokens", 128)
            generate.sampling_params.temperature = sampling.get("temperature", 1.0)
            request = generate.SerializeToString() + tokenized_field(body["input_ids"])
        except (msgspec.DecodeError, KeyError, TypeError, AttributeError, BadRequest) as e:
            return _error(400, f"unreadable /generate body: {e!r}")
        call = self._curl.unary_stream(
            next(self._targets), GENERATE_METHOD, request, vllm_engine_pb2.GenerateResponse.FromString
        )
        frame = await call.read()
        if frame is None or frame.WhichOneof("response") != "complete":
            call.cancel()
            return _error(502, "the replica answered without a complete frame")
        call.release(TRAILERS_GRACE_S)  # only its trailers are left, as the router releases its calls
        done = frame.complete
        answer = {
            "output_ids": list(done.output_ids),
            "meta_info": {
                "id": generate.request_id,
                "finish_reason": done.finish_reason,
                "prompt_tokens": done.prompt_tokens,
                "completion_tokens": len(done.output_ids),
            },
        }
        return Response(self._encode(answer), 200, "application/json", None)


class HttpFloor:
    """Any POST, proxied as it came."""

    def __init__(self, targets: list[tuple[str, int]]) -> None:
        self._targets = itertools.cycle(targets)
        self._client = HttpClient()

    async def handle(self, request: Request) -> Response:
        if request.method != "POST":
            return _error(405, f"only POST is proxied, not {request.method} {request.path}")
        host, port = next(self._targets)
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        try:
            up = await self._client.post(host, port, request.path, request.body, headers)
        except ConnectionError as e:
            return _error(502, f"the backend at {host}:{port} failed: {e}")
        return Response(up.body, up.status, up.headers.get("content-type", "application/json"), None)


def _error(status: int, message: str) -> Response:
    return Response(_render_error("floor_error", message), status, "application/json", None)


def _render_error(code: str, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}).encode()


def _http_target(url: str) -> tuple[str, int] | None:
    """http://HOST:PORT as (host, port); None for anything else."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path.strip("/"):
        return None
    return parts.hostname, port


class _Lifespan:
    """ASGI for uvicorn's lifespan only (requests reach a floor's `handle` through http1)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "lifespan.startup.complete"})
        await receive()
        await send({"type": "lifespan.shutdown.complete"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--worker-urls", nargs="+", required=True)
    args = p.parse_args()
    http = [url for url in args.worker_urls if url.startswith("http://")]
    floor: FloorRouter | HttpFloor
    if not http:
        floor = FloorRouter(args.worker_urls)
    elif len(http) < len(args.worker_urls):
        p.error("--worker-urls: all gRPC replicas or all http:// backends, not both")
    else:
        targets = [_http_target(url) for url in http]
        bad = [url for url, target in zip(http, targets, strict=True) if target is None]
        if bad:
            p.error(f"--worker-urls: not http://HOST:PORT: {' '.join(bad)}")
        floor = HttpFloor([t for t in targets if t is not None])
    config = uvicorn.Config(
        _Lifespan(),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http=http1_protocol(floor.handle, HttpLimits(), _render_error),
        ws="none",
        proxy_headers=False,
        server_header=False,
        log_level="warning",
        access_log=False,
    )
    run_server(AnnouncingServer(config, READY_MARKER, tune_gc=True))


if __name__ == "__main__":
    main()
