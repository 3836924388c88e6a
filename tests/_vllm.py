"""Real vLLM (the CPU build) for tests: stock vLLM gRPC replicas and ours on loopback, serving the tiny Qwen2
checkpoint of psrl.worker.model_folder.build_weighted_model_folder.

The stock replica is vLLM's own launcher with the stock smg-grpc-servicer inside, exactly as users start it.
Nothing is downloaded: the checkpoint is the reference engine's seeded random weights, saved as float32
safetensors, so vLLM loads real weights (greedy decoding is reproducible) and has a file to reload.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
from _procs import REPO, Proc, free_port, popen
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl.gateway.processes import stop_processes

HAS_VLLM = all(importlib.util.find_spec(m) is not None for m in ("vllm", "smg_grpc_servicer"))
# vLLM compiles and caches kernels; inside the build folder, so a test run never writes to the home directory.
CACHE_ROOT = REPO / "build" / "vllm-cache"
STARTUP_TIMEOUT_S = 300.0


def vllm_env() -> dict[str, str]:
    """The environment of a CPU vLLM replica in tests: one process, 1 GiB of KV, no warm-up, caches in build/."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "SMG_VLLM_SERVICER_WARMUP": "off",
        "SMG_VLLM_SERVICER_KV_EVENTS": "0",
        "TORCHINDUCTOR_CACHE_DIR": str(CACHE_ROOT / "inductor"),
        "VLLM_CACHE_ROOT": str(CACHE_ROOT / "vllm"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


def engine_args_of(model_dir: Path) -> list[str]:
    """vLLM engine arguments every test replica uses (real weights, float32, small context, eager)."""
    return ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager"]


def wait_healthy(proc: subprocess.Popen, target: str, log: Path, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM replica exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
            try:
                if stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=2.0).healthy:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    stop_processes([proc])
    raise TimeoutError(f"vLLM replica not healthy in {timeout_s}s:\n{log.read_text(errors='replace')}")


def start_stock_vllm(model_dir: Path, log_dir: Path, *, args: list[str] | None = None, attempts: int = 3) -> Proc:
    """`python -m vllm.entrypoints.launchers.grpc_server` (the stock servicer), ready to serve.

    Its launcher takes a fixed port and binds it only after the engine started (seconds later), when another
    process may have taken the free port we picked: then it is started again on another one."""
    for attempt in range(attempts):
        port = free_port()
        log = log_dir / f"stock-vllm-{port}.log"
        cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.grpc_server", *engine_args_of(model_dir)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), *(args or [])]
        with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
            proc = popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(), start_new_session=True, cwd=REPO)
        target = f"127.0.0.1:{port}"
        try:
            wait_healthy(proc, target, log)
        except RuntimeError:
            if attempt + 1 < attempts and "Failed to bind" in log.read_text(errors="replace"):
                continue
            raise
        return Proc(proc, f"grpc://{target}", log)
    raise AssertionError("unreachable")


def start_vllm_replica(
    model_dir: Path, log_dir: Path, *, args: list[str] | None = None, engine_args: list[str] | None = None
) -> Proc:
    """`python -m psrl.worker --engine vllm` (ours: the stock servicer + ReplicaControl), ready to serve.

    vLLM logs to stdout, so stdout goes to the log file too (an unread pipe would fill and stall the replica);
    the ready line is read from there."""
    log = log_dir / f"vllm-replica-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "psrl.worker", "--engine", "vllm", "--model", str(model_dir), "--port", "0"]
    cmd += [*(args or []), "--", *engine_args_of(model_dir)[2:], *(engine_args or [])]
    with open(log, "wb") as out:
        proc = popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(), start_new_session=True, cwd=REPO)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        ready = [line.split()[1] for line in text.splitlines() if line.startswith("PSRL_WORKER_READY ")]
        if ready:
            return Proc(proc, ready[0], log)
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM replica exited with {proc.returncode}:\n{text}")
        time.sleep(0.2)
    stop_processes([proc])
    raise TimeoutError(f"vLLM replica not ready in {STARTUP_TIMEOUT_S}s:\n{log.read_text(errors='replace')}")


def greedy_request(
    rid: str, prompt: list[int], n: int, kv_transfer_params: dict | None = None
) -> vllm_engine_pb2.GenerateRequest:
    """A streamed greedy Generate of exactly `n` tokens (EOS ignored), optionally carrying KV-transfer params."""
    request = vllm_engine_pb2.GenerateRequest(
        request_id=rid,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        stream=True,
        sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
    )
    if kv_transfer_params is not None:
        request.kv_transfer_params_json = json.dumps(kv_transfer_params)
    return request
