"""A receiver's `max_rate` is the fleet's (DESIGN.md §21), attacked with concurrent
transactions through two instances sharing one store — Redis and PostgreSQL, both real — a
real DNS server and a recording upstream: of 16 transactions to Microsoft recipients at
once, at 2/m (one slot per second of burst), exactly one is taken; the rest are held at
RCPT and reach nobody, while their Gmail recipients all go, once each."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.support import RedisServer, Upstream, base_config, message, running_guard, send
from tests.support.dns import NsdServer
from tests.support.postgres import PostgresServer, reset

RECORDS = [
    "gm IN MX 5 aspmx.l.google.com.",
    "ms IN MX 10 ms-test.mail.protection.outlook.com.",
]
N = 16


def _instance(tmp: Path, upstream: Upstream, nameserver: str, url: str, name: str) -> dict[str, Any]:
    cfg = base_config(tmp, upstream.port, store__url=url, store__unsafe=True)
    cfg["instance"] = name
    cfg["dns"] = {"nameservers": [nameserver], "timeout": "2s"}
    cfg["receivers"] = {}
    cfg["zones"]["acme"]["receivers"] = {"microsoft": {"max_rate": "2/m"}}
    return cfg


@pytest.fixture(params=["redis", "postgres"])
def store_url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        url = server.url.rsplit("/", 1)[0] + "/12"
        plain = redis.Redis.from_url(url)
        plain.flushdb()
        yield url
        plain.flushdb()
        plain.close()
    else:
        pg: PostgresServer = request.getfixturevalue("postgres_server")
        reset(pg.url)
        yield pg.url
        reset(pg.url)


async def test_concurrent_transactions_on_two_instances_share_one_rate(
    tmp: Path, upstream: Upstream, dns_server: NsdServer, store_url: str
) -> None:
    one = _instance(tmp, upstream, dns_server.nameserver, store_url, "i1")
    two = _instance(tmp, upstream, dns_server.nameserver, store_url, "i2")
    async with running_guard(one) as a, running_guard(two) as b:
        ports = [a.ports[0], b.ports[0]]
        # The MX answers are known to both first: every RCPT then races for the slot alone.
        for port in ports:
            assert (await send(port, message(f"warm{port}"), recipients=["w@gm.test"])).code == 250
        replies = await asyncio.gather(
            *(
                send(ports[i % 2], message(f"k{i}"), recipients=[f"m{i}@ms.test", f"g{i}@gm.test"])
                for i in range(N)
            )
        )
        await upstream.wait_received(2 + N)
    codes = sorted(r.code for r in replies)
    print("replies:", codes, "upstream:", len(upstream.received))
    to_microsoft = [r for m in upstream.received for r in m.rcpt_tos if r.endswith("@ms.test")]
    to_gmail = [r for m in upstream.received for r in m.rcpt_tos if r.startswith("g")]
    assert len(to_microsoft) == 1, to_microsoft
    assert codes == [250] + [451] * (N - 1)
    assert sorted(to_gmail) == sorted(f"g{i}@gm.test" for i in range(N))
    assert len(upstream.received) == 2 + N
