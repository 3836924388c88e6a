"""The replica's placement settings: the node id it tells KV peers, the address it registers, and the refusal of
a wildcard bind that names no address others can dial."""

from __future__ import annotations

import pytest

from psrl.kv import NODE_ID_ENV
from psrl.worker.config import parse_args
from psrl.worker.registration import registration_body


def test_the_node_id_is_the_flag_else_this_machine_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_ID_ENV, "from-env")
    assert parse_args([]).node() == "from-env"
    assert parse_args(["--node-id", "ray-0123"]).node() == "ray-0123"


def test_the_advertised_address_is_the_flag_s_host_on_the_bound_port() -> None:
    assert parse_args([]).advertised("127.0.0.1:5000") == "127.0.0.1:5000"
    args = parse_args(["--host", "0.0.0.0", "--advertise-host", "gpu-7.cluster"])
    assert args.advertised("0.0.0.0:5000") == "gpu-7.cluster:5000"
    assert parse_args(["--advertise-host", "fd00::7"]).advertised("[::]:5000") == "[fd00::7]:5000"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]"])
def test_a_wildcard_bind_registers_only_with_an_advertised_host(host: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--host", host, "--router", "http://127.0.0.1:8100"])
    err = capsys.readouterr().err
    assert "listens on every address, which a router cannot dial: give --advertise-host" in err
    parse_args(["--host", host, "--router", "http://127.0.0.1:8100", "--advertise-host", "10.0.0.7"])
    parse_args(["--host", host])  # no registration: whoever registers it names its address


def test_the_registration_labels_carry_the_node_id() -> None:
    body = registration_body(
        grpc_url="grpc://h:1", served_model_name="m", kv_capacity_tokens=64, dp_size=1, kv_block_size=16, node_id="n"
    )
    assert body["labels"]["node_id"] == "n"
