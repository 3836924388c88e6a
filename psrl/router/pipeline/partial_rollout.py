"""Partial rollout (docs/compat.md section 9): when a weight sync aborts a request, keep what it produced and loop it
back as prompt + output with the remaining budget, until it ends with stop or length. Pure bookkeeping.

Routed experts concatenate across iterations: each segment reports the rows from where the previous one ended
(the looped-back request asks from there), so the merge is the first segment's prompt rows, then every
segment's rows, [start, P + R - 1) of the original prompt P and all R tokens. A segment that produced nothing
(refused) adds nothing. A segment without rows among segments with rows, rows of another width, or rows that
do not cover exactly that segment's positions fail the request (500 `routed_experts_mismatch`): misaligned
routing would replay the wrong experts in training.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

import numpy as np

from psrl.router.errors import RouterError
from psrl.router.pipeline.context import Generation, GenerationInput, RoutedExperts, extended

TERMINAL = ("stop", "length")


class SegmentEnd(enum.Enum):
    """What a segment's finish means for its choice."""

    DONE = "done"  # the choice is finished
    LOOP_BACK = "loop_back"  # aborted by a weight sync with budget left: it continues on another iteration


class UnexpectedFinishReason(RouterError):
    status = 500
    code = "unexpected_finish_reason"


class RoutedExpertsMismatch(RouterError):
    status = 500
    code = "routed_experts_mismatch"


@dataclass
class RolloutState:
    """Everything one choice of a request produced over its iterations (one iteration per instance it ran on).
    `index`: the choice (an n > 1 request continues each interrupted choice on its own)."""

    original: GenerationInput
    index: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    iterations: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    weight_version: int = 0  # of the instance that ran the latest iteration
    routed_blocks: list[np.ndarray] = field(default_factory=list)  # each segment's routed-expert rows
    routed_rows: int = 0
    routed_missing: bool = False  # a segment that produced tokens came without routed experts

    def add(self, segment: Generation, weight_version: int) -> None:
        """Append one iteration's output. Log-probs survive only if every segment carried them."""
        if self.iterations == 0:
            self.prompt_tokens = segment.prompt_tokens or len(self.original.prompt_ids)
            self.cached_tokens = segment.cached_tokens
        if self.original.routed_experts_start is not None and segment.output_ids:
            self._add_routed_experts(segment)
        self.iterations += 1
        self.weight_version = weight_version
        ids = segment.output_ids
        self.output_ids.extend(ids)
        self.token_versions.extend([weight_version] * len(ids))
        if ids:
            if segment.logprobs is None or self.logprobs is None:
                self.logprobs = None
            else:
                self.logprobs.extend(segment.logprobs)
            if segment.top_logprobs is None or self.top_logprobs is None:
                self.top_logprobs = None
            else:
                self.top_logprobs.extend(segment.top_logprobs)

    @property
    def routed_experts_start(self) -> int | None:
        """Where the next segment's routed experts start: after the rows so far."""
        start = self.original.routed_experts_start
        return None if start is None else start + self.routed_rows

    def _add_routed_experts(self, segment: Generation) -> None:
        where = f"request {self.original.request_id} iteration {self.iterations}"
        got = segment.routed_experts
        if got is None:
            if self.routed_blocks:
                raise RoutedExpertsMismatch(f"{where} came without routed experts; the iterations before had them")
            self.routed_missing = True
            return
        if self.routed_missing:
            raise RoutedExpertsMismatch(f"{where} has routed experts; the iterations before came without")
        start = self.routed_experts_start
        assert start is not None
        # This segment's prompt is the original's plus the output so far; it fed all of it and its own ids but
        # the last, from where the rows so far end.
        want = len(self.original.prompt_ids) + len(self.output_ids) + len(segment.output_ids) - 1 - start
        if got.prompt_start != start or got.rows.shape[0] != want:
            raise RoutedExpertsMismatch(
                f"{where}: routed experts for {got.rows.shape[0]} positions from {got.prompt_start}; "
                f"expected {want} from {start}"
            )
        if self.routed_blocks and got.rows.shape[1:] != self.routed_blocks[0].shape[1:]:
            raise RoutedExpertsMismatch(
                f"{where}: routed experts of shape [n, {got.num_layers}, {got.top_k}]; earlier iterations had "
                f"[n, {self.routed_blocks[0].shape[1]}, {self.routed_blocks[0].shape[2]}]"
            )
        self.routed_blocks.append(got.rows)
        self.routed_rows += want

    def routed_experts(self) -> RoutedExperts | None:
        """Every segment's rows merged, from the original start (None: not asked, or no replica had them)."""
        start = self.original.routed_experts_start
        if start is None or not self.routed_blocks:
            return None
        rows = self.routed_blocks[0] if len(self.routed_blocks) == 1 else np.concatenate(self.routed_blocks)
        return RoutedExperts(rows, start)

    @property
    def remaining_tokens(self) -> int | None:
        budget = self.original.sampling.max_tokens
        return None if budget is None else max(budget - len(self.output_ids), 0)

    def next_input(self) -> GenerationInput:
        """The looped-back request: the original prepared prompt plus every token produced so far, one choice
        (with the seed vLLM gives choice `index` of an n > 1 request), and the budgets less what was produced."""
        original = self.original
        seed = original.sampling.seed
        sampling = replace(
            original.sampling,
            n=1,
            max_tokens=self.remaining_tokens,
            min_tokens=max(original.sampling.min_tokens - len(self.output_ids), 0),
            seed=None if seed is None else seed + self.index,
        )
        choice = f"-{self.index}" if original.sampling.n > 1 else ""
        return replace(
            original,
            prompt_ids=extended(original.prompt_ids, self.output_ids),
            sampling=sampling,
            request_id=f"{original.request_id}{choice}-r{self.iterations}",
            routed_experts_start=self.routed_experts_start,
        )

    def merged(self, last: Generation) -> Generation:
        return Generation(
            output_ids=self.output_ids,
            logprobs=self.logprobs if self.original.sampling.logprobs is not None else None,
            top_logprobs=self.top_logprobs if self.original.sampling.logprobs else None,
            finish_reason=last.finish_reason,
            matched_stop_token_id=last.matched_stop_token_id,
            matched_stop_str=last.matched_stop_str,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            routed_experts=self.routed_experts(),
        )


def classify(segment: Generation, state: RolloutState) -> SegmentEnd:
    """How the choice goes on after `segment`; raises for a finish reason other than stop, length or abort."""
    reason = segment.finish_reason
    if reason in TERMINAL:
        return SegmentEnd.DONE
    if reason == "abort":
        if state.remaining_tokens == 0:
            return SegmentEnd.DONE  # aborted exactly at the budget: nothing is left to generate
        return SegmentEnd.LOOP_BACK
    raise UnexpectedFinishReason(f"the replica ended the request with finish_reason {reason!r}")
