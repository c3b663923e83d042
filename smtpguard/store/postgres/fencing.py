"""Fencing: of the URL's servers that accept writes, the pool connects to the newer timeline's
only (the decision is policy/fencing.py's; this module asks the servers).

No round trip is added per message: the servers are asked when the pool makes a connection
and the last answer is older than CHECK_EVERY or a connection failed since, and by the
store's watch every CHECK_EVERY. A URL with one host has nothing to fence.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from smtpguard.policy.fencing import Choice, Member, choose, seen, superseded
from smtpguard.store.postgres.replication import FACTS_SQL, ServerFacts

log = logging.getLogger("smtpguard.store")

CHECK_EVERY = 5.0
_PROBE_TIMEOUT = 2.0


class Fenced(psycopg.OperationalError):
    """No connection to this server (or to any): raised where the pool connects, so the
    pool counts it as a failed connect and callers get StoreUnavailable (451 4.3.0)."""


def hosts_of(url: str) -> list[dict[str, str]]:
    """Each server the URL names, as the connection parameters that pick it."""
    params = conninfo_to_dict(url)
    hosts = str(params.get("host") or "").split(",")
    addrs = str(params.get("hostaddr") or "").split(",") if params.get("hostaddr") else []
    ports = str(params.get("port") or "").split(",") if params.get("port") else []
    out = []
    for i, host in enumerate(hosts):
        one = {"host": host}
        if addrs:
            one["hostaddr"] = addrs[i] if len(addrs) > 1 else addrs[0]
        if ports:
            one["port"] = ports[i] if len(ports) > 1 else ports[0]
        out.append(one)
    return out


def _name(server: dict[str, str]) -> str:
    return f"{server.get('hostaddr') or server['host']}:{server.get('port', '5432')}"


class Fence:
    def __init__(self, url: str, connect_kwargs: dict[str, Any]) -> None:
        self.url = url
        self._kwargs = connect_kwargs
        self._servers = hosts_of(url)
        self.multi_host = len(self._servers) > 1
        self.choice = Choice(None)
        self._pin: dict[str, str] | None = None
        self._checked_at = float("-inf")
        self._lock = asyncio.Lock()

    def stale(self) -> None:
        """A connection failed: ask the servers again before the next connect."""
        self._checked_at = float("-inf")

    async def conninfo(self) -> str:
        """The pool's conninfo: the URL as it is, or pinned to the one server to write to."""
        if not self.multi_host:
            return self.url
        if time.monotonic() - self._checked_at > CHECK_EVERY:
            await self.refresh()
        if self.choice.refuse:
            raise Fenced(f"postgresql: writing to no server: {self.choice.reason}")
        if self._pin is None:
            return self.url
        return make_conninfo(self.url, **self._pin)

    def admit(self, facts: ServerFacts) -> None:
        """The pool's configure hook: a new connection reached a server that may be written."""
        winner = self.choice.write_to
        if self.choice.refuse:
            raise Fenced(f"postgresql: writing to no server: {self.choice.reason}")
        if winner is not None and (facts.system_id, facts.timeline) != (winner.system_id, winner.timeline):
            raise Fenced(f"postgresql: connected to a fenced server: {self.choice.reason}")
        if not self.multi_host or facts.read_only:
            return
        member = Member(f"port {facts.port}", facts.system_id, facts.timeline)
        if superseded(member, self.choice.newest):
            self.stale()
            raise Fenced(
                f"postgresql: connected to a server on timeline {facts.timeline}, older than "
                f"{self.choice.newest.timeline if self.choice.newest else '?'} seen accepting writes"
            )
        self.choice = replace(self.choice, newest=seen(self.choice.newest, member))

    async def refresh(self) -> bool:
        """Ask every server of the URL; True when the decision changed."""
        async with self._lock:
            found = await asyncio.gather(*(self._probe(s) for s in self._servers))
            self._checked_at = time.monotonic()
            writable = [m for m in found if m is not None]
            choice = choose(writable, self.choice.newest)
            changed = choice != self.choice
            self.choice = choice
            pin = None
            if choice.write_to is not None:
                pin = next(s for s in self._servers if _name(s) == choice.write_to.name)
            self._pin = pin
        if changed and choice.fenced:
            log.error(
                "postgresql servers fenced",
                extra={
                    "fenced": [m.name for m in choice.fenced],
                    "writing_to": choice.write_to.name if choice.write_to else None,
                    "reason": choice.reason,
                },
            )
        elif changed:
            log.info("postgresql fencing lifted: at most one server accepts writes")
        return changed

    async def _probe(self, server: dict[str, str]) -> Member | None:
        info = make_conninfo(
            self.url, **server, target_session_attrs="any", connect_timeout=str(int(_PROBE_TIMEOUT))
        )
        try:
            async with asyncio.timeout(_PROBE_TIMEOUT + 1):
                conn = await psycopg.AsyncConnection.connect(info, **self._kwargs)
                async with conn:
                    row = await (await conn.execute(FACTS_SQL)).fetchone()
        except (psycopg.Error, OSError):
            return None  # down, or not answering: not a server that takes writes now
        assert row is not None
        facts = ServerFacts.of(row)
        if facts.read_only:
            return None
        return Member(_name(server), facts.system_id, facts.timeline)
