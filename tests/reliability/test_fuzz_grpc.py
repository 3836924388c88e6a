"""Hypothesis over the gRPC services, against real processes: the reference replica's `VllmEngine`,
`ReplicaControl`, `KvMigration` and `grpc.health.v1.Health`, and the PSManager's `PSManagerState` and
`PSManagerAdmin`. Messages are built from the descriptors with any value each field's type allows (ids and
ranks out of range, lengths far past the model's, unknown enum values), and every method also gets bytes that
are not its message (invalid UTF-8 in a string field, truncated, wrong wire types, lengths past the end).

Every call must end with a status from EXPECTED (never UNKNOWN or INTERNAL, never a hang), the process must
stay up, and afterwards it must still serve a normal request with nothing left running.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from _fuzz import INT_EDGES, ODD_STRINGS, VOCAB, fuzz_settings, last_exception_line, normalize
from _procs import Proc, replica_busy, start_psmanager, start_replica, wait_for
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2
from hypothesis import given
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2

from psrl._proto import kv_migration_pb2, psrl_manager_pb2, replica_control_pb2
from psrl.gateway.processes import stop_processes

pytestmark = pytest.mark.fuzz

EXPECTED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)
CALL_TIMEOUT_S = 20.0  # far above any call here (a few decoded tokens); past it the call counts as hung
# Streams that run until the client leaves: ended by the client after a short look, which is no failure.
ENDLESS_STREAMS = {"vllm.grpc.engine.VllmEngine/SubscribeKvEvents", "grpc.health.v1.Health/Watch"}
CHEAP_MAX_TOKENS = 4
# Repeated fields that also get thousands of elements (prompts past the model length, long id lists); the
# others stay short, so no example asks for quadratic work (CanReserve answers request x version).
LONG_LISTS = frozenset(
    {
        "vllm.grpc.engine.TokenizedInput.input_ids",
        "vllm.grpc.engine.SamplingParams.stop_token_ids",
        "vllm.grpc.engine.AbortRequest.request_ids",
        "psrl.kv.TransferKvRequest.token_ids",
        "psrl.state.CanReserveRequest.request_ids",
        "psrl.state.CheckAbortedRequestsRequest.request_ids",
        "psrl.state.AbortRequestsRequest.request_ids",
    }
)


def _service(module: Any, name: str) -> Any:
    return module.DESCRIPTOR.services_by_name[name]


VLLM_ENGINE = _service(vllm_engine_pb2, "VllmEngine")
REPLICA_CONTROL = _service(replica_control_pb2, "ReplicaControl")
KV_MIGRATION = _service(kv_migration_pb2, "KvMigration")
HEALTH = _service(health_pb2, "Health")
PSM_STATE = _service(psrl_manager_pb2, "PSManagerState")
PSM_ADMIN = _service(psrl_manager_pb2, "PSManagerAdmin")


# ---- messages from descriptors ----------------------------------------------------------------------------


_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
# Protobuf strings are UTF-8, so no lone surrogates here: invalid UTF-8 goes in as raw bytes (raw_requests).
_PROTO_TEXT = st.one_of(
    st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=16),
    st.sampled_from([s for s in ODD_STRINGS if not any(0xD800 <= ord(c) <= 0xDFFF for c in s)]),
)


def _int(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in [*INT_EDGES, lo, hi, lo + 1, hi - 1] if lo <= v <= hi]
    return st.one_of(st.integers(-3, 8).filter(lambda v: lo <= v <= hi), st.sampled_from(edges), st.integers(lo, hi))


def _scalar(f: FieldDescriptor, overrides: dict[str, st.SearchStrategy]) -> st.SearchStrategy[Any]:
    if f.full_name in overrides:
        return overrides[f.full_name]
    t = f.type
    if t in _INT_RANGES:
        return _int(*_INT_RANGES[t])
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_FLOAT:
        return st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0, 3.0e38]), st.floats(width=32))
    if t == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if t == FieldDescriptor.TYPE_STRING:
        return _PROTO_TEXT
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=32)
    if t == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in f.enum_type.values]
        return st.one_of(st.sampled_from(known), st.sampled_from([-1, 3, 99, 2**31 - 1]))
    raise AssertionError(f"no strategy for {f.full_name}")


def message(
    desc: Descriptor, overrides: dict[str, st.SearchStrategy] | None = None, depth: int = 0
) -> st.SearchStrategy[Any]:
    """Messages of type `desc` with any subset of fields set to any value their type allows; repeated fields
    of a few elements, sometimes thousands. `overrides` (by field full name) steer fields to useful values."""
    overrides = overrides or {}
    cls = message_factory.GetMessageClass(desc)
    fields: dict[str, st.SearchStrategy] = {}
    for f in desc.fields:
        if f.full_name in overrides and not f.is_repeated:
            fields[f.name] = overrides[f.full_name]
        elif f.message_type is not None and f.message_type.GetOptions().map_entry:
            key_f, val_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            if val_f.message_type is not None:
                continue  # maps of messages (multimodal tensors): not what this fuzz is about
            fields[f.name] = st.dictionaries(_scalar(key_f, overrides), _scalar(val_f, overrides), max_size=3)
        elif f.message_type is not None:
            if depth >= 3:
                continue
            sub = message(f.message_type, overrides, depth + 1)
            fields[f.name] = st.lists(sub, max_size=3) if f.is_repeated else sub
        elif f.is_repeated:
            element = _scalar(f, overrides)
            lists = [st.lists(element, max_size=5), st.lists(element, max_size=5)]
            if f.full_name in LONG_LISTS:
                lists.append(st.lists(element, min_size=4000, max_size=6000))
            fields[f.name] = st.one_of(*lists)
        else:
            fields[f.name] = _scalar(f, overrides)
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


# ---- bytes that are not the message ---------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string_fields(desc: Descriptor) -> list[int]:
    return [f.number for f in desc.fields if f.type == FieldDescriptor.TYPE_STRING]


def raw_requests(desc: Descriptor, valid: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Serialized bytes a client could send that do not parse as `desc` (or only just do)."""
    strings = _string_fields(desc)
    numbers = [f.number for f in desc.fields] or [1]
    bad_utf8 = st.sampled_from([b"\xff\xfe", b"\xed\xa0\x80", b"\xc0\xaf", b"a\x80b", b"\xf8\x88\x80\x80\x80"])
    options: list[st.SearchStrategy[bytes]] = [
        st.binary(max_size=48),
        valid.map(lambda m: m.SerializeToString()).flatmap(
            lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda n: b[:n])
        ),
        # a length-delimited field that claims far more bytes than follow
        st.builds(
            lambda n, ln: _varint(n << 3 | 2) + _varint(ln) + b"abc",
            st.sampled_from(numbers),
            st.sampled_from([2**31, 2**32 - 1, 2**62, 10]),
        ),
        # a field sent with the wrong wire type (fixed32 / group start / reserved wire types 6 and 7)
        st.builds(
            lambda n, w: _varint(n << 3 | w) + b"\x01\x02\x03\x04",
            st.sampled_from(numbers),
            st.sampled_from([1, 3, 4, 5, 6, 7]),
        ),
        # field number 0, and one past the allowed range
        st.sampled_from([b"\x00\x01", b"\xf8\xff\xff\xff\xff\x01\x00"]),
        # a varint that never ends
        st.sampled_from([b"\x08" + b"\xff" * 11, b"\x08\xff"]),
    ]
    if strings:
        options.append(
            st.builds(
                lambda m, n, junk: m.SerializeToString() + _varint(n << 3 | 2) + _varint(len(junk)) + junk,
                valid,
                st.sampled_from(strings),
                bad_utf8,
            )
        )
    return st.one_of(*options)


# ---- per-service steering -----------------------------------------------------------------------------------


def _kv_params_json(replica_target: str) -> st.SearchStrategy[str]:
    source = st.fixed_dictionaries(
        {"target": st.sampled_from([replica_target, "127.0.0.1:1", "nowhere:1", "", "[::1"])},
        optional={"dp_rank": st.one_of(st.integers(-1, 3), st.sampled_from(INT_EDGES), st.text(max_size=3))},
    )
    obj = st.fixed_dictionaries(
        {"source": st.one_of(source, st.just("x"), st.just(None))},
        optional={
            "request_id": _PROTO_TEXT,
            "num_tokens": st.one_of(st.integers(-1, 64), st.sampled_from(INT_EDGES)),
            "mode": st.sampled_from(["sync", "async", "pin_sync", "nope", ""]),
            "timeout_ms": st.one_of(st.integers(-1, 300), st.sampled_from([0, 2**31, 10**30])),
        },
    )
    return st.one_of(obj.map(json.dumps), st.sampled_from(["", "{}", "[]", "null", "{", '"x"', "1e999", "[" * 5000]))


def replica_overrides(replica_target: str) -> dict[str, st.SearchStrategy]:
    token = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([VOCAB, 2**31, 2**32 - 1]))
    return {
        "vllm.grpc.engine.TokenizedInput.input_ids": token,
        "vllm.grpc.engine.SamplingParams.stop_token_ids": token,
        # 0 is refused; a valid max_tokens past the model length would decode thousands of tokens: not here
        "vllm.grpc.engine.SamplingParams.max_tokens": st.integers(0, CHEAP_MAX_TOKENS),
        "vllm.grpc.engine.SamplingParams.n": st.one_of(st.integers(0, 3), st.sampled_from([16384, 16385, 2**32 - 1])),
        "vllm.grpc.engine.SamplingParams.logprobs": st.one_of(
            st.integers(-2, 21), st.sampled_from([2**31 - 1, -(2**31)])
        ),
        "vllm.grpc.engine.SamplingParams.temperature": st.one_of(
            st.sampled_from([0.0, 0.7, 2.0, 2.5, -1.0, float("nan"), float("inf")]), st.floats(width=32)
        ),
        "vllm.grpc.engine.SamplingParams.top_p": st.one_of(
            st.sampled_from([0.0, 0.5, 1.0, 1.5, float("nan")]), st.floats(width=32)
        ),
        "vllm.grpc.engine.GenerateRequest.kv_transfer_params_json": _kv_params_json(replica_target),
        "vllm.grpc.engine.GenerateRequest.data_parallel_rank": _int(-(2**31), 2**31 - 1),
        "psrl.control.LoadWeightsRequest.path": st.sampled_from(
            ["", "/", "/nonexistent.safetensors", "/etc/hostname", "/proc/self/status", "relative/x.safetensors"]
        ),
        "psrl.kv.TransferKvRequest.channel": st.sampled_from(["shm", "", "cuda_ipc", "nccl", "x"]),
        "psrl.kv.TransferKvRequest.layout_json": st.one_of(
            st.sampled_from(
                [
                    "",
                    "{}",
                    "[]",
                    "{",
                    '{"num_layers": -1}',
                    '{"num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_size": 16, "dtype": "float32"}',
                ]
            ),
            _PROTO_TEXT,
        ),
        "psrl.kv.TransferKvRequest.token_ids": token,
        "psrl.kv.PinKvRequest.ttl_ms": st.one_of(st.integers(0, 500), st.sampled_from([2**32 - 1])),
    }


def valid_generate(replica_target: str) -> st.SearchStrategy[Any]:
    """A GenerateRequest the replica should serve: a prompt from the vocabulary, a sampling setup inside every
    documented range, streamed or not, sometimes a dp rank or KV-transfer parameters."""
    greedy = st.fixed_dictionaries({"temperature": st.just(0.0), "n": st.just(1)})
    sampled = st.fixed_dictionaries(
        {"temperature": st.floats(0.125, 2.0, width=32), "n": st.integers(1, 3)},
        optional={
            "top_p": st.floats(0.0625, 1.0, width=32),
            "top_k": st.integers(0, 50),
            "seed": st.integers(-1, 2**31 - 1),
        },
    )
    common = st.fixed_dictionaries(
        {"max_tokens": st.integers(1, CHEAP_MAX_TOKENS)},
        optional={
            "stop": st.lists(st.text(alphabet="abcdefgh \n", min_size=1, max_size=3), max_size=2),
            "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
            "logprobs": st.integers(-1, 20),
            "ignore_eos": st.booleans(),
            "skip_special_tokens": st.booleans(),
            "include_stop_str_in_output": st.booleans(),
        },
    )
    sampling = st.tuples(st.one_of(greedy, sampled), common).map(
        lambda t: vllm_engine_pb2.SamplingParams(**t[0], **t[1])
    )
    return st.builds(
        lambda rid, ids, sp, stream, extra: vllm_engine_pb2.GenerateRequest(
            request_id=rid,
            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids),
            sampling_params=sp,
            stream=stream,
            **extra,
        ),
        st.text(alphabet="abcdef0123456789-", min_size=1, max_size=12),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16),
        sampling,
        st.booleans(),
        st.fixed_dictionaries(
            {},
            optional={
                "data_parallel_rank": st.integers(0, 1),
                "kv_transfer_params_json": _kv_params_json(replica_target),
            },
        ),
    )


def _copy_fields(dst: Any, src: Any, names: list[str]) -> None:
    for name in names:
        dst.ClearField(name)
        f = dst.DESCRIPTOR.fields_by_name[name]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            getattr(dst, name).MergeFrom(getattr(src, name))  # a map field: no add() on it
        elif f.is_repeated:
            getattr(dst, name).extend(getattr(src, name)) if f.message_type is None else [
                getattr(dst, name).add().CopyFrom(m) for m in getattr(src, name)
            ]
        elif f.message_type is not None:
            getattr(dst, name).CopyFrom(getattr(src, name))
        else:
            setattr(dst, name, getattr(src, name))


@st.composite
def near_valid_generate(draw: st.DrawFn, replica_target: str, overrides: dict[str, st.SearchStrategy]) -> Any:
    """A valid GenerateRequest with a few of its fields (or its sampling parameters' fields) taken from an
    arbitrary one: one wrong thing at a time reaches the checks behind the first."""
    req = draw(valid_generate(replica_target))
    other = draw(message(vllm_engine_pb2.GenerateRequest.DESCRIPTOR, overrides))
    for dst, src in ((req, other), (req.sampling_params, other.sampling_params)):
        present = [f.name for f, _ in src.ListFields()]
        if present:
            _copy_fields(dst, src, draw(st.lists(st.sampled_from(present), max_size=2, unique=True)))
    return req


def _cheap_generate(req: Any) -> Any:
    """A valid Generate decodes a few tokens at most: an unset or larger max_tokens becomes CHEAP_MAX_TOKENS
    (0, which is refused, stays)."""
    sp = req.sampling_params
    if not sp.HasField("max_tokens") or sp.max_tokens > 0:
        sp.max_tokens = min(sp.max_tokens, CHEAP_MAX_TOKENS) if sp.HasField("max_tokens") else CHEAP_MAX_TOKENS
    return req


# ---- calls, their statuses, and the record -------------------------------------------------------------------


@dataclass
class GrpcRun:
    """Calls methods of one process and records each status outside EXPECTED under a signature."""

    proc: Proc
    failures: dict[str, list[str]] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)
    methods: dict[str, set[str]] = field(default_factory=dict)  # signature -> the methods that showed it
    hangs: int = 0
    stopped: str | None = None

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(
            self.proc.url.removeprefix("grpc://"),
            options=[("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)],
        )
        self.log_offset = self.proc.log.stat().st_size

    def _new_log(self) -> str:
        with self.proc.log.open("rb") as f:
            f.seek(self.log_offset)
            data = f.read()
        self.log_offset += len(data)
        return data.decode(errors="replace")

    def call(self, method: MethodDescriptor, request: Any, *, raw: bool = False) -> grpc.StatusCode:
        if self.stopped:
            return grpc.StatusCode.OK
        self._new_log()
        path = f"/{method.containing_service.full_name}/{method.name}"
        name = path.lstrip("/")
        serializer = None if raw else type(request).SerializeToString
        endless = name in ENDLESS_STREAMS
        try:
            if method.server_streaming:
                stub = self.channel.unary_stream(path, request_serializer=serializer, response_deserializer=None)
                stream = stub(request, timeout=1.0 if endless else CALL_TIMEOUT_S)
                for _ in stream:
                    pass
            else:
                stub = self.channel.unary_unary(path, request_serializer=serializer, response_deserializer=None)
                stub(request, timeout=CALL_TIMEOUT_S)
            code = grpc.StatusCode.OK
            details = ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        if endless and code == grpc.StatusCode.DEADLINE_EXCEEDED:
            code = grpc.StatusCode.OK
        self.codes[f"{name} {code.name}"] = self.codes.get(f"{name} {code.name}", 0) + 1
        if code not in EXPECTED:
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.hangs += 1
                if self.hangs >= 3:
                    self.stopped = "stopped after 3 calls got no answer"
            log = self._new_log()
            exc = last_exception_line(log)
            if exc is None:
                time.sleep(0.2)  # the traceback may be written just after the status went out
                log += self._new_log()
                exc = last_exception_line(log)
            cause = normalize(exc or details, 110)
            # Bytes that are no message fail the same way on every method: one signature for all of them.
            sig = f"any method (raw bytes): {code.name} [{cause}]" if raw else f"{name}: {code.name} [{cause}]"
            self.methods.setdefault(sig, set()).add(name)
            bucket = self.failures.setdefault(sig, [])
            if len(bucket) < 2:
                shown = request if raw else request.SerializeToString()
                what = f"{shown[:300]!r} ({len(shown)} bytes)" + (
                    "" if raw else f"\n      as text: {str(request)[:400]!r}"
                )
                bucket.append(f"request: {what}\n      details: {details[:300]}\n      log: {log[-1500:]}")
        if not self.proc.alive():
            self.stopped = f"the process exited: {self.proc.log_text()[-2000:]}"
        return code

    def close(self) -> None:
        self.channel.close()

    def report(self) -> str:
        lines = [f"{self.proc.url}: codes {dict(sorted(self.codes.items()))}"]
        if self.stopped:
            lines.append(f"  RUN STOPPED: {self.stopped}")
        for sig, items in self.failures.items():
            lines.append(f"- {sig}")
            if len(self.methods.get(sig, ())) > 1:
                lines.append(f"    methods: {', '.join(sorted(self.methods[sig]))}")
            lines.extend(f"    {item}" for item in items)
        return "\n".join(lines)


@dataclass
class Fleet:
    model_dir: Path
    log_dir: Path
    replica: Proc | None = None
    psmanager: Proc | None = None

    def ensure_up(self) -> None:
        if self.replica is None or not self.replica.alive():
            self.replica = start_replica(self.model_dir, self.log_dir, dp_size=2)
        if self.psmanager is None or not self.psmanager.alive():
            self.psmanager = start_psmanager(self.log_dir)

    def stop(self) -> None:
        stop_processes([p.proc for p in (self.replica, self.psmanager) if p is not None])


@pytest.fixture(scope="module")
def fleet(model_dir: Path, log_dir: Path) -> Iterator[Fleet]:
    f = Fleet(model_dir, log_dir)
    f.ensure_up()
    yield f
    f.stop()


def _method_requests(
    methods: list[MethodDescriptor], overrides: dict[str, st.SearchStrategy]
) -> st.SearchStrategy[tuple[MethodDescriptor, Any]]:
    by_method = []
    for m in methods:
        strategy = message(m.input_type, overrides)
        if m.name == "Generate":
            strategy = strategy.map(_cheap_generate)
        by_method.append(st.tuples(st.just(m), strategy))
    return st.one_of(*by_method)


def _replica_still_serves(run: GrpcRun, replica: Proc) -> list[str]:
    """A normal Generate still answers with tokens, health is SERVING, and nothing stays running."""
    problems: list[str] = []
    if not replica.alive():
        return [f"replica exited: {replica.log_text()[-2000:]}"]
    ctl = run.channel.unary_unary(
        f"/{REPLICA_CONTROL.full_name}/ResumeGeneration",
        request_serializer=replica_control_pb2.ResumeGenerationRequest.SerializeToString,
        response_deserializer=replica_control_pb2.ResumeGenerationResponse.FromString,
    )
    ctl(replica_control_pb2.ResumeGenerationRequest(), timeout=30)
    gen = run.channel.unary_stream(
        f"/{VLLM_ENGINE.full_name}/Generate",
        request_serializer=vllm_engine_pb2.GenerateRequest.SerializeToString,
        response_deserializer=vllm_engine_pb2.GenerateResponse.FromString,
    )
    req = vllm_engine_pb2.GenerateRequest(
        request_id=f"after-fuzz-{time.monotonic_ns()}",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2, temperature=0.0),
    )
    frames = list(gen(req, timeout=30))
    done = [f.complete for f in frames if f.HasField("complete")]
    if not done or done[-1].finish_reason != "length" or len(done[-1].output_ids) != 2:
        problems.append(f"a normal Generate after the fuzz answered {frames!r}")
    health = run.channel.unary_unary(
        f"/{HEALTH.full_name}/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )(health_pb2.HealthCheckRequest(service=""), timeout=10)
    if health.status != health_pb2.HealthCheckResponse.SERVING:
        problems.append(f"health after the fuzz: {health}")
    try:
        wait_for(lambda: replica_busy(replica.url) == 0, "the replica idle", timeout_s=20, poll_s=0.1)
    except AssertionError:
        problems.append(f"replica still has {replica_busy(replica.url)} running+waiting requests 20s after the fuzz")
    return problems


Item = tuple[MethodDescriptor, Any, bool]  # the method, its request (a message, or bytes when raw), raw


def _fuzz_replica(
    fleet: Fleet, requests: st.SearchStrategy[Item], n: int, restore: bool, explicit: list[Item] | None = None
) -> None:
    """`explicit` items (the edges a bug was once found at) go first, then `n` drawn ones."""
    fleet.ensure_up()
    assert fleet.replica is not None
    run = GrpcRun(fleet.replica)
    resume = run.channel.unary_unary(
        f"/{REPLICA_CONTROL.full_name}/ResumeGeneration",
        request_serializer=replica_control_pb2.ResumeGenerationRequest.SerializeToString,
        response_deserializer=None,
    )

    @fuzz_settings(n)
    @given(item=requests)
    def one(item: tuple[MethodDescriptor, Any, bool]) -> None:
        method, request, raw = item
        run.call(method, request, raw=raw)
        if restore and not run.stopped:
            resume(replica_control_pb2.ResumeGenerationRequest(), timeout=30)  # undo a pause or a failed sync

    try:
        for method, request, raw in explicit or []:
            run.call(method, request, raw=raw)
            if restore and not run.stopped:
                resume(replica_control_pb2.ResumeGenerationRequest(), timeout=30)
        one()
        problems = [] if run.stopped else _replica_still_serves(run, fleet.replica)
    finally:
        run.close()
    print(run.report())
    if run.failures or problems or run.stopped:
        pytest.fail(run.report() + "\n" + "\n".join(f"AFTERWARDS: {p}" for p in problems), pytrace=False)


def _as_messages(
    s: st.SearchStrategy[tuple[MethodDescriptor, Any]],
) -> st.SearchStrategy[tuple[MethodDescriptor, Any, bool]]:
    return s.map(lambda t: (t[0], t[1], False))


def _replica_target(fleet: Fleet) -> str:
    assert fleet.replica is not None
    return fleet.replica.url.removeprefix("grpc://")


def _generate(**kw: Any) -> Any:
    base: dict[str, Any] = {
        "request_id": f"edge-{time.monotonic_ns()}",
        "tokenized": vllm_engine_pb2.TokenizedInput(input_ids=[1, 2, 3]),
        "sampling_params": vllm_engine_pb2.SamplingParams(max_tokens=2),
    }
    sp = kw.pop("sampling", None)
    if sp is not None:
        base["sampling_params"] = vllm_engine_pb2.SamplingParams(max_tokens=2, **sp)
    return vllm_engine_pb2.GenerateRequest(**{**base, **kw})


def engine_edges() -> list[Item]:
    from smg_grpc_proto.generated import common_pb2

    gen = VLLM_ENGINE.methods_by_name["Generate"]
    m = VLLM_ENGINE.methods_by_name
    return [
        (gen, _generate(kv_transfer_params_json="[" * 5000), False),
        (gen, _generate(kv_transfer_params_json='{"a": ' * 3000 + "1" + "}" * 3000), False),
        (
            gen,
            _generate(
                kv_transfer_params_json='{"source": {"target": "127.0.0.1:1"}, "request_id": "x", "timeout_ms": 1e999}'
            ),
            False,
        ),
        (
            gen,
            _generate(kv_transfer_params_json='{"source": {"target": "[::1"}, "request_id": "x", "timeout_ms": 50}'),
            False,
        ),
        (gen, _generate(data_parallel_rank=2**31 - 1), False),
        (gen, _generate(data_parallel_rank=-1), False),
        (gen, _generate(tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[7] * 5000)), False),
        (gen, _generate(tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[2**32 - 1])), False),
        (gen, _generate(tokenized=vllm_engine_pb2.TokenizedInput()), False),
        (gen, _generate(text="hello"), False),
        (gen, _generate(sampling={"n": 2**32 - 1, "temperature": 1.0}), False),
        (gen, _generate(sampling={"logprobs": 2**31 - 1}), False),
        (gen, _generate(sampling={"temperature": float("nan")}), False),
        (gen, _generate(sampling={"top_p": float("nan")}), False),
        (gen, _generate(sampling={"top_k": 2**32 - 1}), False),
        (gen, _generate(sampling={"seed": -(2**31)}), False),
        (gen, _generate(sampling={"stop_token_ids": [2**32 - 1]}), False),
        (gen, _generate(sampling={"stop": ["a" * 100_000]}), False),
        (gen, _generate(request_id=""), False),
        (m["SubscribeKvEvents"], common_pb2.SubscribeKvEventsRequest(start_sequence_number=2**64 - 1), False),
        (m["Abort"], vllm_engine_pb2.AbortRequest(request_ids=["x" * 100_000]), False),
        (m["GetLoads"], vllm_engine_pb2.GetLoadsRequest(), False),
    ]


def test_vllm_engine_service(fleet: Fleet) -> None:
    """Generate (streamed or not, with every sampling field, kv_transfer_params_json, dp ranks), Embed, Abort,
    GetLoads, GetModelInfo, GetServerInfo, HealthCheck, FlushCache, profiling, GetTokenizer, SubscribeKvEvents."""
    fleet.ensure_up()
    overrides = replica_overrides(_replica_target(fleet))
    methods = list(VLLM_ENGINE.methods)
    generate = VLLM_ENGINE.methods_by_name["Generate"]
    target = _replica_target(fleet)
    requests = st.one_of(
        st.tuples(st.just(generate), valid_generate(target)),
        st.tuples(st.just(generate), near_valid_generate(target, overrides).map(_cheap_generate)),
        _method_requests([generate], overrides),
        _method_requests(methods, overrides),
    )
    _fuzz_replica(fleet, _as_messages(requests), 300, restore=False, explicit=engine_edges())


def test_replica_control_service(fleet: Fleet) -> None:
    """PauseGeneration (unknown modes too), LoadWeights (seeds, paths that are no weights), ResumeGeneration,
    GetSyncState, FailSync, interleaved with Generate calls; the replica is resumed after each."""
    fleet.ensure_up()
    overrides = replica_overrides(_replica_target(fleet))
    generate = VLLM_ENGINE.methods_by_name["Generate"]
    target = _replica_target(fleet)
    requests = st.one_of(
        _method_requests(list(REPLICA_CONTROL.methods), overrides),
        st.tuples(st.just(generate), valid_generate(target)),
        st.tuples(st.just(generate), near_valid_generate(target, overrides).map(_cheap_generate)),
    )
    c = REPLICA_CONTROL.methods_by_name
    edges: list[Item] = [
        (c["PauseGeneration"], replica_control_pb2.PauseGenerationRequest(mode=99), False),
        (c["LoadWeights"], replica_control_pb2.LoadWeightsRequest(version=-(2**63), seed=-(2**63)), False),
        (c["LoadWeights"], replica_control_pb2.LoadWeightsRequest(version=2**63 - 1, path="/proc/self/status"), False),
        (c["LoadWeights"], replica_control_pb2.LoadWeightsRequest(version=1), False),
        (c["FailSync"], replica_control_pb2.FailSyncRequest(reason="\u00e9" * 10_000), False),
    ]
    _fuzz_replica(fleet, _as_messages(requests), 120, restore=True, explicit=edges)


def test_kv_migration_service(fleet: Fleet) -> None:
    """PinKv, UnpinKv, TransferKv (any tokens, layouts, channels, ranks), ReleaseKv, GetKvMigrationStats."""
    fleet.ensure_up()
    overrides = replica_overrides(_replica_target(fleet))
    k = KV_MIGRATION.methods_by_name
    edges: list[Item] = [
        (
            k["TransferKv"],
            kv_migration_pb2.TransferKvRequest(
                request_id="x", token_ids=[1] * 5000, max_tokens=2**32 - 1, channel="shm"
            ),
            False,
        ),
        (
            k["TransferKv"],
            kv_migration_pb2.TransferKvRequest(
                token_ids=[2**32 - 1] * 40, allow_prefix_cache=True, channel="shm", start_token=2**32 - 1
            ),
            False,
        ),
        (
            k["TransferKv"],
            kv_migration_pb2.TransferKvRequest(data_parallel_rank=2**31 - 1, token_ids=[1, 2], channel="shm"),
            False,
        ),
        (
            k["TransferKv"],
            kv_migration_pb2.TransferKvRequest(
                token_ids=list(range(64)), channel="shm", allow_prefix_cache=True, layout_json="[" * 5000
            ),
            False,
        ),
        (k["PinKv"], kv_migration_pb2.PinKvRequest(request_id="x", data_parallel_rank=-1, ttl_ms=2**32 - 1), False),
        (k["GetKvMigrationStats"], kv_migration_pb2.GetKvMigrationStatsRequest(data_parallel_rank=-(2**31)), False),
        (k["ReleaseKv"], kv_migration_pb2.ReleaseKvRequest(transfer_id="\u00e9" * 1000), False),
    ]
    _fuzz_replica(
        fleet, _as_messages(_method_requests(list(KV_MIGRATION.methods), overrides)), 150, restore=False, explicit=edges
    )


def test_health_service(fleet: Fleet) -> None:
    fleet.ensure_up()
    check = HEALTH.methods_by_name["Check"]
    edges: list[Item] = [(check, health_pb2.HealthCheckRequest(service="x" * 100_000), False)]
    _fuzz_replica(fleet, _as_messages(_method_requests(list(HEALTH.methods), {})), 30, restore=False, explicit=edges)


def _raw_for(
    methods: list[MethodDescriptor], overrides: dict[str, st.SearchStrategy]
) -> st.SearchStrategy[tuple[MethodDescriptor, Any, bool]]:
    options = []
    for m in methods:
        valid = message(m.input_type, overrides)
        options.append(st.tuples(st.just(m), raw_requests(m.input_type, valid), st.just(True)))
    return st.one_of(*options)


def test_replica_services_with_bytes_that_are_not_the_message(fleet: Fleet) -> None:
    """Every replica method, sent bytes that do not parse as its request: a status from EXPECTED
    (INVALID_ARGUMENT is what a client should see), not the INTERNAL of an unhandled parse error."""
    fleet.ensure_up()
    overrides = replica_overrides(_replica_target(fleet))
    methods = [m for s in (VLLM_ENGINE, REPLICA_CONTROL, KV_MIGRATION, HEALTH) for m in s.methods]
    m = VLLM_ENGINE.methods_by_name
    edges: list[Item] = [
        (m["GetLoads"], b"\x0a\x02\xff\xfe", True),  # a string field holding invalid UTF-8
        (m["Generate"], b"\x0a\x02\xed\xa0", True),
        (m["Abort"], b"\x0a\xff\xff\xff\xff\x07", True),  # a length far past the end
    ]
    _fuzz_replica(fleet, _raw_for(methods, overrides), 150, restore=True, explicit=edges)


# ---- the PSManager ----------------------------------------------------------------------------------------------


def _fuzz_psmanager(
    fleet: Fleet, requests: st.SearchStrategy[Item], n: int, explicit: list[Item] | None = None
) -> None:
    fleet.ensure_up()
    assert fleet.psmanager is not None
    run = GrpcRun(fleet.psmanager)

    @fuzz_settings(n)
    @given(item=requests)
    def one(item: tuple[MethodDescriptor, Any, bool]) -> None:
        method, request, raw = item
        run.call(method, request, raw=raw)

    problems: list[str] = []
    try:
        for method, request, raw in explicit or []:
            run.call(method, request, raw=raw)
        one()
        if not fleet.psmanager.alive():
            problems.append("the PSManager exited")
        else:
            snap = run.channel.unary_unary(
                f"/{PSM_ADMIN.full_name}/GetSnapshot",
                request_serializer=psrl_manager_pb2.GetSnapshotRequest.SerializeToString,
                response_deserializer=psrl_manager_pb2.GetSnapshotResponse.FromString,
            )(psrl_manager_pb2.GetSnapshotRequest(), timeout=30)
            json.loads(snap.state_json)
            can = run.channel.unary_unary(
                f"/{PSM_STATE.full_name}/CanReserve",
                request_serializer=psrl_manager_pb2.CanReserveRequest.SerializeToString,
                response_deserializer=psrl_manager_pb2.CanReserveResponse.FromString,
            )(psrl_manager_pb2.CanReserveRequest(request_ids=[1], model_versions=[0]), timeout=30)
            if len(can.results) != 1:
                problems.append(f"CanReserve after the fuzz answered {can}")
    finally:
        run.close()
    print(run.report())
    if run.failures or problems or run.stopped:
        pytest.fail(run.report() + "\n" + "\n".join(f"AFTERWARDS: {p}" for p in problems), pytrace=False)


PSM_OVERRIDES = {
    "psrl.state.UpdateRequestStatusRequest.status": st.sampled_from(
        ["PENDING", "RUNNING", "FINISHED", "ABORTED", "FAILED", "", "nope", "finished"]
    ),
    "psrl.state.RolloutInstanceId.worker_id": st.sampled_from(["0", "1", "", "w" * 300, "\u00e9"]),
}


def test_psmanager_services(fleet: Fleet) -> None:
    """Every PSManagerState and PSManagerAdmin method with any ids, versions (int64 edges), list lengths."""
    methods = [*PSM_STATE.methods, *PSM_ADMIN.methods]
    s, a = PSM_STATE.methods_by_name, PSM_ADMIN.methods_by_name
    iid = psrl_manager_pb2.RolloutInstanceId
    edges: list[Item] = [
        (
            s["CanReserve"],
            psrl_manager_pb2.CanReserveRequest(request_ids=[2**63 - 1], model_versions=[-(2**63)]),
            False,
        ),
        (
            s["CanReserve"],
            psrl_manager_pb2.CanReserveRequest(request_ids=[1, 2], model_versions=[0], is_validate=[True, False, True]),
            False,
        ),
        (
            s["ReserveRolloutInstanceRequests"],
            psrl_manager_pb2.ReserveRolloutInstanceRequestsRequest(
                rollout_instance_ids=[iid(worker_id="0", dp_rank=-1)], request_ids=[1, 2, 3], model_versions=[2**63 - 1]
            ),
            False,
        ),
        (a["SetLatestModelVersion"], psrl_manager_pb2.SetLatestModelVersionRequest(model_version=2**63 - 1), False),
        (s["CanReserve"], psrl_manager_pb2.CanReserveRequest(request_ids=[1], model_versions=[0, 2**63 - 1]), False),
        (a["SetLatestModelVersion"], psrl_manager_pb2.SetLatestModelVersionRequest(model_version=-(2**63)), False),
        (a["ConsumeBuffer"], psrl_manager_pb2.ConsumeBufferRequest(model_version=-1, buffer_id=-1), False),
        (a["AbortModelVersion"], psrl_manager_pb2.AbortModelVersionRequest(model_version=2**63 - 1), False),
        (s["GetRolloutInstanceModelVersion"], psrl_manager_pb2.GetRolloutInstanceModelVersionRequest(), False),
    ]
    _fuzz_psmanager(fleet, _as_messages(_method_requests(methods, PSM_OVERRIDES)), 250, explicit=edges)


def test_psmanager_with_bytes_that_are_not_the_message(fleet: Fleet) -> None:
    methods = [*PSM_STATE.methods, *PSM_ADMIN.methods]
    status = PSM_STATE.methods_by_name["UpdateRequestStatus"]
    _fuzz_psmanager(fleet, _raw_for(methods, PSM_OVERRIDES), 80, explicit=[(status, b"\x12\x02\xff\xfe", True)])
