"""Worker registration (POST /workers, and --worker-urls at start): the body is checked, the worker is asked
what it serves, and the registry, the background loops and the policy learn of it (or forget it)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx
import idna

from psrl.router.background import BackgroundLoops
from psrl.router.config import ConnectionMode
from psrl.router.errors import BadRequest, WorkerUnavailable
from psrl.router.http_backend import HttpWorkers
from psrl.router.pipeline import parse as P
from psrl.router.policies.base import Policy
from psrl.router.registry import Worker, WorkerRegistry
from psrl.router.tokenizers import TokenizerStore
from psrl.router.worker_client import WorkerClients

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registration:
    """A checked POST /workers body."""

    url: str
    mode: ConnectionMode
    netloc: str  # host:port
    labels: dict[str, str]
    worker_id: str | None
    models: list[Any] | None  # names, or {"id": name} objects; None: what the worker reports
    weight_version: int  # the weight_version label


def parse_registration(body: dict[str, Any]) -> Registration:
    url = P.get_str(body, "url", None)
    if not url:
        raise BadRequest("'url' is required", param="url")
    raw_mode = P.get_str(body, "connection_mode", None) or ("http" if url.startswith("http") else "grpc")
    try:
        mode = ConnectionMode(raw_mode)
    except ValueError:
        raise BadRequest(f"connection_mode must be grpc or http, got {raw_mode!r}", param="connection_mode") from None
    form = f"{mode.value}://host:port"
    try:
        parts = urlsplit(url)
        port = parts.port  # a port that is not a number, or past 65535, raises here
    except ValueError as e:
        raise BadRequest(f"'url' must look like {form}, got {url!r}: {e}", param="url") from None
    # Every call reaches a worker at host:port, at the API's own paths (an HTTP worker in plain HTTP, no TLS): a
    # URL that says more (a path, a query, a fragment, credentials) would have it silently dropped, or sent on.
    if (
        parts.scheme != mode.value
        or not parts.hostname
        or not port
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or "@" in parts.netloc
    ):
        raise BadRequest(
            f"'url' must look like {form} (no path, query or user) for connection_mode {mode}, got {url!r}",
            param="url",
        )
    netloc = parts.netloc
    if not netloc.isascii():
        # Every client gets the host in its ASCII form, the one httpx and curl resolve (IDNA 2008 with UTS #46
        # mapping; Python's own "idna" codec is IDNA 2003, which maps some names to other hosts: ß to "ss"). The
        # HTTP/1.1 client writes it into the Host header, which carries ASCII only.
        try:
            host = idna.encode(parts.hostname, uts46=True).decode("ascii")
        except idna.IDNAError as e:
            raise BadRequest(f"'url' has a host name that IDNA cannot encode ({e}): {url!r}", param="url") from None
        netloc = f"{host}:{port}"
        url = f"{parts.scheme}://{netloc}{parts.path}"
    labels = body.get("labels") or {}
    if not isinstance(labels, dict):
        raise BadRequest("'labels' must be an object", param="labels")
    labels = {str(k): str(v) for k, v in labels.items()}
    models = body.get("models")
    if models is not None and not isinstance(models, list):
        raise BadRequest("'models' must be a list", param="models")
    try:
        weight_version = int(labels.get("weight_version", 0))
    except ValueError as e:
        raise BadRequest("label weight_version must be an integer", param="labels") from e
    return Registration(url, mode, netloc, labels, P.get_str(body, "id", None), models, weight_version)


class Registrar:
    """Adds workers to the registry and takes them out, keeping the loops, the policy and the channels in step."""

    def __init__(
        self,
        registry: WorkerRegistry,
        clients: WorkerClients,
        http: HttpWorkers,
        background: BackgroundLoops,
        tokenizers: TokenizerStore,
        policy: Policy,
        *,
        connect_timeout_s: float,
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self.registry = registry
        self.clients = clients
        self.http = http
        self.background = background
        self.tokenizers = tokenizers
        self.policy = policy
        self.connect_timeout_s = connect_timeout_s
        self._spawn = spawn  # background work the router awaits (or cancels) at shutdown

    async def register(self, body: dict[str, Any]) -> Worker:
        reg = parse_registration(body)
        url, labels = reg.url, reg.labels
        if reg.mode is ConnectionMode.GRPC:
            try:
                facts = await self.clients.facts(reg.netloc, self.connect_timeout_s)
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
                hfacts = await self.http.facts(url.rstrip("/"), self.connect_timeout_s)
            except (httpx.HTTPError, ValueError) as e:
                raise WorkerUnavailable(f"cannot reach worker at {url}: {e!r}") from e
            served, dp_size, max_len, block = hfacts.models, 1, hfacts.max_context_length, 0
        names = [m["id"] if isinstance(m, dict) else str(m) for m in reg.models or []] or served
        if not names:
            raise BadRequest("the worker serves no model and the body names none", param="models")

        worker_id = reg.worker_id
        existing = self.registry.by_url(url)
        if existing is not None and worker_id in (None, existing.worker_id):
            worker_id = existing.worker_id  # a replica re-registering (e.g. after a restart): same id
        elif worker_id is None:
            worker_id = self.registry.new_id()
        if existing is not None:
            self.registry.remove(existing.worker_id)
            self.forget(existing)
        worker = self.registry.create_worker(
            worker_id,
            url.rstrip("/"),
            models=names,
            labels=labels,
            dp_size=dp_size,
            connection_mode=reg.mode,
            max_context_length=max_len,
            kv_block_size=block,
            label_weight_version=reg.weight_version,
        )
        self.background.watch_worker(worker)
        if reg.mode is ConnectionMode.GRPC:
            self._spawn(self.tokenizers.prefetch(names[0]))
        logger.info("registered %s worker %s at %s (dp_size=%d, models=%s)", reg.mode, worker_id, url, dp_size, names)
        return worker

    def forget(self, worker: Worker) -> None:
        """A worker left the registry: stop watching it, and close its channel unless another entry shares it."""
        self.background.forget_worker(worker.worker_id)
        self.policy.on_worker_removed(worker.worker_id)
        if worker.connection_mode is ConnectionMode.GRPC and self.registry.by_url(worker.url) is None:
            self._spawn(self.clients.drop(worker.target))
