"""A choice's text as the text APIs return it: decoded and cut at its stop string, whole (`output_text`) or as
its tokens stream (`StreamedText`).

vLLM's rule: the replica stops at the token that completes a stop string and names it (`matched_stop_str`);
that token may decode to more text than the stop string needs, so the ids (kept whole by every token-level
output: the training data is what the model sampled) decode past it. The text ends where the stop string starts
(where it ends with `include_stop_str_in_output`). Only a stop string completing after the first `min_tokens`
tokens counts, as vLLM checks none before. Streamed, text that may still become a stop string is held back
until it cannot, so the pieces add up to `output_text`. After a partial-rollout loop-back the replica sees only
the continuation's output, so a stop string begun before the abort is watched for here (`StopAcrossLoopBack`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from psrl.router.pipeline.context import Generation, SamplingSpec
from psrl.tokenizer import IncrementalDecoder, Tokenizer


def partial_match_start(text: str, marker: str) -> int:
    """Where the longest suffix of `text` that could be the start of `marker` begins (len(text) if none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return len(text) - n
    return len(text)


def stop_cut(text: str, stop: str, include: bool, search_from: int = 0) -> int | None:
    """Where `text` ends when it stopped at `stop` (None when `stop` is not in it, past `search_from`)."""
    at = text.find(stop, search_from)
    if at < 0:
        return None
    return at + len(stop) if include else at


def stop_search_start(tok: Tokenizer, gen: Generation, sampling: SamplingSpec) -> int:
    """The first position the matched stop string may start at: it must complete after the text of the first
    `min_tokens` tokens (an earlier occurrence did not stop the replica)."""
    if not sampling.min_tokens or gen.matched_stop_str is None:
        return 0
    boundary = len(tok.decode(gen.output_ids[: sampling.min_tokens], sampling.skip_special_tokens))
    return max(0, boundary - len(gen.matched_stop_str) + 1)


def output_text(tok: Tokenizer, gen: Generation, sampling: SamplingSpec) -> str:
    """A finished choice's text."""
    text = tok.decode(gen.output_ids, sampling.skip_special_tokens)
    if gen.matched_stop_str is None:
        return text
    cut = stop_cut(
        text, gen.matched_stop_str, sampling.include_stop_str_in_output, stop_search_start(tok, gen, sampling)
    )
    return text if cut is None else text[:cut]


class StopHoldBack:
    """Passes streamed text on once no stop string can begin in it.

    Without `include` (the stop string is cut off) what is held is the earliest start of a stop string or of a
    suffix that could become one; with `include` only what follows a complete stop string (which is returned).
    Once a stop string is complete nothing more is passed on until `finish`: the replica stops there (a
    complete one it did not stop at, inside the first `min_tokens` tokens, holds the rest back until the end).
    """

    def __init__(self, stops: Sequence[str], include: bool) -> None:
        self._stops = stops
        self._include = include
        self._context = max(len(s) for s in stops) - 1
        self._tail = ""  # the last `_context` characters sent: with `include`, a stop string may start there
        self._sent: list[str] = []
        self._sent_len = 0
        self._held = ""
        self._complete = False  # a whole stop string has arrived

    def push(self, text: str) -> str:
        if not text:
            return ""
        buf = self._held + text
        keep = 0 if self._complete else self._keep(buf)
        out, self._held = buf[:keep], buf[keep:]
        if out:
            self._sent.append(out)
            self._sent_len += len(out)
            if self._context:
                self._tail = (self._tail + out)[-self._context :]
        return out

    def _keep(self, buf: str) -> int:
        """How much of `buf` (the held text plus the new) can go out now."""
        if self._include:
            window = self._tail + buf
            ends = [at + len(s) for s in self._stops if (at := window.find(s)) >= 0]
            if not ends:
                return len(buf)
            self._complete = True
            return max(min(ends) - len(self._tail), 0)
        keep = len(buf)
        for s in self._stops:
            at = buf.find(s)
            if at >= 0:
                self._complete = True
                keep = min(keep, at)
            else:
                keep = min(keep, partial_match_start(buf, s))
        return keep

    def finish(self, text: str, matched: str | None, search_from: int) -> str:
        """The rest of the text once the choice ended (`matched`: the stop string it stopped at)."""
        buf, self._held = self._held + text, ""
        if matched is None:
            return buf
        full = "".join(self._sent) + buf
        cut = stop_cut(full, matched, self._include, search_from)
        if cut is None:
            return buf
        return full[self._sent_len : cut]


class StreamedText:
    """One choice's text as its tokens stream: `push` each delta's ids, `finish` with the finished choice. The
    pieces add up to `output_text` of the same ids. Without stop strings `push` is the decoder's own."""

    def __init__(self, tok: Tokenizer, sampling: SamplingSpec) -> None:
        self._tok = tok
        self._sampling = sampling
        self._decoder = IncrementalDecoder(tok, sampling.skip_special_tokens)
        self._held = StopHoldBack(sampling.stop, sampling.include_stop_str_in_output) if sampling.stop else None
        self.push: Callable[[Sequence[int]], str] = self._decoder.push if self._held is None else self._push_held

    def _push_held(self, ids: Sequence[int]) -> str:
        assert self._held is not None
        return self._held.push(self._decoder.push(ids))

    def finish(self, gen: Generation) -> str:
        text = self._decoder.flush()
        if self._held is None:
            return text
        return self._held.finish(text, gen.matched_stop_str, stop_search_start(self._tok, gen, self._sampling))


class StopAcrossLoopBack:
    """A stop string a loop-back hides from the replica: begun in the output so far and completed in the
    continuation, whose replica checks only the continuation's own output. `feed` the continuation's ids: once
    one completes such a stop string, how many of them to keep and the stop string (vLLM would have stopped at
    that id); `done` once none can, so it stops looking."""

    def __init__(self, decoder: IncrementalDecoder, pending: str, sampling: SamplingSpec, produced: int) -> None:
        self._decoder = decoder
        self._tail = pending  # the text from the earliest place a stop string may have begun
        self._pending = len(pending)  # the tail's part from before the loop-back
        self._stops = sampling.stop
        self._min_tokens = sampling.min_tokens
        self._produced = produced
        self.done = False

    @classmethod
    def after(cls, tok: Tokenizer, sampling: SamplingSpec, output_ids: list[int]) -> StopAcrossLoopBack | None:
        """The watch for a continuation of `output_ids`; None when their text ends in no part of a stop string."""
        decoder = IncrementalDecoder(tok, sampling.skip_special_tokens)
        text = decoder.push(output_ids)
        start = min(partial_match_start(text, s) for s in sampling.stop)
        if start == len(text):
            return None
        return cls(decoder, text[start:], sampling, len(output_ids))

    def feed(self, ids: list[int]) -> tuple[int, str] | None:
        for k, token_id in enumerate(ids):
            new = self._decoder.push([token_id])
            self._tail += new
            self._produced += 1
            if self._produced > self._min_tokens and new:  # vLLM checks text completing after min_tokens
                ends = []
                for s in self._stops:
                    at = self._tail.find(s, max(0, len(self._tail) - len(new) - len(s) + 1))
                    if 0 <= at < self._pending:
                        ends.append((at + len(s), s))
                if ends:
                    return k + 1, min(ends, key=lambda e: e[0])[1]  # the first to complete; ties: list order
            if min(partial_match_start(self._tail, s) for s in self._stops) >= self._pending:
                self.done = True  # what could still become a stop string begins after the loop-back
                return None
        return None
