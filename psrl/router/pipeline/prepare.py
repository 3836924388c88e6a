"""The prepare stage: render the chat template and tokenize, checking the prompt against the context."""

from __future__ import annotations

import asyncio
import os

from psrl.router.errors import BadRequest, PromptOverflow
from psrl.router.pipeline.context import SamplingSpec, TokenIds
from psrl.router.pipeline.parse import ChatRequest
from psrl.tokenizer import ChatTemplateError, InvalidTextError, Tokenizer

# Templating and tokenizing text longer than this runs off the event loop, so one huge prompt does not
# stall every other request the router is streaming.
_OFF_LOOP_CHARS = 16_384


_IDS_PER_READ = 256  # request ids drawn from one os.urandom call
# Ids read ahead from the OS, 128 bits each as a uuid4's hex: unguessable, so that no client can name another's
# request (a /generate may carry its own id), at one system call per _IDS_PER_READ ids. list.pop is atomic, so
# threads may draw from it at once.
_unread_ids: list[str] = []
os.register_at_fork(after_in_child=_unread_ids.clear)  # a forked child must not hand out its parent's ids


def new_request_id(prefix: str) -> str:
    while True:
        try:
            return f"{prefix}-{_unread_ids.pop()}"
        except IndexError:  # none left (another thread may have taken the last): read more
            block = os.urandom(16 * _IDS_PER_READ).hex()
            _unread_ids.extend(block[start : start + 32] for start in range(0, len(block), 32))


async def _encode(tokenizer: Tokenizer, text: str, param: str) -> TokenIds:
    try:
        if len(text) > _OFF_LOOP_CHARS:
            return await asyncio.to_thread(tokenizer.encode_ids, text)
        return tokenizer.encode_ids(text)
    except InvalidTextError as e:  # diagnosed only on failure: valid text pays nothing for the check
        raise BadRequest(f"{param}: {e}", param=param) from None


async def chat_prompt_ids(chat: ChatRequest, tokenizer: Tokenizer) -> TokenIds:
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
    return await _encode(tokenizer, text, "messages")


async def text_prompt_ids(prompt: str | TokenIds, tokenizer: Tokenizer, param: str = "prompt") -> TokenIds:
    """A completions (or /generate) prompt's ids; `param` names the field it came in."""
    if not prompt:
        raise BadRequest("prompt is empty", param=param)
    if isinstance(prompt, str):
        return await _encode(tokenizer, prompt, param)
    return prompt


def check_prompt(prompt_ids: TokenIds, sampling: SamplingSpec, max_context: int) -> None:
    """Refuse before dispatch a prompt that (with max_tokens) does not fit the context.

    The message opens with OpenAI's (and older vLLM's) context-window wording, which client libraries match,
    and ends with vLLM's "longer than the maximum model length", which PSRL matches (docs/compat.md, section 4).
    """
    prompt = len(prompt_ids)
    if not max_context:
        return
    if prompt < max_context and (sampling.max_tokens is None or prompt + sampling.max_tokens <= max_context):
        return
    completion = sampling.max_tokens or 1  # unset: at least the one token a generation must produce
    if prompt > max_context:
        detail = f"The prompt (length {prompt}) is longer than the maximum model length of {max_context}."
    else:
        detail = (
            f"The prompt (length {prompt}) plus {completion} completion token(s) is longer than the maximum "
            f"model length of {max_context}."
        )
    raise PromptOverflow(
        f"This model's maximum context length is {max_context} tokens. However, you requested "
        f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the completion). "
        f"Please reduce the length of the messages or completion. {detail}",
        param="messages" if prompt >= max_context else "max_tokens",
    )
