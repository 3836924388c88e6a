"""Workers reached over plain OpenAI-compatible HTTP (a stock `vllm serve`): discovery, health, proxying.

Bodies are forwarded as received, so the router adds no JSON re-serialisation; partial rollout, TITO and
/generate need gRPC workers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import httpx

from psrl.router.errors import RouterError, WorkerInternalError, WorkerStreamFailed, WorkerTimeout, WorkerUnavailable
from psrl.router.http_client import HttpClient, HttpConnectionError, HttpResponse
from psrl.router.pipeline.respond import SSE_DONE, instance_headers, sse
from psrl.router.registry import Worker
from psrl.serving.http1 import AnyResponse, Response, StreamingResponse

if TYPE_CHECKING:
    from psrl.router.selector import Ticket

logger = logging.getLogger(__name__)

_FORWARDED_HEADERS = ("content-type", "authorization")
T = TypeVar("T")


@dataclass(frozen=True)
class HttpWorkerFacts:
    models: list[str]
    max_context_length: int


class HttpWorkers:
    def __init__(self, connect_timeout_s: float, request_timeout_s: float | None) -> None:
        # httpx for registration's facts; the lean client for the proxy path and the health checks (every few
        # seconds a worker: through httpx, a check cost about 1.6 ms of CPU).
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s))
        self._fast = HttpClient()
        self._request_timeout_s = request_timeout_s

    async def close(self) -> None:
        self._fast.close()
        await self._client.aclose()

    async def facts(self, url: str, timeout_s: float) -> HttpWorkerFacts:
        resp = await self._client.get(f"{url}/v1/models", timeout=timeout_s)
        resp.raise_for_status()
        data = resp.json().get("data") or []
        models = [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
        max_len = max((int(m.get("max_model_len") or 0) for m in data if isinstance(m, dict)), default=0)
        return HttpWorkerFacts(models=models, max_context_length=max_len)

    async def is_healthy(self, worker: Worker, timeout_s: float) -> bool:
        """GET /health on the worker's host and port (as the proxy reaches it) answers 200 within `timeout_s`."""
        host, port = worker.host_port
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._fast.get(host, port, "/health")
        except (ConnectionError, TimeoutError):
            return False
        return resp.status == 200

    def _error(self, worker: Worker, e: Exception) -> RouterError:
        if isinstance(e, TimeoutError):
            return WorkerTimeout(f"worker {worker.worker_id} did not answer within the request timeout")
        if isinstance(e, HttpConnectionError):
            return WorkerUnavailable(f"worker {worker.worker_id} is unavailable: {e}")
        return WorkerStreamFailed(f"worker {worker.worker_id} failed mid-request: {e}")

    @staticmethod
    def _headers(headers: Mapping[str, str]) -> dict[str, str]:
        return {k: headers[k] for k in _FORWARDED_HEADERS if k in headers}

    async def _within_timeout(self, pending: Awaitable[T]) -> T:
        """`pending`, awaited within the request timeout if there is one (with none, no scope is entered: even a
        null one costs CPU per request)."""
        if self._request_timeout_s is None:
            return await pending
        async with asyncio.timeout(self._request_timeout_s):
            return await pending

    async def forward(self, worker: Worker, path: str, body: bytes, headers: Mapping[str, str]) -> HttpResponse:
        host, port = worker.host_port
        try:
            return await self._within_timeout(self._fast.post(host, port, path, body, self._headers(headers)))
        except (ConnectionError, TimeoutError) as e:
            raise self._error(worker, e) from e

    async def stream(
        self, worker: Worker, path: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[HttpResponse, AsyncIterator[bytes]]:
        """Open the upstream stream (errors before the first byte raise here) and return its byte iterator."""
        host, port = worker.host_port
        try:
            opened = self._fast.post_stream(host, port, path, body, self._headers(headers))
            head, chunks = await self._within_timeout(opened)
        except (ConnectionError, TimeoutError) as e:
            raise self._error(worker, e) from e

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield chunk
            except ConnectionError as e:
                raise self._error(worker, e) from e

        return head, relay()

    async def proxy(
        self,
        route: str,
        ticket: Ticket,
        raw: bytes,
        headers: Mapping[str, str],
        stream: bool,
        finish: Callable[[Ticket, RouterError | None], None],
    ) -> AnyResponse:
        """Forward a request as received to the ticket's HTTP worker; `finish` releases the ticket once, with the
        error the request ended with. A failure after a stream's headers travels as its last SSE event."""
        worker = ticket.instance.worker
        if not stream:
            error: RouterError | None = None
            try:
                up = await self.forward(worker, route, raw, headers)
                if up.status >= 500:
                    error = WorkerInternalError(f"worker {worker.worker_id} answered {up.status}")
            except RouterError as e:
                error = e
                raise
            finally:
                finish(ticket, error)
            ctype = up.headers.get("content-type", "application/json")
            return Response(up.body, status_code=up.status, media_type=ctype, headers=instance_headers(ticket))
        try:
            head, chunks = await self.stream(worker, route, raw, headers)
        except BaseException as e:  # also cancelled (the client left before the upstream answered)
            finish(ticket, e if isinstance(e, RouterError) else None)
            raise

        async def relay() -> AsyncIterator[bytes]:
            failed: RouterError | None = None
            try:
                async for chunk in chunks:
                    yield chunk
            except RouterError as e:
                failed = e
                yield sse(e.body())
                yield SSE_DONE
            finally:
                finish(ticket, failed)

        ctype = head.headers.get("content-type", "text/event-stream")
        return StreamingResponse(relay(), status_code=head.status, media_type=ctype, headers=instance_headers(ticket))
