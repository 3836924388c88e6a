"""Runs the PyPI mini-swe-agent on one SessionRouter session, offline, and writes what it did as JSON.

Its own parts, as its `mini` command builds them from the bundled mini.yaml: DefaultAgent, LocalEnvironment
(shell commands run in the throwaway folder given as `cwd`) and LitellmModel (tool calls through litellm's
OpenAI provider, `api_base` = the session URL). Run as a child process (`python _mini_swe.py SPEC OUT`): the
variables that keep litellm and mini-swe-agent offline must be set before either is imported, and a guard on
the socket module refuses (and lists) any connection that is not to loopback.
"""

from __future__ import annotations

import copy
import errno
import ipaddress
import json
import os
import socket
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Set in the child's environment before litellm or mini-swe-agent is imported.
OFFLINE_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm's bundled cost map, not the one it fetches at import
    "LITELLM_TELEMETRY": "False",
    "MSWEA_SILENT_STARTUP": "1",
    "MSWEA_COST_TRACKING": "ignore_errors",  # a local model has no price
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",  # one HTTP request per model call: a failure ends the run
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    "NO_PROXY": "*",
    "no_proxy": "*",
}

_blocked: list[str] = []


def _is_loopback(host: Any) -> bool:
    if host in ("localhost", b"localhost"):
        return True
    try:
        return ipaddress.ip_address(host.decode() if isinstance(host, bytes) else host).is_loopback
    except ValueError:
        return False


def _install_network_guard() -> None:
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def check(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            _blocked.append(f"connect {address!r}")
            raise OSError(errno.ENETUNREACH, f"no network in this test: {address!r}")

    def connect(self: socket.socket, address: Any) -> None:
        check(self, address)
        return real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        check(self, address)
        return real_connect_ex(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host is not None and not _is_loopback(host):
            _blocked.append(f"getaddrinfo {host!r}")
            raise socket.gaierror(socket.EAI_NONAME, f"no network in this test: {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect = connect  # type: ignore[method-assign]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]
    socket.getaddrinfo = getaddrinfo


@dataclass(frozen=True)
class Spec:
    session_base_url: str  # http://127.0.0.1:PORT/sessions/{sid}/v1
    model_name: str  # the router's served name
    cwd: str  # the throwaway folder the agent's shell runs in
    task: str
    step_limit: int
    max_tokens: int


def run(spec: Spec) -> dict[str, Any]:
    import litellm
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import builtin_config_dir
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel
    from minisweagent.utils.serialize import recursive_merge

    litellm.suppress_debug_info = True  # its "Provider List" banner each time the cost lookup misses
    calls: list[dict[str, Any]] = []

    class RecordingModel(LitellmModel):
        """LitellmModel, with each request it sends (the messages) and the response it got kept in `calls`."""

        def _query(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
            response = super()._query(messages, **kwargs)
            calls.append({"messages": copy.deepcopy(messages), "response": response.model_dump(mode="json")})
            return response

    # The `mini` command's own config, with a step limit instead of a cost limit (a local model has no price),
    # no cap on consecutive format errors (the tiny model makes one every turn), and greedy, short replies.
    config = recursive_merge(
        yaml.safe_load((builtin_config_dir / "mini.yaml").read_text()),
        {
            "agent": {"step_limit": spec.step_limit, "cost_limit": 0.0, "max_consecutive_format_errors": 0},
            "environment": {"cwd": spec.cwd, "timeout": 10},
            "model": {
                "model_name": f"openai/{spec.model_name}",
                "cost_tracking": "ignore_errors",
                "model_kwargs": {
                    "api_base": spec.session_base_url,
                    "api_key": "dummy",
                    "temperature": 0.0,
                    "max_tokens": spec.max_tokens,
                    "logprobs": True,
                },
            },
        },
    )
    agent_config = {k: v for k, v in config["agent"].items() if k != "mode"}  # `mode` is the interactive agent's
    agent = DefaultAgent(RecordingModel(**config["model"]), LocalEnvironment(**config["environment"]), **agent_config)
    result: dict[str, Any] = {"calls": calls, "blocked": _blocked}
    try:
        info = agent.run(spec.task)
        result["exit_status"] = info.get("exit_status")
    except Exception:
        result["error"] = traceback.format_exc()
    result |= {"n_calls": agent.n_calls, "history": agent.messages, "blocked": _blocked}
    return result


def main(spec_path: str, out_path: str) -> int:
    os.environ.update(OFFLINE_ENV)
    _install_network_guard()
    spec = Spec(**json.loads(Path(spec_path).read_text()))
    result = run(spec)
    Path(out_path).write_text(json.dumps(result, default=repr))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
