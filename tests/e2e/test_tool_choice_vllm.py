"""tool_choice "required" and a named function over a stock vLLM replica (CPU build, the stock servicer): the
router sends the structural tag vLLM builds, vLLM constrains decoding with it, and even the tiny model's random
weights then produce a call, parsed from the hermes format, streamed and not. Marked vllm (its own stage)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from _procs import start_router
from _vllm import HAS_VLLM, start_stock_vllm

from psrl.gateway.processes import stop_processes
from psrl.worker.model_folder import build_weighted_model_folder

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vllm and smg-grpc-servicer not installed")]

# Strict tools without arguments: held to `{}`, the random model's call stays short (vLLM lets JSON carry any
# whitespace, which a random model may never stop writing).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "strict": True,
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
    for name in ("get_weather", "get_time")
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def router_url(tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[str]:
    replica = start_stock_vllm(build_weighted_model_folder(tmp_path_factory.mktemp("vllm-model")), log_dir)
    router = start_router(log_dir, [replica.url])
    yield router.url
    stop_processes([router.proc, replica.proc])


@pytest.fixture(scope="module")
def client(router_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(router_url: str) -> str:
    return httpx.get(f"{router_url}/v1/models").json()["data"][0]["id"]


@pytest.mark.parametrize(
    ("tool_choice", "names", "finish"),
    [
        ("required", {"get_weather", "get_time"}, "tool_calls"),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}, "stop"),
    ],
)
def test_a_forced_call_is_generated_and_parsed(client, model, tool_choice, names, finish) -> None:
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=200, temperature=0)
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == finish, choice.message
    calls = choice.message.tool_calls or []
    assert calls and {c.function.name for c in calls} <= names
    assert all(json.loads(c.function.arguments) == {} for c in calls)
    if finish == "stop":  # a named choice: that one tool, once
        assert len(calls) == 1
    streamed = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    assert streamed[-1].choices[0].finish_reason == finish
