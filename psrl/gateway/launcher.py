"""`python -m psrl.gateway`: start the router on the first free port from 8100 and, when no replicas are
configured, replicas of its own: the embedded default (two reference replicas, one with dp_size 2), or
`--replica-engine vllm --model DIR --replicas N` vLLM ones; print how to call it."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from psrl.credentials import (
    DATA_API_KEY_ENV,
    ROUTER_API_KEY_ENV,
    SESSION_API_KEY_ENV,
    TOKEN_ENV,
    TOKEN_FILE_FLAG,
    env_secret,
)
from psrl.gateway.config import GatewayConfig, parse_args
from psrl.gateway.processes import first_free_port, spawn_module, stop_processes
from psrl.worker.config import WILDCARD_HOSTS

logger = logging.getLogger("psrl.gateway")


class RolloutGateway:
    """Starts and stops the gateway's processes. Usable from Python (tests, training code, the Ray actor
    psrl.gateway.ray) or the CLI. The keys reach the children in their environment, never on a command line
    (psrl.credentials): the config's keys, else the gateway's own $PSRL_ROUTER_API_KEY and $PSRL_API_KEY;
    `replica_token`: the replicas' token, else the token file or $PSRL_REPLICA_TOKEN the children read."""

    def __init__(self, config: GatewayConfig, *, replica_token: str | None = None) -> None:
        config.validate()
        self.config = config
        self.router_url = ""
        self.session_url = ""
        self._router: subprocess.Popen | None = None
        self._session: subprocess.Popen | None = None
        self._replicas: list[subprocess.Popen] = []
        self.admin_key = config.admin_api_key or env_secret(ROUTER_API_KEY_ENV)
        keys = {
            ROUTER_API_KEY_ENV: self.admin_key,
            SESSION_API_KEY_ENV: self.admin_key,  # the SessionRouter's control endpoints take the same key
            DATA_API_KEY_ENV: config.api_key or env_secret(DATA_API_KEY_ENV),
            TOKEN_ENV: replica_token,
        }
        self._env = {name: value for name, value in keys.items() if value}

    @property
    def embedded(self) -> bool:
        return not self.config.worker_urls

    @property
    def call_host(self) -> str:
        """The host the processes call each other on: the bound one, or 127.0.0.1 for a wildcard."""
        return "127.0.0.1" if self.config.host.strip("[]") in WILDCARD_HOSTS else self.config.host

    def _children(self) -> list[subprocess.Popen]:
        """The processes started and not stopped yet, in the order they started."""
        return [p for p in (self._router, self._session, *self._replicas) if p is not None]

    def child_pids(self) -> list[int]:
        """Every process the gateway started and has not stopped yet."""
        return [p.pid for p in self._children()]

    def _log(self, name: str) -> Path | None:
        return Path(self.config.log_dir) / f"{name}.log" if self.config.log_dir else None

    def _spawn(self, module: str, args: list[str], name: str) -> subprocess.Popen:
        return spawn_module(module, args, log_file=self._log(name), env=self._env)

    def start(self) -> None:
        cfg = self.config
        port = first_free_port(cfg.router_port_start, cfg.host)
        self.router_url = f"http://{self.call_host}:{port}"
        args = ["--host", cfg.host, "--port", str(port), "--policy", cfg.policy]
        if cfg.worker_urls:
            args += ["--worker-urls", *cfg.worker_urls]
        if cfg.enable_routing_loop:
            args.append("--enable-routing-loop")
        if cfg.psrl_ps_manager_addr:
            args += ["--psrl-ps-manager-addr", cfg.psrl_ps_manager_addr]
        if cfg.kv_transfer_enable:
            args.append("--kv-transfer-enable")
        if cfg.tokenizer_path:
            args += ["--tokenizer-path", cfg.tokenizer_path]
        if cfg.replica_token_file:
            args += [TOKEN_FILE_FLAG, cfg.replica_token_file]
        self._router = self._spawn("psrl.router", [*args, *cfg.router_args], "router")
        try:
            self._wait_router()
            if self.embedded:
                self._start_embedded()
            self.wait_for_workers(len(cfg.worker_urls) or len(cfg.replica_dp_sizes))
            if cfg.enable_session_router:
                self._start_session_router()
        except BaseException:
            self.stop()
            raise

    def _start_session_router(self) -> None:
        cfg = self.config
        port = first_free_port(cfg.session_port_start, cfg.host)
        self.session_url = f"http://{self.call_host}:{port}"
        args = ["--router-url", self.router_url, "--host", cfg.host, "--port", str(port)]
        if cfg.session_strategy != "none":  # the strategy reads /workers with $PSRL_ROUTER_API_KEY
            args += ["--session-strategy", cfg.session_strategy]
        self._session = self._spawn("psrl.session", [*args, *cfg.session_args], "session")
        self._poll("SessionRouter", lambda c: c.get(f"{self.session_url}/control/sessions").status_code == 200)

    def _start_embedded(self) -> None:
        cfg = self.config
        for i, dp in enumerate(cfg.replica_dp_sizes):
            args = ["--engine", cfg.replica_engine, "--host", cfg.host, "--port", "0", "--router", self.router_url]
            args += ["--dp-size", str(dp), "--seed", str(cfg.embedded_seed), "--worker-id", f"replica-{i}"]
            if self.call_host != cfg.host:  # bound to every address: registered where the router calls it
                args += ["--advertise-host", self.call_host]
            if cfg.replica_engine == "reference":
                args += ["--torch-threads", str(cfg.embedded_torch_threads)]
            if cfg.embedded_model:
                args += ["--model", cfg.embedded_model]
            if cfg.replica_token_file:
                args += [TOKEN_FILE_FLAG, cfg.replica_token_file]
            if cfg.replica_engine_args:
                args += ["--", *cfg.replica_engine_args]
            self._replicas.append(self._spawn("psrl.worker", args, f"replica-{i}"))

    def admin_headers(self) -> dict[str, str]:
        key = self.admin_key
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
        with httpx.Client(base_url=self.router_url, timeout=2.0, headers=self.admin_headers()) as client:
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

    def wait_for_workers(self, n: int) -> None:
        """Wait until the router lists `n` workers (the configured ones, or replicas registering themselves)."""
        self._poll(f"{n} workers", lambda c: len(c.get("/workers").json().get("workers", [])) >= n)

    def wait_for_registered(self, urls: Sequence[str]) -> None:
        """Wait until the router lists a worker at each of `urls`."""

        def listed(client: httpx.Client) -> bool:
            return set(urls) <= {w["url"] for w in client.get("/workers").json().get("workers", [])}

        self._poll(f"workers {', '.join(urls)}", listed)

    def running(self) -> bool:
        """Whether every process the gateway started is still running (False once stopped)."""
        procs = self._children()
        return bool(procs) and all(p.poll() is None for p in procs)

    def stop(self) -> None:
        stop_processes(self._children()[::-1])  # the router last: the others call it
        self._replicas.clear()
        self._router = None
        self._session = None

    def wait(self) -> int:
        """Block until a child dies (returns its code) or the gateway is stopped."""
        while True:
            if self._router is None:  # stopped
                return 0
            for proc in self._children():
                if proc.poll() is not None:
                    return proc.returncode or 1
            time.sleep(0.5)

    def __enter__(self) -> RolloutGateway:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _banner(gw: RolloutGateway) -> str:
    with httpx.Client(base_url=gw.router_url, timeout=5.0, headers=gw.admin_headers()) as client:
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
