"""SessionRouter test helpers: a scripted agent (each turn adds the reply and a tool result to its context),
and a small capacity-bound stack for the thunder_agent strategy."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from _procs import Proc, start_replica, start_router, start_session_router
from _wait import wait_for

from psrl.gateway.processes import stop_processes

CAPACITY = ["--num-blocks", "32", "--block-size", "16"]  # 512 tokens: about two of the scripted agents
ROUTER_ADMIN = "router-admin"


@contextmanager
def capacity_stack(model_dir: Path, log_dir: Path, session_args: list[str]) -> Iterator[tuple[Proc, Proc, str]]:
    """A keyed router, one replica of CAPACITY that registers itself (its labels carry its KV capacity,
    `max_model_len`), and a SessionRouter with `session_args`: (router, session router, model)."""
    router = start_router(log_dir, [], args=["--load-poll-interval-s", "0.1", "--admin-api-key", ROUTER_ADMIN])
    procs = [router.proc]
    try:
        args = [*CAPACITY, "--router", router.url, "--router-api-key", ROUTER_ADMIN]
        procs.append(start_replica(model_dir, log_dir, args=args).proc)
        wait_for(lambda: httpx.get(f"{router.url}/health").json()["workers"] == 1, "the replica registered")
        session = start_session_router(log_dir, router.url, session_args)
        procs.append(session.proc)
        model = httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"]
        yield router, session, model
    finally:
        stop_processes(procs[::-1])


async def scripted_agent(client: httpx.AsyncClient, model: str, sid: str, turns: int) -> list[int]:
    """Run `turns` chat turns of session `sid` (each adds the reply and a tool result to the context), then close
    the session; the turns' status codes (it stops at the first that is not 200)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {sid[:6]}: list the files"}]
    statuses = []
    for i in range(turns):
        body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = await client.post(f"/sessions/{sid}/v1/chat/completions", json=body)
        statuses.append(r.status_code)
        if r.status_code != 200:
            break
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        messages.append({"role": "user", "content": f"tool output {i}: a.txt b.txt c.txt"})
    await client.delete(f"/sessions/{sid}")
    return statuses
