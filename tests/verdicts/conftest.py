"""The stores verdict tests run on: a real SQLite file, or a database of its own on the
session's real redis-server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.utf8 import store_overrides


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request: pytest.FixtureRequest, tmp: Path) -> Iterator[str]:
    for overrides in store_overrides(request, tmp, redis_db=12):
        yield overrides["store__url"]
