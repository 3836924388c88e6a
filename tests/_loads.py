"""A replica's GetLoads, for tests that must act while its requests decode."""

from __future__ import annotations

import asyncio

from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc


async def wait_decoding(
    stub: vllm_engine_pb2_grpc.VllmEngineStub, *, rank: int = 0, running: int = 1, timeout_s: float = 30.0
) -> None:
    """Wait until `running` requests run on dp rank `rank` and its KV in use grew past what it held when they
    first ran: they have generated tokens (a non-streamed request shows none until it ends)."""

    async def load() -> vllm_engine_pb2.SchedulerLoad:
        return (await stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(dp_rank=rank))).loads[0]

    async with asyncio.timeout(timeout_s):
        while (first := await load()).num_running_reqs < running:
            await asyncio.sleep(0.01)
        while (await load()).num_used_tokens <= first.num_used_tokens:
            await asyncio.sleep(0.01)
