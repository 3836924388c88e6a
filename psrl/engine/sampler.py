"""Sampling options and the batched sampler: greedy, temperature/top-k/top-p, raw log-probs like vLLM."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from psrl.engine.errors import InvalidSamplingError

_GREEDY_EPS = 1e-5
MAX_TEMPERATURE = 2.0  # vLLM refuses hotter sampling
MAX_N = 16384  # vLLM's default cap on parallel samples (VLLM_MAX_N_SEQUENCES)


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    max_tokens: int | None = None  # None = until max model len
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # None = none, 0 = sampled token only, k > 0 = plus top-k alternatives
    n: int = 1  # parallel samples of one prompt (AsyncEngine.generate runs each as a request of its own)
    stop: tuple[str, ...] = ()  # stop strings, matched in the decoded output text (the engine needs a tokenizer)
    include_stop_str_in_output: bool = False  # only changes the text (the router's cut), never the ids
    skip_special_tokens: bool = True  # how the output is decoded for stop strings
    # Record the routed experts of positions from this one on (MoE models only; None = record nothing). vLLM's
    # routed_experts_prompt_start: 0..prompt length; the finished output carries the rows.
    routed_experts_prompt_start: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # one stop string, as vLLM takes it
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop_token_ids", "stop"):
            if not isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        # vLLM treats temperatures below 1e-5 as greedy too (dividing by them only overflows).
        return self.temperature < _GREEDY_EPS

    def for_choice(self, index: int) -> SamplingOptions:
        """The options of choice `index` of an n > 1 request, as vLLM's parallel sampling derives them: one
        sample each, and a seeded request's choices seeded `seed + index` (so they differ, reproducibly)."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)

    def validate(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidSamplingError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidSamplingError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidSamplingError(f"max_tokens must be >= 1 or None, got {self.max_tokens!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidSamplingError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidSamplingError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise InvalidSamplingError(f"logprobs must be None or >= 0, got {self.logprobs!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidSamplingError(f"n must be in [1, {MAX_N}], got {self.n!r}")
        if self.n > 1 and self.greedy:  # vLLM's rule: the choices could only be copies of each other
            raise InvalidSamplingError(f"n must be 1 when using greedy sampling, got {self.n}")
        start = self.routed_experts_prompt_start
        if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
            raise InvalidSamplingError(f"routed_experts_prompt_start must be None or >= 0, got {start!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSamplingError(f"stop cannot contain an empty string (or a non-string), got {self.stop}")


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # raw log-prob of each sampled token (None where not asked)
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Samples one token per row. Each row's draw depends only on its own logits and generator.

    Seeded requests draw one uniform from their own generator per token, so what they sample does not
    depend on what else is in the batch; unseeded rows draw from the engine's generator.
    """

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator(device="cpu").manual_seed(int(seed))

    def sample(
        self,
        logits: torch.Tensor,
        options: list[SamplingOptions],
        generators: list[torch.Generator | None],
    ) -> SampleResult:
        logits = logits.float()
        n, vocab = logits.shape
        tokens = torch.empty(n, dtype=torch.long, device=logits.device)
        random_rows = [i for i, o in enumerate(options) if not o.greedy]
        greedy_rows = [i for i, o in enumerate(options) if o.greedy]
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=logits.device)
            tokens[idx] = logits[idx].argmax(dim=-1)
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            opts = [options[i] for i in random_rows]
            uniforms = self._uniforms([generators[i] for i in random_rows])
            tokens[idx] = _sample_filtered(logits[idx], opts, uniforms.to(logits.device))
        token_list = tokens.tolist()

        want = [o.logprobs is not None for o in options]
        logprobs: list[float | None] = [None] * n
        top: list[list[tuple[int, float]] | None] = [None] * n
        if any(want):
            # vLLM's default "raw_logprobs": log_softmax of the model's logits before any processing.
            lp = torch.log_softmax(logits, dim=-1)
            chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
            kmax = min(max(o.logprobs or 0 for o in options), vocab)
            top_vals = top_ids = None
            if kmax > 0:
                tv, ti = lp.topk(kmax, dim=-1)
                top_vals, top_ids = tv.tolist(), ti.tolist()
            for i, o in enumerate(options):
                if o.logprobs is None:
                    continue
                logprobs[i] = chosen[i]
                if o.logprobs > 0 and top_ids is not None and top_vals is not None:
                    k = min(o.logprobs, vocab)
                    top[i] = list(zip(top_ids[i][:k], top_vals[i][:k]))
        return SampleResult(token_ids=token_list, logprobs=logprobs, top_logprobs=top)

    def _uniforms(self, generators: list[torch.Generator | None]) -> torch.Tensor:
        u = torch.empty(len(generators), dtype=torch.float64)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            u[shared] = torch.rand(len(shared), dtype=torch.float64, generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand(1, dtype=torch.float64, generator=g)
        return u


def _sample_filtered(logits: torch.Tensor, opts: list[SamplingOptions], uniforms: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, then top-p (vLLM's order); then inverse-CDF sampling with `uniforms`."""
    vocab = logits.shape[1]
    temps = torch.tensor([o.temperature for o in opts], dtype=logits.dtype, device=logits.device)
    logits = logits / temps.unsqueeze(1)
    ks = [o.top_k if 0 < o.top_k < vocab else vocab for o in opts]
    ps = [o.top_p for o in opts]
    if any(k < vocab for k in ks) or any(p < 1.0 for p in ps):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
        k_t = torch.tensor(ks, device=logits.device).unsqueeze(1)
        kth = sorted_logits.gather(1, k_t - 1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        p_t = torch.tensor(ps, dtype=torch.float64, device=logits.device).unsqueeze(1)
        sorted_probs = torch.softmax(sorted_logits.double(), dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep a token while the mass before it is still below top_p (the first is always kept).
        drop = (mass_before >= p_t) & (p_t < 1.0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
    probs = torch.softmax(logits.double(), dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = uniforms.unsqueeze(1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    # Rounding can only ever land past the last kept token; fall back to the most likely one then.
    picked = torch.where(probs.gather(1, picked) > 0, picked, probs.argmax(dim=-1, keepdim=True))
    return picked.squeeze(1)
