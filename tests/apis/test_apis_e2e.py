"""`/v1/responses` and `/v1/messages` over real processes with the official clients: on the router directly,
and as TITO turns through the SessionRouter (recorded token for token like chat turns)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from _procs import Proc, start_session_router

from psrl.gateway.processes import stop_processes
from psrl.tito import build_training_arrays

TOOLS_RESPONSES = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]


@pytest.fixture(scope="module")
def session_url(router: Proc, log_dir) -> Iterator[str]:
    proc = start_session_router(log_dir, router.url)
    yield proc.url
    stop_processes([proc.proc])


@pytest.fixture(scope="module")
def model(router: Proc) -> str:
    return httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"]


def test_responses_on_the_router_plain_and_streamed(router: Proc, model: str) -> None:
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x")
    raw = client.responses.with_raw_response.create(
        model=model, input="Hello there", max_output_tokens=6, temperature=0, tools=TOOLS_RESPONSES
    )
    assert raw.headers["x-base-worker-id"]
    response = raw.parse()
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 6 and response.usage.input_tokens > 0
    events = list(
        client.responses.create(
            model=model, input="Hello there", max_output_tokens=6, temperature=0, tools=TOOLS_RESPONSES, stream=True
        )
    )
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1  # streamed as generated, not one finished text
    assert "".join(e.delta for e in deltas) == response.output_text  # greedy: the same text either way
    assert events[-1].response.output[0].id == events[2].item.id and events[-1].response.usage.output_tokens == 6
    include = ["message.output_text.logprobs"]
    plain = client.responses.create(
        model=model, input="Hello there", max_output_tokens=6, temperature=0, include=include
    )
    events = list(
        client.responses.create(
            model=model, input="Hello there", max_output_tokens=6, temperature=0, include=include, stream=True
        )
    )
    done = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response  # incomplete at max_output_tokens (the SDK's stream helper wants "completed")
    [part] = plain.output[0].content
    assert len(part.logprobs) == 6 and [lp.token for lp in done[0].logprobs] == [lp.token for lp in part.logprobs]
    assert final.output[0].content[0].text == part.text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", previous_response_id="resp_1")
    assert "previous_response_id" in str(e.value)


def test_messages_on_the_router_plain_and_streamed(router: Proc, model: str) -> None:
    client = anthropic.Anthropic(base_url=router.url, api_key="x")
    messages = [{"role": "user", "content": "Hello there"}]
    message = client.messages.create(
        model=model, max_tokens=6, messages=messages, extra_body={"temperature": 0}, system="Be brief."
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    with client.messages.stream(
        model=model, max_tokens=6, messages=messages, extra_body={"temperature": 0}, system="Be brief."
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == message.content[0].text and final.stop_reason == "max_tokens"
    r = httpx.post(f"{router.url}/v1/messages", json={"model": model, "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_responses_and_messages_turns_are_recorded_by_tito(session_url: str, model: str, tokenizer) -> None:
    for api in ("responses", "messages"):
        sid = httpx.post(f"{session_url}/sessions").json()["session_id"]
        outputs: list[str] = []
        if api == "responses":
            client = openai.OpenAI(base_url=f"{session_url}/sessions/{sid}/v1", api_key="x")
            items: list = [{"role": "user", "content": "Hello there"}]
            for i in range(3):
                stream = i == 1  # a streaming client gets the event sequence built from the buffered turn
                if stream:
                    events = list(client.responses.create(model=model, input=items, max_output_tokens=5, stream=True))
                    text = events[-1].response.output_text
                else:
                    text = client.responses.create(model=model, input=items, max_output_tokens=5).output_text
                outputs.append(text)
                items += [
                    {"role": "assistant", "content": [{"type": "output_text", "text": text}]},
                    {"role": "user", "content": f"more {i}"},
                ]
        else:
            aclient = anthropic.Anthropic(base_url=f"{session_url}/sessions/{sid}", api_key="x")
            messages: list = [{"role": "user", "content": "Hello there"}]
            for i in range(3):
                reply = aclient.messages.create(model=model, max_tokens=5, messages=messages)
                text = "".join(b.text for b in reply.content if b.type == "text")
                outputs.append(text)
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"more {i}"}]
            assert aclient.messages.count_tokens(model=model, messages=messages).input_tokens == 0
        snap = httpx.get(f"{session_url}/sessions/{sid}").json()
        arrays = build_training_arrays(snap)
        assert arrays.num_turns == 3, api
        [trajectory] = snap["trajectories"]
        assert len(trajectory["records"]) == 3  # each turn continued the last one: no branch
        sampled = arrays.response_ids[arrays.response_mask == 1].tolist()
        assert len(sampled) == 15  # 3 turns x max 5 tokens, none re-tokenized
        for n, text in enumerate(outputs):
            assert tokenizer.decode(sampled[5 * n : 5 * n + 5]) == text
        [entry] = [s for s in httpx.get(f"{session_url}/control/sessions").json()["sessions"] if s["session_id"] == sid]
        assert entry["total_tokens"] > 0
        assert httpx.delete(f"{session_url}/sessions/{sid}").status_code == 204
