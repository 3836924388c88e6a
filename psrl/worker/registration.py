"""Self-registration with the router: POST /workers (docs/compat.md section 5) once our own HealthCheck passes.

The router's admin key goes in the `Authorization` header (from --router-api-key-file or $PSRL_ROUTER_API_KEY,
or --router-api-key); the router then calls this replica back over gRPC, with the replicas' token if it has one.
A router that is refused for want of that token answers `worker_unauthenticated`: retrying cannot help, so the
registration fails at once, saying so.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING

import grpc
import httpx
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl.replica_auth import REFUSED_ERROR_CODE, token_interceptors

if TYPE_CHECKING:
    from psrl.worker.config import WorkerArgs

logger = logging.getLogger(__name__)


def registration_body(
    *,
    grpc_url: str,
    served_model_name: str,
    kv_capacity_tokens: int,
    dp_size: int,
    kv_block_size: int,
    node_id: str,
    tp_size: int = 1,
    worker_id: str | None = None,
) -> dict:
    """The body PSRL's replicas send; label values are strings. The router keeps labels it does not read, such
    as `node_id`, and shows them in GET /workers."""
    body: dict = {
        "url": grpc_url,
        "worker_type": "regular",
        "connection_mode": "grpc",
        "runtime_type": "vllm",
        "models": [{"id": served_model_name}],
        "labels": {
            "max_model_len": str(kv_capacity_tokens),
            "dp_size": str(dp_size),
            "tp_size": str(tp_size),
            "pp_size": "1",
            "kv_block_size": str(kv_block_size),
            "node_id": node_id,
        },
    }
    if worker_id is not None:
        body["id"] = worker_id
    return body


async def wait_until_healthy(
    target: str, timeout_s: float = 300.0, poll_s: float = 0.2, *, token: str | None = None
) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with grpc.aio.insecure_channel(target, interceptors=token_interceptors(token)) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        while True:
            try:
                reply = await stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=5.0)
                if reply.healthy:
                    return
            except grpc.aio.AioRpcError as e:
                logger.debug("health check of %s failed: %s", target, e.code())
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{target} did not become healthy within {timeout_s}s")
            await asyncio.sleep(poll_s)


async def register_with_router(
    router_url: str, body: dict, *, api_key: str | None = None, timeout_s: float = 300.0
) -> str:
    """POST /workers until the router accepts it; returns the worker_id the router assigned."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with httpx.AsyncClient(base_url=router_url.rstrip("/"), timeout=10.0) as client:
        while True:
            try:
                resp = await client.post("/workers", json=body, headers=headers)
                if resp.status_code < 300:
                    worker_id = str(resp.json().get("worker_id", ""))
                    logger.info("registered %s with %s as worker %s", body["url"], router_url, worker_id)
                    return worker_id
                if 400 <= resp.status_code < 500:  # the router refuses this body: retrying won't help
                    raise RuntimeError(f"router refused registration: {resp.status_code} {resp.text}")
                if resp.headers.get("x-smg-error-code") == REFUSED_ERROR_CODE:
                    raise RuntimeError(
                        f"router could not register this replica: its calls here were refused for want of the "
                        f"replicas' token (start the router with the same PSRL_REPLICA_TOKEN or "
                        f"--replica-token-file): {resp.status_code} {resp.text}"
                    )
                logger.warning("router answered %s to registration; retrying", resp.status_code)
            except httpx.TransportError as e:
                logger.info("router %s not reachable yet (%s); retrying", router_url, e)
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"could not register with {router_url} within {timeout_s}s")
            await asyncio.sleep(0.5)


def _start_registration(
    target: str, router_url: str, body: dict, api_key: str | None, token: str | None, on_failure
) -> asyncio.Task:
    """Register in the background once our own HealthCheck passes; `on_failure()` if that never happens."""

    async def _register() -> None:
        await wait_until_healthy(target, token=token)
        await register_with_router(router_url, body, api_key=api_key)

    def _done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("registration failed: %s", task.exception())
            on_failure()

    task = asyncio.create_task(_register())
    task.add_done_callback(_done)
    return task


async def serve_until_stopped(
    target: str,
    ready_line: str,
    *,
    router_url: str | None,
    body: dict | None,
    api_key: str | None,
    token: str | None = None,
) -> bool:
    """A serving replica's life: print its ready line (one parseable line for launchers that passed --port 0),
    register with `router_url` if given, and wait for SIGINT/SIGTERM or a failed registration (a replica its
    router cannot see is of no use). Returns whether the registration failed: the process then exits 1.
    `token`: the replica's own token, for its health check on itself."""
    print(ready_line, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    registration = None
    if router_url and body is not None:
        registration = _start_registration(target, router_url, body, api_key, token, stop.set)
    await stop.wait()
    logger.info("shutting down")
    if registration is None:
        return False
    if registration.done() and not registration.cancelled() and registration.exception() is not None:
        return True
    registration.cancel()
    return False


async def serve_replica(
    args: WorkerArgs,
    target: str,
    served_name: str,
    *,
    kv_capacity_tokens: int,
    kv_block_size: int,
    tp_size: int = 1,
    engine: str | None = None,
    replica_token: str | None = None,
) -> bool:
    """`serve_until_stopped` for a replica started from the command line, whose server is bound at `target`:
    its PSRL_WORKER_READY line (with `engine=` when not the reference one) and, with `--router`, its
    registration (with the router's admin key, `args.registration_key()`; `replica_token`: the one this
    replica's server requires). Both name the address others reach it at (`--advertise-host`, else the bound
    one; WorkerArgs.validate refuses a wildcard bind without it)."""
    url = f"grpc://{args.advertised(target)}"
    body = None
    if args.router:
        body = registration_body(
            grpc_url=url,
            served_model_name=served_name,
            kv_capacity_tokens=kv_capacity_tokens,
            dp_size=args.dp_size,
            tp_size=tp_size,
            kv_block_size=kv_block_size,
            node_id=args.node(),
            worker_id=args.worker_id,
        )
    ready = f"PSRL_WORKER_READY {url} dp_size={args.dp_size} model={served_name}"
    if engine is not None:
        ready += f" engine={engine}"
    return await serve_until_stopped(
        target, ready, router_url=args.router, body=body, api_key=args.registration_key(), token=replica_token
    )
