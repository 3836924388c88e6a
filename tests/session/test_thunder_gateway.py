"""`python -m psrl.gateway --session-strategy thunder_agent`: the gateway's SessionRouter runs the strategy,
reads every embedded instance's capacity with the gateway's admin key (from its environment), and takes the
thunder flags given after `--session-args`."""

from __future__ import annotations

from pathlib import Path

import httpx
from _wait import wait_for
from prometheus_client.parser import text_string_to_metric_families

from psrl.gateway.config import parse_args
from psrl.gateway.launcher import RolloutGateway


def test_the_gateway_starts_its_session_router_with_the_strategy(model_dir: Path, tmp_path: Path) -> None:
    argv = ["--router-port-start", "18300", "--session-port-start", "18400", "--admin-api-key", "gw-admin"]
    argv += ["--model", str(model_dir), "--embedded-dp-sizes", "1", "2", "--log-dir", str(tmp_path)]
    argv += ["--session-strategy", "thunder_agent", "--session-args", "--thunder-check-interval-ms", "50"]
    config = parse_args(argv)
    assert config.session_args == ["--thunder-check-interval-ms", "50"]
    with RolloutGateway(config) as gateway:
        assert gateway._session is not None
        args = " ".join(map(str, gateway._session.args))
        assert "--session-strategy thunder_agent" in args and "gw-admin" not in args
        # the strategy reads the router with the admin key from its environment
        environ = Path(f"/proc/{gateway._session.pid}/environ").read_bytes().split(b"\0")
        assert b"PSRL_ROUTER_API_KEY=gw-admin" in environ

        def remaining() -> dict[tuple[str, str], float]:
            text = httpx.get(f"{gateway.session_url}/metrics").text
            return {
                (s.labels["base_worker_id"], s.labels["dp_rank"]): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "psrl_session_thunder_remaining_tokens"
            }

        wait_for(lambda: len(remaining()) == 3, "a round that saw the three embedded instances")
        headers = {"Authorization": "Bearer gw-admin"}
        workers = httpx.get(f"{gateway.router_url}/workers", headers=headers).json()["workers"]
        # no sessions yet: each instance has its whole KV capacity left
        expected = {
            (w["worker_id"], str(rank)): float(w["labels"]["max_model_len"])
            for w in workers
            for rank in range(w["dp_size"])
        }
        assert remaining() == expected
