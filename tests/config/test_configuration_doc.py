"""docs/configuration.md is generated from the settings declarations; it must match what they generate now."""

from __future__ import annotations

from pathlib import Path

from psrl.settings import configuration_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_doc_is_current() -> None:
    expected = configuration_markdown()
    committed = DOC.read_text() if DOC.exists() else ""
    assert committed == expected, (
        "docs/configuration.md is stale: a setting changed. Regenerate it with `make docs` "
        "(or `python -m psrl.settings > docs/configuration.md`) and commit the result."
    )
