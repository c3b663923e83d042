"""What receiver tests share: a real DNS server (NSD on a loopback port) serving the zone
`test` with the MX records the module names as RECORDS, for the whole module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.dns import NsdServer, nsd


@pytest.fixture(scope="module")
def dns_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NsdServer]:
    records: list[str] = request.module.RECORDS
    with nsd(tmp_path_factory.mktemp("dns"), "test", records, ttl=300, negative=60) as server:
        yield server
