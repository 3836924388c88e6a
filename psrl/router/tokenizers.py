"""Per-model tokenizers: a local folder when configured, otherwise fetched once from a worker (GetTokenizer)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from psrl.router.errors import WorkerUnavailable
from psrl.router.registry import WorkerRegistry
from psrl.router.worker_client import WorkerClients
from psrl.tokenizer import Tokenizer, TokenizerLoadError

logger = logging.getLogger(__name__)


class TokenizerStore:
    def __init__(self, registry: WorkerRegistry, clients: WorkerClients, local_path: str | None) -> None:
        self._registry = registry
        self._clients = clients
        self._local = Tokenizer.from_folder(local_path) if local_path else None
        self._by_model: dict[str, Tokenizer] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, model: str) -> Tokenizer:
        if self._local is not None:
            return self._local
        tok = self._by_model.get(model)
        if tok is not None:
            return tok
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:  # one fetch per model, shared by everyone who asks meanwhile
            tok = self._by_model.get(model)
            if tok is None:
                tok = self._by_model[model] = await self._fetch(model)
        return tok

    async def prefetch(self, model: str) -> None:
        """Fetch in the background at registration, so the first request does not wait for it."""
        try:
            await self.get(model)
        except WorkerUnavailable as e:
            logger.info("tokenizer prefetch for %s deferred: %s", model, e.message)

    async def _fetch(self, model: str) -> Tokenizer:
        errors = []
        for worker in self._registry.serving(model):
            if not worker.healthy:
                continue
            try:
                tok = await self._clients.tokenizer(worker.target)
                logger.info("tokenizer for %s fetched from worker %s", model, worker.worker_id)
                return tok
            except grpc.aio.AioRpcError as e:
                errors.append(f"worker {worker.worker_id}: {e.code().name} {e.details()}")
            except TokenizerLoadError as e:
                errors.append(f"worker {worker.worker_id}: {e}")
        detail = "; ".join(errors) or "no healthy worker serves it"
        raise WorkerUnavailable(f"no tokenizer available for model {model!r}: {detail}")
