"""Router + replica processes: the official openai client (chat, streaming, completions), /generate equal to
the replica's own answer, models, workers."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc


@pytest.fixture(scope="module")
def model_name(router) -> str:
    return httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)


def test_models_and_workers(router, replica, model_name) -> None:
    workers = httpx.get(f"{router.url}/workers").json()["workers"]
    assert len(workers) == 1 and workers[0]["url"] == replica.url and workers[0]["dp_size"] == 2
    assert [i["dp_rank"] for i in workers[0]["instances"]] == [0, 1]
    assert workers[0]["models"] == [{"id": model_name}]


def test_chat_completion(client, model_name, tokenizer) -> None:
    resp = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
        logprobs=True,
        top_logprobs=2,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}]))
    assert resp.usage.prompt_tokens == len(prompt)
    assert len(choice.logprobs.content) == 8
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in choice.logprobs.content)
    assert isinstance(choice.message.content, str)


def test_chat_streaming_matches_non_streaming(client, model_name) -> None:
    kwargs = dict(
        model=model_name,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == full.choices[0].message.content
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 20


def test_completions_with_text_and_token_prompts(client, model_name, tokenizer) -> None:
    by_text = client.completions.create(
        model=model_name,
        prompt="The quick brown fox",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
        logprobs=1,
    )
    ids = tokenizer.encode("The quick brown fox")
    by_ids = client.completions.create(
        model=model_name, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert len(by_text.choices[0].logprobs.token_logprobs) == 6


def test_generate_equals_the_replica_answer(router, replica, model_name) -> None:
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    body = {
        "model": model_name,
        "request_id": "gen-eq-1",
        "input_ids": prompt,
        "stream": False,
        "return_logprob": True,
        "sampling_params": {
            "n": 1,
            "logprobs": 0,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "repetition_penalty": 1.0,
            "ignore_eos": True,
            "detokenize": False,
            "max_new_tokens": 16,
        },
    }
    r = httpx.post(f"{router.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    rank = int(r.headers["x-target-dp-rank"])
    assert r.headers["x-base-worker-id"] and r.headers["x-version-tag"] == "0"
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 16}
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 16
    assert meta["weight_version"] == 0
    assert "text" not in out

    # The same request straight to the replica, same rank.
    with grpc.insecure_channel(replica.url.removeprefix("grpc://")) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        sp = vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0, n=1)
        req = vllm_engine_pb2.GenerateRequest(
            request_id="direct-1",
            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
            sampling_params=sp,
            stream=False,
            data_parallel_rank=rank,
        )
        direct = list(stub.Generate(req))[-1].complete
    assert out["output_ids"] == list(direct.output_ids)
    assert [lp for lp, _ in meta["output_token_logprobs"]] == list(direct.output_logprobs.token_logprobs)
    assert [t for _, t in meta["output_token_logprobs"]] == out["output_ids"]


def test_generate_batch_and_text(router, model_name) -> None:
    body = {
        "model": model_name,
        "input_ids": [[1, 2, 3], [4, 5, 6, 7]],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(f"{router.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and [len(o["output_ids"]) for o in outs] == [4, 4]
    assert all(isinstance(o["text"], str) for o in outs)
    r = httpx.post(
        f"{router.url}/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 3}}, timeout=60
    )
    assert r.status_code == 200 and len(r.json()["output_ids"]) <= 3


def test_round_robin_spreads_over_both_ranks(router, model_name) -> None:
    ranks = set()
    for _ in range(4):
        r = httpx.post(
            f"{router.url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}, timeout=60
        )
        ranks.add(r.headers["x-target-dp-rank"])
    assert ranks == {"0", "1"}


def test_tool_calls_are_parsed_when_tools_are_offered(router, model_name, tokenizer) -> None:
    """Tools render through the template and the reply goes through the tool-call parser (the random model
    does not call tools, so what it says stays content; the parsing itself is tested in test_tool_calls)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": tools,
        "max_tokens": 4,
        "temperature": 0,
    }
    r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["tool_calls"], list)
