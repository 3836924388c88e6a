"""Workers reached over plain OpenAI-compatible HTTP (a stock `vllm serve`): discovery, health, proxying.

Bodies are forwarded as received, so the router adds no JSON re-serialisation; partial rollout, TITO and
/generate need gRPC workers.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from psrl.router.errors import RouterError, WorkerStreamFailed, WorkerTimeout, WorkerUnavailable
from psrl.router.registry import Worker

logger = logging.getLogger(__name__)

_FORWARDED_HEADERS = ("content-type", "authorization")


@dataclass(frozen=True)
class HttpWorkerFacts:
    models: list[str]
    max_context_length: int


@dataclass
class UpstreamResponse:
    status: int
    content_type: str
    body: bytes


class HttpWorkers:
    def __init__(self, connect_timeout_s: float, request_timeout_s: float | None) -> None:
        timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=60)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits)

    async def close(self) -> None:
        await self._client.aclose()

    async def facts(self, url: str, timeout_s: float) -> HttpWorkerFacts:
        resp = await self._client.get(f"{url}/v1/models", timeout=timeout_s)
        resp.raise_for_status()
        data = resp.json().get("data") or []
        models = [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
        max_len = max((int(m.get("max_model_len") or 0) for m in data if isinstance(m, dict)), default=0)
        return HttpWorkerFacts(models=models, max_context_length=max_len)

    async def is_healthy(self, worker: Worker, timeout_s: float) -> bool:
        try:
            resp = await self._client.get(f"{worker.url}/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def _error(self, worker: Worker, e: httpx.HTTPError, started: bool) -> RouterError:
        if isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout):
            return WorkerTimeout(f"worker {worker.worker_id} did not answer within the request timeout")
        if started or isinstance(e, httpx.RemoteProtocolError | httpx.ReadError):
            return WorkerStreamFailed(f"worker {worker.worker_id} failed mid-request: {e!r}")
        return WorkerUnavailable(f"worker {worker.worker_id} is unavailable: {e!r}")

    async def forward(self, worker: Worker, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        sent = {k: v for k, v in headers.items() if k in _FORWARDED_HEADERS}
        try:
            resp = await self._client.post(f"{worker.url}{path}", content=body, headers=sent)
        except httpx.HTTPError as e:
            raise self._error(worker, e, started=False) from e
        return UpstreamResponse(resp.status_code, resp.headers.get("content-type", "application/json"), resp.content)

    async def stream(
        self, worker: Worker, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, str, AsyncIterator[bytes]]:
        """Open the upstream stream (errors before the first byte raise here) and return its byte iterator."""
        sent = {k: v for k, v in headers.items() if k in _FORWARDED_HEADERS}
        request = self._client.build_request("POST", f"{worker.url}{path}", content=body, headers=sent)
        try:
            resp = await self._client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise self._error(worker, e, started=False) from e

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                raise self._error(worker, e, started=True) from e
            finally:
                await resp.aclose()

        return resp.status_code, resp.headers.get("content-type", "text/event-stream"), chunks()
