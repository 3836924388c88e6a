"""Conformance: the reference replica answers a GenerateRequest as stock vLLM with the stock servicer does.

One list of cases goes to both replicas, which load the same float32 weights (the reference engine's seeded
ones, saved as model.safetensors). Each case has a check that must hold on both, vLLM first: vLLM's answer is
the spec, so a check it fails is a wrong expectation (a plain failure). Then the two answers are compared: by
default their shape (per choice, the frame kinds in order, which fields each sets, finish reason, matched-stop
kind, top-log-prob widths; or the status code), and for greedy decoding also the ids, matched stops and
log-probs themselves, which the two engines agree on to float32 noise.

Never compared, because they legitimately differ: sampled ids (the two samplers differ), `cached_tokens` (vLLM's
CPU blocks hold 128 tokens, ours 16), how many ids one streamed chunk carries (vLLM merges the deltas a slow
reader has not taken yet) and the max model length (vLLM runs with --max-model-len 2048, ours with its config's
4096: cases that need it build their prompts from each replica's GetModelInfo).

A case where the reference replica still differs names the difference (`differs`): it is expected to fail with
ReferenceDiffers (strict), so it fails again as soon as the replica conforms, and a failure on vLLM's side
still fails it.

It lives with the other real-vLLM tests for their marker and the session's stock replica (tests/real_vllm/conftest.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import random
import threading
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from _procs import Proc, start_replica, wait_for
from google.protobuf import text_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl._proto import kv_migration_pb2, replica_control_pb2
from psrl.gateway.processes import stop_processes
from psrl.router.pipeline.execute import _OVERFLOW_MARKERS

TIMEOUT_S = 120.0
ABORT_AFTER_S = 1.0  # of decoding before a non-streamed request is aborted: both replicas have ids by then
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
EOS_IDS = (2, 0)  # config.json's eos_token_id: the tokenizer's EOS, then one vLLM reports as a matched stop id
# Greedy decoding of this prompt ends with EOS id 0 as its 6th token.
EOS_PROMPT = [303, 132, 214, 148, 561]
LOGPROB_TOLERANCE = 1e-4  # the engines' float32 log-probs differ by ~1e-5
INVALID = grpc.StatusCode.INVALID_ARGUMENT
VLLM_ENGINE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name


class ReferenceDiffers(AssertionError):
    """The reference replica's answer failed a case that vLLM's answer met."""


@dataclass(frozen=True)
class Replica:
    name: str
    stub: vllm_engine_pb2_grpc.VllmEngineStub
    channel: grpc.Channel
    max_len: int  # GetModelInfo.max_context_length
    block_size: int  # GetServerInfo.block_size

    def running(self) -> int:
        loads = self.stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=TIMEOUT_S).loads
        return sum(entry.num_running_reqs for entry in loads)


@dataclass
class Outcome:
    """One Generate call: the frames received and how the call ended."""

    replica: Replica
    request: vllm_engine_pb2.GenerateRequest
    frames: list[vllm_engine_pb2.GenerateResponse]
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    def __str__(self) -> str:
        if not self.ok:
            return f"{self.code.name}: {self.details}"
        return "\n".join(text_format.MessageToString(f, as_one_line=True)[:300] for f in self.frames)


@dataclass
class Choice:
    """One choice as the router accumulates it: its chunks' ids, or its complete frame's when no chunk came."""

    ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    complete: vllm_engine_pb2.GenerateComplete

    @property
    def matched(self) -> tuple[str, int | str] | None:
        which = self.complete.WhichOneof("matched_stop")
        return None if which is None else (which, getattr(self.complete, which))


def _message(frame: vllm_engine_pb2.GenerateResponse) -> Any:
    return getattr(frame, frame.WhichOneof("response"))


def _ids(m: Any) -> list[int]:
    return list(m.token_ids if isinstance(m, vllm_engine_pb2.GenerateStreamChunk) else m.output_ids)


def choices(o: Outcome) -> dict[int, Choice]:
    parts: dict[int, list[Any]] = {}
    out: dict[int, Choice] = {}
    for frame in o.frames:
        m = _message(frame)
        if frame.HasField("chunk"):
            parts.setdefault(m.index, []).append(m)
            continue
        got = parts.get(m.index) or [m]
        lps = [p.output_logprobs for p in got]
        out[m.index] = Choice(
            ids=[t for p in got for t in _ids(p)],
            logprobs=[v for lp in lps for v in lp.token_logprobs],
            top=[list(zip(t.token_ids, t.values)) for lp in lps for t in lp.top_logprobs],
            complete=m,
        )
    return out


# ---- requests and how they are sent -------------------------------------------------------------------------


def request(
    rid: str,
    *,
    prompt: list[int] | str | None = PROMPT,
    stream: bool = False,
    kv_transfer_params_json: str | None = None,
    data_parallel_rank: int | None = None,
    **sampling: Any,
) -> vllm_engine_pb2.GenerateRequest:
    """A GenerateRequest that sets exactly the fields given (a str prompt is text input, None no input)."""
    req = vllm_engine_pb2.GenerateRequest(
        request_id=rid, sampling_params=vllm_engine_pb2.SamplingParams(**sampling), stream=stream
    )
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.tokenized.input_ids.extend(prompt)
    if kv_transfer_params_json is not None:
        req.kv_transfer_params_json = kv_transfer_params_json
    if data_parallel_rank is not None:
        req.data_parallel_rank = data_parallel_rank
    return req


Requests = Callable[[Replica, str], list[vllm_engine_pb2.GenerateRequest]]


def one(**fields: Any) -> Requests:
    return lambda replica, rid: [request(rid, **fields)]


def several(*each: dict[str, Any]) -> Requests:
    return lambda replica, rid: [request(f"{rid}-{i}", **fields) for i, fields in enumerate(each)]


def filler(n: int, seed: int = 0) -> list[int]:
    """n ordinary token ids (no special ones), the same for every call with the same arguments."""
    rng = random.Random(seed)
    return [rng.randrange(3, 700) for _ in range(n)]


def at_context(offset: int, **fields: Any) -> Requests:
    """One request whose prompt is `offset` tokens off the replica's max model length."""
    return lambda replica, rid: [request(rid, prompt=filler(replica.max_len + offset), **fields)]


def generate(replica: Replica, req: vllm_engine_pb2.GenerateRequest) -> Outcome:
    frames: list[vllm_engine_pb2.GenerateResponse] = []
    try:
        for frame in replica.stub.Generate(req, timeout=TIMEOUT_S):
            frames.append(frame)
    except grpc.RpcError as e:
        return Outcome(replica, req, frames, e.code(), e.details() or "")
    return Outcome(replica, req, frames)


def _abort(replica: Replica, rid: str) -> None:
    replica.stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=[rid]), timeout=TIMEOUT_S)


def abort_after_first_ids(replica: Replica, req: vllm_engine_pb2.GenerateRequest) -> Outcome:
    """Streams `req` and sends Abort with its id once the first ids arrived."""
    frames: list[vllm_engine_pb2.GenerateResponse] = []
    try:
        for frame in replica.stub.Generate(req, timeout=TIMEOUT_S):
            frames.append(frame)
            if len(frames) == 1:
                _abort(replica, req.request_id)
    except grpc.RpcError as e:
        return Outcome(replica, req, frames, e.code(), e.details() or "")
    return Outcome(replica, req, frames)


def abort_while_running(replica: Replica, req: vllm_engine_pb2.GenerateRequest) -> Outcome:
    """Sends `req` (not streamed) and Abort with its id once the replica has run it a while (decoding: an abort
    still in prefill has no ids to return on either replica, one after it has them on both)."""
    done: list[Outcome] = []
    caller = threading.Thread(target=lambda: done.append(generate(replica, req)))
    caller.start()
    wait_for(
        lambda: bool(done) or replica.running() > 0,
        "the request running on the replica (or already answered)",
        timeout_s=TIMEOUT_S,
    )
    time.sleep(ABORT_AFTER_S)
    _abort(replica, req.request_id)
    caller.join(TIMEOUT_S)
    return done[0]


def while_its_id_streams(replica: Replica, req: vllm_engine_pb2.GenerateRequest) -> Outcome:
    """Sends `req` while another request with the same id streams, then aborts that id."""
    other = vllm_engine_pb2.GenerateRequest()
    other.CopyFrom(req)
    other.stream = True
    other.sampling_params.max_tokens = 2000
    other.sampling_params.ignore_eos = True
    streaming = replica.stub.Generate(other, timeout=TIMEOUT_S)
    next(streaming)
    outcome = generate(replica, req)
    _abort(replica, req.request_id)
    for _ in streaming:
        pass
    return outcome


# ---- what every answer satisfies, and what a case expects --------------------------------------------------


def well_formed(o: Outcome) -> None:
    """smg-grpc-servicer's framing, for any served request: streamed, each choice's chunks then its complete
    frame repeating the last delta; not streamed, one complete frame per choice in index order; per frame, the
    counts and log-probs of its ids as asked."""
    if not o.ok:
        return
    sp = o.request.sampling_params
    n = sp.n or 1
    kinds = [f.WhichOneof("response") for f in o.frames]
    if o.request.stream:
        for index in range(n):
            mine = [f for f in o.frames if _message(f).index == index]
            assert [f.WhichOneof("response") for f in mine] == ["chunk"] * (len(mine) - 1) + ["complete"]
            assert len(mine) >= 2
            assert _ids(mine[-1].complete) == _ids(mine[-2].chunk), "the complete frame repeats the last delta"
    else:
        assert kinds == ["complete"] * n
        assert [f.complete.index for f in o.frames] == list(range(n))
    k = sp.logprobs if sp.HasField("logprobs") else None
    for frame in o.frames:
        m = _message(frame)
        ids = _ids(m)
        assert m.index < n
        assert m.completion_tokens == len(ids)
        if o.request.HasField("tokenized"):
            assert m.prompt_tokens == len(o.request.tokenized.input_ids)
        lp = m.output_logprobs
        if k is None or not ids:
            assert not m.HasField("output_logprobs")
        else:
            assert list(lp.token_ids) == ids and len(lp.token_logprobs) == len(ids)
            assert all(v <= 0 for v in lp.token_logprobs)
            assert [(len(t.token_ids), len(t.values)) for t in lp.top_logprobs] == [(k, k)] * (len(ids) if k else 0)
        if frame.HasField("complete"):
            assert m.finish_reason in ("stop", "length", "abort")
            assert m.WhichOneof("matched_stop") is None or m.finish_reason == "stop"


Check = Callable[..., None]


def finishes(reason: str, *, ids: int | None = None, matched: tuple[str, int | str] | None = None, n: int = 1) -> Check:
    """Each of the n choices ends with `reason` (and `matched`), after `ids` ids when given."""

    def check(o: Outcome) -> None:
        assert o.ok, str(o)
        got = choices(o)
        assert sorted(got) == list(range(n))
        for choice in got.values():
            assert choice.complete.finish_reason == reason
            assert choice.matched == matched
            assert ids is None or len(choice.ids) == ids

    return check


def refused(code: grpc.StatusCode = INVALID, *, says: Sequence[str] = ()) -> Check:
    """The call fails with `code`; with `says`, its message contains one of those (what the router reads)."""

    def check(o: Outcome) -> None:
        assert o.code == code, str(o)
        assert not says or any(s in o.details for s in says), f"{o.details!r} has none of {list(says)}"

    return check


def all_of(*checks: Check) -> Check:
    def check(*outcomes: Outcome) -> None:
        for c in checks:
            c(*outcomes)

    return check


def each(check: Check) -> Check:
    """`check` on every outcome of a several-request case."""

    def check_each(*outcomes: Outcome) -> None:
        for o in outcomes:
            check(o)

    return check_each


def ids_of(o: Outcome) -> list[list[int]]:
    return [c.ids for _, c in sorted(choices(o).items())]


def same_ids(*outcomes: Outcome) -> None:
    first, *rest = outcomes
    assert all(ids_of(o) == ids_of(first) for o in rest), [ids_of(o) for o in outcomes]


def seeded_twice_then_another(a: Outcome, b: Outcome, c: Outcome) -> None:
    same_ids(a, b)
    assert ids_of(c) != ids_of(a), "another seed samples other ids"


def choices_are_seeded_one_by_one(parallel: Outcome, *singles: Outcome) -> None:
    """Choice i of a seeded n > 1 request samples what one request seeded seed + i does (vLLM's rule)."""
    assert ids_of(parallel) == [ids_of(s)[0] for s in singles]


def interleaved(o: Outcome) -> None:
    """Every choice streams its first chunk before any choice completes."""
    first_complete = next(i for i, f in enumerate(o.frames) if f.HasField("complete"))
    assert {f.chunk.index for f in o.frames[:first_complete]} == set(range(o.request.sampling_params.n))


def sampled_token_first(o: Outcome) -> None:
    """Top log-probs of a sampled token list that token first (the stock servicer takes vLLM's first k entries,
    the sampled token's own, then the most likely others)."""
    for choice in choices(o).values():
        assert [top[0][0] for top in choice.top] == choice.ids


def no_eos_before(count: int) -> Check:
    def check(o: Outcome) -> None:
        assert not any(set(EOS_IDS) & set(c.ids[:count]) for c in choices(o).values())

    return check


def aborted_mid_stream(o: Outcome) -> None:
    """An aborted stream ends normally: a last chunk, then the "abort" complete frame repeating its delta. The
    delta is empty, unless a decoding step ended as the Abort came in (vLLM then sends that step's ids)."""
    *_, last_chunk, complete = o.frames
    assert last_chunk.HasField("chunk") and complete.HasField("complete")
    assert list(complete.complete.output_ids) == list(last_chunk.chunk.token_ids)
    assert len(choices(o)[0].ids) < o.request.sampling_params.max_tokens


def aborted_with_ids_so_far(o: Outcome) -> None:
    assert 0 < len(choices(o)[0].ids) < o.request.sampling_params.max_tokens


def no_kv_transfer_report(o: Outcome) -> None:
    assert not any(c.complete.HasField("kv_transfer_params_json") for c in choices(o).values())


def prompt_logprobs_per_prompt_token(o: Outcome) -> None:
    """One entry per prompt token; the first has no log-prob (nothing precedes it)."""
    lp = choices(o)[0].complete.input_logprobs
    assert list(lp.token_ids) == list(o.request.tokenized.input_ids)
    assert [t.HasField("value") for t in lp.token_logprobs] == [False] + [True] * (len(lp.token_ids) - 1)


def second_hits_the_prefix_cache(first: Outcome, second: Outcome) -> None:
    """The same prompt again reuses the cached KV of its full blocks (prefix caching is on by default)."""
    before, again = (choices(o)[0].complete for o in (first, second))
    assert before.cached_tokens == 0
    assert 0 < again.cached_tokens < again.prompt_tokens, again.cached_tokens
    assert again.cached_tokens % second.replica.block_size == 0, "whole blocks only"


# ---- comparing the two replicas' answers -------------------------------------------------------------------


def shape(o: Outcome) -> object:
    """What an answer means, without the values that legitimately differ: its status code, or per choice its
    frames as kind, fields set (but cached_tokens), finish reason, matched-stop kind and top-log-prob widths,
    a run of alike chunks counted once."""
    if not o.ok:
        return o.code.name
    per_choice: dict[int, list[tuple[object, ...]]] = {}
    for frame in o.frames:
        m = _message(frame)
        desc: tuple[object, ...] = (
            frame.WhichOneof("response"),
            tuple(sorted(d.name for d, _ in m.ListFields() if d.name != "cached_tokens")),
            tuple(sorted({len(t.token_ids) for t in m.output_logprobs.top_logprobs})),
        )
        if frame.HasField("complete"):
            desc += (m.finish_reason, m.WhichOneof("matched_stop"))
        runs = per_choice.setdefault(m.index, [])
        if not runs or runs[-1] != desc:
            runs.append(desc)
    return sorted(per_choice.items())


def same_shape(vllm: list[Outcome], ours: list[Outcome]) -> None:
    assert [shape(o) for o in ours] == [shape(o) for o in vllm]


def same_tokens(vllm: list[Outcome], ours: list[Outcome]) -> None:
    """Greedy decoding: the same shape, ids and matched stops, and the same log-probs to float32 noise."""
    same_shape(vllm, ours)
    for v, o in zip(vllm, ours):
        for (_, vc), (_, oc) in zip(sorted(choices(v).items()), sorted(choices(o).items())):
            assert (oc.ids, oc.matched) == (vc.ids, vc.matched)
            assert oc.logprobs == pytest.approx(vc.logprobs, abs=LOGPROB_TOLERANCE)
            assert [[t for t, _ in top] for top in oc.top] == [[t for t, _ in top] for top in vc.top]
            assert [[v for _, v in top] for top in oc.top] == [
                pytest.approx([v for _, v in top], abs=LOGPROB_TOLERANCE) for top in vc.top
            ]


@contextlib.contextmanager
def reference_differs(vllm: object = None, ours: object = None) -> Iterator[None]:
    """A failure in here is the reference replica's: vLLM's answer, which met the case, is the spec. The two
    answers, when given, are added to the message."""
    try:
        yield
    except AssertionError as e:
        answers = "" if vllm is None else f"\n--- vLLM:\n{vllm}\n--- reference:\n{ours}"
        raise ReferenceDiffers(f"{e}{answers}") from e


# ---- the cases ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    requests: Requests
    check: Check
    compare: Callable[[list[Outcome], list[Outcome]], None] = same_shape
    send: Callable[[Replica, vllm_engine_pb2.GenerateRequest], Outcome] = generate
    differs: str | None = None  # how the reference replica still answers otherwise (then it is expected to fail)

    def run(self, replica: Replica) -> list[Outcome]:
        return [self.send(replica, req) for req in self.requests(replica, f"{self.id}-{replica.name}")]

    def param(self) -> Any:
        marks = [pytest.mark.xfail(raises=ReferenceDiffers, strict=True, reason=self.differs)] if self.differs else []
        return pytest.param(self, id=self.id, marks=marks)


def greedy(case_id: str, check: Check, **fields: Any) -> Case:
    """A greedy request (the same tokens on both replicas), without EOS unless `fields` says otherwise."""
    return Case(case_id, one(**{"temperature": 0.0, "ignore_eos": True, **fields}), check, same_tokens)


_SAMPLED = {"temperature": 1.0, "ignore_eos": True, "max_tokens": 6}
_SEEDED = {**_SAMPLED, "seed": 7}
_NOT_IMPLEMENTED = (
    "the reference engine does not implement {}, so the replica refuses it (INVALID_ARGUMENT, as the README "
    "says); vLLM honours it"
)
CASES = [
    # framing and log-probs
    greedy("greedy", finishes("length", ids=12), max_tokens=12),
    greedy("greedy-streamed", finishes("length", ids=12), max_tokens=12, stream=True),
    greedy("logprobs", finishes("length", ids=12), max_tokens=12, logprobs=0),
    greedy("logprobs-streamed", finishes("length", ids=12), max_tokens=12, logprobs=0, stream=True),
    greedy("top-logprobs", finishes("length", ids=12), max_tokens=12, logprobs=5),
    greedy("top-logprobs-streamed", finishes("length", ids=12), max_tokens=12, logprobs=5, stream=True),
    greedy("top-logprobs-at-the-limit", finishes("length", ids=3), max_tokens=3, logprobs=20),
    greedy("logprobs-over-the-limit", refused(), max_tokens=3, logprobs=21),
    greedy("logprobs-of-the-whole-vocabulary", refused(), max_tokens=3, logprobs=-1),
    Case(
        "top-logprobs-sampled",
        one(temperature=1.5, seed=3, ignore_eos=True, max_tokens=8, logprobs=3),
        all_of(finishes("length", ids=8), sampled_token_first),
        differs="the reference lists the k most likely tokens; the stock servicer lists the sampled token first, "
        "then the most likely others (k in all), so a sampled token outside the top k is listed and the k-th "
        "most likely is not",
    ),
    *(
        greedy(
            f"greedy-agrees-on-a-{len(p)}-token-prompt",
            finishes("length", ids=64),
            prompt=p,
            max_tokens=64,
            logprobs=0,
        )
        for p in ([1], [300, 12, 77], filler(150), filler(700))
    ),
    greedy("text-prompt", finishes("length", ids=6), prompt="hello world", max_tokens=6),
    # stop token ids, stop strings, EOS
    greedy("stop-token-ids", finishes("stop", matched=("matched_token_id", 94)), max_tokens=12, stop_token_ids=[94]),
    greedy(
        "stop-token-ids-streamed",
        finishes("stop", matched=("matched_token_id", 94)),
        max_tokens=12,
        stop_token_ids=[686, 94],
        stream=True,
    ),
    greedy(
        "stop-string-inside-a-token", finishes("stop", matched=("matched_stop_str", "sh")), max_tokens=12, stop=["sh"]
    ),
    greedy(
        "stop-string-across-tokens-streamed",
        finishes("stop", matched=("matched_stop_str", "rn| pu")),
        max_tokens=12,
        stop=["zzz", "rn| pu"],
        stream=True,
        logprobs=0,
    ),
    greedy(
        "stop-string-that-ends-first",
        finishes("stop", matched=("matched_stop_str", "fu")),
        max_tokens=12,
        stop=[" four", "fu"],
    ),
    greedy(
        "stop-string-included-in-output",
        finishes("stop", matched=("matched_stop_str", "sh")),
        max_tokens=12,
        stop=["sh"],
        include_stop_str_in_output=True,
    ),
    greedy("stop-string-never-generated", finishes("length", ids=3), max_tokens=3, stop=["qqq"]),
    greedy(
        "stop-token-and-string-on-one-token",
        finishes("stop", matched=("matched_token_id", 686)),
        max_tokens=12,
        stop_token_ids=[686],
        stop=["sh"],
    ),
    greedy("empty-stop-string", refused(), max_tokens=3, stop=[""]),
    greedy("stop-token-outside-the-vocabulary", refused(), max_tokens=3, stop_token_ids=[704]),
    greedy(
        "eos",
        finishes("stop", ids=6, matched=("matched_token_id", 0)),
        prompt=EOS_PROMPT,
        max_tokens=12,
        ignore_eos=False,
    ),
    greedy("ignore-eos", finishes("length", ids=12), prompt=EOS_PROMPT, max_tokens=12),
    Case(
        "min-tokens",
        one(prompt=EOS_PROMPT, temperature=0.0, max_tokens=12, min_tokens=9),
        all_of(finishes("length", ids=12), no_eos_before(9)),
        same_tokens,
        differs=_NOT_IMPLEMENTED.format("min_tokens"),
    ),
    # lengths
    greedy("max-tokens-1", finishes("length", ids=1), max_tokens=1, logprobs=2),
    greedy("max-tokens-1-streamed", finishes("length", ids=1), max_tokens=1, logprobs=2, stream=True),
    greedy("max-tokens-0", refused(), max_tokens=0),
    Case(
        "max-tokens-past-the-context",
        at_context(-3, temperature=0.0, ignore_eos=True, max_tokens=50),
        finishes("length", ids=3),
    ),
    Case(
        "max-tokens-past-the-context-streamed",
        at_context(-3, temperature=0.0, ignore_eos=True, max_tokens=50, stream=True),
        finishes("length", ids=3),
    ),
    Case("max-tokens-unset", at_context(-3, temperature=0.0, ignore_eos=True), finishes("length", ids=3)),
    greedy(
        "max-tokens-unset-ends-at-eos",
        finishes("stop", ids=6, matched=("matched_token_id", 0)),
        prompt=EOS_PROMPT,
        ignore_eos=False,
    ),
    Case(
        "prompt-fills-the-context",
        at_context(0, temperature=0.0, max_tokens=1),
        refused(says=_OVERFLOW_MARKERS),
    ),
    Case(
        "prompt-past-the-context",
        at_context(1, temperature=0.0, max_tokens=1),
        refused(says=_OVERFLOW_MARKERS),
    ),
    Case(
        "text-prompt-past-the-context",  # each "hello " is more than one token
        lambda replica, rid: [request(rid, prompt="hello " * replica.max_len, temperature=0.0, max_tokens=1)],
        refused(says=_OVERFLOW_MARKERS),
    ),
    # n > 1 and seeds
    Case("n2", one(n=2, **_SAMPLED), finishes("length", ids=6, n=2)),
    Case(
        "n2-streamed",
        one(n=2, stream=True, logprobs=0, **_SAMPLED),
        all_of(finishes("length", ids=6, n=2), interleaved),
    ),
    Case("n2-seeded", one(n=2, **_SEEDED), finishes("length", ids=6, n=2)),
    Case("n2-seeded-streamed", one(n=2, stream=True, **_SEEDED), all_of(finishes("length", ids=6, n=2), interleaved)),
    greedy("n2-greedy", refused(), n=2, max_tokens=3),
    Case(
        "n2-choices-are-seeded-seed-plus-index",
        several({"n": 2, **_SEEDED}, _SEEDED, {**_SEEDED, "seed": 8}),
        choices_are_seeded_one_by_one,
    ),
    Case("seed-reproduces", several(_SEEDED, _SEEDED, {**_SEEDED, "seed": 8}), seeded_twice_then_another),
    Case("seed-reproduces-streamed-or-not", several({**_SEEDED, "stream": True}, _SEEDED), same_ids),
    # unset, empty and out-of-range fields
    Case("temperature-unset-is-1", several({**_SEEDED, "temperature": None}, _SEEDED), same_ids),
    greedy("temperature-above-2", refused(), temperature=2.5, max_tokens=3),
    greedy("kv-transfer-params-unset", finishes("length", ids=3), max_tokens=3),
    greedy("kv-transfer-params-empty", refused(), max_tokens=3, kv_transfer_params_json=""),
    greedy(
        "kv-transfer-params-empty-object",
        all_of(finishes("length", ids=3), no_kv_transfer_report),
        max_tokens=3,
        kv_transfer_params_json="{}",
    ),
    greedy("kv-transfer-params-not-an-object", refused(), max_tokens=3, kv_transfer_params_json="[]"),
    greedy("data-parallel-rank-0", finishes("length", ids=3), max_tokens=3, data_parallel_rank=0),
    greedy("data-parallel-rank-out-of-range", refused(), max_tokens=3, data_parallel_rank=1),
    greedy("data-parallel-rank-negative", refused(), max_tokens=3, data_parallel_rank=-1),
    greedy("empty-prompt", refused(), prompt=[], max_tokens=3),
    greedy("no-prompt", refused(), prompt=None, max_tokens=3),
    greedy("prompt-token-outside-the-vocabulary", refused(), prompt=[1, 704], max_tokens=3),
    Case(
        "empty-request-id",
        lambda replica, rid: [request("", temperature=0.0, max_tokens=3)],
        finishes("length", ids=3),
        differs="the reference replica refuses an empty request_id (INVALID_ARGUMENT, as the README says); "
        "vLLM serves it",
    ),
    Case(
        "request-id-already-running",
        one(temperature=0.0, max_tokens=3),
        finishes("length", ids=3),
        send=while_its_id_streams,
        differs="the reference replica refuses a request_id that is running (INVALID_ARGUMENT, as the README says); "
        "vLLM serves both (an Abort with that id then aborts both)",
    ),
    # abort
    Case(
        "abort-mid-stream",
        one(temperature=0.0, ignore_eos=True, max_tokens=1500, logprobs=0, stream=True),
        all_of(finishes("abort"), aborted_mid_stream),
        send=abort_after_first_ids,
    ),
    Case(
        "abort-not-streamed",
        one(temperature=0.0, ignore_eos=True, max_tokens=1500, logprobs=0),
        all_of(finishes("abort"), aborted_with_ids_so_far),
        send=abort_while_running,
    ),
    # caching
    Case(
        "prefix-cache-hit",
        several(*[{"prompt": filler(300, seed=1), "temperature": 0.0, "max_tokens": 2}] * 2),
        all_of(each(finishes("length", ids=2)), second_hits_the_prefix_cache),
        same_tokens,
    ),
    # what vLLM samples with and the reference replica does not implement
    Case(
        "prompt-logprobs",
        one(temperature=0.0, max_tokens=3, prompt_logprobs=0),
        all_of(finishes("length", ids=3), prompt_logprobs_per_prompt_token),
        differs=_NOT_IMPLEMENTED.format("prompt_logprobs"),
    ),
    *(
        Case(
            name.replace("_", "-"),
            one(temperature=1.0, seed=1, ignore_eos=True, max_tokens=3, **{name: value}),
            finishes("length", ids=3),
            differs=_NOT_IMPLEMENTED.format(name),
        )
        for name, value in [
            ("repetition_penalty", 1.2),
            ("frequency_penalty", 0.5),
            ("presence_penalty", 0.5),
            ("min_p", 0.1),
            ("logit_bias", {5: 10.0}),
        ]
    ),
]


@pytest.fixture(scope="module")
def reference(vllm_model_dir: Path, log_dir: Path) -> Iterator[Proc]:
    """The reference replica over the stock replica's model folder, dp_size 1 like it."""
    proc = start_replica(vllm_model_dir, log_dir)
    yield proc
    stop_processes([proc.proc])


@pytest.fixture(scope="module")
def replicas(stock_vllm: Proc, reference: Proc) -> Iterator[tuple[Replica, Replica]]:
    """(stock vLLM, the reference replica)."""
    with contextlib.ExitStack() as stack:
        out = []
        for name, proc in (("vllm", stock_vllm), ("reference", reference)):
            channel = stack.enter_context(grpc.insecure_channel(proc.url.removeprefix("grpc://")))
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            model = stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT_S)
            server = stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=TIMEOUT_S)
            out.append(Replica(name, stub, channel, model.max_context_length, server.block_size))
        yield out[0], out[1]


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_generate(case: Case, replicas: tuple[Replica, Replica]) -> None:
    vllm_replica, reference_replica = replicas
    vllm = case.run(vllm_replica)
    for o in vllm:
        well_formed(o)
    case.check(*vllm)
    ours = case.run(reference_replica)
    with reference_differs("\n".join(map(str, vllm)), "\n".join(map(str, ours))):
        for o in ours:
            well_formed(o)
        case.check(*ours)
        case.compare(vllm, ours)


# ---- management RPCs ---------------------------------------------------------------------------------------

SAME = "the same value (unset on both included)"
BOTH = "set on both; the values legitimately differ"
VLLM_ONLY = "set by the stock servicer only"
OURS_ONLY = "set by the reference replica only"
NOT_COMPARED = "not compared"


def _call(rpc: str) -> Callable[[vllm_engine_pb2_grpc.VllmEngineStub], Message]:
    return lambda stub: getattr(stub, rpc)(getattr(vllm_engine_pb2, f"{rpc}Request")(), timeout=TIMEOUT_S)


# Every field of each answer is compared by its rule here (SAME unless named), so a field a new proto adds is too.
INFO: dict[str, tuple[Callable[[vllm_engine_pb2_grpc.VllmEngineStub], Message], type[Message], dict[str, str]]] = {
    "GetModelInfo": (
        _call("GetModelInfo"),
        vllm_engine_pb2.GetModelInfoResponse,
        {
            "served_model_name": BOTH,  # vLLM's default is its --model path, ours the folder's name
            "max_context_length": BOTH,  # vLLM runs with --max-model-len 2048, ours at the config's 4096
            "max_req_input_len": BOTH,
        },
    ),
    "GetServerInfo": (
        _call("GetServerInfo"),
        vllm_engine_pb2.GetServerInfoResponse,
        {
            "last_receive_timestamp": NOT_COMPARED,  # ours sets it once a Generate came, the stock servicer never
            "uptime_seconds": OURS_ONLY,
            "server_type": OURS_ONLY,  # "vllm-grpc", the value the proto documents; the stock servicer leaves it
            "shm_namespace_id": VLLM_ONLY,  # for multimodal tensors over /dev/shm; ours serves text only
            "multimodal_encoder_dtype": VLLM_ONLY,  # the model dtype, which vLLM names for a text model too
            "constrained_decoding_start": VLLM_ONLY,  # ours refuses constrained decoding
            "block_size": BOTH,  # 128 on vLLM's CPU backend, 16 on ours
            "max_num_seqs": BOTH,
        },
    ),
    "GetLoads": (
        _call("GetLoads"),
        vllm_engine_pb2.GetLoadsResponse,
        {"timestamp": BOTH, "version": BOTH, "loads": NOT_COMPARED},  # the entries: field by field, next
    ),
    "GetLoads.loads[0]": (
        lambda stub: _call("GetLoads")(stub).loads[0],
        vllm_engine_pb2.SchedulerLoad,
        {
            "gen_throughput": NOT_COMPARED,  # measured over the requests before
            "cache_hit_rate": NOT_COMPARED,
            "max_total_num_tokens": BOTH,  # the KV capacities differ
            "max_running_requests": BOTH,
        },
    ),
    "HealthCheck": (_call("HealthCheck"), vllm_engine_pb2.HealthCheckResponse, {}),
}
INFO_FIELDS = [
    pytest.param(rpc, field.name, rules.get(field.name, SAME), id=f"{rpc}.{field.name}")
    for rpc, (_, response, rules) in INFO.items()
    for field in response.DESCRIPTOR.fields
    if rules.get(field.name) != NOT_COMPARED
]


@pytest.fixture(scope="module")
def info(replicas: tuple[Replica, Replica]) -> dict[str, tuple[Message, Message]]:
    """Each answer of INFO from (vLLM, ours), both idle."""
    wait_for(lambda: all(r.running() == 0 for r in replicas), "every replica idle", timeout_s=TIMEOUT_S)
    return {name: (fetch(replicas[0].stub), fetch(replicas[1].stub)) for name, (fetch, _, _) in INFO.items()}


def _is_set(message: Message, name: str) -> bool:
    return any(d.name == name for d, _ in message.ListFields())


@pytest.mark.parametrize(("rpc", "name", "rule"), INFO_FIELDS)
def test_info_field(rpc: str, name: str, rule: str, info: dict[str, tuple[Message, Message]]) -> None:
    vllm, ours = info[rpc]
    if rule == SAME:
        with reference_differs(vllm, ours):
            assert getattr(ours, name) == getattr(vllm, name)
        return
    assert _is_set(vllm, name) == (rule != OURS_ONLY)
    if rule == BOTH:
        with reference_differs(vllm, ours):
            assert _is_set(ours, name)
    else:  # a difference the table documents
        assert _is_set(ours, name) == (rule == OURS_ONLY)


def _consistent(model: Any, server: Any, loads: Any) -> None:
    """What the router reads together: the input limit is the context length; one load entry per dp rank; an
    ISO 8601 timestamp with its zone."""
    assert model.max_req_input_len == model.max_context_length > 0
    assert loads.dp_rank_count == len(loads.loads) == server.data_parallel_size
    assert datetime.fromisoformat(loads.timestamp).tzinfo is not None


def test_info_is_consistent(info: dict[str, tuple[Message, Message]]) -> None:
    vllm, ours = zip(*(info[rpc] for rpc in ("GetModelInfo", "GetServerInfo", "GetLoads")))
    _consistent(*vllm)
    with reference_differs(*("\n".join(map(str, side)) for side in (vllm, ours))):
        _consistent(*ours)


def _load_entries(replica: Replica, rank: int) -> int | str:
    try:
        reply = replica.stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(dp_rank=rank), timeout=TIMEOUT_S)
    except grpc.RpcError as e:
        return e.code().name
    return len(reply.loads)


@pytest.mark.parametrize(
    "rank",
    [
        0,
        pytest.param(
            1,
            marks=pytest.mark.xfail(
                raises=ReferenceDiffers,
                strict=True,
                reason="the stock servicer does not apply GetLoadsRequest.dp_rank (reserved) and answers every rank; "
                "the reference replica filters by it and refuses a rank it does not have (INVALID_ARGUMENT)",
            ),
        ),
    ],
)
def test_get_loads_of_a_rank(rank: int, replicas: tuple[Replica, Replica]) -> None:
    vllm, ours = (_load_entries(r, rank) for r in replicas)
    assert vllm == 1
    with reference_differs(vllm, ours):
        assert ours == vllm


def _tokenizer_files(replica: Replica) -> dict[str, bytes]:
    chunks = list(replica.stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT_S))
    data = b"".join(c.data for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True], "the sha256 comes last"
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as bundle:
        return {name: bundle.read(name) for name in bundle.namelist()}


def test_get_tokenizer_streams_the_same_files(replicas: tuple[Replica, Replica]) -> None:
    vllm = _tokenizer_files(replicas[0])
    assert "tokenizer.json" in vllm
    with reference_differs():
        assert _tokenizer_files(replicas[1]) == vllm


HEALTH_CASES = [
    ("Check", "", "SERVING"),
    ("Check", VLLM_ENGINE, "SERVING"),
    ("Check", "no.such.Service", "NOT_FOUND"),
    ("Watch", "", "SERVING"),
    ("Watch", "no.such.Service", "SERVICE_UNKNOWN"),
]


def _health(channel: grpc.Channel, method: str, service: str) -> str:
    """The status a grpc.health.v1 call answers (Watch: its first), or its error code."""
    stub = health_pb2_grpc.HealthStub(channel)
    req = health_pb2.HealthCheckRequest(service=service)
    try:
        if method == "Check":
            reply = stub.Check(req, timeout=TIMEOUT_S)
        else:
            watch = stub.Watch(req, timeout=TIMEOUT_S)
            reply = next(watch)
            watch.cancel()
    except grpc.RpcError as e:
        return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@pytest.mark.parametrize(
    ("method", "service", "expected"), HEALTH_CASES, ids=[f"{m}({s!r})" for m, s, _ in HEALTH_CASES]
)
def test_standard_health(method: str, service: str, expected: str, replicas: tuple[Replica, Replica]) -> None:
    vllm, ours = (_health(r.channel, method, service) for r in replicas)
    assert vllm == expected
    with reference_differs(vllm, ours):
        assert ours == vllm


def _reflection(channel: grpc.Channel, *requests: reflection_pb2.ServerReflectionRequest) -> list[Any]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    return list(stub.ServerReflectionInfo(iter(requests), timeout=TIMEOUT_S))


def _resolved(channel: grpc.Channel, services: list[str]) -> list[str]:
    """Those of `services` whose defining file reflection returns (what grpcurl describes a service from)."""
    symbols = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=s) for s in services]
    replies = _reflection(channel, *symbols)
    return [s for s, reply in zip(services, replies) if reply.HasField("file_descriptor_response")]


def test_reflection_lists_the_stock_services_and_resolves_them(replicas: tuple[Replica, Replica]) -> None:
    listed = []
    for r in replicas:
        (reply,) = _reflection(r.channel, reflection_pb2.ServerReflectionRequest(list_services=""))
        listed.append(sorted(s.name for s in reply.list_services_response.service))
    vllm, ours = listed
    assert vllm == sorted([VLLM_ENGINE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"])
    assert _resolved(replicas[0].channel, vllm) == vllm
    extra = [
        replica_control_pb2.DESCRIPTOR.services_by_name["ReplicaControl"].full_name,
        kv_migration_pb2.DESCRIPTOR.services_by_name["KvMigration"].full_name,
    ]
    with reference_differs(vllm, ours):
        assert ours == sorted(vllm + extra)
        assert _resolved(replicas[1].channel, ours) == ours
