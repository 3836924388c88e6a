"""The router's HTTP surface: thin handlers that run the pipeline stages, the selector and the registry calls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx

from psrl import apis as A
from psrl.apis import ApiShapeError
from psrl.psmanager.client import PSManagerClient
from psrl.router import coordinator_api
from psrl.router.asgi import AnyResponse, App, Request, Response, StreamingResponse, json_response
from psrl.router.background import BackgroundLoops
from psrl.router.config import RouterConfig
from psrl.router.dispatch import Dispatcher, Rollout
from psrl.router.errors import (
    BadRequest,
    NotFound,
    RouterError,
    Unauthorized,
    WorkerInternalError,
    WorkerUnavailable,
)
from psrl.router.http_backend import HttpWorkers
from psrl.router.logs import request_id_var
from psrl.router.metadata import RoutingMeta, parse_routing_meta
from psrl.router.metrics import RouterMetrics
from psrl.router.pipeline import parse as P
from psrl.router.pipeline import respond as R
from psrl.router.pipeline.context import Generation, GenerationInput, routed_experts_start
from psrl.router.pipeline.execute import Delta
from psrl.router.pipeline.prepare import chat_prompt_ids, new_request_id, text_prompt_ids
from psrl.router.pipeline.select import resolve_model
from psrl.router.pipeline.stops import StreamedText, output_text
from psrl.router.pipeline.stream import (
    ApiWriter,
    ChatChoice,
    CompletionChoice,
    MessagesWriter,
    ResponsesWriter,
    StreamStart,
    api_stream,
    sse_stream,
)
from psrl.router.pipeline.tool_calls import NoToolParser, ParsedOutput, ToolCallParser, make_tool_parser
from psrl.router.pipeline.tool_choice import explaining_refusal, require_parser
from psrl.router.policies import KvEventIndex, SelectionRequest, make_policy
from psrl.router.psmanager_admission import PSManagerAdmission
from psrl.router.registry import Worker, WorkerRegistry
from psrl.router.routing_loop import RoutingLoop
from psrl.router.selector import AdmissionHook, PassThroughAdmission, Selector, Ticket
from psrl.router.tito_bridge import TitoBridge
from psrl.router.tokenizers import TokenizerStore
from psrl.router.worker_client import WorkerClients
from psrl.serving import may_hold_surrogates
from psrl.tokenizer import Tokenizer

logger = logging.getLogger("psrl.router")
_NO_TOOL_PARSER = NoToolParser()

_JSON = "application/json"

Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]


_json = json_response


def _instance_headers(ticket: Ticket) -> dict[str, str]:
    """What PSRL reads back and replays as the next turn's hint and version floor."""
    return {
        "x-base-worker-id": ticket.instance.id.base_worker_id,
        "x-target-dp-rank": str(ticket.instance.id.dp_rank),
        "x-version-tag": str(ticket.pinned_version),
    }


class RouterApp:
    """Owns the registry, channel pools, selector, tokenizers and metrics; builds the Starlette app."""

    def __init__(self, config: RouterConfig) -> None:
        config.validate()
        self.config = config
        self.registry = WorkerRegistry(config.health, config.breaker)
        self.clients = WorkerClients(config.replica_token())
        self.http = HttpWorkers(config.connect_timeout_s, config.request_timeout_s)
        self.metrics = RouterMetrics(self.registry)
        self.policy = make_policy(config.policy, config.cache_aware)
        index = getattr(self.policy, "index", None)
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
                on_commit=self._on_loop_commit,
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
            evict=getattr(self.policy, "maybe_evict", None),
        )
        self._tasks: set[asyncio.Task] = set()  # background work, awaited (or cancelled) at shutdown
        admin, data = True, False
        routes = [
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
            ("/v1/chat/completions", "POST", self.chat_completions, data),
            ("/v1/responses", "POST", self.responses, data),
            ("/v1/messages", "POST", self.messages, data),
            ("/v1/completions", "POST", self.completions, data),
            ("/generate", "POST", self.generate, data),
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
                await self._register({"url": url, "connection_mode": self.config.connection_mode})
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
                    logger.warning("%s %s -> %s %s: %s", request.method, route, e.status, e.code, e.message)
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
        return P.parse_json_body(await request.body(), self.config.max_payload_bytes)

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
        worker = await self._register(await self._body(request))
        return _json({"worker_id": worker.worker_id, "status": "registered", "worker": worker.to_json()})

    async def remove_worker(self, request: Request) -> AnyResponse:
        worker_id = request.path_params["worker_id"]
        worker = self.registry.remove(worker_id)
        if worker is None:
            raise NotFound(f"no worker {worker_id!r}")
        self._forget(worker)
        return _json({"worker_id": worker_id, "status": "removed"})

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget(self, worker: Worker) -> None:
        self.background.forget_worker(worker.worker_id)
        self.policy.on_worker_removed(worker.worker_id)
        if worker.connection_mode == "grpc" and self.registry.by_url(worker.url) is None:
            self._spawn(self.clients.drop(worker.target))

    async def _coordinator_body(self, request: Request) -> Any:
        body = P.parse_json(await request.body(), self.config.max_payload_bytes)
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

    async def _on_loop_commit(self, ticket: Ticket) -> None:
        if ticket.meta.has_psrl:
            await self.admission.on_commit(ticket.instance, ticket.meta, ticket.pinned_version)

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

    async def _register(self, body: dict[str, Any]) -> Worker:
        url = P.get_str(body, "url", None)
        if not url:
            raise BadRequest("'url' is required", param="url")
        mode = P.get_str(body, "connection_mode", None) or ("http" if url.startswith("http") else "grpc")
        if mode not in ("grpc", "http"):
            raise BadRequest(f"connection_mode must be grpc or http, got {mode!r}", param="connection_mode")
        form = "grpc://host:port" if mode == "grpc" else "http://host:port"
        try:
            parts = urlsplit(url)
            port = parts.port  # a port that is not a number, or past 65535, raises here
        except ValueError as e:
            raise BadRequest(f"'url' must look like {form}, got {url!r}: {e}", param="url") from None
        scheme_ok = parts.scheme == "grpc" if mode == "grpc" else parts.scheme in ("http", "https")
        if not scheme_ok or not parts.hostname or not port:
            raise BadRequest(f"'url' must look like {form} for connection_mode {mode}, got {url!r}", param="url")
        labels = body.get("labels") or {}
        if not isinstance(labels, dict):
            raise BadRequest("'labels' must be an object", param="labels")
        labels = {str(k): str(v) for k, v in labels.items()}
        worker_id = P.get_str(body, "id", None)
        models = body.get("models")
        if models is not None and not isinstance(models, list):
            raise BadRequest("'models' must be a list", param="models")
        try:
            weight_version = int(labels.get("weight_version", 0))
        except ValueError as e:
            raise BadRequest("label weight_version must be an integer", param="labels") from e

        if mode == "grpc":
            try:
                facts = await self.clients.facts(parts.netloc, self.config.connect_timeout_s)
            except grpc.aio.AioRpcError as e:
                raise WorkerUnavailable(f"cannot reach worker at {url}: {e.code().name} {e.details()}") from e
            dp_label = labels.get("dp_size")
            if dp_label is not None and dp_label != str(facts.dp_size):
                raise BadRequest(f"label dp_size={dp_label} but the worker reports {facts.dp_size}", param="labels")
            served, dp_size, max_len, block = (
                [facts.served_model_name],
                facts.dp_size,
                facts.max_context_length,
                facts.block_size,
            )
        else:
            try:
                hfacts = await self.http.facts(url.rstrip("/"), self.config.connect_timeout_s)
            except (httpx.HTTPError, ValueError) as e:
                raise WorkerUnavailable(f"cannot reach worker at {url}: {e!r}") from e
            served, dp_size, max_len, block = hfacts.models, 1, hfacts.max_context_length, 0
        names = [m["id"] if isinstance(m, dict) else str(m) for m in models or []] or served
        if not names:
            raise BadRequest("the worker serves no model and the body names none", param="models")

        existing = self.registry.by_url(url)
        if existing is not None and worker_id in (None, existing.worker_id):
            worker_id = existing.worker_id  # a replica re-registering (e.g. after a restart): same id
        elif worker_id is None:
            worker_id = self.registry.new_id()
        if existing is not None:
            self.registry.remove(existing.worker_id)
            self._forget(existing)
        worker = self.registry.create_worker(
            worker_id,
            url.rstrip("/"),
            models=names,
            labels=labels,
            dp_size=dp_size,
            connection_mode=mode,
            max_context_length=max_len,
            kv_block_size=block,
            label_weight_version=weight_version,
        )
        self.background.watch_worker(worker)
        if mode == "grpc":
            self._spawn(self.tokenizers.prefetch(names[0]))
        logger.info("registered %s worker %s at %s (dp_size=%d, models=%s)", mode, worker_id, url, dp_size, names)
        return worker

    # ---- selection and dispatch ------------------------------------------------------------------------

    def _stream(self, route: str, request: Request, ticket: Ticket, events: AsyncIterator[bytes]) -> StreamingResponse:
        start = request.arrived

        async def body() -> AsyncIterator[bytes]:
            first = True
            try:
                async for event in events:
                    if first:
                        self.metrics.first_token(route, time.perf_counter() - start)
                        first = False
                    yield event
            finally:
                self.metrics.stream_done(route, time.perf_counter() - start)

        return StreamingResponse(body(), media_type="text/event-stream", headers=_instance_headers(ticket))

    async def _proxy(self, route: str, ticket: Ticket, raw: bytes, request: Request, stream: bool) -> AnyResponse:
        """Forward a request as received to an HTTP worker."""
        worker = ticket.instance.worker
        if not stream:
            error: RouterError | None = None
            try:
                up = await self.http.forward(worker, route, raw, request.headers)
                if up.status >= 500:
                    error = WorkerInternalError(f"worker {worker.worker_id} answered {up.status}")
            except RouterError as e:
                error = e
                raise
            finally:
                self.dispatcher.finish(ticket, error)
            ctype = up.headers.get("content-type", _JSON)
            return Response(up.body, status_code=up.status, media_type=ctype, headers=_instance_headers(ticket))
        try:
            head, chunks = await self.http.stream(worker, route, raw, request.headers)
        except RouterError as e:
            self.dispatcher.finish(ticket, e)
            raise

        async def relay() -> AsyncIterator[bytes]:
            error: RouterError | None = None
            try:
                async for chunk in chunks:
                    yield chunk
            except RouterError as e:
                error = e
                yield R.sse(e.body())
                yield R.SSE_DONE
            finally:
                self.dispatcher.finish(ticket, error)

        ctype = head.headers.get("content-type", "text/event-stream")
        return StreamingResponse(relay(), status_code=head.status, media_type=ctype, headers=_instance_headers(ticket))

    def _needs_tokens(self, model: str) -> bool:
        return any(w.connection_mode == "grpc" for w in self.registry.serving(model))

    # ---- TITO sessions -------------------------------------------------------------------------------

    async def tito_create(self, request: Request) -> AnyResponse:
        client = TitoBridge.client_of(request.headers.get("authorization")) if self.config.api_key else None
        return _json({"session_id": await self.tito.create(client)})

    async def tito_get(self, request: Request) -> AnyResponse:
        return _json(await self.tito.snapshot(request.path_params["session_id"]))

    async def tito_delete(self, request: Request) -> AnyResponse:
        await self.tito.delete(request.path_params["session_id"])
        return Response(b"", 204)

    def _parse_output(self, chat: P.ChatRequest, tok: Tokenizer, gen: Generation) -> ParsedOutput:
        return self._tool_parser(chat).parse(output_text(tok, gen, chat.sampling))

    def _tool_parser(self, chat: P.ChatRequest) -> ToolCallParser:
        # Tool calls are parsed out only when the request offered tools, as vLLM does with a parser enabled.
        return self.tool_parser if chat.tools else _NO_TOOL_PARSER

    async def _tito_chat(
        self, turn: tuple[str, int], chat: P.ChatRequest, model: str, meta: RoutingMeta, rid: str, tok: Tokenizer
    ) -> tuple[Ticket, Generation, ParsedOutput]:
        """A TITO turn: incrementally tokenized prompt, log-probs forced on, and the sampled ids recorded with
        the reply the agent gets (a later turn continues this one only if it echoes that reply)."""
        if chat.stream:
            raise BadRequest(
                "TITO turns are not streamed upstream; send stream=false (the SessionRouter "
                "builds SSE from the buffered result)",
                param="stream",
            )
        if chat.sampling.n > 1:
            raise BadRequest("a TITO turn records one reply; send n=1 (one trajectory per sample)", param="n")
        prepared = await self.tito.prepare(turn[0], turn[1], chat, model=model, tokenizer=tok)
        if chat.sampling.logprobs is None:
            chat.sampling.logprobs = 0
        # With routed experts recorded, the rows start where the reused path's end: its last id was never fed.
        experts_from = max(prepared.reused_tokens - 1, 0) if self.config.tito.tito_routed_experts else None
        gen_input = GenerationInput(rid, prepared.prompt_ids, chat.sampling, False, routed_experts_start=experts_from)
        try:
            rollout = Rollout(self.dispatcher, model, meta, gen_input)
            ticket = await rollout.start()
            [gen] = await rollout.collect()
        except BaseException:
            await self.tito.abandon(prepared)
            raise
        last = rollout.ticket
        assert last is not None
        output = self._parse_output(chat, tok, gen)
        await self.tito.record(
            prepared,
            output_ids=gen.output_ids,
            output_logprobs=gen.logprobs,
            finish_reason=gen.finish_reason,
            weight_version=last.instance.weight_version,
            token_versions=rollout.states[0].token_versions,
            instance=(last.instance.id.base_worker_id, last.instance.id.dp_rank),
            assistant_message={"role": "assistant", "content": output.content, "tool_calls": output.tool_calls},
            routed_experts=None if gen.routed_experts is None else gen.routed_experts.record(),
        )
        return ticket, gen, output

    # ---- data plane -----------------------------------------------------------------------------------

    async def _chat_front(
        self, request: Request, to_chat: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    ) -> tuple[bytes, dict[str, Any], RoutingMeta, P.ChatRequest, str, str]:
        """What every chat-shaped endpoint starts with: (raw body, body, routing meta, the chat request, model,
        request id); `to_chat` converts another API's body to a chat body first."""
        raw = await request.body()
        body = P.parse_json_body(raw, self.config.max_payload_bytes)
        meta = parse_routing_meta(request.headers)
        chat_body = body
        if to_chat is not None:
            try:
                chat_body = to_chat(body)
            except ApiShapeError as e:
                raise BadRequest(e.message, param=e.param) from None
        chat = P.parse_chat(chat_body, check_texts=may_hold_surrogates(raw))
        return raw, body, meta, chat, resolve_model(self.registry, chat.model), new_request_id("chatcmpl")

    def _tito_turn(self, request: Request) -> tuple[str, int] | None:
        return TitoBridge.turn_of(request.headers) if self.config.tito.enable_tito else None

    async def chat_completions(self, request: Request) -> AnyResponse:
        raw, _, meta, chat, model, rid = await self._chat_front(request)
        if not self._needs_tokens(model):
            return await self._proxy_http("/v1/chat/completions", chat, model, meta, rid, raw, request)
        turn = self._tito_turn(request)
        if chat.stream and turn is None:
            require_parser(chat.tool_choice, not isinstance(self.tool_parser, NoToolParser))
            with explaining_refusal(chat.tool_choice):
                tok, rollout, ticket = await self._start_stream(chat, model, meta, rid)
            events = self._chat_sse(rollout, tok, chat, rid, int(time.time()), model)
            return self._stream("/v1/chat/completions", request, ticket, events)
        ticket, out = await self._chat_completion(chat, model, meta, rid, turn)
        return _json(out, headers=_instance_headers(ticket))

    async def _start_stream(
        self, chat: P.ChatRequest, model: str, meta: RoutingMeta, rid: str
    ) -> tuple[Tokenizer, Rollout, Ticket]:
        """A streamed chat generation, started: (tokenizer, the rollout to read deltas from, its first instance)."""
        tok = await self.tokenizers.get(model)
        prompt = await chat_prompt_ids(chat, tok)
        rollout = Rollout(self.dispatcher, model, meta, GenerationInput(rid, prompt, chat.sampling, True))
        return tok, rollout, await rollout.start()

    async def _proxy_http(
        self, route: str, chat: P.ChatRequest, model: str, meta: RoutingMeta, rid: str, raw: bytes, request: Request
    ) -> AnyResponse:
        """A model served only over HTTP: the body goes to the chosen worker's `route` as it came."""
        if self._tito_turn(request) is not None:
            raise BadRequest(f"TITO needs gRPC workers; model {model!r} is served only over HTTP")
        text = "".join(m["content"] for m in chat.messages)  # what prefix policies match on over HTTP
        ticket = await self.dispatcher.acquire(model, meta, SelectionRequest(rid, model, (), text, meta.routing_key))
        return await self._proxy(route, ticket, raw, request, chat.stream)

    async def _chat_completion(
        self, chat: P.ChatRequest, model: str, meta: RoutingMeta, rid: str, turn: tuple[str, int] | None
    ) -> tuple[Ticket, dict[str, Any]]:
        """A non-streamed chat completion over gRPC workers (a TITO turn when `turn` is set)."""
        require_parser(chat.tool_choice, not isinstance(self.tool_parser, NoToolParser))
        tok = await self.tokenizers.get(model)
        created = int(time.time())
        with explaining_refusal(chat.tool_choice):
            if turn is not None:
                ticket, gen, output = await self._tito_chat(turn, chat, model, meta, rid, tok)
                gens, outputs = [gen], [output]
            else:
                prompt = await chat_prompt_ids(chat, tok)
                rollout = Rollout(self.dispatcher, model, meta, GenerationInput(rid, prompt, chat.sampling, False))
                ticket = await rollout.start()
                gens = await rollout.collect()
                outputs = [self._parse_output(chat, tok, g) for g in gens]
        choices = []
        for i, (gen, output) in enumerate(zip(gens, outputs, strict=True)):
            lps = R.chat_logprobs(tok, gen.output_ids, gen.logprobs, gen.top_logprobs) if chat.logprobs else None
            choices.append(R.chat_choice(i, output, gen, lps, chat.tool_choice.named))
        out = R.chat_completion(request_id=rid, created=created, model=model, choices=choices, gens=gens)
        return ticket, out

    async def _converted_chat(
        self,
        request: Request,
        route: str,
        to_chat: Callable[[dict[str, Any]], dict[str, Any]],
        from_chat: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]],
        writer: Callable[[StreamStart], ApiWriter],
    ) -> AnyResponse:
        """`/v1/responses` and `/v1/messages`: the body becomes a chat request and runs the chat pipeline (TITO
        included); the completion is shaped back, or (`stream`) `writer` writes the API's events as the
        generation streams."""
        raw, body, meta, chat, model, rid = await self._chat_front(request, to_chat)
        chat.stream = P.get_bool(body, "stream", False)
        if not self._needs_tokens(model):
            return await self._proxy_http(route, chat, model, meta, rid, raw, request)
        turn = self._tito_turn(request)
        if chat.stream and turn is None:
            require_parser(chat.tool_choice, not isinstance(self.tool_parser, NoToolParser))
            with explaining_refusal(chat.tool_choice):
                tok, rollout, ticket = await self._start_stream(chat, model, meta, rid)
            lps = chat.logprobs

            def logprobs(d: Delta) -> list[dict[str, Any]] | None:
                chat_lps = R.chat_logprobs(tok, d.token_ids, d.logprobs, d.top_logprobs) if lps else None
                return None if chat_lps is None else chat_lps["content"]  # the Responses entries have this shape

            start = StreamStart(body, rid, int(time.time()), model, len(rollout.states[0].original.prompt_ids))
            events = api_stream(
                rollout,
                StreamedText(tok, chat.sampling),
                self._tool_parser(chat).stream(),
                writer(start),
                logprobs,
                rid,
            )
            return self._stream(route, request, ticket, events)
        ticket, completion = await self._chat_completion(chat, model, meta, rid, turn)
        return _json(from_chat(completion, body), headers=_instance_headers(ticket))

    async def responses(self, request: Request) -> AnyResponse:
        return await self._converted_chat(
            request, "/v1/responses", A.responses_to_chat, A.chat_to_response, ResponsesWriter
        )

    async def messages(self, request: Request) -> AnyResponse:
        return await self._converted_chat(
            request,
            "/v1/messages",
            A.messages_to_chat,
            lambda completion, _: A.chat_to_message(completion),
            MessagesWriter,
        )

    def _chat_sse(
        self, source: Rollout, tok: Tokenizer, chat: P.ChatRequest, rid: str, created: int, model: str
    ) -> AsyncIterator[bytes]:
        choices = [
            ChatChoice(
                i,
                StreamedText(tok, chat.sampling),
                self._tool_parser(chat).stream(),
                tok,
                chat.logprobs,
                chat.tool_choice.named,
            )
            for i in range(chat.sampling.n)
        ]
        envelope = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        return sse_stream(
            source,
            choices,
            envelope=envelope,
            include_usage=chat.include_usage,
            continuous_usage=chat.continuous_usage,
            prompt_tokens=len(source.states[0].original.prompt_ids),
        )

    async def completions(self, request: Request) -> AnyResponse:
        raw = await request.body()
        body = P.parse_json_body(raw, self.config.max_payload_bytes)
        meta = parse_routing_meta(request.headers)
        req = P.parse_completion(body)
        model = resolve_model(self.registry, req.model)
        rid = new_request_id("cmpl")
        created = int(time.time())
        if not self._needs_tokens(model):
            text = req.prompts[0] if isinstance(req.prompts[0], str) else None
            ticket = await self.dispatcher.acquire(
                model, meta, SelectionRequest(rid, model, (), text, meta.routing_key)
            )
            return await self._proxy("/v1/completions", ticket, raw, request, req.stream)
        tok = await self.tokenizers.get(model)
        prompts = [await text_prompt_ids(p, tok) for p in req.prompts]
        if req.stream:
            rollout = Rollout(self.dispatcher, model, meta, GenerationInput(rid, prompts[0], req.sampling, True))
            ticket = await rollout.start()
            return self._stream(
                "/v1/completions", request, ticket, self._completion_sse(rollout, tok, req, rid, created, model)
            )

        async def one(index: int, prompt: list[int]) -> tuple[Ticket, list[Generation]]:
            sub_id = rid if len(prompts) == 1 else f"{rid}-{index}"
            rollout = Rollout(self.dispatcher, model, meta, GenerationInput(sub_id, prompt, req.sampling, False))
            ticket = await rollout.start()
            return ticket, await rollout.collect()

        results = await _gather_or_raise([one(i, p) for i, p in enumerate(prompts)])
        choices: list[dict[str, Any]] = []
        for _, gens in results:  # prompt-major, as vLLM numbers them
            for gen in gens:
                lps = R.completion_logprobs(tok, gen.output_ids, gen.logprobs, gen.top_logprobs)
                choices.append(R.completion_choice(len(choices), output_text(tok, gen, req.sampling), gen, lps))
        body_out = R.completion(
            request_id=rid, created=created, model=model, choices=choices, prompts=[gens for _, gens in results]
        )
        return _json(body_out, headers=_instance_headers(results[0][0]))

    def _completion_sse(
        self, source: Rollout, tok: Tokenizer, req: P.CompletionRequest, rid: str, created: int, model: str
    ) -> AsyncIterator[bytes]:
        choices = [CompletionChoice(i, StreamedText(tok, req.sampling), tok) for i in range(req.sampling.n)]
        envelope = {"id": rid, "object": "text_completion", "created": created, "model": model}
        return sse_stream(
            source,
            choices,
            envelope=envelope,
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            prompt_tokens=len(source.states[0].original.prompt_ids),
        )

    async def generate(self, request: Request) -> AnyResponse:
        body = await self._body(request)
        meta = parse_routing_meta(request.headers)
        req = P.parse_generate(body)
        model = resolve_model(self.registry, req.model)
        sp = body.get("sampling_params") or {}
        detokenize = sp.get("detokenize", True) is not False
        needs_tokenizer = detokenize or any(isinstance(p, str) for p in req.prompts)
        tok = await self.tokenizers.get(model) if needs_tokenizer else None
        routed_start = routed_experts_start(body)

        async def one(prompt: list[int] | str, rid: str | None) -> tuple[Ticket, list[dict[str, Any]]]:
            ids = await text_prompt_ids(prompt, tok, "text") if isinstance(prompt, str) and tok else prompt
            assert isinstance(ids, list)
            rid = rid or new_request_id("gen")
            if routed_start is not None and routed_start > len(ids):
                raise BadRequest(
                    f"routed_experts_start_len ({routed_start}) exceeds the prompt's {len(ids)} tokens",
                    param="routed_experts_start_len",
                )
            gen_in = GenerationInput(rid, ids, req.sampling, False, routed_experts_start=routed_start)
            rollout = Rollout(self.dispatcher, model, meta, gen_in)
            await rollout.start()
            gens = await rollout.collect()
            last = rollout.ticket
            assert last is not None
            outs = []
            for i, (gen, state) in enumerate(zip(gens, rollout.states, strict=True)):
                out = R.generate_output(
                    request_id=rid if len(gens) == 1 else f"{rid}-{i}",
                    gen=gen,
                    weight_version=state.weight_version,
                    prompt_ids=ids,
                    return_logprob=req.return_logprob,
                    return_prompt_token_ids=req.return_prompt_token_ids,
                    text=output_text(tok, gen, req.sampling) if detokenize and tok else None,
                    token_versions=state.token_versions,
                    return_routed_experts=routed_start is not None,
                )
                outs.append(out)
            return last, outs

        results = await _gather_or_raise([one(p, r) for p, r in zip(req.prompts, req.request_ids)])
        # SGLang's shape: one object per prompt; n > 1 makes a flat list of every prompt's n samples, prompt-major.
        outputs = [o for _, outs in results for o in outs]
        payload: Any = outputs if req.batched or req.sampling.n > 1 else outputs[0]
        return _json(payload, headers=_instance_headers(results[0][0]))


async def _gather_or_raise(coros: list) -> list:
    """Run a batch concurrently; the first failure cancels the rest and is raised."""
    if len(coros) == 1:  # the common case: no task to create
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
