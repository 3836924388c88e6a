"""n > 1 in the router (execute, dispatch): one Generate's interleaved frames accumulated per choice; a weight-sync
abort continues each unfinished choice on its own as an n = 1 request (its prompt plus its output, vLLM's seed
for that choice), a refusal retries the request whole, and n = 1 loops back as before; a stop string begun before
a loop-back ends the continuation where vLLM would have stopped. The replica is scripted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from psrl.router.dispatch import Dispatcher, Rollout
from psrl.router.errors import WorkerStreamFailed
from psrl.router.metadata import RoutingMeta
from psrl.router.pipeline.context import GenerationInput, SamplingSpec
from psrl.router.pipeline.execute import Delta, WorkerCall
from psrl.router.pipeline.stops import StopAcrossLoopBack, output_text
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer

PROMPT = [11, 12, 13]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_folder(build_tiny_tokenizer(Path(tmp_path_factory.mktemp("tok"))))


def chunk(ids: list[int], index: int = 0) -> pb.GenerateResponse:
    lps = pb.OutputLogProbs(token_logprobs=[-0.5] * len(ids), token_ids=ids)
    return pb.GenerateResponse(
        chunk=pb.GenerateStreamChunk(token_ids=ids, prompt_tokens=3, index=index, output_logprobs=lps)
    )


def complete(ids: list[int], reason: str, index: int = 0, stop: str | None = None) -> pb.GenerateResponse:
    lps = pb.OutputLogProbs(token_logprobs=[-0.5] * len(ids), token_ids=ids)
    frame = pb.GenerateComplete(output_ids=ids, finish_reason=reason, prompt_tokens=3, index=index, output_logprobs=lps)
    if stop is not None:
        frame.matched_stop_str = stop
    return pb.GenerateResponse(complete=frame)


class _Call:
    """A Generate RPC answering scripted frames, then None (the end)."""

    def __init__(self, frames: list[pb.GenerateResponse]) -> None:
        self._frames = list(frames)

    async def read(self) -> Any:
        return self._frames.pop(0) if self._frames else None

    def cancel(self) -> None:
        self._frames = []

    def release(self, grace_s: float) -> None:
        self._frames = []

    def done(self) -> bool:
        return not self._frames

    async def initial_metadata(self) -> tuple:
        return ()

    async def wait_for_connection(self) -> None:
        return None


@dataclass
class _Replica:
    """Answers each GenerateRequest with `script(request)`; the instance's weight version can move on."""

    script: Callable[[pb.GenerateRequest], list[pb.GenerateResponse]]
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    instance: Any = field(
        default_factory=lambda: SimpleNamespace(
            worker=SimpleNamespace(target="t", max_context_length=0),
            id=SimpleNamespace(base_worker_id="0", dp_rank=0),
            weight_version=0,
        )
    )

    def generate(self, target: str, wire: bytes, timeout_s: float | None, metadata=()) -> _Call:
        request = pb.GenerateRequest.FromString(wire)
        self.requests.append(request)
        return _Call(self.script(request))


class _Dispatcher:
    """What a Rollout asks of the Dispatcher, over one scripted instance."""

    partial_rollout = True
    max_iterations = 5
    metrics = SimpleNamespace(kv_transfer=lambda n: None)

    def __init__(self, replica: _Replica, tok: Tokenizer | None = None) -> None:
        self.replica = replica
        self.released = 0

        async def tokenizer(model: str) -> Tokenizer:
            assert tok is not None
            return tok

        self.tokenizers = SimpleNamespace(get=tokenizer)

    async def acquire(self, model: str, meta: RoutingMeta, request: Any, *, grpc_only: bool = False) -> Any:
        return SimpleNamespace(instance=self.replica.instance, pinned_version=0, meta=meta, release_handoff=None)

    def finish(self, ticket: Any, error: Any) -> None:
        self.released += 1

    def kv_transfer_params(self, source: Any, gen: GenerationInput) -> str:
        return ""

    async def start_call(self, ticket: Any, gen: GenerationInput) -> WorkerCall:
        call = WorkerCall(self.replica, ticket.instance, gen, None)  # type: ignore[arg-type]
        await call.start()
        return call


async def _run(
    replica: _Replica,
    sampling: SamplingSpec,
    stream: bool = True,
    tok: Tokenizer | None = None,
    meta: RoutingMeta | None = None,
) -> tuple[Rollout, list[Delta]]:
    dispatcher = _Dispatcher(replica, tok)
    gen = GenerationInput("req", PROMPT, sampling, stream)
    rollout = Rollout(dispatcher, "m", meta or RoutingMeta(), gen)  # type: ignore[arg-type]
    await rollout.start()
    deltas = [d async for d in rollout.deltas()]
    assert dispatcher.released == len(replica.requests)  # every ticket released once
    return rollout, deltas


def _per_choice(deltas: list[Delta], n: int) -> tuple[list[list[int]], list[int]]:
    ids: list[list[int]] = [[] for _ in range(n)]
    ends = []
    for d in deltas:
        if d.finished is None:
            assert not ends.count(d.index), "no token of a choice after its end"
            ids[d.index] += d.token_ids
        else:
            ends.append(d.index)
    return ids, ends


async def test_interleaved_streamed_choices_accumulate_per_index() -> None:
    frames = [
        chunk([1], 0),
        chunk([5], 1),
        chunk([2], 0),
        complete([2], "length", 0),
        chunk([6], 1),
        complete([6], "stop", 1, stop="</a>"),
    ]
    rollout, deltas = await _run(_Replica(lambda r: frames), SamplingSpec(n=2, max_tokens=2, logprobs=0))
    ids, ends = _per_choice(deltas, 2)
    assert ids == [[1, 2], [5, 6]] and ends == [0, 1]  # choice 0 ends when its complete frame comes
    first, second = rollout.results
    assert first.output_ids == [1, 2] and first.finish_reason == "length" and first.logprobs == [-0.5, -0.5]
    assert second.output_ids == [5, 6] and second.finish_reason == "stop" and second.matched_stop_str == "</a>"
    assert second.stop_reason == "</a>" and first.stop_reason is None


async def test_non_streamed_choices_come_as_one_complete_frame_each() -> None:
    frames = [complete([1, 2, 3], "length", 0), complete([5], "stop", 1)]
    rollout, _ = await _run(_Replica(lambda r: frames), SamplingSpec(n=2, max_tokens=3), stream=False)
    assert [g.output_ids for g in rollout.results] == [[1, 2, 3], [5]]


async def test_an_interrupted_choice_continues_on_its_own() -> None:
    def script(request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        if request.request_id == "req":  # both choices aborted by a sync, choice 0 after 2 tokens, 1 after 1
            return [chunk([1], 0), chunk([5], 1), chunk([2], 0), complete([], "abort", 0), complete([], "abort", 1)]
        replica.instance.weight_version = 1
        if list(request.tokenized.input_ids) == [*PROMPT, 1, 2]:
            return [chunk([3], 0), chunk([4], 0), complete([4], "length", 0)]
        assert list(request.tokenized.input_ids) == [*PROMPT, 5]
        return [chunk([6], 0), chunk([7], 0), complete([7], "stop", 0, stop="x")]

    replica = _Replica(script)
    rollout, deltas = await _run(replica, SamplingSpec(n=2, max_tokens=4, seed=10, min_tokens=2))
    ids, ends = _per_choice(deltas, 2)
    assert ids == [[1, 2, 3, 4], [5, 6, 7]] and sorted(ends) == [0, 1]
    first, second = rollout.results
    assert first.output_ids == [1, 2, 3, 4] and first.finish_reason == "length"
    assert second.output_ids == [5, 6, 7] and second.matched_stop_str == "x"
    assert [s.token_versions for s in rollout.states] == [[0, 0, 1, 1], [0, 1, 1]]
    continued = {r.request_id: r.sampling_params for r in replica.requests[1:]}
    assert sorted(continued) == ["req-0-r1", "req-1-r1"]
    zero, one = continued["req-0-r1"], continued["req-1-r1"]
    assert zero.n == one.n == 1
    assert (zero.seed, one.seed) == (10, 11)  # vLLM seeds choice i with seed + i
    assert (zero.max_tokens, one.max_tokens) == (2, 3) and (zero.min_tokens, one.min_tokens) == (0, 1)


async def test_a_refused_request_is_retried_whole() -> None:
    def script(request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        if request.request_id == "req":
            return [complete([], "abort", 0)]  # admission closed: one empty abort frame, whatever n
        return [complete([1], "length", 0), complete([2], "length", 1)]

    replica = _Replica(script)
    rollout, _ = await _run(replica, SamplingSpec(n=2, max_tokens=1), stream=False)
    assert [g.output_ids for g in rollout.results] == [[1], [2]]
    retry = replica.requests[1]
    assert retry.request_id == "req-r1" and retry.sampling_params.n == 2


async def test_one_choice_loops_back_as_before() -> None:
    def script(request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        if request.request_id == "req":
            return [chunk([1]), chunk([2]), complete([], "abort")]
        return [chunk([3]), complete([3], "length")]

    replica = _Replica(script)
    _, deltas = await _run(replica, SamplingSpec(max_tokens=3, seed=4, min_tokens=3))
    assert [d.token_ids for d in deltas if d.finished is None] == [[1], [2], [3]]
    assert deltas[-1].finished is not None and deltas[-1].finished.output_ids == [1, 2, 3]
    loop = replica.requests[1]
    assert loop.request_id == "req-r1" and list(loop.tokenized.input_ids) == [*PROMPT, 1, 2]
    assert loop.sampling_params.seed == 4 and loop.sampling_params.max_tokens == 1
    assert loop.sampling_params.min_tokens == 1  # the budget left, not the whole again


async def test_a_failed_continuation_fails_the_request() -> None:
    def script(request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        if request.request_id == "req":
            return [chunk([1], 0), chunk([5], 1), complete([], "abort", 0), complete([], "abort", 1)]
        return [chunk([2], 0)]  # dies without a complete frame

    with pytest.raises(WorkerStreamFailed):
        await _run(_Replica(script), SamplingSpec(n=2, max_tokens=4))


PSRL = RoutingMeta(request_id=1, prompt_id=1)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_psrl_request_whose_replica_dies_mid_decode_continues_with_its_tokens(stream: bool) -> None:
    def script(request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        if request.request_id == "req":
            return [chunk([1]), chunk([2])]  # then the stream breaks: no complete frame
        return [chunk([3]), complete([3], "length")]

    replica = _Replica(script)
    rollout, _ = await _run(replica, SamplingSpec(max_tokens=3, logprobs=0), stream=stream, meta=PSRL)
    [gen] = rollout.results
    assert gen.output_ids == [1, 2, 3] and gen.finish_reason == "length" and gen.logprobs == [-0.5] * 3
    again = replica.requests[1]
    assert list(again.tokenized.input_ids) == [*PROMPT, 1, 2] and again.sampling_params.max_tokens == 1
    assert not again.kv_transfer_params_json  # the failed replica's KV is gone: recomputed


async def test_the_choices_of_a_psrl_request_whose_replica_dies_each_continue() -> None:
    def script(request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        if request.request_id == "req":
            return [chunk([1], 0), chunk([5], 1), complete([5], "stop", 1)]  # choice 0 is cut off
        assert list(request.tokenized.input_ids) == [*PROMPT, 1]
        return [chunk([2], 0), complete([2], "length", 0)]

    rollout, _ = await _run(_Replica(script), SamplingSpec(n=2, max_tokens=2), meta=PSRL)
    assert [g.output_ids for g in rollout.results] == [[1, 2], [5]]
    assert [g.finish_reason for g in rollout.results] == ["length", "stop"]


async def test_a_replica_failure_still_fails_a_request_without_psrl_headers() -> None:
    with pytest.raises(WorkerStreamFailed, match="without a complete frame"):
        await _run(_Replica(lambda r: [chunk([1])]), SamplingSpec(max_tokens=3))


async def test_a_frame_for_a_choice_that_does_not_exist_is_a_stream_failure() -> None:
    with pytest.raises(WorkerStreamFailed, match="choice 2"):
        await _run(_Replica(lambda r: [chunk([1], 2)]), SamplingSpec(n=2, max_tokens=4))


@pytest.mark.parametrize("stream", [True, False])
async def test_a_stop_string_begun_before_a_loop_back_ends_the_continuation(tok: Tokenizer, stream: bool) -> None:
    before, after = tok.encode("The answer is 4</ans"), tok.encode("wer> and then more text")
    merged = before + after
    completing = next(k for k in range(1, len(after) + 1) if "</answer>" in tok.decode(before + after[:k]))

    def script(request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        if request.request_id == "req":
            return [*(chunk([t]) for t in before), complete([], "abort")]
        # the replica sees only its own output, so it runs on past the stop string
        frames = [chunk([t]) for t in after] if stream else []
        return [*frames, complete(after if not stream else after[-1:], "length")]

    sampling = SamplingSpec(max_tokens=len(merged) + 5, stop=["</answer>"], logprobs=0)
    rollout, deltas = await _run(_Replica(script), sampling, stream=stream, tok=tok)
    [gen] = rollout.results
    assert gen.output_ids == merged[: len(before) + completing]  # up to the id completing it, as vLLM keeps
    assert gen.finish_reason == "stop" and gen.matched_stop_str == "</answer>"
    assert gen.logprobs is not None and len(gen.logprobs) == len(gen.output_ids)
    assert [t for d in deltas if d.finished is None for t in d.token_ids] == gen.output_ids
    assert output_text(tok, gen, sampling) == "The answer is 4"


def test_the_watch_looks_only_while_a_stop_string_may_span_the_loop_back(tok: Tokenizer) -> None:
    sampling = SamplingSpec(stop=["</answer>"])
    assert StopAcrossLoopBack.after(tok, sampling, tok.encode("nothing pending")) is None
    watch = StopAcrossLoopBack.after(tok, sampling, tok.encode("pending </an"))
    assert watch is not None
    assert watch.feed(tok.encode("d more")) is None and watch.done  # "</and" is no stop string
    watch = StopAcrossLoopBack.after(tok, sampling, tok.encode("pending </an"))
    assert watch is not None
    ids = tok.encode("swer> tail")
    keep, stop = watch.feed(ids) or (0, "")
    assert stop == "</answer>" and "</answer>" in tok.decode(tok.encode("pending </an") + ids[:keep])
    # one the continuation holds whole is the replica's to find
    watch = StopAcrossLoopBack.after(tok, sampling, tok.encode("pending <"))
    assert watch is not None and watch.feed(tok.encode("x </answer>")) is None and watch.done


class _Silent(_Call):
    """A Generate that never answers (a non-streamed choice still generating)."""

    def __init__(self) -> None:
        super().__init__([])
        self.cancelled = False
        self.reading = asyncio.Event()  # set once the dispatcher waits for the first frame

    async def read(self) -> Any:
        self.reading.set()
        await asyncio.Event().wait()

    def cancel(self) -> None:
        self.cancelled = True

    def done(self) -> bool:
        return self.cancelled


async def test_a_dispatch_cancelled_before_its_first_frame_releases_its_ticket() -> None:
    """A sibling choice failed or the client left while this call waited: its ticket must not leak."""
    silent = _Silent()
    replica = _Replica(lambda r: [])
    replica.generate = lambda target, request, timeout_s, metadata=(): silent  # type: ignore[method-assign]
    dispatcher = Dispatcher.__new__(Dispatcher)
    dispatcher.clients, dispatcher.request_timeout_s = replica, None  # type: ignore[assignment]
    released: list[Any] = []
    dispatcher.finish = lambda ticket, error: released.append(error)  # type: ignore[method-assign]
    ticket = SimpleNamespace(instance=replica.instance, meta=RoutingMeta(), release_handoff=None)
    task = asyncio.ensure_future(
        dispatcher.start_call(ticket, GenerationInput("r", PROMPT, SamplingSpec(max_tokens=4)))  # type: ignore[arg-type]
    )
    await asyncio.wait_for(silent.reading.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert released == [None] and silent.cancelled  # released once, not as the instance's fault; RPC cancelled
