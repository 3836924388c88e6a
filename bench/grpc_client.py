"""The router's gRPC edge alone: CPU per Generate call of grpc.aio's client against psrl.router.grpc_stream (the
router's libcurl client), side by side in one run, against the same reference replicas.

No router and no HTTP: each client runs in this process on uvloop and keeps C calls in flight (--connections,
default 64 and 1), each one a non-streamed Generate of 200 input ids and 1 new token, as the grpc section of
router_overhead.py sends. Per window: calls/s and this process's CPU (utime+stime, all threads) per call. The
clients alternate window by window (--repeat rounds), and the table shows medians, min-max and curl/grpc.aio.

Run from the repo root: python bench/grpc_client.py [--duration 4] [--repeat 3] [--connections 64 1]
Results: a table on stdout and JSON under bench/out/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import benchlib
import grpc
import uvloop
from benchlib import HOST, REPO, Procs, own_cpu_s, wait_for_log
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from psrl.router.grpc_stream import CurlGrpc
from psrl.router.worker_client import GENERATE_METHOD

IDS = [1 + i % 500 for i in range(200)]
Client = Callable[[str, pb.GenerateRequest], Awaitable[list[pb.GenerateResponse]]]


def _request(i: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"bench-{i}",
        tokenized=pb.TokenizedInput(input_ids=IDS),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=1),
        stream=False,
    )


class GrpcAio:
    name = "grpc.aio"

    def __init__(self, targets: list[str]) -> None:
        self.channels = [grpc.aio.insecure_channel(t) for t in targets]
        self.stubs = [pb_grpc.VllmEngineStub(c) for c in self.channels]

    async def call(self, i: int) -> list[pb.GenerateResponse]:
        return [f async for f in self.stubs[i % len(self.stubs)].Generate(_request(i), timeout=60)]

    async def close(self) -> None:
        for c in self.channels:
            await c.close()


class Curl:
    name = "curl"

    def __init__(self, targets: list[str]) -> None:
        self.targets = targets
        self.client = CurlGrpc()

    async def call(self, i: int) -> list[pb.GenerateResponse]:
        call = self.client.unary_stream(
            self.targets[i % len(self.targets)],
            GENERATE_METHOD,
            _request(i).SerializeToString(),
            pb.GenerateResponse.FromString,
            timeout_s=60,
        )
        frames = []
        while (frame := await call.read()) is not None:
            frames.append(frame)  # type: ignore[arg-type]
        return frames

    async def close(self) -> None:
        self.client.close()


async def window(kind: type, targets: list[str], conns: int, seconds: float) -> dict[str, float]:
    client = kind(targets)
    counter = [0]

    async def worker(w: int, until: float) -> None:
        i = w
        while time.monotonic() < until:
            frames = await client.call(i)
            if frames[-1].WhichOneof("response") != "complete":
                raise RuntimeError(f"{client.name}: no complete frame in {frames}")
            counter[0] += 1
            i += conns

    await asyncio.gather(*(worker(w, time.monotonic() + 1.0) for w in range(conns)))  # warm-up, connections up
    counter[0] = 0
    cpu0, t0 = own_cpu_s(), time.monotonic()
    await asyncio.gather(*(worker(w, t0 + seconds) for w in range(conns)))
    cpu, wall = own_cpu_s() - cpu0, time.monotonic() - t0
    await client.close()
    return {"calls_per_s": counter[0] / wall, "us_per_call": cpu / max(counter[0], 1) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=4.0, help="measured seconds per window")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; each client gets one window per round")
    ap.add_argument("--connections", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--replicas", type=int, default=2)
    args = ap.parse_args()

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = REPO / "bench" / "out"
    with Procs(Path(tempfile.mkdtemp(prefix="grpc-client-"))) as procs:
        started = []
        for n in range(args.replicas):
            argv = [sys.executable, "-m", "psrl.worker", "--host", HOST, "--port", "0", "--dp-size", "1"]
            started.append((f"replica{n + 1}", procs.start(f"replica{n + 1}", [*argv, "--torch-threads", "1"])))
        targets = []
        for name, proc in started:
            match = wait_for_log(procs, name, proc, r"PSRL_WORKER_READY grpc://(\S+)", 180)
            targets.append(match.group(1))
        results: dict[str, dict[int, list[dict[str, float]]]] = {
            k.name: {c: [] for c in args.connections} for k in (GrpcAio, Curl)
        }
        for conns in args.connections:
            for _ in range(args.repeat):
                for kind in (GrpcAio, Curl):
                    results[kind.name][conns].append(uvloop.run(window(kind, targets, conns, args.duration)))

    print(
        f"\nGenerate client CPU per call (this process, all threads), {args.replicas} reference replicas, "
        f"{args.repeat} x {args.duration:g} s windows, median (min-max)"
    )
    print(f"{'client':10s} {'conns':>5s} {'calls/s':>8s} {'us/call':>8s} {'min-max':>11s} {'x grpc.aio':>10s}")
    summary = {}
    for conns in args.connections:
        base = statistics.median(w["us_per_call"] for w in results["grpc.aio"][conns])
        for name in ("grpc.aio", "curl"):
            ws = results[name][conns]
            us = [w["us_per_call"] for w in ws]
            med = statistics.median(us)
            rate = statistics.median(w["calls_per_s"] for w in ws)
            summary[f"{name}@{conns}"] = {"us_per_call": med, "calls_per_s": rate, "x_grpc_aio": med / base}
            print(f"{name:10s} {conns:5d} {rate:8.0f} {med:8.0f} {min(us):5.0f}-{max(us):<5.0f} {med / base:10.2f}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"grpc_client_{stamp}.json"
    path.write_text(
        json.dumps(
            {"env": benchlib.environment(), "args": vars(args), "summary": summary, "windows": results}, indent=1
        )
    )
    print(f"JSON: {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
