"""Sampling options, filtering, seeding and raw log-probs (unit level)."""

from __future__ import annotations

import pytest
import torch

from psrl.engine import InvalidSamplingError, SamplingOptions
from psrl.engine.sampler import Sampler


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop_token_ids": (1, -3)}, "stop_token_ids"),
    ],
)
def test_invalid_options_raise_value_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidSamplingError, match=match):
        SamplingOptions(**kwargs).validate()
    assert issubclass(InvalidSamplingError, ValueError)


def test_stop_token_ids_become_a_tuple() -> None:
    assert SamplingOptions(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # type: ignore[arg-type]


def _logits(n: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_one_pick_the_argmax() -> None:
    logits = _logits()
    sampler = Sampler(seed=0)
    greedy = sampler.sample(logits, [SamplingOptions(temperature=0.0)] * 6, [None] * 6)
    top1 = sampler.sample(logits, [SamplingOptions(temperature=1.3, top_k=1)] * 6, [None] * 6)
    assert greedy.token_ids == logits.argmax(-1).tolist() == top1.token_ids


def test_tiny_top_p_picks_the_argmax() -> None:
    logits = _logits()
    out = Sampler(seed=0).sample(logits, [SamplingOptions(top_p=1e-6)] * 6, [None] * 6)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_only_samples_among_the_k_best() -> None:
    logits = _logits(n=1, vocab=100)
    allowed = set(logits[0].topk(5).indices.tolist())
    sampler = Sampler(seed=3)
    seen = {sampler.sample(logits, [SamplingOptions(top_k=5)], [None]).token_ids[0] for _ in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    logits = _logits(n=4)
    opts = SamplingOptions(temperature=1.0, seed=42)

    def draw(batch_logits: torch.Tensor, others: int) -> list[int]:
        gen = torch.Generator().manual_seed(42)
        sampler = Sampler(seed=others)
        tokens = []
        for _ in range(20):
            rows = [opts] + [SamplingOptions()] * others
            res = sampler.sample(batch_logits[: 1 + others], rows, [gen] + [None] * others)
            tokens.append(res.token_ids[0])
        return tokens

    assert draw(logits, 0) == draw(logits, 3)


def test_raw_logprobs_ignore_temperature_and_top_k_lists_are_sorted() -> None:
    logits = _logits(n=3)
    opts = [
        SamplingOptions(temperature=0.0, logprobs=4),
        SamplingOptions(temperature=0.5, logprobs=0),
        SamplingOptions(),
    ]
    res = Sampler(seed=0).sample(logits, opts, [None] * 3)
    lp = torch.log_softmax(logits, -1)
    assert res.logprobs[0] == pytest.approx(lp[0, res.token_ids[0]].item(), abs=1e-6)
    assert res.logprobs[1] == pytest.approx(lp[1, res.token_ids[1]].item(), abs=1e-6)
    assert res.logprobs[2] is None and res.top_logprobs[2] is None and res.top_logprobs[1] is None
    top = res.top_logprobs[0]
    assert top is not None and len(top) == 4
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert top[0][0] == res.token_ids[0]
