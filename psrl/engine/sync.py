"""What crosses the engine boundary during a weight sync: the pause modes and the requests a pause aborted."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class PauseMode(enum.Enum):
    """vLLM's `pause_generation(mode=...)`: what happens to the requests in flight when a sync pauses."""

    ABORT = "abort"  # end them now; each stream gets an "abort" output carrying what it produced
    WAIT = "wait"  # let them finish normally (new ones are refused meanwhile)
    KEEP = "keep"  # freeze them, KV and all, until resume


@dataclass(frozen=True)
class SyncAbortedRequest:
    """A request a sync pause aborted, as it stood at that moment (before its KV blocks were freed)."""

    request_id: str
    token_ids: tuple[int, ...]  # prompt + output so far
    num_prompt_tokens: int
    num_computed_tokens: int  # leading tokens whose K/V are in block_ids
    block_ids: tuple[int, ...]

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[self.num_prompt_tokens :]


class KvSource(enum.StrEnum):
    """Where lent-out KV comes from (a wire value: TransferKvResponse.source)."""

    PIN = "pin"  # a request's pinned KV
    PREFIX_CACHE = "prefix_cache"  # the prefix cache's full blocks


@dataclass(frozen=True)
class KvLease:
    """KV blocks lent out for a transfer: the first `num_tokens` tokens asked for have their K/V in `block_ids`
    (the last block may be partial). The blocks carry an extra reference until released."""

    num_tokens: int
    block_ids: tuple[int, ...]
    source: KvSource


@dataclass(frozen=True)
class PreloadedKV:
    """KV moved in from another engine: `block_ids` (reserved here) hold the K/V of the prompt's first
    `num_tokens` tokens, so those are not prefilled again. `token_ids`, when given, are those tokens: the engine
    refuses the KV for a request whose prompt starts otherwise."""

    block_ids: tuple[int, ...]
    num_tokens: int
    token_ids: tuple[int, ...] | None = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share (what a pin holds of a looped-back prompt)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
