"""PSRL routing headers: a request with none of them skips the parse, and the skip knows every header read."""

from __future__ import annotations

import pytest

from psrl.router import metadata
from psrl.router.errors import BadRequest
from psrl.router.metadata import NO_ROUTING_META, RoutingMeta, parse_routing_meta
from psrl.router.registry import InstanceId


class _Recording(dict):
    """Headers that note every name the parser looks up."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.asked: set[str] = set()

    def get(self, name, default=None):  # type: ignore[override]
        self.asked.add(name)
        return super().get(name, default)


def test_the_skip_covers_every_header_the_parse_reads() -> None:
    headers = _Recording({"x-request-id": "7"})
    parse_routing_meta(headers)
    assert headers.asked == metadata._HEADERS


def test_a_request_without_psrl_headers_gets_the_shared_empty_meta() -> None:
    meta = parse_routing_meta({"host": "x", "content-type": "application/json", "authorization": "Bearer k"})
    assert meta is NO_ROUTING_META
    assert meta == RoutingMeta()


@pytest.mark.parametrize(
    ("name", "value", "field", "expected"),
    [
        ("x-request-id", "12", "request_id", 12),
        ("x-prompt-id", "3", "prompt_id", 3),
        ("x-version-tag", "4", "version_tag", 4),
        ("x-base-worker-id", "w1", "hint", InstanceId("w1", 0)),
        ("x-target-dp-rank", "2", "hint", None),  # a rank alone names no instance
        ("x-is-validate", "true", "is_validate", True),
        ("x-is-sticky", "yes", "is_sticky", True),
        ("x-force-pin-once", "1", "force_pin_once", True),
        ("x-smg-routing-key", "k", "routing_key", "k"),
    ],
)
def test_each_header_alone_is_read(name: str, value: str, field: str, expected: object) -> None:
    assert getattr(parse_routing_meta({name: value}), field) == expected


def test_a_bad_header_alone_is_still_refused() -> None:
    with pytest.raises(BadRequest, match="x-is-sticky"):
        parse_routing_meta({"x-is-sticky": "maybe"})
