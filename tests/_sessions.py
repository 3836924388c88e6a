"""A scripted agent for SessionRouter tests: each turn adds the reply and a tool result to its context."""

from __future__ import annotations

from typing import Any

import httpx


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
