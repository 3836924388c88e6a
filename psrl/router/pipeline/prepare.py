"""Stage 2, prepare: render the chat template and tokenize, checking the prompt against the context."""

from __future__ import annotations

import asyncio
import uuid

from psrl.router.errors import BadRequest, PromptOverflow
from psrl.router.pipeline.context import SamplingSpec
from psrl.router.pipeline.parse import ChatRequest
from psrl.tokenizer import ChatTemplateError, Tokenizer

# Templating and tokenizing text longer than this runs off the event loop, so one huge prompt does not
# stall every other request the router is streaming.
_OFF_LOOP_CHARS = 16_384


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    if len(text) > _OFF_LOOP_CHARS:
        return await asyncio.to_thread(tokenizer.encode, text)
    return tokenizer.encode(text)


async def chat_prompt_ids(chat: ChatRequest, tokenizer: Tokenizer) -> list[int]:
    def render() -> str:
        return tokenizer.apply_chat_template(
            chat.messages,
            add_generation_prompt=chat.add_generation_prompt,
            tools=chat.tools,
            **chat.template_kwargs,
        )

    try:
        size = sum(len(m.get("content") or "") for m in chat.messages)
        text = await asyncio.to_thread(render) if size > _OFF_LOOP_CHARS else render()
    except ChatTemplateError as e:
        raise BadRequest(f"chat template rejected the messages: {e}", param="messages") from e
    return await _encode(tokenizer, text)


async def text_prompt_ids(prompt: str | list[int], tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty", param="prompt")
        return await _encode(tokenizer, prompt)
    if not prompt:
        raise BadRequest("prompt is empty", param="prompt")
    return prompt


def check_prompt(prompt_ids: list[int], sampling: SamplingSpec, max_context: int) -> None:
    """Refuse before dispatch what the replica would refuse anyway, with vLLM's wording."""
    if max_context and len(prompt_ids) >= max_context:
        raise PromptOverflow(
            f"The prompt (length {len(prompt_ids)}) is longer than the maximum model length of {max_context}.",
            param="messages",
        )
    if max_context and sampling.max_tokens is not None and len(prompt_ids) + sampling.max_tokens > max_context:
        raise BadRequest(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{len(prompt_ids) + sampling.max_tokens} tokens ({len(prompt_ids)} in the prompt, "
            f"{sampling.max_tokens} for the completion). Reduce the prompt or max_tokens.",
            param="max_tokens",
        )
