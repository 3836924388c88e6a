"""POST /workers bodies as registration reads them (the refusals a router answers are in
tests/reliability/test_bad_input.py)."""

from __future__ import annotations

import httpx
import pytest

from psrl.router.config import ConnectionMode
from psrl.router.errors import BadRequest
from psrl.router.registration import parse_registration


def test_an_ascii_url_is_kept_as_given() -> None:
    reg = parse_registration({"url": "grpc://Replica-1.internal:9000"})
    assert (reg.url, reg.netloc, reg.mode) == (
        "grpc://Replica-1.internal:9000",
        "Replica-1.internal:9000",
        ConnectionMode.GRPC,
    )


@pytest.mark.parametrize(
    ("url", "mode", "ascii_url", "netloc"),
    [
        ("http://Bücher.example:8000/", "http", "http://xn--bcher-kva.example:8000/", "xn--bcher-kva.example:8000"),
        ("grpc://例え.テスト:9000", "grpc", "grpc://xn--r8jz45g.xn--zckzah:9000", "xn--r8jz45g.xn--zckzah:9000"),
        # IDNA 2008, as httpx and curl resolve it: IDNA 2003 (Python's codec) would make it strasse.example
        ("http://Straße.example:8000", "http", "http://xn--strae-oqa.example:8000", "xn--strae-oqa.example:8000"),
    ],
)
def test_an_internationalized_host_reaches_every_client_in_its_ascii_form(
    url: str, mode: str, ascii_url: str, netloc: str
) -> None:
    """The HTTP/1.1 client writes the host into the Host header, which holds ASCII only; curl and grpc get the
    same name. The registry keys the worker by this form, so registering either spelling is one worker."""
    reg = parse_registration({"url": url, "connection_mode": mode})
    assert (reg.url, reg.netloc) == (ascii_url, netloc)
    assert httpx.URL(url).raw_host.decode() == netloc.partition(":")[0]  # what registration's facts call resolves
    assert parse_registration({"url": ascii_url, "connection_mode": mode}).url == ascii_url


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("grpc://" + "é" * 70 + ".example:9000", "IDNA cannot encode"),  # a label past 63 characters
        ("grpc://ü..example:9000", "IDNA cannot encode"),  # an empty label
        ("grpc://usér@ü.example:9000", "no path, query or user"),
    ],
)
def test_a_host_name_without_an_ascii_form_or_with_a_user_is_refused(url: str, says: str) -> None:
    with pytest.raises(BadRequest) as e:
        parse_registration({"url": url})
    assert says in e.value.message and e.value.param == "url"
