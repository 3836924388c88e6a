"""Router + reference replica processes: n > 1 (chat, completions, /generate; streamed and not) and stop strings
(the text cut, the ids kept), each checked against the replica's own answer for the same prompt ids."""

from __future__ import annotations

import uuid

import anthropic
import grpc
import httpx
import openai
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def model(router) -> str:
    return httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=60)


def direct(replica, prompt: list[int], **params: object) -> list[vllm_engine_pb2.GenerateComplete]:
    """The replica's own non-streamed answer (a complete frame per choice, by index)."""
    with grpc.insecure_channel(replica.url.removeprefix("grpc://")) as channel:
        request = vllm_engine_pb2.GenerateRequest(
            request_id=f"direct-{uuid.uuid4().hex}",
            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
            sampling_params=vllm_engine_pb2.SamplingParams(logprobs=0, **params),
        )
        frames = [f.complete for f in vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(request, timeout=60)]
    return sorted(frames, key=lambda c: c.index)


def chat_prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))


SEEDED = {"seed": 5, "temperature": 1.0, "ignore_eos": True}


def test_chat_with_two_choices(client, model, replica, tokenizer) -> None:
    want = [list(c.output_ids) for c in direct(replica, chat_prompt(tokenizer), n=2, max_tokens=8, **SEEDED)]
    assert want[0] != want[1]  # choice i samples with seed + i
    kwargs = dict(model=model, messages=MESSAGES, n=2, max_tokens=8, seed=5, temperature=1.0)
    reply = client.chat.completions.create(**kwargs, logprobs=True, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.message.content for c in reply.choices] == [tokenizer.decode(w) for w in want]
    assert [len(c.logprobs.content) for c in reply.choices] == [8, 8]
    assert reply.usage.prompt_tokens == len(chat_prompt(tokenizer)) and reply.usage.completion_tokens == 16
    texts, finishes, openings = ["", ""], [None, None], [0, 0]
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    for chunk in stream:
        for c in chunk.choices:
            openings[c.index] += c.delta.role == "assistant"
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [c.message.content for c in reply.choices]
    assert finishes == ["length", "length"] and openings == [1, 1]


def test_completions_and_generate_with_two_choices(client, router, model, replica, tokenizer) -> None:
    prompts = [tokenizer.encode("Once upon a time"), [3, 14, 15, 92]]
    want = [list(c.output_ids) for p in prompts for c in direct(replica, p, n=2, max_tokens=5, **SEEDED)]
    reply = client.completions.create(
        model=model, prompt=prompts, n=2, max_tokens=5, seed=5, temperature=1.0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]  # prompt-major
    assert [c.text for c in reply.choices] == [tokenizer.decode(w) for w in want]
    assert reply.usage.prompt_tokens == sum(map(len, prompts)) and reply.usage.completion_tokens == 20
    streamed = ["", ""]
    kwargs = dict(model=model, n=2, max_tokens=5, seed=5, temperature=1.0, extra_body={"ignore_eos": True})
    for chunk in client.completions.create(**kwargs, prompt=prompts[0], stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in reply.choices[:2]]

    sp = {"n": 2, "max_new_tokens": 5, **SEEDED, "detokenize": False}
    one = httpx.post(f"{router.url}/generate", json={"input_ids": prompts[1], "sampling_params": sp}, timeout=60)
    assert [o["output_ids"] for o in one.json()] == want[2:]  # SGLang's shape: a list of n results
    batch = httpx.post(f"{router.url}/generate", json={"input_ids": prompts, "sampling_params": sp}, timeout=60)
    assert [o["output_ids"] for o in batch.json()] == want  # every prompt's n samples, prompt-major
    assert [o["meta_info"]["output_token_versions"] for o in batch.json()] == [[0] * 5] * 4


def _stop_of(tokenizer: Tokenizer, ids: list[int]) -> tuple[str, int]:
    """Three characters of the decoded output that first occur a few characters in, and where they start."""
    text = tokenizer.decode(ids)
    for start in range(3, len(text) - 6):
        stop = text[start : start + 3]
        if text.find(stop) == start and "\ufffd" not in stop and stop.strip() == stop:
            return stop, start
    raise AssertionError(f"no usable stop string in {text!r}")


def test_a_stop_string_cuts_the_text_and_keeps_the_ids(client, router, model, replica, tokenizer) -> None:
    prompt = chat_prompt(tokenizer)
    [full] = direct(replica, prompt, temperature=0.0, max_tokens=24, ignore_eos=True)
    stop, at = _stop_of(tokenizer, list(full.output_ids))
    text = tokenizer.decode(list(full.output_ids))[:at]
    [stopped] = direct(replica, prompt, temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.matched_stop_str == stop

    kwargs = dict(model=model, messages=MESSAGES, max_tokens=24, temperature=0, stop=stop)
    reply = client.chat.completions.create(**kwargs, logprobs=True, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.message.content == text and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    assert reply.usage.completion_tokens == len(stopped.output_ids) == len(choice.logprobs.content)
    chunks = client.chat.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices) == text

    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    out = httpx.post(f"{router.url}/generate", json={"input_ids": prompt, "sampling_params": sp}, timeout=60).json()
    assert out["output_ids"] == list(stopped.output_ids) and out["text"] == text
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}

    messages = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0)
    message = messages.messages.create(
        model=model,
        max_tokens=24,
        messages=MESSAGES,
        stop_sequences=[stop],
        extra_body={"temperature": 0, "ignore_eos": True},  # this client version takes no `temperature`
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop


def test_stop_strings_on_completions_streamed_and_not(client, model, replica, tokenizer) -> None:
    prompt = tokenizer.encode("Once upon a time")
    [full] = direct(replica, prompt, temperature=0.0, max_tokens=24, ignore_eos=True)
    stop, at = _stop_of(tokenizer, list(full.output_ids))
    text = tokenizer.decode(list(full.output_ids))[:at]
    kwargs = dict(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    extra = {"ignore_eos": True}
    assert client.completions.create(**kwargs, extra_body=extra).choices[0].text == text
    included = client.completions.create(**kwargs, extra_body={**extra, "include_stop_str_in_output": True})
    assert included.choices[0].text == text + stop
    chunks = client.completions.create(**kwargs, stream=True, extra_body=extra)
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == text


def test_a_tito_turn_takes_one_choice(router, model) -> None:
    sid = httpx.post(f"{router.url}/tito/sessions").json()["session_id"]
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "n": 2, "temperature": 1.0}
    r = httpx.post(f"{router.url}/v1/chat/completions", json=body, headers={"x-smg-tito-session-id": sid})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
