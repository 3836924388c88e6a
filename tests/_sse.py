"""SSE test helper: the events in what a stream wrote (one write may carry several)."""

from __future__ import annotations

from collections.abc import Iterable


def sse_events(writes: Iterable[bytes]) -> list[str]:
    """Each event of the writes, as its text without the blank line that ends it."""
    text = b"".join(writes).decode()
    assert text.endswith("\n\n"), "a write ends on an event's end"
    return text.removesuffix("\n\n").split("\n\n")
