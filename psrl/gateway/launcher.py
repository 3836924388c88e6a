"""`python -m psrl.gateway`: start the router on the first free port from 8100 and, when no replicas are
configured, replicas of its own: the embedded default (two reference replicas, one with dp_size 2), or
`--replica-engine vllm --model DIR --replicas N` vLLM ones; print how to call it."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from psrl.gateway.processes import first_free_port, spawn_module, stop_processes
from psrl.replica_auth import ROUTER_API_KEY_ENV, TOKEN_FILE_FLAG, load_replica_token

logger = logging.getLogger("psrl.gateway")
REPLICA_ENGINES = ("reference", "vllm")


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    router_port_start: int = 8100
    session_port_start: int = 8200
    enable_session_router: bool = True
    worker_urls: list[str] = field(default_factory=list)
    policy: str = "round_robin"
    tokenizer_path: str | None = None
    api_key: str | None = None
    admin_api_key: str | None = None
    # The replicas' shared gRPC token, given to the router and to the replicas started here (psrl.replica_auth);
    # without it they use $PSRL_REPLICA_TOKEN, which they inherit from the gateway.
    replica_token_file: str | None = None
    # As PSRL launches it: the routing loop on, the psrl selector (the router's default), and an optional
    # PSManager ("" disables selection stage 4).
    enable_routing_loop: bool = True
    psrl_ps_manager_addr: str = ""
    router_args: list[str] = field(default_factory=list)  # extra `python -m psrl.router` flags, passed as given
    # Replicas of the gateway's own, started only when worker_urls is empty.
    replica_engine: str = "reference"  # or "vllm" (python -m psrl.worker --engine vllm)
    embedded_model: str | None = None  # a model folder; default: the tiny one built locally (reference only)
    embedded_dp_sizes: list[int] | None = None  # one replica per entry; default: [1, 2] reference, [1] vLLM
    replica_engine_args: list[str] = field(default_factory=list)  # vLLM engine arguments for each vLLM replica
    kv_transfer_enable: bool = False  # KV migration on loop-backs (the router's --kv-transfer-enable)
    embedded_seed: int = 0
    embedded_torch_threads: int = 1
    startup_timeout_s: float = 180.0
    log_dir: str | None = None

    def validate(self) -> None:
        if not self.worker_urls and not self.replica_dp_sizes:
            raise ValueError("no worker_urls and no embedded replicas: nothing to route to")
        if any(d < 1 for d in self.replica_dp_sizes):
            raise ValueError("embedded_dp_sizes must all be >= 1")
        if self.replica_engine not in REPLICA_ENGINES:
            raise ValueError(f"replica_engine must be one of {REPLICA_ENGINES}")
        if self.replica_engine == "vllm" and not self.worker_urls and not self.embedded_model:
            raise ValueError("vLLM replicas need a model folder (--model DIR)")
        if self.replica_engine_args and self.replica_engine != "vllm":
            raise ValueError("replica_engine_args are vLLM engine arguments; they need replica_engine vllm")
        load_replica_token(self.replica_token_file)  # an unreadable or empty file fails here, not in a child

    @property
    def replica_dp_sizes(self) -> list[int]:
        if self.embedded_dp_sizes is not None:
            return self.embedded_dp_sizes
        return [1, 2] if self.replica_engine == "reference" else [1]

    @classmethod
    def from_yaml(cls, path: str | Path) -> GatewayConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**data)


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
        self._session = spawn_module("psrl.session", args, log_file=self._log("session"))
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


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m psrl.gateway", description=__doc__)
    p.add_argument("--config", help="YAML file with GatewayConfig keys (flags override it)")
    p.add_argument("--host")
    p.add_argument("--router-port-start", type=int)
    p.add_argument("--session-port-start", type=int)
    p.add_argument("--enable-session-router", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--worker-urls", nargs="*")
    p.add_argument("--policy")
    p.add_argument("--tokenizer-path")
    p.add_argument("--api-key")
    p.add_argument("--admin-api-key")
    p.add_argument(
        TOKEN_FILE_FLAG,
        dest="replica_token_file",
        help="file with the replicas' shared gRPC token, for the router and the replicas (default $PSRL_REPLICA_TOKEN)",
    )
    p.add_argument("--replica-engine", choices=REPLICA_ENGINES, help="the engine of the replicas started here")
    p.add_argument("--model", "--embedded-model", dest="embedded_model", help="model folder of those replicas")
    p.add_argument("--embedded-dp-sizes", type=int, nargs="+", help="one replica per entry, with that dp_size")
    p.add_argument("--replicas", type=int, help="N replicas of dp_size 1 (instead of --embedded-dp-sizes)")
    p.add_argument("--kv-transfer-enable", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument(
        "--replica-engine-args", nargs=argparse.REMAINDER, help="everything after it goes to each vLLM replica"
    )
    p.add_argument("--log-dir")
    p.add_argument("--enable-routing-loop", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--psrl-ps-manager-addr")
    p.add_argument("--router-args", nargs=argparse.REMAINDER, help="everything after it goes to the router")
    ns = vars(p.parse_args(argv))
    config_path = ns.pop("config")
    replicas = ns.pop("replicas")
    if replicas is not None:
        if replicas < 1:
            p.error("--replicas must be >= 1")
        ns["embedded_dp_sizes"] = [1] * replicas
    cfg = GatewayConfig.from_yaml(config_path) if config_path else GatewayConfig()
    overrides = {k: v for k, v in ns.items() if v is not None}
    cfg = dataclasses.replace(cfg, **overrides)
    cfg.validate()
    return cfg


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
