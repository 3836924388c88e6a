"""The gateway on a Ray cluster (`pip install "psrl-gateway[ray]"`).

* `RolloutGateway`: a Ray actor that runs the gateway (psrl.gateway.launcher) on its node: the router on the first
  free port from 8100 and the SessionRouter from 8200, bound to the node's IP unless the config names a host.
  It returns their URLs, reports health, and may own child actors: a PSManager and replicas.
* `ReplicaActor`: one `python -m psrl.worker [--engine vllm]` on its node (`.options(num_gpus=1)` for a GPU),
  bound to that node's IP and registered with the router by the router's URL.
* `PSManagerActor`: one `python -m psrl.psmanager` on its node.

Keys (the router's admin key, the data-plane key, the replicas' token) travel as actor arguments, serialized by
Ray, and reach the processes in their environment: never on a command line, which other users can read.

No process outlives its actor. Each one is started in its own process group with PR_SET_PDEATHSIG, so `stop()`,
`ray.kill` of the actor (which ends its worker process) and the loss of its node all end it. Child actors share
their owner's fate (Ray's ownership): a gateway killed or lost takes its replica and PSManager actors along.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import ray

from psrl.credentials import ROUTER_API_KEY_ENV, TOKEN_ENV
from psrl.gateway.config import GatewayConfig
from psrl.gateway.launcher import RolloutGateway as LocalGateway
from psrl.gateway.processes import AnnouncedProcess, stop_processes
from psrl.settings import from_mapping

WORKER_READY = "PSRL_WORKER_READY"  # psrl.worker.registration's ready line
PSMANAGER_READY = "PSRL_PSMANAGER_READY"  # psrl.psmanager.server's


def node_ip() -> str:
    """The IP address Ray knows this node by (reachable from the cluster's other nodes)."""
    return str(ray.util.get_node_ip_address())


@dataclass
class ReplicaSpec:
    """One replica a `RolloutGateway` starts as a `ReplicaActor` child."""

    engine: str = "reference"  # python -m psrl.worker --engine
    model: str | None = None  # --model; default: the reference engine's tiny built-in folder
    dp_size: int = 1
    args: list[str] = field(default_factory=list)  # more psrl.worker flags (e.g. --kv-pin-ttl-s 30)
    engine_args: list[str] = field(default_factory=list)  # vLLM's own arguments (after --)
    env: dict[str, str] = field(default_factory=dict)  # e.g. VLLM_* settings
    num_cpus: float = 1.0
    num_gpus: float = 0.0


class _ServiceActor:
    """An actor that runs one announced process and stops it with itself."""

    def _start(self, module: str, args: list[str], marker: str, env: dict[str, str], timeout_s: float) -> None:
        self._child = AnnouncedProcess(module, args, marker, env=env)
        try:
            self._address = self._child.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def address(self) -> str:
        """What the process announced: `grpc://host:port` for a replica, `host:port` for a PSManager."""
        return self._address

    def pid(self) -> int:
        return self._child.proc.pid

    def alive(self) -> bool:
        return self._child.proc.poll() is None

    def stop(self) -> None:
        stop_processes([self._child.proc])


@ray.remote(num_cpus=1)
class ReplicaActor(_ServiceActor):
    """A replica on this actor's node, registered with `router_url` (docs/replicas.md). `router_api_key`: the
    router's admin key it registers with; `replica_token`: the token its gRPC server then requires."""

    def __init__(
        self,
        router_url: str,
        spec: ReplicaSpec | None = None,
        *,
        router_api_key: str | None = None,
        replica_token: str | None = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        spec = spec or ReplicaSpec()
        args = ["--engine", spec.engine, "--host", node_ip(), "--port", "0", "--router", router_url]
        args += ["--dp-size", str(spec.dp_size), "--node-id", ray.get_runtime_context().get_node_id()]
        if spec.model:
            args += ["--model", spec.model]
        args += spec.args
        if spec.engine_args:
            args += ["--", *spec.engine_args]
        keys = {ROUTER_API_KEY_ENV: router_api_key, TOKEN_ENV: replica_token}
        env = {**spec.env, **{name: value for name, value in keys.items() if value}}
        self._start("psrl.worker", args, WORKER_READY, env, startup_timeout_s)


@ray.remote(num_cpus=0)
class PSManagerActor(_ServiceActor):
    """A PSManager on this actor's node; `args`: its flags (e.g. --rollout-n 8)."""

    def __init__(self, args: Sequence[str] = (), *, startup_timeout_s: float = 60.0) -> None:
        self._start(
            "psrl.psmanager", ["--host", node_ip(), "--port", "0", *args], PSMANAGER_READY, {}, startup_timeout_s
        )


def _config(config: GatewayConfig | Mapping[str, Any] | None) -> GatewayConfig:
    """The config as `python -m psrl.gateway` takes it; the host the node's IP unless it names one."""
    if isinstance(config, GatewayConfig):
        cfg = dataclasses.replace(config)
        named_host = cfg.host != GatewayConfig.host
    else:
        data = dict(config or {})
        cfg = from_mapping(GatewayConfig, data, "RolloutGateway config")
        named_host = "host" in data
    if not named_host:
        cfg.host = node_ip()
    return cfg


@ray.remote(num_cpus=1)
class RolloutGateway:
    """The gateway on this actor's node. `config`: a GatewayConfig or its YAML keys as a dict. `replicas`: one
    ReplicaActor child per spec, placed by Ray (with neither worker_urls nor embedded_dp_sizes in the config, they
    are the whole fleet and the gateway starts no replicas of its own). `psmanager`: start a PSManagerActor child
    (with these flags) and route with it. `replica_token`: the replicas' token, for the router and every replica.
    """

    def __init__(
        self,
        config: GatewayConfig | Mapping[str, Any] | None = None,
        *,
        replicas: Sequence[ReplicaSpec] = (),
        psmanager: Sequence[str] | None = None,
        replica_token: str | None = None,
    ) -> None:
        cfg = _config(config)
        if replicas and not cfg.worker_urls and cfg.embedded_dp_sizes is None:
            cfg.embedded_dp_sizes = []
        self._psmanager = None
        if psmanager is not None:
            if cfg.psrl_ps_manager_addr:
                raise ValueError("psmanager and psrl_ps_manager_addr: give one")
            self._psmanager = PSManagerActor.remote(list(psmanager))  # type: ignore[attr-defined]
            cfg.psrl_ps_manager_addr = ray.get(self._psmanager.address.remote(), timeout=cfg.startup_timeout_s)
        self._token = replica_token
        self._gateway = LocalGateway(cfg, replica_token=replica_token)
        self._replicas: list[Any] = []
        try:
            self._gateway.start()
            self.add_replicas(replicas)
        except BaseException:
            self.stop()
            raise

    def add_replicas(self, specs: Sequence[ReplicaSpec]) -> list[str]:
        """Start one ReplicaActor child per spec and wait until the router lists them; their gRPC URLs."""
        actors = [
            ReplicaActor.options(num_cpus=s.num_cpus, num_gpus=s.num_gpus).remote(  # type: ignore[attr-defined]
                self._gateway.router_url,
                s,
                router_api_key=self._gateway.admin_key,
                replica_token=self._token,
                startup_timeout_s=self._gateway.config.startup_timeout_s,
            )
            for s in specs
        ]
        self._replicas += actors
        urls = ray.get([a.address.remote() for a in actors], timeout=self._gateway.config.startup_timeout_s)
        self._gateway.wait_for_registered(urls)
        return urls

    def urls(self) -> dict[str, str]:
        """The router's and the SessionRouter's URLs ("" when the config turned it off)."""
        return {"router": self._gateway.router_url, "session": self._gateway.session_url}

    def replicas(self) -> list[Any]:
        """The handles of the ReplicaActor children."""
        return list(self._replicas)

    def psmanager(self) -> Any:
        """The handle of the PSManagerActor child (None without one)."""
        return self._psmanager

    def child_pids(self) -> list[int]:
        """The processes this actor started itself (the router, the SessionRouter, embedded replicas)."""
        return self._gateway.child_pids()

    def wait_for_workers(self, n: int) -> None:
        """Wait until the router lists `n` workers (replicas started elsewhere register themselves)."""
        self._gateway.wait_for_workers(n)

    def health(self) -> dict[str, Any]:
        """Whether every process answers, and the router's view of its workers."""
        out: dict[str, Any] = {"processes_alive": self._gateway.running(), "router": False, "session": None}
        headers = self._gateway.admin_headers()
        try:
            with httpx.Client(timeout=5.0, headers=headers) as client:
                out["router"] = client.get(f"{self._gateway.router_url}/health").status_code == 200
                workers = client.get(f"{self._gateway.router_url}/workers").json()["workers"]
                if self._gateway.session_url:
                    out["session"] = client.get(f"{self._gateway.session_url}/control/sessions").status_code == 200
        except httpx.HTTPError:
            workers = []
        out["workers"] = len(workers)
        out["healthy_workers"] = sum(bool(w.get("healthy")) for w in workers)
        out["healthy"] = out["processes_alive"] and out["router"] and out["session"] is not False
        return out

    def stop(self) -> None:
        """Stop the replica and PSManager children, then the gateway's own processes."""
        for actor in [*self._replicas, *([self._psmanager] if self._psmanager is not None else [])]:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception:  # already gone: its processes went with it
                pass
            ray.kill(actor)
        self._replicas.clear()
        self._psmanager = None
        self._gateway.stop()


__all__ = ["PSManagerActor", "ReplicaActor", "ReplicaSpec", "RolloutGateway", "node_ip"]
