"""Instructions per request of the router's middle alone, counted by valgrind's callgrind.

The router's app is built in this process with --workers workers (two by default) under --policy (round_robin),
and its edges are replaced by ones that answer at once: for `generate` and `chat` (a chat of 200 words, `max_tokens: 1`,
as router_overhead.py's grpc section sends), the gRPC client's call returns a complete Generate frame (gRPC workers);
for `proxied`, the HTTP client returns a fixed chat answer (HTTP-only workers).
Requests then go through the app's own routing (`App.handle`), so what runs is everything between our HTTP server
and our clients: the endpoint wrapper, the pipeline, selection, metrics, the answer's shape. No sockets, no
event-loop waits. The
cyclic GC is set as the router's server sets it once it listens (`psrl.serving.server.tune_gc`; a tree from before
that helper runs on Python's default GC).

Each count is two runs under callgrind, one with --requests and one with none (both with the same warm-up),
and the difference divided by --requests: start-up, imports and the warm-up cancel out. The figure moves well
under 1% from run to run, where `router_instructions.py` (a whole router behind real replicas) moves about 2%,
so it weighs a change of the middle in a few minutes. It counts work, not time: what a request costs at 1
connection also depends on the caches it finds (docs/performance.md, "The edges and the middle").

Run from the repo root with the venv active (valgrind must be installed):
    python bench/router_middle.py                        # every load, this tree
    python bench/router_middle.py --ab-src /tmp/old      # also another tree (git archive + _proto + the .so)
    python bench/router_middle.py --workers 64           # what a request costs in front of a larger fleet
    python bench/router_middle.py --loads generate --prompt-ids 3000   # a /generate of a longer prompt
    python bench/router_middle.py --child generate 100   # the loop alone, no valgrind (what the counts run)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import router_overhead as ro
from router_instructions import read_dump

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
LOADS = ("generate", "chat", "proxied")
WARMUP = 50


def warmup(workers: int) -> int:
    """Requests before the counted ones: at least two per worker, so that each worker's first request (its URL's
    parts worked out and cached, say) falls in the warm-up, which both runs of a count share, and not in the
    requests counted."""
    return max(WARMUP, 2 * workers)


def _generate_app(workers: int, policy: str, prompt_ids: int, chat: bool) -> tuple[Any, str, bytes, list[str]]:
    """The app with gRPC workers whose Generate answers at once; the path, the body (for `chat`, a chat of 200 words
    with `max_tokens: 1`, else a `/generate` of `prompt_ids` ids), and each call's target."""
    from smg_grpc_proto.generated import vllm_engine_pb2

    from psrl.router.app import RouterApp
    from psrl.router.config import parse_args
    from psrl.tokenizer import build_tiny_tokenizer

    app = RouterApp(parse_args(["--tokenizer-path", str(build_tiny_tokenizer()), "--policy", policy]))
    for i in range(workers):
        app.registry.create_worker(
            str(i), f"grpc://127.0.0.1:{9000 + i}", models=["tiny"], labels={}, max_context_length=8192
        )
    frame = vllm_engine_pb2.GenerateResponse()
    frame.complete.output_ids.extend([42])
    frame.complete.finish_reason = "length"
    frame.complete.prompt_tokens = prompt_ids
    wire = frame.SerializeToString()
    reached: list[str] = []

    class Call:  # a finished unary-stream call: its one frame, then the end
        def __init__(self) -> None:
            self._frames = [vllm_engine_pb2.GenerateResponse.FromString(wire)]

        async def read(self) -> Any:
            return self._frames.pop() if self._frames else None

        def release(self, grace_s: float) -> None:
            pass

        def cancel(self) -> bool:
            return False

        def done(self) -> bool:
            return True

        async def wait_for_connection(self) -> None:
            pass

    class Streams:  # the router's libcurl client, as `WorkerClients` uses it
        def unary_stream(self, target: str, method: str, request: bytes, *args: Any, **kwargs: Any) -> Call:
            reached.append(target)
            return Call()

        def close(self) -> None:
            pass

    app.clients._streams = Streams()  # the gRPC edge
    if chat:
        words = " ".join(f"word{i}" for i in range(200))
        body = {"model": "tiny", "messages": [{"role": "user", "content": words}], "max_tokens": 1}
        return app, "/v1/chat/completions", json.dumps(body).encode(), reached
    ids = [3 + (i * 37) % 600 for i in range(prompt_ids)]
    body = {"model": "tiny", "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    return app, "/generate", json.dumps(body).encode(), reached


def _proxied_app(workers: int, policy: str) -> tuple[Any, str, bytes, list[str]]:
    """The app with HTTP-only workers whose answer comes at once; the path, the body, and each call's target."""
    from psrl.router.app import RouterApp
    from psrl.router.config import parse_args
    from psrl.router.http_client import HttpResponse

    app = RouterApp(parse_args(["--policy", policy, "--connection-mode", "http"]))
    for i in range(workers):
        app.registry.create_worker(
            str(i),
            f"http://127.0.0.1:{9000 + i}",
            models=["fast"],
            labels={},
            max_context_length=8192,
            connection_mode="http",
        )
    answer = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}
    raw = json.dumps(answer).encode()
    reached: list[str] = []

    class Client:  # the router's HTTP client, as `HttpWorkers` uses it for a non-streamed request
        async def post(self, host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> HttpResponse:
            reached.append(f"{host}:{port}")
            return HttpResponse(200, {"content-type": "application/json"}, raw)

        def close(self) -> None:
            pass

    app.http._fast = Client()  # the HTTP edge
    words = " ".join(f"word{i}" for i in range(200))
    body = {"model": "fast", "messages": [{"role": "user", "content": words}], "max_tokens": 16}
    return app, "/v1/chat/completions", json.dumps(body).encode(), reached


def child(
    load: str, requests: int, workers: int = 2, policy: str = "round_robin", psrl: bool = False, prompt_ids: int = 200
) -> dict[str, Any]:
    """Send warmup(workers) + `requests` requests of `load` through the app (with `psrl`, each with PSRL's two routing
    headers, so it goes through selection's five steps); what the last one answered."""
    import uvloop

    from psrl.serving import server
    from psrl.serving.http1 import Request

    if load in ("generate", "chat"):
        app, path, body, reached = _generate_app(workers, policy, prompt_ids, load == "chat")
    else:
        app, path, body, reached = _proxied_app(workers, policy)
    # The GC as the router's server sets it once it listens. A tree given to --ab-src from before 7 December 2026
    # has no `tune_gc` and runs on Python's default GC, as it was counted then (the counts differ by under 1%).
    tune_gc = getattr(server, "tune_gc", None)
    if tune_gc is not None:
        tune_gc()
    headers = {"host": "127.0.0.1", "content-type": "application/json", "content-length": str(len(body))}

    async def run() -> dict[str, Any]:
        response = None
        for i in range(warmup(workers) + requests):
            sent = dict(headers)
            if psrl:
                sent["x-request-id"] = sent["x-prompt-id"] = str(i)
            request = Request("POST", path, b"", sent, True)
            request.body = body
            response = await app.app.handle(request)
            if response.status_code != 200:
                raise RuntimeError(f"{load}: {response.status_code} {response.body[:300]!r}")
        assert response is not None
        return {
            "status": response.status_code,
            "body": json.loads(response.body),
            "upstream_calls": len(reached),
            "workers_reached": len(set(reached)),
        }

    return uvloop.run(run())


def count(load: str, requests: int, src: str | None, out_dir: Path, args: argparse.Namespace) -> int:
    """Instructions per request of `load`'s middle (see the module docstring), with the --workers, --policy,
    --psrl and --prompt-ids of `args`. The child runs psrl from `src` as router_overhead.py runs a router from
    --router-src."""
    summaries = []
    for n in (0, requests):
        dump = out_dir / f"{load}-{n}{'-b' if src else ''}.out"
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={dump}"]
        argv += [*ro.psrl_argv(argparse.Namespace(router_src=None), "router_middle", src), "--child", load, str(n)]
        argv += ["--workers", str(args.workers), "--policy", args.policy, "--prompt-ids", str(args.prompt_ids)]
        argv += ["--psrl"] if args.psrl else []
        env = {**os.environ, "PYTHONPATH": str(BENCH), "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"}
        done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        summaries.append(read_dump(dump)[0])
    return round((summaries[1] - summaries[0]) / requests)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loads", nargs="+", choices=LOADS, default=list(LOADS))
    p.add_argument("--requests", type=int, default=2000, help="requests counted, after the warm-up")
    p.add_argument("--ab-src", metavar="DIR", help="also count the middle of the tree in DIR/psrl")
    p.add_argument("--workers", type=int, default=2, help="workers registered (one instance each)")
    p.add_argument("--policy", default="round_robin", help="the router's --policy")
    p.add_argument("--psrl", action="store_true", help="send x-request-id and x-prompt-id: PSRL's selection")
    p.add_argument("--prompt-ids", type=int, default=200, help="token ids in a /generate prompt")
    p.add_argument("--child", nargs=2, metavar=("LOAD", "N"), help="run the loop alone (what is counted)")
    args = p.parse_args(argv)
    if args.child:
        load, n = args.child
        if load not in LOADS:
            p.error(f"--child: a load of {LOADS}, not {load!r}")
        print(json.dumps(child(load, int(n), args.workers, args.policy, args.psrl, args.prompt_ids)))
        return
    if args.requests < 1:
        p.error("--requests: at least 1")
    if args.workers < 1:
        p.error("--workers: at least 1")
    if args.prompt_ids < 1:
        p.error("--prompt-ids: at least 1")
    out_dir = REPO / "bench" / "out" / "router_middle"
    out_dir.mkdir(parents=True, exist_ok=True)
    trees = [("this tree", None), *([(args.ab_src, args.ab_src)] if args.ab_src else [])]
    psrl = ", PSRL headers" if args.psrl else ""
    print(f"{args.workers} workers, {args.policy}{psrl}, /generate prompts of {args.prompt_ids} ids", flush=True)
    results: dict[str, dict[str, int]] = {}
    for load in args.loads:
        for name, src in trees:
            results.setdefault(load, {})[name] = count(load, args.requests, src, out_dir, args)
            print(f"{load:9} {name}: {results[load][name]:,} instructions a request", flush=True)
        if args.ab_src:
            a, b = results[load]["this tree"], results[load][args.ab_src]
            print(f"{load:9} b/a: {b / a:.3f}", flush=True)
    summary = {"requests": args.requests, "workers": args.workers, "policy": args.policy, "psrl": args.psrl}
    summary["prompt_ids"] = args.prompt_ids
    summary["results"] = results
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
