"""The verdict loop (DESIGN.md §19): each `unknown` record whose attempt went through a
provider with an `api` is asked about from `after` on, every `every`, until a verdict or
`give_up`, and settled through settle.py.

Once per fleet in effect: `serve` runs one loop per host (worker 0), and every host sharing
the store may ask about the same record; the store's compare-and-swap lets exactly one
verdict settle it, and any other finds it settled and leaves it alone. When to look is this
process's memory (a restart looks again from `after`), which costs requests, never effects.

Bounded per provider: a round asks about at most BATCH[kind] of the provider's due records,
at most `api.max_connections` at once, and a provider's rounds are PACE[kind] seconds apart
on the loop's clock, so a thousand unknowns cost a bounded number of requests per minute
(SendGrid's Email Activity API allows 6 a minute, a record costs up to 4 there). Records are
found by an index walk of each zone's `unknown` records updated within `give_up`, at most
SCAN_MAX per round.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from smtpguard.config import Config, ConfigError
from smtpguard.config.verdicts import MailgunApi, PostmarkApi, SendgridApi, VerdictsConfig
from smtpguard.policy.ledger import Record
from smtpguard.policy.verdicts import Attempt, VerdictKind, next_look
from smtpguard.store import Store, StoreUnavailable
from smtpguard.verdicts import clients_for, logs_of
from smtpguard.verdicts.ask import Asked, Proof, ask, record_attempt
from smtpguard.verdicts.model import LogApi
from smtpguard.verdicts.settle import settle

log = logging.getLogger("smtpguard.verdicts")

BATCH = {"mailgun": 20, "postmark": 20, "sendgrid": 1}
"""Records asked about per provider per round, by api kind."""
PACE = {"mailgun": 5.0, "postmark": 5.0, "sendgrid": 40.0}
"""Seconds between two rounds of one provider, by api kind."""
TICK = 5.0
"""Seconds between rounds of the loop (real time; what a round does is on its clock)."""
SCAN_PAGE = 200
SCAN_MAX = 5000


def settings_of(config: Config) -> VerdictsConfig:
    """`verdicts:`, or its defaults when only `api:` sections are given."""
    return config.verdicts or VerdictsConfig()


@dataclass(slots=True)
class _Due:
    record: Record
    attempt: Attempt
    due_at: float


class VerdictLoop:
    def __init__(
        self,
        config: Callable[[], Config],
        store: Store,
        clients: Mapping[str, LogApi],
        clock: Callable[[], float],
        on_verdict: Callable[[str, str], None] = lambda provider, verdict: None,
        on_api_error: Callable[[str, str, int], None] = lambda provider, kind, n: None,
    ) -> None:
        self._config = config
        self.store = store
        self.clients = dict(clients)
        self._clock = clock
        self._on_verdict = on_verdict
        self._on_api_error = on_api_error
        self._looked: dict[tuple[str, str, str], float] = {}
        """(zone, key, attempt id) → when this process last asked about it."""
        self._gave_up: set[tuple[str, str, str]] = set()
        self._paced: dict[str, float] = {}
        """provider → when its last round ran."""
        self._errors_seen: dict[str, Counter[str]] = {}
        self._busy: dict[str, asyncio.Task[list[Asked]]] = {}
        """provider → its round still running (serve's loop)."""
        self._apis = _apis(config())
        self._read = config()
        """The config whose api keys the clients were last checked against (`_keys_moved`)."""

    async def run(self) -> None:
        while True:
            try:
                await self.round(wait=False)
            except StoreUnavailable as e:
                log.warning("verdict round skipped: store unavailable", extra={"error": str(e)})
            except Exception:  # the loop must outlive any one round's surprise
                log.exception("verdict round failed")
            await asyncio.sleep(TICK)

    async def close(self) -> None:
        for task in list(self._busy.values()):
            task.cancel()
        await asyncio.gather(*self._busy.values(), return_exceptions=True)
        for client in self.clients.values():
            with contextlib.suppress(Exception):
                await client.close()

    async def round(self, wait: bool = True) -> list[Asked]:
        """One pass: every due record of every paced-in provider, up to its batch. What was
        asked, for tests and `bench/verdicts.py`.

        `wait` False (serve's loop): each provider's round runs on its own and this returns
        at once; a provider whose last round is still running is left out. A hung API then
        holds only its own provider's looks (bounded by its timeouts), never the others'."""
        config = self._config()
        await self._follow_reload(config)
        settings = settings_of(config)
        now = self._clock()
        due = await self._due(config, settings, now)
        ready = [
            p
            for p in due
            if (wait or p not in self._busy)
            and now >= self._paced.get(p, float("-inf")) + PACE[self._kind(config, p)]
        ]
        if not wait:
            for p in ready:
                task = asyncio.create_task(self._provider_round(config, p, due[p], settings, now))
                self._busy[p] = task
                task.add_done_callback(functools.partial(self._finished, p))
            return []
        rounds = (self._provider_round(config, p, due[p], settings, now) for p in ready)
        results = await asyncio.gather(*rounds)
        self._count_errors()
        return [a for asked in results for a in asked]

    def _finished(self, provider: str, task: asyncio.Task[list[Asked]]) -> None:
        if self._busy.get(provider) is task:
            del self._busy[provider]
        self._count_errors()
        if task.cancelled():
            return
        error = task.exception()
        if isinstance(error, StoreUnavailable):
            why = {"provider": provider, "error": str(error)}
            log.warning("verdict round cut short: store unavailable", extra=why)
        elif error is not None:
            log.error("verdict round failed", extra={"provider": provider}, exc_info=error)

    async def _follow_reload(self, config: Config) -> None:
        """A reload that changed a provider's `api` (or removed it), or rewrote a key file so
        that it names another log, gets clients of the new settings; a key that cannot be read
        keeps the old clients that still read the log their provider's api names
        (`_drop_moved`), and says so. (A reload that adds the first `api` to a config that
        had none starts the loop: Server.reload.)"""
        apis = _apis(config)
        read, self._read = self._read, config
        if apis == self._apis and (config is read or not self._keys_moved(config)):
            return
        try:
            clients = clients_for(config, wall=self._clock)
        except ConfigError as e:
            self._apis = apis  # said once per reload, not once per round
            why = "; ".join(e.problems)
            log.warning(
                "verdicts: a reloaded api cannot be used; the previous ones stay", extra={"error": why}
            )
            await self._drop_moved(apis)
            return
        # A provider's round still running uses the old clients: it ends before they close
        # (a hung one would otherwise fail on a closed session, or hold the new settings off).
        busy = list(self._busy.values())
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        old, self.clients, self._apis = self.clients, clients, apis
        self._errors_seen = {}
        for client in old.values():
            with contextlib.suppress(Exception):
                await client.close()

    def _keys_moved(self, config: Config) -> bool:
        """A reload with the same `api` settings whose key files now name other logs (a key
        rewritten in place, perhaps another account's): the relay notes the new ones from now
        on (server/reload.py), so the clients must read them. Read once per reload."""
        return logs_of(config) != {p: c.log for p, c in self.clients.items() if c.log is not None}

    async def _drop_moved(self, apis: Mapping[str, object]) -> None:
        """After a reload whose clients cannot be built: the previous client of a provider
        whose `api` no longer names the log it reads (removed, another kind, domain or
        base_url) is closed, not kept. The provider's messages go elsewhere from now on:
        their absence from the log it reads proves nothing, and `not accepted` would send
        them again. A client whose log is the same (only its key or limits changed) stays."""
        moved = [p for p, client in self.clients.items() if not _reads(client, apis.get(p))]
        busy = [self._busy[p] for p in moved if p in self._busy]
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        for provider in moved:
            client = self.clients.pop(provider)
            with contextlib.suppress(Exception):
                await client.close()

    def _kind(self, config: Config, provider: str) -> str:
        for p in config.providers:
            if p.name == provider:
                api = getattr(p, "api", None)
                if api is not None:
                    return str(api.kind)
        return "mailgun"

    async def _provider_round(
        self, config: Config, provider: str, due: list[_Due], settings: VerdictsConfig, now: float
    ) -> list[Asked]:
        client = self.clients[provider]
        kind = self._kind(config, provider)
        self._paced[provider] = now
        due.sort(key=lambda d: d.due_at)
        batch = due[: BATCH[kind]]
        limit = asyncio.Semaphore(_max_connections(config, provider))
        proof = Proof(client)

        async def one(d: _Due) -> Asked:
            async with limit:
                asked = await ask(client, d.record, d.attempt, settings, now, proof)
            self._looked[_ident(d.record)] = now
            await self._apply(config, provider, asked)
            return asked

        asked = list(await asyncio.gather(*(one(d) for d in batch)))
        failed = [a for a in asked if a.error is not None]
        if failed:
            # One line per provider per round, not one per record: a thousand unknown
            # records while the API is down would otherwise flood the log.
            log.warning(
                "verdict: the provider's log could not be read; the records stay unknown",
                extra={"provider": provider, "records": len(failed), "error": failed[0].error},
            )
        return asked

    async def _apply(self, config: Config, provider: str, asked: Asked) -> None:
        v = asked.verdict
        self._on_verdict(provider, v.kind.value)
        rec = asked.record
        if not v.settles:
            return
        written = await settle(
            self.store, rec.zone, rec.key, v, "api", provider, attempt_id=rec.sg_id,
            min_retry_interval=config.event_key.min_retry_interval, clock=self._clock,
        )  # fmt: skip
        if written is not None:
            log.info(
                "verdict settled an unknown outcome",
                extra={
                    "zone": rec.zone,
                    "event_key": rec.key,
                    "provider": provider,
                    "verdict": v.kind.value,
                    "state": written.state.value,
                },
            )

    async def _due(self, config: Config, settings: VerdictsConfig, now: float) -> dict[str, list[_Due]]:
        """Per provider with a client, its unknown records due for a look now."""
        due: dict[str, list[_Due]] = {}
        seen: set[tuple[str, str, str]] = set()
        keys: set[tuple[str, str]] = set()
        scanned = 0
        since = now - settings.give_up  # updated later than the attempt: an index bound
        for zone in config.zones:
            before: float | None = None
            while scanned < SCAN_MAX:
                page = await self.store.list_records(zone, "unknown", since, before, SCAN_PAGE)
                scanned += len(page)
                fresh = [r for r in page if (r.zone, r.key) not in keys]
                keys.update((r.zone, r.key) for r in fresh)
                for rec in fresh:
                    self._consider(rec, settings, now, due, seen)
                if len(page) < SCAN_PAGE:
                    break
                # `before` is exclusive: records sharing the last one's time are read
                # again on the next page (and skipped above) rather than missed, unless a
                # whole page shares it; then past them, or no page would ever be new.
                last = page[-1].updated_at
                before = math.nextafter(last, math.inf) if fresh else last
        # Forget what no longer needs a look (settled, purged, retried) so memory stays
        # bounded by the unknown records themselves.
        self._looked = {k: t for k, t in self._looked.items() if k in seen}
        self._gave_up &= seen
        return due

    def _consider(
        self,
        rec: Record,
        settings: VerdictsConfig,
        now: float,
        due: dict[str, list[_Due]],
        seen: set[tuple[str, str, str]],
    ) -> None:
        attempt = record_attempt(rec)
        if attempt is None or attempt.provider not in self.clients:
            return
        ident = _ident(rec)
        seen.add(ident)
        last = self._looked.get(ident)
        at = next_look(attempt.at, last, after=settings.after, every=settings.every, give_up=settings.give_up)
        if at is None:
            if ident not in self._gave_up:
                self._gave_up.add(ident)
                self._on_verdict(attempt.provider, VerdictKind.GAVE_UP.value)
                log.info(
                    "verdict: gave up asking the provider's log; the record waits for an operator",
                    extra={"zone": rec.zone, "event_key": rec.key, "provider": attempt.provider},
                )
            return
        if now >= at:
            due.setdefault(attempt.provider, []).append(_Due(rec, attempt, at))

    def _count_errors(self) -> None:
        for provider, client in self.clients.items():
            seen = self._errors_seen.setdefault(provider, Counter())
            for kind, n in client.errors.items():
                if n > seen[kind]:
                    self._on_api_error(provider, kind, n - seen[kind])
                    seen[kind] = n


def _reads(client: LogApi, api: object) -> bool:
    """Does `client` read the log `api` (a provider's `api:` now, or None) names?"""
    if not isinstance(api, MailgunApi | PostmarkApi | SendgridApi) or api.kind != client.kind:
        return False
    same_url = getattr(client, "base_url", None) == api.url(api.kind).rstrip("/")
    return same_url and getattr(client, "domain", None) == getattr(api, "domain", None)


def _apis(config: Config) -> dict[str, object]:
    return {p.name: api for p in config.providers if (api := getattr(p, "api", None)) is not None}


def _ident(rec: Record) -> tuple[str, str, str]:
    return (rec.zone, rec.key, rec.sg_id)


def _max_connections(config: Config, provider: str) -> int:
    for p in config.providers:
        if p.name == provider:
            api = getattr(p, "api", None)
            if api is not None:
                return int(api.max_connections)
    return 1
