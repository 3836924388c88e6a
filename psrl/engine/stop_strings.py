"""Stop strings as vLLM checks them: a request's output is decoded as it grows, and the request stops at the
token whose text completes one of its stop strings (that token is kept; cutting the text is the router's job).
"""

from __future__ import annotations

from collections.abc import Sequence

from psrl.tokenizer import IncrementalDecoder, Tokenizer


class StopStringMatcher:
    """Finds the first stop string in a text that arrives in pieces.

    Keeps only the tail a match could still start in (the longest stop string less one character): each piece
    costs its own length plus that, never the whole output.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(stops):
            raise ValueError(f"stop strings must be non-empty, got {list(stops)!r}")
        self.stops = tuple(stops)
        self._keep = max(len(s) for s in self.stops) - 1
        self._tail = ""

    def feed(self, piece: str) -> str | None:
        """The stop string `piece` completes, or None. Of several, the one that ends first in the text, ties
        broken by list order (vLLM's rule, so a piece of many characters matches like one at a time)."""
        if not piece:
            return None
        text = self._tail + piece
        new_from = len(self._tail)
        best: str | None = None
        best_end = len(text) + 1
        for stop in self.stops:
            # A match has to end inside the new piece: the text before it was searched when it arrived.
            at = text.find(stop, max(0, new_from - len(stop) + 1))
            if at != -1 and at + len(stop) < best_end:
                best, best_end = stop, at + len(stop)
        self._tail = text[-self._keep :] if self._keep else ""
        return best


class StopStringDetector:
    """One request's check: its output ids, decoded incrementally (an incomplete UTF-8 sequence is held back
    until the ids completing it arrive), fed to a StopStringMatcher."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], *, skip_special_tokens: bool) -> None:
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self._matcher = StopStringMatcher(stops)

    def push(self, token_id: int) -> str | None:
        """Add the next output token; the stop string its text completes, or None."""
        return self._matcher.feed(self._decoder.push([token_id]))
