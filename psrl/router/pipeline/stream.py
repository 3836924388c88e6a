"""Stage 5 for streaming clients: turn a worker call's deltas into SSE events, whatever the API's spelling.

Each API supplies one function that spells a choice (text delta, token delta or None at the end, finish reason);
the framing, the usage event, the error event and `[DONE]` are shared.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from psrl.router.errors import RouterError
from psrl.router.pipeline import respond as R
from psrl.router.pipeline.execute import Delta, WorkerCall
from psrl.tokenizer import IncrementalDecoder

logger = logging.getLogger(__name__)

# (new text, the token delta or None for the closing event, finish reason or None) -> a choice, or None to skip
ChoiceFn = Callable[[str, Delta | None, str | None], dict[str, Any] | None]


async def sse_stream(
    call: WorkerCall,
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
        async for d in call.deltas():
            ch = choice(decoder.push(d.token_ids), d, None)
            if ch is not None:
                yield event(ch)
        closing = choice(decoder.flush(), None, call.result.finish_reason)
        assert closing is not None
        yield event(closing)
        if include_usage:
            yield R.sse({**envelope, "choices": [], "usage": R.usage(call.result)})
    except RouterError as e:  # headers are sent: the error travels as an SSE event
        logger.warning("stream %s failed: %s", envelope.get("id"), e.message)
        yield R.sse(e.body())
    finally:
        call.cancel()
    yield R.SSE_DONE
