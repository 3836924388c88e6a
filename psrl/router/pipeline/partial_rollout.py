"""Partial rollout (COMPAT section 5): when a weight sync aborts a request, keep what it produced and loop it
back as prompt + output with the remaining budget, until it ends with stop or length. Pure bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from psrl.router.errors import RouterError
from psrl.router.pipeline.context import Generation, GenerationInput

TERMINAL = ("stop", "length")


class UnexpectedFinishReason(RouterError):
    status = 500
    code = "unexpected_finish_reason"


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

    def add(self, segment: Generation, weight_version: int) -> None:
        """Append one iteration's output. Log-probs survive only if every segment carried them."""
        if self.iterations == 0:
            self.prompt_tokens = segment.prompt_tokens or len(self.original.prompt_ids)
            self.cached_tokens = segment.cached_tokens
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
            prompt_ids=original.prompt_ids + self.output_ids,
            sampling=sampling,
            request_id=f"{original.request_id}{choice}-r{self.iterations}",
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
        )


def classify(segment: Generation, state: RolloutState) -> str:
    """'done', 'loop' (aborted by a sync: loop back) or raise for any other finish reason."""
    reason = segment.finish_reason
    if reason in TERMINAL:
        return "done"
    if reason == "abort":
        if state.remaining_tokens == 0:
            return "done"  # aborted exactly at the budget: nothing is left to generate
        return "loop"
    raise UnexpectedFinishReason(f"the replica ended the request with finish_reason {reason!r}")
