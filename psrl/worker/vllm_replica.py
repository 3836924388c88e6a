"""`python -m psrl.worker --engine vllm`: a real vLLM replica of ours.

vLLM's AsyncLLM behind the stock smg-grpc-servicer (`VllmEngineServicer`, used as it is: generation, frames,
aborts, loads and the tokenizer are vLLM's), plus on the same gRPC server our `ReplicaControl` mapped onto
AsyncLLM (psrl/worker/vllm_control.py), the standard health service and server reflection. The only thing
added in front of the stock Generate is the admission gate of a weight sync: while a sync pauses the replica
(or after it failed) a new Generate gets the empty "abort" frame at once instead of queueing in a paused
engine, as the reference replica does.

Routed experts (MoE routing replay): vLLM returns them with a finished output when the engine runs with
`--enable-return-routed-experts` (vLLM's Model Runner V2, which needs Triton: a GPU build). The stock proto has
no field for them, so a Generate that asks (metadata `x-psrl-routed-experts-start`, psrl.worker.routed_experts)
gets `routed_experts_prompt_start` set on its sampling params, and each choice's rows are kept for our
`psrl.experts.RoutedExperts` service as its complete frame is built. A replica without the flag says so there.

vLLM's engine arguments come after `--` on our command line and go to vLLM's own parser; ours (`--model`,
`--served-model-name`, `--dp-size`, `--host`, `--port`, `--router`) are translated. A model folder without
weights is served with `--load-format dummy` (random weights; LoadWeights then needs a loader that reads
files).
"""

from __future__ import annotations

import contextvars
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl._proto import kv_migration_pb2_grpc, replica_control_pb2_grpc, routed_experts_pb2_grpc
from psrl.lifetime import end_with_us
from psrl.worker.admission import ACCEPTED_METADATA_KEY, AdmissionGate, refused_complete
from psrl.worker.grpc_services import (
    KV_MIGRATION_SERVICE,
    REPLICA_CONTROL_SERVICE,
    VLLM_ENGINE_SERVICE,
    add_health_and_reflection,
    replica_grpc_server,
)
from psrl.worker.kv_migration import KvTransferParamsError, kv_transfer_params_object
from psrl.worker.model_folder import WEIGHTS_FILE
from psrl.worker.registration import serve_replica
from psrl.worker.routed_experts import (
    BadRoutedExpertsAsk,
    RoutedExpertsServicer,
    RoutedExpertsStore,
    asked_start,
)

if TYPE_CHECKING:
    from psrl.worker.config import WorkerArgs

logger = logging.getLogger("psrl.worker")

# vLLM on a machine without CUDA (the CPU build): keep the model executor inside the engine-core process and
# give the KV cache a modest default, unless the user chose otherwise.
CPU_ENV_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
# vLLM's engine core starts after this process made its gRPC server: gRPC does not survive a fork.
ENV_DEFAULTS = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def apply_env_defaults(engine_args: Sequence[str] = ()) -> None:
    """Before vLLM is imported: its settings are read from the environment at import."""
    import torch

    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if any(a.startswith("--enable-return-routed-experts") for a in engine_args):
        # vLLM captures routed experts in Model Runner V2 only; its default picks V1 where V2 lacks a feature.
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    if not torch.cuda.is_available():
        for key, value in CPU_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)


def vllm_argv(args: WorkerArgs) -> list[str]:
    """Our flags in vLLM's terms, then the user's own engine arguments (which win where they repeat one)."""
    assert args.model is not None
    extra = args.engine_args
    argv = ["--model", args.model, "--data-parallel-size", str(args.dp_size), "--seed", str(args.seed)]
    # Served under the folder's name, as the reference replica is: a mixed fleet serves one model id.
    argv += ["--served-model-name", args.served_model_name or os.path.basename(os.path.normpath(args.model))]
    if not os.path.isfile(os.path.join(args.model, WEIGHTS_FILE)) and not any(
        a.startswith("--load-format") for a in extra
    ):
        argv += ["--load-format", "dummy"]
    return argv + extra


def kv_migration_off_reason(args: WorkerArgs) -> str | None:
    """Why this vLLM replica runs without psrl's KV connector (None: it loads it)."""
    if args.kv_pin_ttl_s <= 0:
        return "--kv-pin-ttl-s is 0"
    if args.dp_size > 1:
        return "the connector serves one engine per replica (--dp-size 1)"
    if any(a.startswith("--kv-transfer-config") for a in args.engine_args):
        return "the engine arguments name their own --kv-transfer-config"
    return None


class FinalOnly:
    """A streamed Generate's frames folded into what a non-streamed one answers: one complete frame per
    choice (index), carrying every id and log-prob the choice produced, in index order, once all finished.

    Streamed, each chunk carries a choice's new ids and the complete frame repeats the last chunk's delta,
    so ids and log-probs come from the chunks and everything else from the complete frame.
    """

    def __init__(self) -> None:
        self._chunks: dict[int, list[vllm_engine_pb2.GenerateStreamChunk]] = {}
        self._completes: dict[int, vllm_engine_pb2.GenerateComplete] = {}

    def add(self, frame: vllm_engine_pb2.GenerateResponse) -> None:
        if frame.WhichOneof("response") == "chunk":
            self._chunks.setdefault(frame.chunk.index, []).append(frame.chunk)
        else:
            self._completes[frame.complete.index] = frame.complete

    def completes(self) -> list[vllm_engine_pb2.GenerateComplete]:
        out = []
        for index in sorted(self._completes):
            complete = vllm_engine_pb2.GenerateComplete()
            complete.CopyFrom(self._completes[index])
            chunks = self._chunks.get(index, [])
            del complete.output_ids[:]
            complete.ClearField("output_logprobs")
            for chunk in chunks:
                complete.output_ids.extend(chunk.token_ids)
                if chunk.HasField("output_logprobs"):
                    lp = complete.output_logprobs
                    lp.token_logprobs.extend(chunk.output_logprobs.token_logprobs)
                    lp.token_ids.extend(chunk.output_logprobs.token_ids)
                    lp.top_logprobs.extend(chunk.output_logprobs.top_logprobs)
            if chunks and chunks[0].HasField("input_logprobs"):
                complete.input_logprobs.CopyFrom(chunks[0].input_logprobs)
            complete.completion_tokens = len(complete.output_ids)
            out.append(complete)
        return out


# The Generate call being served and the position it asks routed experts from. Each gRPC call runs in a task of
# its own, so the stock servicer's helpers called inside it (sampling params, complete frames) see its value.
_ROUTED_ASK: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("psrl_routed_ask", default=None)


def routed_experts_unsupported(vllm_config: Any) -> str | None:
    """Why this vLLM engine cannot return routed experts (None when it can)."""
    if not vllm_config.aux_output_config.enable_return_routed_experts:
        return "this vLLM replica runs without --enable-return-routed-experts"
    if not vllm_config.model_config.is_moe:
        return "the model has no MoE layers"
    return None


def _gated_servicer_class() -> type:
    from smg_grpc_servicer.vllm.servicer import VllmEngineServicer

    class GatedVllmEngineServicer(VllmEngineServicer):
        """The stock servicer, with a weight sync's admission gate in front of Generate, and the routed experts
        a Generate asks for kept for `routed_experts`."""

        def __init__(
            self, llm: Any, start_time: float, gate: AdmissionGate, routed_experts: RoutedExpertsServicer
        ) -> None:
            super().__init__(llm, start_time)
            self.gate = gate
            self.routed_experts = routed_experts

        def _sampling_params_from_proto(self, params: Any, stream: bool = True, kv_transfer_params: Any = None) -> Any:
            sampling = super()._sampling_params_from_proto(params, stream=stream, kv_transfer_params=kv_transfer_params)
            ask = _ROUTED_ASK.get()
            if ask is not None:
                sampling.routed_experts_prompt_start = ask[1]
            return sampling

        def _complete_response(
            self,
            output: Any,
            completion: Any = None,
            num_logprobs: int | None = None,
            num_prompt_logprobs: int | None = None,
            media_identity: Any = None,
        ) -> vllm_engine_pb2.GenerateResponse:
            ask = _ROUTED_ASK.get()
            choice: Any = completion if completion is not None else (output.outputs[0] if output.outputs else None)
            rows = getattr(choice, "routed_experts", None)
            if ask is not None and choice is not None and rows is not None:
                # Kept before the frame goes out: a router that read it can take them at once.
                self.routed_experts.store.put(ask[0], choice.index, np.asarray(rows), ask[1])
            return super()._complete_response(
                output,
                completion=completion,
                num_logprobs=num_logprobs,
                num_prompt_logprobs=num_prompt_logprobs,
                media_identity=media_identity,
            )

        async def Generate(
            self, request: vllm_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
            reason = self.gate.closed_reason
            if reason is not None:
                logger.info("Generate %s refused: %s", request.request_id, reason)
                yield vllm_engine_pb2.GenerateResponse(complete=refused_complete(len(request.tokenized.input_ids)))
                return
            if request.HasField("kv_transfer_params_json"):
                try:  # the stock servicer's json.loads has no depth bound: a hostile value is refused here
                    kv_transfer_params_object(request.kv_transfer_params_json)
                except KvTransferParamsError as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            try:
                start = asked_start(context.invocation_metadata())
            except BadRoutedExpertsAsk as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if start is not None and self.routed_experts.unsupported is None:
                _ROUTED_ASK.set((request.request_id, start))  # this call's task only
            self.gate.started(request.request_id)
            finish_reason = None
            try:
                # At once, not with the first frame (the only one of a non-streamed call comes at its end): the
                # router's routing loop holds a sync's pause barrier until the call is on the wire.
                await context.send_initial_metadata(((ACCEPTED_METADATA_KEY, "1"),))
                if request.stream:
                    async for frame in super().Generate(request, context):
                        if frame.WhichOneof("response") == "complete" and finish_reason != "abort":
                            finish_reason = frame.complete.finish_reason  # any aborted choice: an abort
                        yield frame
                    return
                # vLLM's final-only output drops what an aborted request produced; streamed, every token
                # arrives as it is made, so a sync abort loses nothing. Answered as final-only would be.
                streamed = vllm_engine_pb2.GenerateRequest()
                streamed.CopyFrom(request)
                streamed.stream = True
                final = FinalOnly()
                async for frame in super().Generate(streamed, context):
                    final.add(frame)
                for complete in final.completes():
                    if finish_reason != "abort":
                        finish_reason = complete.finish_reason
                    yield vllm_engine_pb2.GenerateResponse(complete=complete)
            finally:
                self.gate.ended(request.request_id, finish_reason)

    return GatedVllmEngineServicer


async def serve_vllm(args: WorkerArgs) -> None:
    if args.model is None:
        raise SystemExit("--engine vllm needs --model DIR")
    apply_env_defaults(args.engine_args)
    from smg_grpc_servicer.vllm.health_servicer import VllmHealthServicer
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    from psrl.worker.vllm_control import VllmReplicaControl

    start_time = time.time()
    # Bound first: KV migration's connector needs the address peers will name this replica by. The token
    # guards the stock servicer, ReplicaControl and KvMigration alike (an interceptor on the whole server).
    token = args.replica_token()
    server, target = replica_grpc_server(args.host, args.port, token=token)
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm engine arguments"))
    engine_args = AsyncEngineArgs.from_cli_args(parser.parse_args(vllm_argv(args)))
    off = kv_migration_off_reason(args)
    if off is None and engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size > 1:
        off = "the connector serves one worker per engine (tensor and pipeline parallel size 1)"
    side_dir: tempfile.TemporaryDirectory[str] | None = None
    proxy = None
    if off is None:
        from vllm.config import KVTransferConfig

        from psrl.worker.vllm_kv import KvMigrationProxy, kv_transfer_config

        side_dir = tempfile.TemporaryDirectory(prefix="psrl-kv-")
        side_channel = f"unix:{side_dir.name}/side.sock"
        config = kv_transfer_config(
            self_target=target,
            advertised=args.advertised(target),
            node_id=args.node(),
            side_channel=side_channel,
            pin_ttl_s=args.kv_pin_ttl_s,
            shm_pool_bytes=args.kv_shm_pool_mib << 20,
            pin_max_bytes=args.kv_pin_max_mib << 20,
            replica_token_file=args.replica_token_file,
        )
        engine_args.kv_transfer_config = KVTransferConfig(**config)
        proxy = KvMigrationProxy(side_channel)
    else:
        logger.info("KV migration off: %s", off)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    llm = AsyncLLM.from_vllm_config(vllm_config=vllm_config, usage_context=UsageContext.OPENAI_API_SERVER)
    # vLLM's EngineCore process does not watch this one: a replica killed outright would leave it running.
    watcher = end_with_us([child.pid for child in multiprocessing.active_children() if child.pid is not None])

    gate = AdmissionGate()
    routed_experts = RoutedExpertsServicer(RoutedExpertsStore(), routed_experts_unsupported(vllm_config))
    servicer = _gated_servicer_class()(llm, start_time, gate, routed_experts)

    async def waiting() -> int:
        loads = await servicer.GetLoads(vllm_engine_pb2.GetLoadsRequest(), None)
        return sum(x.num_waiting_reqs for x in loads.loads)

    control = VllmReplicaControl(llm, gate, waiting)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
    replica_control_pb2_grpc.add_ReplicaControlServicer_to_server(control, server)
    routed_experts_pb2_grpc.add_RoutedExpertsServicer_to_server(routed_experts, server)
    served: tuple[str, ...] = (VLLM_ENGINE_SERVICE, REPLICA_CONTROL_SERVICE)
    if proxy is not None:
        kv_migration_pb2_grpc.add_KvMigrationServicer_to_server(proxy, server)
        served += (KV_MIGRATION_SERVICE,)
    # vLLM's own health service (it asks AsyncLLM.check_health); reflection lists what this replica serves.
    health = add_health_and_reflection(server, VllmHealthServicer(llm), served)
    await server.start()
    cache = vllm_config.cache_config
    served_name = vllm_config.model_config.served_model_name
    failed = await serve_replica(
        args,
        target,
        served_name,
        kv_capacity_tokens=(cache.num_gpu_blocks or 0) * cache.block_size,
        kv_block_size=cache.block_size,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        engine="vllm",
        replica_token=token,
    )
    health.set_not_serving()
    await server.stop(grace=1.0)
    if proxy is not None:
        await proxy.close()
    llm.shutdown()
    if watcher is not None:  # its work is done: the engine ended with the shutdown
        watcher.kill()
        watcher.wait()
    if side_dir is not None:
        side_dir.cleanup()
    if failed:
        raise SystemExit(1)
