"""The router in front of real vLLM: a stock replica (vLLM's launcher with the stock smg-grpc-servicer) and a
vLLM replica of ours (`python -m psrl.worker --engine vllm`). Every endpoint through the official clients,
n = 2, stop strings and a TITO session, each checked against what that vLLM itself samples for the same prompt
ids (asked directly over gRPC; greedy or seeded, so reproducible); and the router's health checks and load
polls, read as grpc.aio reads them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import grpc
import httpx
import openai
import pytest
from _procs import Proc, start_router
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl.gateway.processes import stop_processes
from psrl.router.registry import WorkerRegistry
from psrl.router.worker_client import WorkerClients
from psrl.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "Tell me a story about a robot"}]


@dataclass
class Sampled:
    """One choice as vLLM answers it."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    matched_stop_str: str | None


@pytest.fixture(scope="module", params=["stock", "ours"])
def replica(request: pytest.FixtureRequest) -> Proc:
    if request.param == "stock":
        return request.getfixturevalue("stock_vllm")
    return request.getfixturevalue("vllm_pair")[0]


@pytest.fixture(scope="module")
def router(replica: Proc, log_dir: Path) -> Iterator[Proc]:
    proc = start_router(log_dir, [replica.url])
    yield proc
    stop_processes([proc.proc])


@pytest.fixture(scope="module")
def model(router: Proc) -> str:
    return httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(router: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(vllm_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(vllm_model_dir)


@pytest.fixture(scope="module")
def vllm(replica: Proc) -> Iterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    with grpc.insecure_channel(replica.url.removeprefix("grpc://")) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


def sample(stub: vllm_engine_pb2_grpc.VllmEngineStub, prompt: list[int], **params: object) -> list[Sampled]:
    """vLLM's own non-streamed answer for `prompt` (one entry per choice, by index)."""
    request = vllm_engine_pb2.GenerateRequest(
        request_id=f"direct-{uuid.uuid4().hex}",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=vllm_engine_pb2.SamplingParams(logprobs=0, **params),
    )
    out: dict[int, Sampled] = {}
    for frame in stub.Generate(request, timeout=120):
        c = frame.complete
        matched = c.matched_stop_str if c.WhichOneof("matched_stop") == "matched_stop_str" else None
        out[c.index] = Sampled(list(c.output_ids), list(c.output_logprobs.token_logprobs), c.finish_reason, matched)
    return [out[i] for i in sorted(out)]


def chat_prompt(tok: Tokenizer, messages: list[dict] = MESSAGES) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def greedy(
    stub: vllm_engine_pb2_grpc.VllmEngineStub, prompt: list[int], n_tokens: int = 16, ignore_eos: bool = True
) -> Sampled:
    [s] = sample(stub, prompt, temperature=0.0, max_tokens=n_tokens, ignore_eos=ignore_eos)
    return s


def a_stop_string(tok: Tokenizer, ids: list[int]) -> tuple[str, int]:
    """Three characters of the decoded output that first occur a few characters in, and where they start."""
    text = tok.decode(ids)
    for start in range(3, len(text) - 6):
        stop = text[start : start + 3]
        if text.find(stop) == start and "\ufffd" not in stop and stop.strip() == stop and stop:
            return stop, start
    raise AssertionError(f"no usable stop string in {text!r}")


# ---- the background calls ---------------------------------------------------------------------------------


async def test_health_checks_and_load_polls_read_vllm_as_grpc_aio_does(replica: Proc) -> None:
    """The router's health check and load poll go over its libcurl client: against vLLM's servicer they answer
    what grpc.aio's stub answers."""
    clients = WorkerClients()
    try:
        worker = WorkerRegistry().create_worker("v", replica.url, models=["m"], labels={})
        assert await clients.is_healthy(worker, 60.0)
        ours = await clients.loads(worker, 60.0)
        async with grpc.aio.insecure_channel(worker.target) as channel:
            theirs = await vllm_engine_pb2_grpc.VllmEngineStub(channel).GetLoads(
                vllm_engine_pb2.GetLoadsRequest(), timeout=60
            )
        assert ours.loads and [x.dp_rank for x in ours.loads] == [x.dp_rank for x in theirs.loads]
        assert not clients._channels  # no grpc.aio channel was opened for them
    finally:
        await clients.close()


# ---- the endpoints ----------------------------------------------------------------------------------------


def test_chat_streamed_and_not_with_logprobs(client, model, tok, vllm) -> None:
    want = greedy(vllm, chat_prompt(tok))
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    choice = reply.choices[0]
    assert choice.message.content == tok.decode(want.ids) and choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(chat_prompt(tok)) and reply.usage.completion_tokens == 16
    assert [round(e.logprob, 3) for e in choice.logprobs.content] == [round(lp, 3) for lp in want.logprobs]
    assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    text, logprobs, finish = "", 0, None
    for chunk in client.chat.completions.create(**kwargs, stream=True, logprobs=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            logprobs += len(c.logprobs.content) if c.logprobs else 0
            finish = c.finish_reason or finish
    assert text == choice.message.content and logprobs == 16 and finish == "length"


def test_generate_with_logprobs_is_what_vllm_sampled(router, vllm) -> None:
    prompt = [5, 6, 7, 8, 9]
    want = greedy(vllm, prompt, 8)
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "detokenize": False},
    }
    out = httpx.post(f"{router.url}/generate", json=body, timeout=120).json()
    assert out["output_ids"] == want.ids and "text" not in out
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8} and meta["prompt_tokens"] == 5
    assert [tid for _, tid in meta["output_token_logprobs"]] == want.ids
    assert [round(lp, 3) for lp, _ in meta["output_token_logprobs"]] == [round(lp, 3) for lp in want.logprobs]
    assert meta["output_token_versions"] == [0] * 8


def test_a_long_prompt_spaced_any_way_reaches_vllm_whole(router, model, tok, vllm) -> None:
    """/generate reads `input_ids`, and /v1/completions `prompt`, from the body's digits
    (psrl._wire.json_take_token_ids): a prompt of 1,500 ids across the vocabulary, spaced as a pretty-printer writes
    JSON, reaches vLLM as sent (its greedy output is vLLM's own answer for those ids) and comes back whole in
    prompt_token_ids."""
    prompt = [(i * 7919) % tok.vocab_size for i in range(1500)]
    want = greedy(vllm, prompt, 8)
    body = {
        "input_ids": prompt,
        "return_prompt_token_ids": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    raw = json.dumps(body, indent=1).encode()
    headers = {"content-type": "application/json"}
    out = httpx.post(f"{router.url}/generate", content=raw, headers=headers, timeout=120).json()
    assert out["output_ids"] == want.ids
    assert out["meta_info"]["prompt_tokens"] == len(prompt) and out["meta_info"]["prompt_token_ids"] == prompt
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    raw = json.dumps(body, indent=1).encode()
    out = httpx.post(f"{router.url}/v1/completions", content=raw, headers=headers, timeout=120).json()
    assert out["choices"][0]["text"] == tok.decode(want.ids) and out["usage"]["prompt_tokens"] == len(prompt)


def test_completions_text_and_token_prompts(client, model, tok, vllm) -> None:
    prompts = ["Once upon a time", "The robot said"]
    kwargs = dict(model=model, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    reply = client.completions.create(**kwargs, prompt=prompts, logprobs=1)
    wants = [tok.decode(greedy(vllm, tok.encode(p), 8).ids) for p in prompts]
    assert [c.text for c in reply.choices] == wants and [len(c.logprobs.tokens) for c in reply.choices] == [8, 8]
    assert reply.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    by_ids = client.completions.create(**kwargs, prompt=[tok.encode(p) for p in prompts])
    assert [c.text for c in by_ids.choices] == wants


def test_responses_streamed_and_not(client, model, tok, vllm) -> None:
    want = greedy(vllm, chat_prompt(tok), 12, ignore_eos=False)
    kwargs = dict(model=model, input=MESSAGES[0]["content"], max_output_tokens=12, temperature=0)
    response = client.responses.create(**kwargs)
    assert response.output_text == tok.decode(want.ids)
    assert response.status == ("incomplete" if want.finish_reason == "length" else "completed")
    text, final = "", None
    with client.responses.stream(**kwargs) as stream:
        for event in stream:  # a cut response ends with response.incomplete (the client waits for completed)
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert final is not None and final.status == response.status
    assert text == response.output_text and final.usage.output_tokens == len(want.ids)


def test_messages_streamed_and_not(router, model, tok, vllm) -> None:
    want = greedy(vllm, chat_prompt(tok), 12, ignore_eos=False)
    client = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0)
    # this client version takes no `temperature` argument; the API still does
    kwargs = dict(model=model, max_tokens=12, messages=MESSAGES, extra_body={"temperature": 0})
    message = client.messages.create(**kwargs)
    assert message.content[0].text == tok.decode(want.ids)
    assert message.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text and final.usage.output_tokens == len(want.ids)


# ---- n = 2 --------------------------------------------------------------------------------------------------


def test_chat_with_two_choices_streamed_and_not(client, model, tok, vllm) -> None:
    want = sample(vllm, chat_prompt(tok), n=2, seed=7, temperature=1.0, max_tokens=10, ignore_eos=True)
    kwargs = dict(model=model, messages=MESSAGES, n=2, seed=7, temperature=1.0, max_tokens=10)
    reply = client.chat.completions.create(**kwargs, logprobs=True, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.message.content for c in reply.choices] == [tok.decode(w.ids) for w in want]
    assert [len(c.logprobs.content) for c in reply.choices] == [10, 10]
    assert reply.usage.prompt_tokens == len(chat_prompt(tok)) and reply.usage.completion_tokens == 20
    texts, finishes, usage = ["", ""], [None, None], None
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in reply.choices] and finishes == ["length", "length"]
    assert usage is not None and usage.completion_tokens == 20


def test_completions_with_two_choices_per_prompt_are_prompt_major(client, model, tok, vllm) -> None:
    prompts = ["Once upon a time", "The robot said"]
    reply = client.completions.create(
        model=model, prompt=prompts, n=2, seed=3, temperature=1.0, max_tokens=6, extra_body={"ignore_eos": True}
    )
    want = [w for p in prompts for w in sample(vllm, tok.encode(p), n=2, seed=3, temperature=1.0, max_tokens=6)]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [tok.decode(w.ids) for w in want]
    assert reply.usage.completion_tokens == 24


def test_generate_with_two_samples_is_a_list(router, vllm) -> None:
    prompt = [5, 6, 7, 8, 9]
    want = sample(vllm, prompt, n=2, seed=11, temperature=1.0, max_tokens=5, ignore_eos=True)
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"n": 2, "seed": 11, "temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True},
    }
    out = httpx.post(f"{router.url}/generate", json=body, timeout=120).json()
    assert isinstance(out, list) and [o["output_ids"] for o in out] == [w.ids for w in want]
    assert all(len(o["meta_info"]["output_token_logprobs"]) == 5 for o in out)
    batch = httpx.post(f"{router.url}/generate", json={**body, "input_ids": [prompt, prompt[:3]]}, timeout=120).json()
    assert len(batch) == 4 and [o["output_ids"] for o in batch[:2]] == [w.ids for w in want]


# ---- stop strings -------------------------------------------------------------------------------------------


def test_a_stop_string_cuts_the_text_and_keeps_the_ids(router, client, model, tok, vllm) -> None:
    prompt = chat_prompt(tok)
    full = greedy(vllm, prompt, 24)
    stop, at = a_stop_string(tok, full.ids)
    [want] = sample(vllm, prompt, temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    assert want.finish_reason == "stop" and want.matched_stop_str == stop
    text = tok.decode(full.ids)[:at]
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=24, temperature=0, stop=[stop])
    reply = client.chat.completions.create(**kwargs, logprobs=True, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.message.content == text and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    # token-level: every id vLLM returned, the one completing the stop string included
    assert reply.usage.completion_tokens == len(want.ids) == len(choice.logprobs.content)
    streamed = "".join(
        c.delta.content or ""
        for chunk in client.chat.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
        for c in chunk.choices
    )
    assert streamed == text
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "stop": stop}}
    out = httpx.post(f"{router.url}/generate", json=body, timeout=120).json()
    assert out["output_ids"] == want.ids and out["text"] == text
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    body["sampling_params"]["no_stop_trim"] = True
    assert httpx.post(f"{router.url}/generate", json=body, timeout=120).json()["text"] == text + stop


def test_stop_strings_on_completions_and_messages(router, client, model, tok, vllm) -> None:
    prompt = "Once upon a time"
    full = greedy(vllm, tok.encode(prompt), 24)
    stop, at = a_stop_string(tok, full.ids)
    text = tok.decode(full.ids)[:at]
    kwargs = dict(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=stop)
    assert client.completions.create(**kwargs).choices[0].text == text
    included = client.completions.create(**kwargs, extra_body={"include_stop_str_in_output": True})
    assert included.choices[0].text == text + stop
    streamed = "".join(c.text for chunk in client.completions.create(**kwargs, stream=True) for c in chunk.choices)
    assert streamed == text

    reply = greedy(vllm, chat_prompt(tok), 24, ignore_eos=False).ids
    stop, at = a_stop_string(tok, reply)
    messages = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0)
    kwargs = dict(model=model, max_tokens=24, messages=MESSAGES, stop_sequences=[stop], extra_body={"temperature": 0})
    message = messages.messages.create(**kwargs)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == tok.decode(reply)[:at]
    with messages.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.content[0].text == message.content[0].text


# ---- TITO -----------------------------------------------------------------------------------------------------


def test_a_two_turn_tito_session_records_what_vllm_sampled(router, model, vllm) -> None:
    sid = httpx.post(f"{router.url}/tito/sessions").json()["session_id"]
    headers = {"x-smg-tito-session-id": sid}
    messages = list(MESSAGES)
    for turn in range(2):
        body = {"model": model, "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{router.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        messages += [
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"And then {turn}?"},
        ]
    n2 = httpx.post(f"{router.url}/v1/chat/completions", json={**body, "n": 2}, headers=headers, timeout=120)
    assert n2.status_code == 400 and n2.json()["error"]["param"] == "n"
    [trajectory] = httpx.get(f"{router.url}/tito/sessions/{sid}").json()["trajectories"]
    accumulated, records = trajectory["accumulated_token_ids"], trajectory["records"]
    assert len(records) == 2
    for record in records:
        prompt = accumulated[: record["prompt_token_count"]]
        ids = [tid for _, tid in record["output_logprobs"]]
        assert ids == greedy(vllm, prompt, 10).ids  # exactly what vLLM samples for that prompt
        assert accumulated[len(prompt) : len(prompt) + len(ids)] == ids
    first_prompt = records[0]["prompt_token_count"]
    first_ids = [tid for _, tid in records[0]["output_logprobs"]]
    assert records[1]["prompt_token_count"] > first_prompt + len(first_ids)  # turn 2 extends turn 1's ids
    assert httpx.delete(f"{router.url}/tito/sessions/{sid}").status_code == 204
