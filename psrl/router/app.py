"""The router's HTTP surface: the route table, and adapters from each route to a pipeline, the registry, the
routing loop or the TITO store. The request path itself is psrl.router.pipeline.stages."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from psrl.psmanager.client import PSManagerClient
from psrl.router import coordinator_api
from psrl.router.background import BackgroundLoops
from psrl.router.config import RouterConfig
from psrl.router.dispatch import Dispatcher
from psrl.router.errors import BadRequest, NotFound, RouterError, Unauthorized, WorkerInternalError
from psrl.router.http_backend import HttpWorkers
from psrl.router.logs import request_id_var
from psrl.router.metrics import RouterMetrics
from psrl.router.pipeline import parse as P
from psrl.router.pipeline import stages
from psrl.router.pipeline.runner import Pipeline, RequestContext
from psrl.router.pipeline.tool_calls import make_tool_parser
from psrl.router.policies import make_policy
from psrl.router.policies.kv_index import KvEventIndex
from psrl.router.psmanager_admission import PSManagerAdmission
from psrl.router.registration import Registrar
from psrl.router.registry import WorkerRegistry
from psrl.router.routing_loop import RoutingLoop
from psrl.router.selector import AdmissionHook, PassThroughAdmission, Selector
from psrl.router.tito_bridge import TitoBridge
from psrl.router.tokenizers import TokenizerStore
from psrl.router.web import App, json_response
from psrl.router.worker_client import WorkerClients
from psrl.serving.http1 import AnyResponse, Request, Response, StreamingResponse

logger = logging.getLogger("psrl.router")

Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]

_json = json_response


class RouterApp:
    """Owns the registry, channel pools, selector, tokenizers and metrics; builds the router's `asgi.App`."""

    def __init__(self, config: RouterConfig) -> None:
        config.validate()
        self.config = config
        self.registry = WorkerRegistry(config.health, config.breaker)
        self.clients = WorkerClients(config.replica_token())
        self.http = HttpWorkers(config.connect_timeout_s, config.request_timeout_s)
        self.metrics = RouterMetrics(self.registry)
        self.policy = make_policy(config.policy, config.cache_aware)
        index = self.policy.kv_index
        self.kv_index: KvEventIndex | None = index if config.enable_kv_events else None
        self.admission: AdmissionHook = PassThroughAdmission()
        if config.psrl_ps_manager_addr:
            client = PSManagerClient(config.psrl_ps_manager_addr, timeout_s=config.psmanager_rpc_timeout_s)
            self.admission = PSManagerAdmission(client)
        self.selector = Selector(config.selector, self.policy, self.admission)
        self.loop: RoutingLoop | None = None
        if config.routing_loop.enable_routing_loop:
            self.loop = RoutingLoop(
                config.routing_loop,
                self.selector,
                on_queue_length=self.metrics_queue_length,
            )
        self.tool_parser = make_tool_parser(config.tool_call_parser)
        self.tito = TitoBridge(config.tito)
        self.metrics.tito_sessions.set_function(self.tito.num_sessions)
        self.metrics.tito_sessions_expired.set_function(self.tito.sessions_expired)
        self.metrics.tito_turns_not_exported.set_function(self.tito.turns_not_exported)
        self.tokenizers = TokenizerStore(self.registry, self.clients, config.tokenizer_path)
        self.dispatcher = Dispatcher(
            self.registry,
            self.selector,
            self.admission,
            self.loop,
            self.clients,
            self.metrics,
            self.tokenizers,
            request_timeout_s=config.request_timeout_s,
            partial_rollout=config.enable_partial_rollout,
            max_iterations=config.max_rollout_iterations,
            kv_transfer=config.kv_transfer,
        )
        self.background = BackgroundLoops(
            self.registry,
            self.clients,
            self.http,
            health_interval_s=config.health.interval_s,
            health_timeout_s=config.health.timeout_s,
            load_poll_interval_s=config.load_poll_interval_s,
            kv_index=self.kv_index,
            evict=self.policy.maybe_evict,
        )
        self._tasks: set[asyncio.Task] = set()  # background work, awaited (or cancelled) at shutdown
        self.registrar = Registrar(
            self.registry,
            self.clients,
            self.http,
            self.background,
            self.tokenizers,
            self.policy,
            connect_timeout_s=config.connect_timeout_s,
            spawn=self._spawn,
        )
        self.services = stages.Services(
            config,
            self.registry,
            self.dispatcher,
            self.tokenizers,
            self.http,
            self.tito,
            self.tool_parser,
            self.metrics,
            self.policy,
        )
        admin, data = True, False
        routes: list[tuple[str, str, Handler, bool | None]] = [
            ("/health", "GET", self.health, None),
            # Open by default (scrapers on loopback); --metrics-require-key: the admin key, as fleet-wide state.
            ("/metrics", "GET", self.metrics_endpoint, admin if config.metrics_require_key else None),
            ("/v1/models", "GET", self.models, data),
            ("/workers", "GET", self.list_workers, admin),
            ("/workers", "POST", self.add_worker, admin),
            ("/workers/stats", "GET", self.workers_stats, admin),
            ("/workers/update_stats", "POST", self.update_stats, admin),
            ("/workers/update_weight_version", "POST", self.update_weight_version, admin),
            ("/workers/pause", "POST", self.pause_workers, admin),
            ("/workers/resume", "POST", self.resume_workers, admin),
            ("/workers/{worker_id}", "DELETE", self.remove_worker, admin),
            ("/routing_loop/pause", "POST", self.pause_loop, admin),
            ("/routing_loop/resume", "POST", self.resume_loop, admin),
            ("/routing_loop/status", "GET", self.loop_status, admin),
            ("/routing_loop/filter", "GET", self.loop_filter, admin),
            ("/tito/sessions", "POST", self.tito_create, data),
            ("/tito/sessions/{session_id}", "GET", self.tito_get, data),
            ("/tito/sessions/{session_id}", "DELETE", self.tito_delete, data),
        ]
        routes += [
            (path, "POST", self._runs(path, pipeline), data)
            for path, pipeline in [
                ("/v1/chat/completions", stages.CHAT),
                ("/v1/responses", stages.RESPONSES),
                ("/v1/messages", stages.MESSAGES),
                ("/v1/completions", stages.COMPLETION),
                ("/generate", stages.GENERATE),
            ]
        ]
        self.app = App(self._lifespan)
        for path, method, handler, auth in routes:
            self.app.route(method, path, self._endpoint(path, handler, auth))

    # ---- lifecycle ----------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self) -> AsyncIterator[None]:
        self.background.start()
        if self.loop is not None:
            self.loop.start()
        for url in self.config.worker_urls:
            self._spawn(self._register_from_cli(url))
        try:
            yield
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.background.stop()
            if self.loop is not None:
                await self.loop.stop()
            await self.clients.close()
            await self.http.close()
            if isinstance(self.admission, PSManagerAdmission):
                await self.admission.close()

    async def _register_from_cli(self, url: str) -> None:
        while True:
            try:
                await self.registrar.register({"url": url, "connection_mode": self.config.connection_mode})
                return
            except RouterError as e:
                logger.info("worker %s not registered yet: %s", url, e.message)
                await asyncio.sleep(1.0)

    # ---- the wrapper every endpoint runs in: auth, request id, errors, metrics ----------------------------

    def _endpoint(self, route: str, handler: Handler, auth: bool | None) -> Handler:
        async def endpoint(request: Request) -> AnyResponse:
            start = request.arrived
            token = request_id_var.set(request.headers.get("x-request-id", "-"))
            try:
                if auth is not None:
                    self._authorize(request, admin=auth)
                response = await handler(request)
            except RouterError as e:
                if e.status >= 500:
                    where = f" in stage {e.stage}" if e.stage else ""
                    logger.warning("%s %s -> %s %s%s: %s", request.method, route, e.status, e.code, where, e.message)
                response = e.to_response()
            except Exception as e:  # a bug must cost one request a 500, never the process
                logger.exception("unexpected error on %s %s", request.method, route)
                response = WorkerInternalError(
                    f"internal router error: {type(e).__name__}: {e}", code="internal_error"
                ).to_response()
            finally:
                request_id_var.reset(token)
            streaming = isinstance(response, StreamingResponse)  # streams observe their own end
            self.metrics.request_done(route, response.status_code, None if streaming else time.perf_counter() - start)
            return response

        return endpoint

    def _authorize(self, request: Request, *, admin: bool) -> None:
        key = self.config.admin_api_key if admin else self.config.api_key
        if key and request.headers.get("authorization") != f"Bearer {key}":
            raise Unauthorized("missing or wrong bearer token")

    async def _body(self, request: Request) -> dict[str, Any]:
        return P.parse_json_body(request.body, self.config.max_payload_bytes)

    # ---- simple endpoints ----------------------------------------------------------------------------

    async def health(self, request: Request) -> AnyResponse:
        return _json({"status": "ok", "workers": len(self.registry.workers())})

    async def metrics_endpoint(self, request: Request) -> AnyResponse:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> AnyResponse:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "psrl"} for m in self.registry.models()]
        return _json({"object": "list", "data": data})

    # ---- worker registry and coordinator endpoints ----------------------------------------------------

    async def list_workers(self, request: Request) -> AnyResponse:
        return _json({"workers": [w.to_json() for w in self.registry.workers()]})

    async def add_worker(self, request: Request) -> AnyResponse:
        worker = await self.registrar.register(await self._body(request))
        return _json({"worker_id": worker.worker_id, "status": "registered", "worker": worker.to_json()})

    async def remove_worker(self, request: Request) -> AnyResponse:
        worker_id = request.path_params["worker_id"]
        worker = self.registry.remove(worker_id)
        if worker is None:
            raise NotFound(f"no worker {worker_id!r}")
        self.registrar.forget(worker)
        return _json({"worker_id": worker_id, "status": "removed"})

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _coordinator_body(self, request: Request) -> Any:
        body = P.parse_json(request.body, self.config.max_payload_bytes)
        if body is None:
            raise BadRequest("request body is empty")
        return body

    async def workers_stats(self, request: Request) -> AnyResponse:
        return _json(coordinator_api.worker_stats(self.registry))

    async def update_stats(self, request: Request) -> AnyResponse:
        return _json(coordinator_api.update_stats(self.registry, await self._coordinator_body(request)))

    async def update_weight_version(self, request: Request) -> AnyResponse:
        return _json(coordinator_api.update_weight_version(self.registry, await self._coordinator_body(request)))

    async def pause_workers(self, request: Request) -> AnyResponse:
        return _json(coordinator_api.set_paused(self.registry, await self._coordinator_body(request), True))

    async def resume_workers(self, request: Request) -> AnyResponse:
        return _json(coordinator_api.set_paused(self.registry, await self._coordinator_body(request), False))

    # ---- the routing loop -----------------------------------------------------------------------------

    def metrics_queue_length(self, n: int) -> None:
        self.metrics.queue_length.set(n)

    def _loop_status(self) -> dict[str, Any]:
        return self.loop.status() if self.loop is not None else RoutingLoop.disabled_status()

    def _query(self, request: Request) -> dict[str, str]:
        return {k: v[-1] for k, v in urllib.parse.parse_qs(request.query.decode("latin-1")).items()}

    async def pause_loop(self, request: Request) -> AnyResponse:
        wait = self._query(request).get("wait", "false").lower() in ("1", "true", "yes")
        if self.loop is not None:
            await self.loop.pause(wait)
        return _json(self._loop_status())

    async def resume_loop(self, request: Request) -> AnyResponse:
        if self.loop is not None:
            self.loop.resume()
        return _json(self._loop_status())

    async def loop_status(self, request: Request) -> AnyResponse:
        return _json(self._loop_status())

    async def loop_filter(self, request: Request) -> AnyResponse:
        raw = self._query(request).get("version_tag")
        try:
            version = int(raw) if raw is not None else -1
        except ValueError:
            raise BadRequest(f"version_tag must be an integer, got {raw!r}", param="version_tag") from None
        return _json(self.loop.queued(version) if self.loop is not None else [])

    # ---- TITO sessions -------------------------------------------------------------------------------

    async def tito_create(self, request: Request) -> AnyResponse:
        client = TitoBridge.client_of(request.headers.get("authorization")) if self.config.api_key else None
        return _json({"session_id": await self.tito.create(client)})

    async def tito_get(self, request: Request) -> AnyResponse:
        return _json(await self.tito.snapshot(request.path_params["session_id"]))

    async def tito_delete(self, request: Request) -> AnyResponse:
        await self.tito.delete(request.path_params["session_id"])
        return Response(b"", 204)

    # ---- data plane: each route runs its endpoint kind's pipeline ----------------------------------------

    def _runs(self, route: str, pipeline: Pipeline[stages.Services]) -> Handler:
        def run(request: Request) -> Awaitable[AnyResponse]:  # the pipeline's run itself: no coroutine around it
            return pipeline.run(self.services, RequestContext(request, route))

        return run
