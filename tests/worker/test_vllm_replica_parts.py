"""The vLLM replica's own parts that need no vLLM: its command line, the admission gate, the final-only fold of
a streamed Generate, and where LoadWeights points vLLM's loader. The replica itself runs in tests/vllm/."""

from __future__ import annotations

from pathlib import Path

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from psrl.gateway.launcher import GatewayConfig
from psrl.gateway.launcher import parse_args as gateway_args
from psrl.worker.admission import AdmissionGate
from psrl.worker.server import parse_args
from psrl.worker.vllm_control import checkpoint_dir
from psrl.worker.vllm_replica import FinalOnly, vllm_argv


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


def test_gateway_starts_vllm_replicas_only_with_a_model() -> None:
    cfg = gateway_args(["--replica-engine", "vllm", "--model", "/m", "--replicas", "3", "--kv-transfer-enable"])
    assert (cfg.replica_engine, cfg.embedded_model, cfg.embedded_dp_sizes, cfg.kv_transfer_enable) == (
        "vllm",
        "/m",
        [1, 1, 1],
        True,
    )
    assert gateway_args(["--replica-engine", "vllm", "--model", "/m", "--replica-engine-args", "--dtype", "half"])
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
