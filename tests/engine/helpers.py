"""Shared helpers for the reference-engine tests: small configs, random prompts, run-to-completion."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from _wait import until

from psrl.engine import (
    AllBlocksCleared,
    AsyncEngine,
    BlocksRemoved,
    CacheConfig,
    Engine,
    KvEvent,
    ModelConfig,
    RequestOutput,
    SamplingOptions,
)

VOCAB = 256
CacheState = dict[int, tuple[int | None, tuple[int, ...]]]  # block hash -> (parent hash, token ids)


def model_config(**overrides: object) -> ModelConfig:
    return ModelConfig(**{"vocab_size": VOCAB, **overrides})  # type: ignore[arg-type]


def make_engine(*, seed: int = 0, block_size: int = 16, num_blocks: int = 256, **kwargs: object) -> Engine:
    mc = kwargs.pop("model_config", None) or model_config()
    return Engine(mc, CacheConfig(block_size=block_size, num_blocks=num_blocks), seed=seed, **kwargs)  # type: ignore[arg-type]


def prompts(lengths: list[int], seed: int = 1, vocab: int = VOCAB) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def greedy(max_tokens: int = 16, **kwargs: object) -> SamplingOptions:
    return SamplingOptions(temperature=0.0, max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]


@dataclass
class Collected:
    """A request's delta outputs, concatenated."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop_token_id: int | None = None
    num_outputs: int = 0
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        assert self.finish_reason is None, f"{out.request_id} got output after finishing"
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            self.logprobs.extend(out.new_logprobs)
        if out.new_top_logprobs is not None:
            self.top_logprobs.extend(out.new_top_logprobs)
        self.finish_reason = out.finish_reason
        self.matched_stop_token_id = out.matched_stop_token_id
        self.num_outputs += 1
        self.last = out


def drain(
    engine: Engine, collected: dict[str, Collected] | None = None, max_steps: int = 10_000
) -> dict[str, Collected]:
    collected = {} if collected is None else collected
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return collected
        for out in engine.step():
            collected.setdefault(out.request_id, Collected()).add(out)
    raise AssertionError("engine did not finish")


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingOptions]]) -> dict[str, Collected]:
    for request_id, (prompt, sampling) in requests.items():
        engine.add_request(request_id, prompt, sampling)
    return drain(engine)


def apply(state: CacheState, events: list[KvEvent]) -> None:
    """What a subscriber does with the events: hash -> (parent hash, token ids)."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            state.clear()
        elif isinstance(event, BlocksRemoved):
            for h in event.block_hashes:
                del state[h]
        else:
            parent = event.parent_block_hash
            for blk in event.blocks:
                assert blk.block_hash not in state
                state[blk.block_hash] = (parent, blk.token_ids)
                parent = blk.block_hash


async def wait_idle(aengine: AsyncEngine) -> None:
    """The engine has no work left and its step thread has handed out the last outputs: the engine's own
    count of unfinished requests drops within a step, before that step's outputs reach their streams."""
    await until(lambda: step_thread_parked(aengine), "the engine has no work left")


def step_thread_parked(aengine: AsyncEngine) -> bool:
    """Whether the step thread waits on its condition variable with nothing it may run: it steps again only
    once something new wakes it."""
    with aengine._wake:
        return aengine._idle and not aengine.engine.has_unfinished_requests()


async def collect(stream) -> list[RequestOutput]:
    """Every output of an AsyncEngine stream."""
    return [out async for out in stream]
