"""Router + replica processes, read by the official openai and anthropic clients: the OpenAI-shape details real
clients see. The reply text is what the model sampled (leading whitespace included), streamed usage comes only
when asked for and then alone on a last `choices: []` chunk (vLLM's continuous_usage_stats on every chunk),
and tool_choice is honoured or refused by name: "none" offers the template no tools, "required" and a named
function need a constraint the reference replica does not implement, so they are a 400 naming tool_choice."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_name(router) -> str:
    return httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)


def _sampled_text(choice) -> str:
    """The text of the tokens the model sampled, from their log-prob entries (the end of turn left out)."""
    return "".join(t.token for t in choice.logprobs.content if t.token not in ("<|im_end|>", "<|endoftext|>"))


def test_content_keeps_the_whitespace_the_model_sampled(client, model_name) -> None:
    """With tools offered (the hermes parser runs) a reply without a call is its sampled text verbatim, streamed
    or not: the model sampled " astersaus", the client gets " astersaus"."""
    kwargs = dict(model=model_name, messages=MESSAGES, tools=TOOLS, max_tokens=6, temperature=1.0, logprobs=True)
    found = None
    for seed in range(64):  # seeded sampling is reproducible: the first seed whose reply opens with a space
        reply = client.chat.completions.create(**kwargs, seed=seed)
        choice = reply.choices[0]
        sampled = _sampled_text(choice)
        if sampled[:1].isspace() and sampled.strip() and "<" not in sampled and not choice.message.tool_calls:
            found = seed, sampled, choice.message.content
            break
    assert found is not None, "no seed made the tiny model open its reply with whitespace"
    seed, sampled, content = found
    assert content == sampled
    chunks = list(client.chat.completions.create(**kwargs, seed=seed, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == sampled


def test_streamed_usage_only_when_asked_and_on_a_last_chunk_of_its_own(client, model_name) -> None:
    kwargs = dict(model=model_name, messages=MESSAGES, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    plain = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "length"
    asked = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert asked[-1].choices == [] and asked[-1].usage.total_tokens == full.usage.total_tokens
    assert (asked[-1].usage.prompt_tokens, asked[-1].usage.completion_tokens) == (full.usage.prompt_tokens, 5)
    assert asked[-2].choices[0].finish_reason == "length" and all(c.usage is None for c in asked[:-1])
    stats = {"include_usage": True, "continuous_usage_stats": True}
    every = list(client.chat.completions.create(**kwargs, stream=True, stream_options=stats))
    counts = [c.usage.completion_tokens for c in every]
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in every)
    assert counts[0] == 0 and counts == sorted(counts) and counts[-2:] == [5, 5]
    assert every[-1].choices == [] and every[-1].usage.total_tokens == full.usage.total_tokens


def test_completions_stream_usage_the_same_way(client, model_name) -> None:
    kwargs = dict(model=model_name, prompt="Hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = list(client.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in plain)
    asked = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in asked[:-1])


def test_tool_choice_none_offers_the_template_no_tools(client, model_name, tokenizer) -> None:
    kwargs = dict(model=model_name, messages=MESSAGES, max_tokens=2, temperature=0)
    bare = len(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES)))
    with_tools = len(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, tools=TOOLS)))
    assert client.chat.completions.create(**kwargs, tools=TOOLS).usage.prompt_tokens == with_tools
    assert client.chat.completions.create(**kwargs, tools=TOOLS, tool_choice="none").usage.prompt_tokens == bare


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_the_replica_cannot_constrain_is_a_400_naming_tool_choice(
    client, model_name, tool_choice, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model_name, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=8, stream=stream
        )
    error = e.value.body
    assert isinstance(error, dict) and error["param"] == "tool_choice"
    assert "cannot be honoured" in error["message"] and "structured output" in error["message"]


def test_bad_tool_choices_are_400s(client, model_name) -> None:
    for tool_choice, tools in [("required", None), ({"type": "function", "function": {"name": "nope"}}, TOOLS)]:
        extra = {"tools": tools} if tools else {}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model_name, messages=MESSAGES, tool_choice=tool_choice, **extra)
        assert isinstance(e.value.body, dict) and e.value.body["param"] == "tool_choice"


def test_responses_and_messages_pass_their_tool_choice_on(router, client, model_name) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_name, input="Weather?", tools=tools, tool_choice="required")
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "tool_choice"
    reply = client.responses.create(model=model_name, input="Weather?", tools=tools, tool_choice="none")
    assert reply.status in ("completed", "incomplete")

    claude = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0)
    anthropic_tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        with pytest.raises(anthropic.BadRequestError) as e2:
            claude.messages.create(
                model=model_name, max_tokens=8, messages=MESSAGES, tools=anthropic_tools, tool_choice=choice
            )
        assert "tool_choice" in str(e2.value)
