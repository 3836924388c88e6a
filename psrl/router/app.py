"""The router's HTTP surface: thin handlers that run the pipeline stages and the worker-registry calls."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from psrl.router.config import RouterConfig
from psrl.router.errors import (
    BadRequest,
    NotFound,
    RouterError,
    Unauthorized,
    WorkerInternalError,
    WorkerUnavailable,
)
from psrl.router.pipeline import parse as P
from psrl.router.pipeline import respond as R
from psrl.router.pipeline.context import Generation, GenerationInput
from psrl.router.pipeline.execute import Delta, WorkerCall
from psrl.router.pipeline.prepare import chat_prompt_ids, check_prompt, new_request_id, text_prompt_ids
from psrl.router.pipeline.select import resolve_model, select_instance
from psrl.router.pipeline.stream import sse_stream
from psrl.router.policies import SelectionRequest, make_policy
from psrl.router.registry import Instance, Worker, WorkerRegistry
from psrl.router.tokenizers import TokenizerStore
from psrl.router.worker_client import WorkerClients
from psrl.tokenizer import IncrementalDecoder, Tokenizer

logger = logging.getLogger("psrl.router")

_JSON = "application/json"


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(payload), status_code=status, media_type=_JSON, headers=headers)


class RouterApp:
    """Owns the registry, the channel pool, the policy and the tokenizers; builds the Starlette app."""

    def __init__(self, config: RouterConfig) -> None:
        config.validate()
        self.config = config
        self.registry = WorkerRegistry()
        self.clients = WorkerClients()
        self.policy = make_policy(config.policy)
        self.tokenizers = TokenizerStore(self.registry, self.clients, config.tokenizer_path)
        self._background: list[asyncio.Task] = []
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/workers", self.list_workers, methods=["GET"]),
                Route("/workers", self.add_worker, methods=["POST"]),
                Route("/workers/{worker_id}", self.remove_worker, methods=["DELETE"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/generate", self.generate, methods=["POST"]),
            ],
            exception_handlers={RouterError: self._router_error, Exception: self._unexpected_error},
            lifespan=self._lifespan,
        )

    # ---- lifecycle ----------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._background.append(asyncio.create_task(self._health_loop()))
        for url in self.config.worker_urls:
            self._background.append(asyncio.create_task(self._register_from_cli(url)))
        try:
            yield
        finally:
            for task in self._background:
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            await self.clients.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            workers = self.registry.workers()
            results = await asyncio.gather(
                *(self.clients.is_healthy(w, self.config.health_check_timeout_s) for w in workers)
            )
            for worker, healthy in zip(workers, results):
                if worker.healthy != healthy:
                    logger.warning(
                        "worker %s (%s) is now %s",
                        worker.worker_id,
                        worker.url,
                        "healthy" if healthy else "unhealthy",
                    )
                worker.healthy = healthy

    async def _register_from_cli(self, url: str) -> None:
        while True:
            try:
                await self._register({"url": url})
                return
            except RouterError as e:
                logger.info("worker %s not registered yet: %s", url, e.message)
                await asyncio.sleep(1.0)

    # ---- errors and auth ----------------------------------------------------------------------------

    async def _router_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RouterError)
        if exc.status >= 500:
            logger.warning("%s %s -> %s %s: %s", request.method, request.url.path, exc.status, exc.code, exc.message)
        return exc.to_response()

    async def _unexpected_error(self, request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return WorkerInternalError(
            f"internal router error: {type(exc).__name__}: {exc}", code="internal_error"
        ).to_response()

    def _authorize(self, request: Request, *, admin: bool) -> None:
        key = self.config.admin_api_key if admin else self.config.api_key
        if key and request.headers.get("authorization") != f"Bearer {key}":
            raise Unauthorized("missing or wrong bearer token")

    async def _body(self, request: Request) -> dict[str, Any]:
        return P.parse_json_body(await request.body(), self.config.max_payload_bytes)

    # ---- simple endpoints ----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return _json({"status": "ok", "workers": len(self.registry.workers())})

    async def models(self, request: Request) -> Response:
        self._authorize(request, admin=False)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "psrl"} for m in self.registry.models()]
        return _json({"object": "list", "data": data})

    # ---- worker registry ------------------------------------------------------------------------------

    async def list_workers(self, request: Request) -> Response:
        self._authorize(request, admin=True)
        return _json({"workers": [w.to_json() for w in self.registry.workers()]})

    async def add_worker(self, request: Request) -> Response:
        self._authorize(request, admin=True)
        worker = await self._register(await self._body(request))
        return _json({"worker_id": worker.worker_id, "status": "registered", "worker": worker.to_json()})

    async def remove_worker(self, request: Request) -> Response:
        self._authorize(request, admin=True)
        worker_id = request.path_params["worker_id"]
        worker = self.registry.remove(worker_id)
        if worker is None:
            raise NotFound(f"no worker {worker_id!r}")
        if self.registry.by_url(worker.url) is None:
            await self.clients.drop(worker.target)
        return _json({"worker_id": worker_id, "status": "removed"})

    async def _register(self, body: dict[str, Any]) -> Worker:
        url = P.get_str(body, "url", None)
        if not url:
            raise BadRequest("'url' is required", param="url")
        parts = urlsplit(url)
        mode = P.get_str(body, "connection_mode", "grpc")
        if parts.scheme != "grpc" or not parts.hostname or not parts.port:
            raise BadRequest(f"'url' must look like grpc://host:port, got {url!r}", param="url")
        if mode != "grpc":
            raise BadRequest(f"connection_mode {mode!r} is not supported yet; use grpc", param="connection_mode")
        labels = body.get("labels") or {}
        if not isinstance(labels, dict):
            raise BadRequest("'labels' must be an object", param="labels")
        labels = {str(k): str(v) for k, v in labels.items()}
        worker_id = P.get_str(body, "id", None)
        models = body.get("models")
        if models is not None and not isinstance(models, list):
            raise BadRequest("'models' must be a list", param="models")

        try:
            facts = await self.clients.facts(parts.netloc, self.config.connect_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise WorkerUnavailable(f"cannot reach worker at {url}: {e.code().name} {e.details()}") from e
        dp_label = labels.get("dp_size")
        if dp_label is not None and dp_label != str(facts.dp_size):
            raise BadRequest(f"label dp_size={dp_label} but the worker reports {facts.dp_size}", param="labels")
        names = [m["id"] if isinstance(m, dict) else str(m) for m in models or []] or [facts.served_model_name]
        try:
            weight_version = int(labels.get("weight_version", 0))
        except ValueError as e:
            raise BadRequest("label weight_version must be an integer", param="labels") from e

        existing = self.registry.by_url(url)
        if existing is not None and worker_id in (None, existing.worker_id):
            worker_id = existing.worker_id  # a replica re-registering (e.g. after a restart): same id
        elif worker_id is None:
            worker_id = self.registry.new_id()
        elif existing is not None:
            self.registry.remove(existing.worker_id)
        worker = Worker(
            worker_id=worker_id,
            url=url,
            models=names,
            labels=labels,
            dp_size=facts.dp_size,
            max_context_length=facts.max_context_length,
            kv_block_size=facts.block_size,
            weight_version=weight_version,
        )
        self.registry.add(worker)
        logger.info("registered worker %s at %s (dp_size=%d, models=%s)", worker_id, url, facts.dp_size, names)
        return worker

    # ---- data plane ---------------------------------------------------------------------------------

    async def _dispatch(self, gen: GenerationInput, instance: Instance) -> WorkerCall:
        call = WorkerCall(self.clients, instance, gen, self.config.request_timeout_s)
        try:
            await call.start()
        except WorkerUnavailable:
            # Take it out of rotation at once; the health loop brings it back when it answers again.
            instance.worker.healthy = False
            call.cancel()
            raise
        except RouterError:
            call.cancel()
            raise
        return call

    def _route(self, model: str, gen_id: str, prompt_ids: list[int]) -> Instance:
        return select_instance(self.registry, self.policy, model, SelectionRequest(gen_id, prompt_ids))

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request, admin=False)
        chat = P.parse_chat(await self._body(request))
        model = resolve_model(self.registry, chat.model)
        tok = await self.tokenizers.get(model)
        prompt = await chat_prompt_ids(chat, tok)
        rid = new_request_id("chatcmpl")
        instance = self._route(model, rid, prompt)
        check_prompt(prompt, chat.sampling, instance.worker.max_context_length, 0)
        call = await self._dispatch(GenerationInput(rid, model, prompt, chat.sampling, chat.stream), instance)
        created = int(time.time())
        headers = _instance_headers(instance)
        if chat.stream:
            return StreamingResponse(
                self._chat_sse(call, tok, chat, rid, created, model),
                media_type="text/event-stream",
                headers=headers,
            )
        gen = await _collect(call)
        text = tok.decode(gen.output_ids, skip_special_tokens=chat.sampling.skip_special_tokens)
        logprobs = R.chat_logprobs(tok, gen.output_ids, gen.logprobs, gen.top_logprobs) if chat.logprobs else None
        body = R.chat_completion(request_id=rid, created=created, model=model, text=text, gen=gen, logprobs=logprobs)
        return _json(body, headers=headers)

    def _chat_sse(
        self, call: WorkerCall, tok: Tokenizer, chat: P.ChatRequest, rid: str, created: int, model: str
    ) -> AsyncIterator[bytes]:
        def choice(text: str, d: Delta | None, finish: str | None) -> dict[str, Any] | None:
            lps = R.chat_logprobs(tok, d.token_ids, d.logprobs, d.top_logprobs) if d and chat.logprobs else None
            if finish is None and not text and lps is None:
                return None
            delta = {"content": text} if text or finish is None else {}
            return {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}

        envelope = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        decoder = IncrementalDecoder(tok, chat.sampling.skip_special_tokens)
        return sse_stream(
            call, decoder, envelope=envelope, choice=choice, opening=opening, include_usage=chat.include_usage
        )

    async def completions(self, request: Request) -> Response:
        self._authorize(request, admin=False)
        req = P.parse_completion(await self._body(request))
        model = resolve_model(self.registry, req.model)
        tok = await self.tokenizers.get(model)
        rid = new_request_id("cmpl")
        created = int(time.time())
        prompts = [await text_prompt_ids(p, tok) for p in req.prompts]
        if req.stream:
            instance = self._route(model, rid, prompts[0])
            check_prompt(prompts[0], req.sampling, instance.worker.max_context_length, 0)
            call = await self._dispatch(GenerationInput(rid, model, prompts[0], req.sampling, True), instance)
            return StreamingResponse(
                self._completion_sse(call, tok, req, rid, created, model),
                media_type="text/event-stream",
                headers=_instance_headers(instance),
            )

        async def one(index: int, prompt: list[int]) -> tuple[Instance, Generation]:
            sub_id = rid if len(prompts) == 1 else f"{rid}-{index}"
            instance = self._route(model, sub_id, prompt)
            check_prompt(prompt, req.sampling, instance.worker.max_context_length, 0)
            call = await self._dispatch(GenerationInput(sub_id, model, prompt, req.sampling, False), instance)
            return instance, await _collect(call)

        results = await _gather_or_raise([one(i, p) for i, p in enumerate(prompts)])
        choices = []
        for i, (_, gen) in enumerate(results):
            text = tok.decode(gen.output_ids, skip_special_tokens=req.sampling.skip_special_tokens)
            lps = R.completion_logprobs(tok, gen.output_ids, gen.logprobs, gen.top_logprobs)
            choices.append(R.completion_choice(i, text, gen, lps))
        body = R.completion(request_id=rid, created=created, model=model, choices=choices, gens=[g for _, g in results])
        return _json(body, headers=_instance_headers(results[0][0]))

    def _completion_sse(
        self, call: WorkerCall, tok: Tokenizer, req: P.CompletionRequest, rid: str, created: int, model: str
    ) -> AsyncIterator[bytes]:
        def choice(text: str, d: Delta | None, finish: str | None) -> dict[str, Any] | None:
            lps = R.completion_logprobs(tok, d.token_ids, d.logprobs, d.top_logprobs) if d else None
            if finish is None and not text and lps is None:
                return None
            return {"index": 0, "text": text, "logprobs": lps, "finish_reason": finish}

        envelope = {"id": rid, "object": "text_completion", "created": created, "model": model}
        decoder = IncrementalDecoder(tok, req.sampling.skip_special_tokens)
        return sse_stream(call, decoder, envelope=envelope, choice=choice, include_usage=req.include_usage)

    async def generate(self, request: Request) -> Response:
        self._authorize(request, admin=False)
        body = await self._body(request)
        req = P.parse_generate(body)
        model = resolve_model(self.registry, req.model)
        sp = body.get("sampling_params") or {}
        detokenize = sp.get("detokenize", True) is not False
        needs_tokenizer = detokenize or any(isinstance(p, str) for p in req.prompts)
        tok = await self.tokenizers.get(model) if needs_tokenizer else None

        async def one(prompt: list[int] | str, rid: str | None) -> tuple[Instance, dict[str, Any]]:
            ids = await text_prompt_ids(prompt, tok) if isinstance(prompt, str) and tok else prompt
            assert isinstance(ids, list)
            rid = rid or new_request_id("gen")
            instance = self._route(model, rid, ids)
            check_prompt(ids, req.sampling, instance.worker.max_context_length, 0)
            call = await self._dispatch(GenerationInput(rid, model, ids, req.sampling, False), instance)
            gen = await _collect(call)
            text = tok.decode(gen.output_ids, req.sampling.skip_special_tokens) if detokenize and tok else None
            out = R.generate_output(
                request_id=rid,
                gen=gen,
                weight_version=instance.worker.weight_version,
                prompt_ids=ids,
                return_logprob=req.return_logprob,
                return_prompt_token_ids=req.return_prompt_token_ids,
                text=text,
            )
            return instance, out

        results = await _gather_or_raise([one(p, r) for p, r in zip(req.prompts, req.request_ids)])
        payload: Any = [o for _, o in results] if req.batched else results[0][1]
        return _json(payload, headers=_instance_headers(results[0][0]))


def _instance_headers(instance: Instance) -> dict[str, str]:
    return {
        "x-base-worker-id": instance.id.base_worker_id,
        "x-target-dp-rank": str(instance.id.dp_rank),
        "x-version-tag": str(instance.worker.weight_version),
    }


async def _collect(call: WorkerCall) -> Generation:
    try:
        return await call.collect()
    finally:
        call.cancel()  # no-op after a clean end; frees the replica if this handler was cancelled


async def _gather_or_raise(coros: list) -> list:
    """Run a batch concurrently; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
