"""`python -m psrl.gateway`: start the router on the first free port from 8100 and, when no replicas are
configured, replicas of its own: the embedded default (two reference replicas, one with dp_size 2), or
`--replica-engine vllm --model DIR --replicas N` vLLM ones; print how to call it."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from psrl.credentials import ROUTER_API_KEY_ENV, TOKEN_FILE_FLAG
from psrl.gateway.config import GatewayConfig, parse_args
from psrl.gateway.processes import first_free_port, spawn_module, stop_processes

logger = logging.getLogger("psrl.gateway")


class RolloutGateway:
    """Starts and stops the gateway's processes. Usable from Python (tests, training code) or the CLI."""

    def __init__(self, config: GatewayConfig) -> None:
        config.validate()
        self.config = config
        self.router_url = ""
        self.session_url = ""
        self._router: subprocess.Popen | None = None
        self._session: subprocess.Popen | None = None
        self._replicas: list[subprocess.Popen] = []

    @property
    def embedded(self) -> bool:
        return not self.config.worker_urls

    def _log(self, name: str) -> Path | None:
        return Path(self.config.log_dir) / f"{name}.log" if self.config.log_dir else None

    def start(self) -> None:
        cfg = self.config
        port = first_free_port(cfg.router_port_start, cfg.host)
        self.router_url = f"http://{cfg.host}:{port}"
        args = ["--host", cfg.host, "--port", str(port), "--policy", cfg.policy]
        if cfg.worker_urls:
            args += ["--worker-urls", *cfg.worker_urls]
        if cfg.enable_routing_loop:
            args.append("--enable-routing-loop")
        if cfg.psrl_ps_manager_addr:
            args += ["--psrl-ps-manager-addr", cfg.psrl_ps_manager_addr]
        if cfg.kv_transfer_enable:
            args.append("--kv-transfer-enable")
        for flag, value in (
            ("--tokenizer-path", cfg.tokenizer_path),
            ("--api-key", cfg.api_key),
            ("--admin-api-key", cfg.admin_api_key),
            (TOKEN_FILE_FLAG, cfg.replica_token_file),
        ):
            if value:
                args += [flag, value]
        self._router = spawn_module("psrl.router", [*args, *cfg.router_args], log_file=self._log("router"))
        try:
            self._wait_router()
            if self.embedded:
                self._start_embedded()
            self._wait_workers(len(cfg.worker_urls) or len(cfg.replica_dp_sizes))
            if cfg.enable_session_router:
                self._start_session_router()
        except BaseException:
            self.stop()
            raise

    def _start_session_router(self) -> None:
        cfg = self.config
        port = first_free_port(cfg.session_port_start, cfg.host)
        self.session_url = f"http://{cfg.host}:{port}"
        args = ["--router-url", self.router_url, "--host", cfg.host, "--port", str(port)]
        if cfg.admin_api_key:
            args += ["--admin-api-key", cfg.admin_api_key]
        if cfg.session_strategy != "none":
            args += ["--session-strategy", cfg.session_strategy]
            if cfg.admin_api_key:  # the strategy reads the router's /workers and /workers/stats
                args += ["--router-admin-api-key", cfg.admin_api_key]
        self._session = spawn_module("psrl.session", [*args, *cfg.session_args], log_file=self._log("session"))
        self._poll("SessionRouter", lambda c: c.get(f"{self.session_url}/control/sessions").status_code == 200)

    def _start_embedded(self) -> None:
        cfg = self.config
        for i, dp in enumerate(cfg.replica_dp_sizes):
            args = ["--engine", cfg.replica_engine, "--host", cfg.host, "--port", "0", "--router", self.router_url]
            args += ["--dp-size", str(dp), "--seed", str(cfg.embedded_seed), "--worker-id", f"replica-{i}"]
            if cfg.replica_engine == "reference":
                args += ["--torch-threads", str(cfg.embedded_torch_threads)]
            if cfg.embedded_model:
                args += ["--model", cfg.embedded_model]
            if cfg.replica_token_file:
                args += [TOKEN_FILE_FLAG, cfg.replica_token_file]
            # The admin key they register with goes in their environment, not on a command line others can read.
            env = {ROUTER_API_KEY_ENV: cfg.admin_api_key} if cfg.admin_api_key else None
            if cfg.replica_engine_args:
                args += ["--", *cfg.replica_engine_args]
            self._replicas.append(spawn_module("psrl.worker", args, log_file=self._log(f"replica-{i}"), env=env))

    def _admin_headers(self) -> dict[str, str]:
        key = self.config.admin_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _check_children(self) -> None:
        named = [
            ("router", self._router),
            ("session-router", self._session),
            *((f"replica-{i}", p) for i, p in enumerate(self._replicas)),
        ]
        for name, proc in named:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up")

    def _poll(self, what: str, ready) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        with httpx.Client(base_url=self.router_url, timeout=2.0, headers=self._admin_headers()) as client:
            while True:
                self._check_children()
                try:
                    if ready(client):
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} not ready within {self.config.startup_timeout_s}s")
                time.sleep(0.2)

    def _wait_router(self) -> None:
        self._poll("router", lambda c: c.get("/health").status_code == 200)

    def _wait_workers(self, n: int) -> None:
        self._poll(f"{n} workers", lambda c: len(c.get("/workers").json().get("workers", [])) >= n)

    def stop(self) -> None:
        stop_processes([p for p in (self._session, *self._replicas, self._router) if p is not None])
        self._replicas.clear()
        self._router = None
        self._session = None

    def wait(self) -> int:
        """Block until a child dies (returns its code) or the gateway is stopped."""
        while True:
            for proc in [self._router, *self._replicas, *([self._session] if self._session else [])]:
                if proc is None:
                    return 0
                if proc.poll() is not None:
                    return proc.returncode or 1
            time.sleep(0.5)

    def __enter__(self) -> RolloutGateway:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _banner(gw: RolloutGateway) -> str:
    with httpx.Client(base_url=gw.router_url, timeout=5.0, headers=gw._admin_headers()) as client:
        workers = client.get("/workers").json()["workers"]
    model = workers[0]["models"][0]["id"] if workers else "?"
    instances = sum(w["dp_size"] for w in workers)
    if not gw.embedded:
        kind = "configured"
    elif gw.config.replica_engine == "vllm":
        kind = "vLLM replicas started by the gateway"
    else:
        kind = "embedded default (reference replicas)"
    url = gw.router_url
    return f"""
psrl-gateway is up
  router    {url}   (OpenAI API under /v1, PSRL /generate, /workers, /tito/sessions)
  sessions  {gw.session_url or "(off)"}   (SessionRouter: POST /sessions, then /sessions/<id>/v1/...)
  replicas  {len(workers)} workers, {instances} instances, {kind}, model "{model}"

Try it:
  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 16}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model}', max_tokens=16, \\
messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"

Ctrl-C stops the gateway and every process it started.
"""


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gateway = RolloutGateway(parse_args(argv))

    def _on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops the gateway exactly like Ctrl-C

    signal.signal(signal.SIGTERM, _on_signal)
    code = 0
    try:
        gateway.start()
        print(_banner(gateway), flush=True)
        code = gateway.wait()
        if code:
            logger.error("a gateway process exited with code %s; stopping the rest", code)
    except KeyboardInterrupt:
        pass
    finally:
        gateway.stop()
    sys.exit(code)
