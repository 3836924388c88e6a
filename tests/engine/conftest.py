"""Fixtures shared by the reference-engine tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from psrl.engine import AsyncEngine

from .helpers import make_engine


@pytest.fixture
def aengine() -> Iterator[AsyncEngine]:
    engine = AsyncEngine(make_engine())
    yield engine
    engine.shutdown()
