"""The vLLM replica's own parts that need no vLLM: its command line, the admission gate, the final-only fold of
a streamed Generate, and where LoadWeights points vLLM's loader. The replica itself runs in tests/real_vllm/."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from psrl._proto import replica_control_pb2 as rc
from psrl.gateway.config import GatewayConfig
from psrl.gateway.config import parse_args as gateway_args
from psrl.worker.admission import AdmissionGate
from psrl.worker.config import parse_args
from psrl.worker.vllm_control import VllmReplicaControl, checkpoint_dir
from psrl.worker.vllm_replica import FinalOnly, kv_migration_off_reason, vllm_argv


def test_engine_arguments_after_double_dash(tmp_path: Path) -> None:
    args = parse_args(["--engine", "vllm", "--model", str(tmp_path), "--dp-size", "2", "--", "--dtype", "float32"])
    assert args.engine == "vllm" and args.engine_args == ["--dtype", "float32"]
    argv = vllm_argv(args)
    assert argv[:4] == ["--model", str(tmp_path), "--data-parallel-size", "2"]
    assert argv[argv.index("--served-model-name") + 1] == tmp_path.name  # named like the reference replica
    assert "dummy" in argv  # no model.safetensors in the folder: random weights
    assert argv[-2:] == ["--dtype", "float32"]  # the user's own arguments come last, so they win
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "dummy" not in vllm_argv(args)


def test_engine_arguments_need_the_vllm_engine(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--", "--dtype", "float32"])
    assert "need --engine vllm" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a reference-engine setting is not silently dropped on vLLM
        parse_args(["--engine", "vllm", "--model", "/m", "--block-size", "32", "--num-blocks", "8"])
    assert "--block-size, --num-blocks: reference-engine settings" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the bound on a vLLM replica's pin copies means nothing to the reference engine
        parse_args(["--kv-pin-max-mib", "8"])
    assert "--kv-pin-max-mib bounds a vLLM replica's pins" in capsys.readouterr().err


def test_kv_migration_loads_the_connector_unless_it_cannot() -> None:
    def off(*argv: str) -> str | None:
        return kv_migration_off_reason(parse_args(["--engine", "vllm", "--model", "/m", *argv]))

    assert off() is None  # on by default, as on the reference replica
    assert off("--kv-pin-ttl-s", "0") == "--kv-pin-ttl-s is 0"
    assert off("--dp-size", "2") is not None and "--dp-size 1" in str(off("--dp-size", "2"))
    assert "own --kv-transfer-config" in str(off("--", "--kv-transfer-config", "{}"))


def test_gateway_starts_vllm_replicas_only_with_a_model() -> None:
    cfg = gateway_args(["--replica-engine", "vllm", "--model", "/m", "--replicas", "3", "--kv-transfer-enable"])
    assert (cfg.replica_engine, cfg.embedded_model, cfg.embedded_dp_sizes, cfg.kv_transfer_enable) == (
        "vllm",
        "/m",
        [1, 1, 1],
        True,
    )
    one = gateway_args(["--replica-engine", "vllm", "--model", "/m", "--replica-engine-args", "--dtype", "half"])
    assert one.replica_dp_sizes == [1] and one.replica_engine_args == ["--dtype", "half"]
    assert GatewayConfig().replica_dp_sizes == [1, 2]  # the embedded default: two reference replicas
    with pytest.raises(ValueError, match="model folder"):
        GatewayConfig(replica_engine="vllm").validate()
    with pytest.raises(ValueError, match="replica_engine"):
        GatewayConfig(replica_engine="sglang").validate()
    with pytest.raises(ValueError, match="vLLM engine arguments"):
        GatewayConfig(replica_engine_args=["--dtype", "half"]).validate()


def test_admission_gate_reports_each_abort_once_and_only_while_watching() -> None:
    gate = AdmissionGate()
    for rid in ("a", "b", "c"):
        gate.started(rid)
    gate.ended("a", "abort")  # before the pause: not the pause's doing
    gate.watch_aborts()
    gate.ended("b", "abort")
    gate.ended("c", "length")
    gate.started("b")
    gate.ended("b", "abort")
    assert gate.take_aborts() == ["b"] and gate.take_aborts() == []
    assert gate.in_flight == set()
    gate.close("paused")
    assert gate.closed_reason == "paused"
    gate.open()
    assert gate.closed_reason is None


def _chunk(index: int, ids: list[int], logprobs: bool = True) -> pb.GenerateResponse:
    lp = pb.OutputLogProbs(token_logprobs=[-float(i) for i in ids], token_ids=ids) if logprobs else None
    return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=ids, index=index, output_logprobs=lp))


def _complete(index: int, last: list[int], reason: str, **kw) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        complete=pb.GenerateComplete(output_ids=last, finish_reason=reason, index=index, prompt_tokens=3, **kw)
    )


def test_final_only_folds_interleaved_choices_into_one_complete_each() -> None:
    fold = FinalOnly()
    frames = [
        _chunk(0, [1, 2]),
        _chunk(1, [7]),
        _chunk(0, [3]),
        _complete(0, [3], "stop", matched_stop_str="x"),
        _chunk(1, [8, 9]),
        _complete(1, [8, 9], "abort"),
    ]
    for f in frames:
        fold.add(f)
    first, second = fold.completes()
    assert (list(first.output_ids), first.completion_tokens, first.finish_reason) == ([1, 2, 3], 3, "stop")
    assert first.matched_stop_str == "x" and first.prompt_tokens == 3
    assert list(first.output_logprobs.token_ids) == [1, 2, 3]
    assert list(first.output_logprobs.token_logprobs) == [-1.0, -2.0, -3.0]
    # an aborted choice keeps what it produced (vLLM's own final-only answer has no ids then)
    assert (list(second.output_ids), second.index, second.finish_reason) == ([7, 8, 9], 1, "abort")


def test_final_only_without_chunks_or_logprobs() -> None:
    fold = FinalOnly()
    fold.add(_chunk(0, [4, 5], logprobs=False))
    fold.add(_complete(0, [5], "length"))
    (only,) = fold.completes()
    assert list(only.output_ids) == [4, 5] and not only.HasField("output_logprobs")
    empty = FinalOnly()
    empty.add(_complete(0, [], "abort"))
    (refused,) = empty.completes()
    assert list(refused.output_ids) == [] and refused.finish_reason == "abort"


def test_load_weights_points_the_loader_at_a_folder(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    weights = ckpt / "step7.safetensors"
    weights.write_bytes(b"x")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert checkpoint_dir(str(ckpt), scratch) == ckpt  # a folder is read as vLLM reads a model folder
    folder = checkpoint_dir(str(weights), scratch)  # one file: a folder of its own holding only it
    assert folder == scratch and [p.name for p in folder.iterdir()] == ["step7.safetensors"]
    assert (folder / "step7.safetensors").read_bytes() == b"x"
    with pytest.raises(FileNotFoundError):
        checkpoint_dir(str(tmp_path / "missing.safetensors"), scratch)
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="safetensors"):
        checkpoint_dir(str(tmp_path / "w.bin"), scratch)


class _FakeLLM:
    """AsyncLLM's methods the control calls, recording them; `pause_generation` ends what is running."""

    def __init__(self, gate: AdmissionGate, queued_late: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.gate, self.queued_late, self.calls, self.paused = gate, set(queued_late), [], False

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause", mode, clear_cache))
        self.paused = True
        if mode == "abort":
            for rid in sorted(self.gate.in_flight - self.queued_late):
                self.gate.ended(rid, "abort")

    async def abort(self, request_ids: list[str]) -> None:
        self.calls.append(("abort", sorted(request_ids)))
        for rid in request_ids:
            self.gate.ended(rid, "abort")

    async def is_paused(self) -> bool:
        return self.paused

    async def resume_generation(self) -> None:
        self.paused = False

    async def collective_rpc(self, method: str, kwargs: dict) -> None:
        self.calls.append(
            (method, kwargs["weights_path"], sorted(p.name for p in Path(kwargs["weights_path"]).iterdir()))
        )

    async def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))


class _Refused(Exception):
    pass


class _Context:
    async def abort(self, code, details: str):
        raise _Refused(code, details)


async def _no_waiting() -> int:
    return 0


def _control(queued_late: set[str] = frozenset()):  # type: ignore[assignment]
    gate = AdmissionGate()
    llm = _FakeLLM(gate, queued_late)
    return VllmReplicaControl(llm, gate, _no_waiting), llm, gate


async def test_an_abort_pause_reports_the_aborted_and_aborts_a_late_arrival() -> None:
    control, llm, gate = _control(queued_late={"late"})
    for rid in ("a", "late"):
        gate.started(rid)
    reply = await control.PauseGeneration(rc.PauseGenerationRequest(mode=rc.PAUSE_MODE_ABORT), _Context())
    assert sorted(reply.aborted_request_ids) == ["a", "late"] and reply.paused
    assert llm.calls == [("pause", "abort", False), ("abort", ["late"])]
    assert gate.closed_reason is not None and gate.in_flight == set()
    state = await control.GetSyncState(rc.GetSyncStateRequest(), _Context())
    assert state.admission == rc.ADMISSION_PAUSED and state.running_requests == 0


async def test_a_keep_pause_returns_at_once_with_requests_frozen() -> None:
    control, llm, gate = _control()
    gate.started("frozen")
    reply = await asyncio.wait_for(
        control.PauseGeneration(rc.PauseGenerationRequest(mode=rc.PAUSE_MODE_KEEP), _Context()), timeout=1.0
    )
    assert list(reply.aborted_request_ids) == [] and gate.in_flight == {"frozen"}
    assert (await control.GetSyncState(rc.GetSyncStateRequest(), _Context())).running_requests == 1
    await control.ResumeGeneration(rc.ResumeGenerationRequest(), _Context())
    assert gate.closed_reason is None and not llm.paused


async def test_load_weights_from_a_file_keeps_its_folder_until_the_next_load(tmp_path: Path) -> None:
    control, llm, _ = _control()
    for name in ("v1.safetensors", "v2.safetensors"):
        (tmp_path / name).write_bytes(b"x")
    await control.LoadWeights(rc.LoadWeightsRequest(version=1, path=str(tmp_path / "v1.safetensors")), _Context())
    method, first, files = llm.calls[0]
    assert (method, files) == ("reload_weights", ["v1.safetensors"]) and Path(first).is_dir()
    assert llm.calls[1] == ("reset_prefix_cache",) and control.weight_version == 1
    await control.LoadWeights(rc.LoadWeightsRequest(version=2, path=str(tmp_path / "v2.safetensors")), _Context())
    assert not Path(first).exists() and control.weight_version == 2  # the previous one is gone only now
    with pytest.raises(_Refused, match="loads weights from a path"):
        await control.LoadWeights(rc.LoadWeightsRequest(version=3, seed=3), _Context())
    with pytest.raises(_Refused, match="no such weights file"):
        await control.LoadWeights(rc.LoadWeightsRequest(version=3, path=str(tmp_path / "nope")), _Context())
    assert control.weight_version == 2
