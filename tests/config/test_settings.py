"""The settings declarations: every setting has help text, its flag and YAML key reach the same field, the old
flag names keep working, and the config modules import no implementation."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from psrl.gateway.config import GatewayConfig
from psrl.gateway.config import parse_args as gateway_args
from psrl.router.config import (
    TOOL_PARSER_NAMES,
    ConnectionMode,
    KvTransferMode,
    LogFormat,
    RouterConfig,
    load_yaml,
)
from psrl.router.config import parse_args as router_args
from psrl.router.policies import POLICIES, make_policy
from psrl.session.config import parse_args as session_args
from psrl.settings import PROCESSES, rows, setting
from psrl.worker.config import parse_args as worker_args

CONFIG_MODULES = [module for _, module, _, _ in PROCESSES]


@pytest.mark.parametrize(("module", "cls_name"), [(m, c) for _, m, c, _ in PROCESSES])
def test_every_setting_has_help_and_a_distinct_flag(module: str, cls_name: str) -> None:
    cls = getattr(importlib.import_module(module), cls_name)
    seen: set[str] = set()
    for row in rows(cls):
        assert row.meta.help.strip(), row.key
        assert not seen & set(row.flags), row.key
        seen.update(row.flags)
    importlib.import_module(module).build_parser()  # argparse refuses a flag declared twice


def test_a_field_without_setting_is_refused() -> None:
    from dataclasses import dataclass

    @dataclass
    class Half:
        named: int = setting(1, help="has help")
        bare: int = 2

    with pytest.raises(TypeError, match="bare"):
        list(rows(Half))


# What a config module may import on top of its package: the helpers every process shares, and the policy names.
# What a config module may load: the settings machinery, other processes' config (the gateway passes flags on).
LIGHT = {"psrl.settings", "psrl.credentials", "psrl.serving.limits", "psrl.router.policies", "psrl.psmanager.state"}
LIGHT |= {module for _, module, _, _ in PROCESSES}
HEAVY = (
    "torch", "transformers", "jinja2", "tokenizers", "httpx", "fastapi", "smg_grpc_proto", "grpc", "uvicorn", "numpy",
)  # fmt: skip


PACKAGES = {"psrl", "psrl.router", "psrl.session", "psrl.worker", "psrl.gateway", "psrl.psmanager", "psrl.serving"}


def test_config_modules_import_no_implementation() -> None:
    """Each config module, imported after its package (whose __init__ may re-export more), adds only light
    modules: no router, replica or engine implementation, no heavy library."""
    code = (
        "import importlib, json, sys\n"
        "added = {}\n"
        f"for m in {CONFIG_MODULES!r}:\n"
        "    importlib.import_module(m.rpartition('.')[0])\n"
        "    before = set(sys.modules)\n"
        "    importlib.import_module(m)\n"
        "    added[m] = sorted(set(sys.modules) - before - {m})\n"
        "print(json.dumps(added))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for module, added in json.loads(out).items():
        light = [m for m in added if m in LIGHT or m in PACKAGES]
        heavy = [m for m in added if m.split(".")[0] in HEAVY or (m.startswith("psrl.") and m not in light)]
        assert not heavy, f"{module} imports implementations: {heavy}"


def test_router_flags_reach_their_settings() -> None:
    cfg = router_args(
        [
            "--port", "0",
            "--worker-urls", "grpc://a:1", "grpc://b:2",
            "--worker-selection-strategy", "policy",  # the PSRL-style flat names of four sections
            "--cache-threshold", "0.5",
            "--enable-routing-loop",
            "--tito-max-sessions", "7",
            "--health-interval-s", "3",  # the prefixed ones
            "--breaker-open-duration-s", "4",
            "--kv-transfer-enable",
            "--kv-transfer-transfer-mode", "pin_sync",
            "--no-enable-partial-rollout",
            "--policy", "request_num_balance",
        ]
    )  # fmt: skip
    assert cfg.port == 0 and cfg.worker_urls == ["grpc://a:1", "grpc://b:2"]
    assert cfg.selector.worker_selection_strategy == "policy" and cfg.cache_aware.cache_threshold == 0.5
    assert cfg.routing_loop.enable_routing_loop and cfg.tito.tito_max_sessions == 7
    assert cfg.health.interval_s == 3.0 and cfg.breaker.open_duration_s == 4.0
    assert cfg.kv_transfer.enable and cfg.kv_transfer.transfer_mode is KvTransferMode.PIN_SYNC
    assert cfg.enable_partial_rollout is False and cfg.policy == "least_load"
    assert router_args([]) == RouterConfig(policy="round_robin")  # no flag: the declared defaults


def test_router_yaml_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        "port: 9000\n"
        "connection_mode: http\n"
        "kv_transfer:\n  transfer_mode: sync\n"
        "selector:\n  enable_group_sticky: true\n"
    )
    cfg = router_args(["--config", str(path), "--port", "9001", "--log-format", "json"])
    assert cfg.port == 9001 and cfg.selector.enable_group_sticky
    assert cfg.connection_mode is ConnectionMode.HTTP and cfg.kv_transfer.transfer_mode is KvTransferMode.SYNC
    assert cfg.log_format is LogFormat.JSON
    path.write_text("selector:\n  telepathy: 1\n")
    with pytest.raises(ValueError, match=r"selector: unknown keys \['telepathy'\]"):
        load_yaml(path)


def test_string_choices_are_enums_equal_to_their_strings() -> None:
    cfg = RouterConfig(connection_mode="http", log_format="json")  # type: ignore[arg-type]  # YAML gives str
    cfg.validate()
    assert cfg.connection_mode is ConnectionMode.HTTP and cfg.connection_mode == "http"
    assert f"{cfg.log_format}" == "json" and {"json": 1}[cfg.log_format] == 1
    for bad, what in (({"connection_mode": "udp"}, "connection_mode"), ({"log_format": "xml"}, "log_format")):
        with pytest.raises(ValueError, match=f"{what} must be one of"):
            RouterConfig(**bad).validate()  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        router_args(["--kv-transfer-transfer-mode", "later"])  # argparse names the choices


def test_policy_names_come_from_the_registry() -> None:
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown policy"):
        RouterConfig(policy="telepathy").validate()


def test_tool_parser_names_are_those_the_pipeline_builds() -> None:
    from psrl.router.pipeline import tool_calls

    assert set(tool_calls._PARSERS) == set(TOOL_PARSER_NAMES)
    RouterConfig(tool_call_parser="hermes").validate()
    with pytest.raises(ValueError, match="unknown tool_call_parser"):
        RouterConfig(tool_call_parser="xml").validate()


def test_gateway_flags(tmp_path: Path) -> None:
    assert gateway_args(["--model", "/m"]).embedded_model == "/m"
    assert gateway_args(["--embedded-model", "/m"]).embedded_model == "/m"
    assert gateway_args(["--worker-urls"]).worker_urls == []
    assert gateway_args(["--replicas", "3"]).embedded_dp_sizes == [1, 1, 1]
    none = gateway_args(["--replicas", "0"])  # replicas register themselves
    assert none.embedded_dp_sizes == [] and none.replica_dp_sizes == []
    assert gateway_args(["--replicas", "0", "--replica-engine", "vllm"]).embedded_model is None  # none to load
    with pytest.raises(ValueError, match="starts no replicas"):
        GatewayConfig(worker_urls=["grpc://h:1"], embedded_dp_sizes=[]).validate()
    cfg = gateway_args(["--no-enable-session-router", "--router-args", "--policy", "random", "--port", "1"])
    assert cfg.enable_session_router is False and cfg.router_args == ["--policy", "random", "--port", "1"]
    path = tmp_path / "gateway.yaml"
    path.write_text("embedded_dp_sizes: [2]\nenable_routing_loop: false\n")
    cfg = gateway_args(["--config", str(path), "--embedded-seed", "5"])
    assert cfg == GatewayConfig(embedded_dp_sizes=[2], enable_routing_loop=False, embedded_seed=5)


def test_worker_and_session_flags() -> None:
    args = worker_args(["--port", "5", "--no-prefix-caching", "--kv-pin-ttl-s", "0"])
    assert (args.port, args.enable_prefix_caching, args.kv_pin_ttl_s) == (5, False, 0.0)
    with pytest.raises(SystemExit):  # validation errors are argparse errors
        worker_args(["--dp-size", "0"])
    cfg = session_args(["--router-url", "http://r:1/", "--trajectory-id-strategy", "auto"])
    assert cfg.router_url == "http://r:1" and cfg.trajectory_id_strategy == "auto"


def test_keys_come_from_the_environment_when_their_flags_are_not_given(monkeypatch) -> None:
    from psrl.router.config import parse_args as router_args
    from psrl.session.config import parse_args as session_args

    monkeypatch.setenv("PSRL_ROUTER_API_KEY", "admin-from-env")
    monkeypatch.setenv("PSRL_API_KEY", "data-from-env")
    monkeypatch.setenv("PSRL_SESSION_API_KEY", "session-from-env")
    router = router_args([])
    assert (router.admin_api_key, router.api_key) == ("admin-from-env", "data-from-env")
    assert router_args(["--admin-api-key", "flag"]).admin_api_key == "flag"  # a flag wins
    session = session_args([])
    assert (session.admin_api_key, session.router_api_key, session.router_admin_api_key) == (
        "session-from-env",
        "data-from-env",
        "admin-from-env",
    )
    monkeypatch.setenv("PSRL_API_KEY", "has a space")
    with pytest.raises(ValueError, match="PSRL_API_KEY: must be printable ASCII"):
        router_args([])
