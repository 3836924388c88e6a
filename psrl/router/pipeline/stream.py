"""Stage 5 for streaming clients: turn a worker call's deltas into SSE events, whatever the API's spelling.

Each API supplies one function that spells a choice (text delta, token delta or None at the end, finish reason);
the framing, the usage event, the error event and `[DONE]` are shared.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from psrl.router.errors import RouterError
from psrl.router.pipeline import respond as R
from psrl.router.pipeline.context import Generation
from psrl.router.pipeline.execute import Delta
from psrl.tokenizer import IncrementalDecoder

logger = logging.getLogger(__name__)

# (new text, the token delta or None for the closing event, finish reason or None) -> a choice, or None to skip
ChoiceFn = Callable[[str, Delta | None, str | None], dict[str, Any] | None]


class DeltaSource(Protocol):
    """A started generation: its token deltas (which clean up after themselves) and, after them, the result."""

    def deltas(self) -> AsyncIterator[Delta]: ...

    @property
    def result(self) -> Generation: ...


async def sse_stream(
    source: DeltaSource,
    decoder: IncrementalDecoder,
    *,
    envelope: dict[str, Any],
    choice: ChoiceFn,
    opening: dict[str, Any] | None = None,
    include_usage: bool = False,
) -> AsyncIterator[bytes]:
    def event(ch: dict[str, Any]) -> bytes:
        return R.sse({**envelope, "choices": [ch]})

    try:
        if opening is not None:
            yield event(opening)
        async for d in source.deltas():
            ch = choice(decoder.push(d.token_ids), d, None)
            if ch is not None:
                yield event(ch)
        result = source.result
        closing = choice(decoder.flush(), None, result.finish_reason)
        assert closing is not None
        yield event(closing)
        if include_usage:
            yield R.sse({**envelope, "choices": [], "usage": R.usage(result)})
    except RouterError as e:  # headers are sent: the error travels as an SSE event
        logger.warning("stream %s failed: %s", envelope.get("id"), e.message)
        yield R.sse(e.body())
    yield R.SSE_DONE
