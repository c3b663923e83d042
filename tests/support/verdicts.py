"""What the verdict-loop tests and bench/verdicts.py share: a guard config whose provider
has a log `api` pointing at a local fake, and the provider's side of a relayed message (its
tag and Message-ID as the sink received them, for the fake's log); for the tests, a guard
serving such a config on an injected clock with its fake log (`verdict_harness`), and the
§19 table at the documented defaults (`judged`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from email.message import EmailMessage
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from smtpguard.policy.ledger import Record, State
from smtpguard.policy.verdicts import Attempt, LogEntry, Verdict, VerdictKind, verdict
from smtpguard.server import Server
from smtpguard.verdicts.loop import VerdictLoop
from tests.support import Behaviour, FakeClock, base_config, message, running_guard, send, write_config
from tests.support.provider_api_fakes import FakeApi, FakeMailgun, FakePostmark, FakeSendgrid

if TYPE_CHECKING:
    import pytest

    from tests.support import Received, Upstream

API_KEY = "key-0123456789abcdef-verdicts"
API_ENV = "SMTPGUARD_TEST_LOG_API_KEY"
MAILGUN_DOMAIN = "mg.acme.example"


def api_section(kind: str, base_url: str) -> dict[str, Any]:
    secret = {"postmark": "token_env"}.get(kind, "key_env")
    api: dict[str, Any] = {"kind": kind, secret: API_ENV, "base_url": base_url}
    if kind == "mailgun":
        api["domain"] = MAILGUN_DOMAIN
    return api


def verdict_config(
    tmp: Path, upstream_port: int, store_url: str, kind: str, base_url: str, **overrides: Any
) -> dict[str, Any]:
    """base_config with the provider's `api`, the §19 defaults spelt out, and the store."""
    cfg = base_config(tmp, upstream_port, **overrides)
    cfg["store"] = {"url": store_url, **({"unsafe": True} if store_url.startswith("redis") else {})}
    cfg["providers"][0]["api"] = api_section(kind, base_url)
    cfg["verdicts"] = {"after": "2m", "every": "5m", "absent_after": "30m", "give_up": "24h"}
    return cfg


def tag_of(received: Received, kind: str) -> str | None:
    """smtpguard's tag as the provider reads it from the relayed message."""
    if kind == "postmark":
        return received.header("X-PM-Metadata-smtpguard_key")
    raw = received.header({"mailgun": "X-Mailgun-Variables", "sendgrid": "X-SMTPAPI"}[kind])
    if raw is None:
        return None
    doc = json.loads(raw)
    value = doc.get("unique_args", {}) if kind == "sendgrid" else doc
    tag = value.get("smtpguard_key")
    return tag if isinstance(tag, str) else None


def message_id_of(received: Received) -> str:
    mid = received.header("Message-ID")
    assert mid is not None, "every relayed message carries a Message-ID"
    return mid


MINUTE = 60.0
ABSENT_AFTER = 30 * MINUTE
GIVE_UP = 24 * 3600.0
"""absent_after and give_up as verdict_config spells them out (the §19 defaults)."""


def judged(
    attempt: Attempt, entries: Iterable[LogEntry], *, now: float, proof: bool, log: str | None
) -> Verdict:
    """The §19 table for one record under the defaults' absent_after and give_up."""
    return verdict(
        attempt,
        entries,
        now=now,
        absent_after=ABSENT_AFTER,
        give_up=GIVE_UP,
        proof_of_ingestion=proof,
        log=log,
    )


@dataclass
class Harness:
    guard: Server
    clock: FakeClock
    fake: FakeApi
    upstream: Upstream
    kind: str
    cfg: dict[str, Any] = field(default_factory=dict)
    """What the guard was started with: a test edits it and calls `reload`."""
    path: Path | None = None
    """Where `cfg` is written for the guard to re-read."""
    api: dict[str, Any] = field(default_factory=dict)
    """The provider's `api` as verdict_config wrote it, in `cfg` or left out of it."""

    @property
    def loop(self) -> VerdictLoop:
        assert self.guard.verdicts is not None, "serve started no verdict loop"
        return self.guard.verdicts

    async def lose_reply(self, key: str, raw: EmailMessage | bytes | None = None) -> Record:
        """Submit `key` (as `raw`, where given); the upstream takes the dot and drops before
        its 250: unknown."""
        self.upstream.handler.script = [Behaviour(drop_after_dot=True)]
        reply = await send(self.guard.ports[0], message(key) if raw is None else raw)
        assert reply.code == 451 and "unknown" in reply.text
        return await self.record(key, State.UNKNOWN)

    async def record(self, key: str, state: State | None = None) -> Record:
        assert self.guard.store is not None
        rec = await self.guard.store.get("acme", key)
        assert rec is not None
        if state is not None:
            assert rec.state is state, f"{key} is {rec.state.value}, not {state.value}"
        return rec

    async def lost_and_logged(self, key: str, event: str = "accepted", reason: str = "") -> Record:
        """lose_reply, and the provider's log shows the message a second after the attempt."""
        rec = await self.lose_reply(key)
        self.log(self.last_received(), rec.attempts[-1].at + 1, event, reason)
        return rec

    def last_received(self) -> Received:
        return self.upstream.received[-1]

    def log(self, received: Received, at: float, event: str = "accepted", reason: str = "") -> None:
        """The provider's log shows `received` (as its tag and Message-ID say) at `at`."""
        tag = tag_of(received, self.kind)
        if isinstance(self.fake, FakeMailgun):
            self.fake.add(event, at, message_id=message_id_of(received), tag=tag, reason=reason)
        elif isinstance(self.fake, FakePostmark):
            assert event == "accepted"
            self.fake.add_message(at, tag=tag)
        else:
            assert isinstance(self.fake, FakeSendgrid)
            self.fake.add_message(at, tag=tag, dropped=reason if event == "dropped" else None)

    def other_acceptance(self, at: float) -> None:
        """Another message's acceptance through the same provider: the ingestion proof."""
        if isinstance(self.fake, FakeMailgun):
            self.fake.add("accepted", at, message_id="<other.1@elsewhere.example>", tag="acme:other")
        elif isinstance(self.fake, FakePostmark):
            self.fake.add_message(at, tag="acme:other")
        else:
            assert isinstance(self.fake, FakeSendgrid)
            self.fake.add_message(at, tag="acme:other")

    async def after(self, seconds: float) -> list[VerdictKind]:
        self.clock.t += seconds
        return [a.verdict.kind for a in await self.loop.round()]

    async def rounds(self, count: int, every: float) -> None:
        """`count` of the loop's rounds, the clock moved `every` after each (serve's own
        loop, the same object, may take a round between them)."""
        for _ in range(count):
            await self.loop.round()
            self.clock.t += every

    async def reload(self) -> bool:
        """Write the edited `cfg` where the guard reads it, and reload as SIGHUP does."""
        assert self.path is not None, "the guard was started without a config file"
        write_config(self.path, self.cfg)
        return await self.guard.reload()


def make_fake(kind: str, clock: FakeClock) -> FakeApi:
    if kind == "mailgun":
        return FakeMailgun(API_KEY, MAILGUN_DOMAIN, clock)
    if kind == "postmark":
        return FakePostmark(API_KEY, clock)
    return FakeSendgrid(API_KEY, clock)


F = TypeVar("F", bound=FakeApi)


@contextlib.asynccontextmanager
async def serving(fake: F) -> AsyncIterator[F]:
    """`fake`'s log API listening for as long as the block runs."""
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


QUEUED: dict[str, Any] = {
    "zones__acme__delivery": "queue",
    "queue": {"poll_interval": "100ms", "backoff": {"base": "1s", "max": "2s"}},
}
"""verdict_harness's overrides for store-and-forward: a worker that polls and backs off
within a test's few seconds."""


@contextlib.asynccontextmanager
async def verdict_harness(
    tmp: Path,
    upstream: Upstream,
    store_url: str,
    monkeypatch: pytest.MonkeyPatch,
    kind: str = "mailgun",
    *,
    api: bool = True,
    clock: FakeClock | None = None,
    fake: FakeApi | None = None,
    configure: Callable[[dict[str, Any]], None] | None = None,
    **overrides: Any,
) -> AsyncIterator[Harness]:
    """A guard in this process whose provider `primary` relays to `upstream` and has `kind`'s
    log `api` at a local fake, both on one injected clock, the key in the environment.

    `api=False` starts it with the provider's api left out (`Harness.api` holds it, for a
    reload to bring). `overrides` go to base_config (`zones__acme__delivery="queue"`);
    `configure` edits the whole config last, before the guard starts. `clock` and `fake`:
    ones the test made first (the fake serving, on that clock); by default a new clock and
    a fake of `kind` served for the block. The config is written at tmp/c.yaml: edit
    `Harness.cfg` and `Harness.reload()`."""
    monkeypatch.setenv(API_ENV, API_KEY)
    clock = clock or FakeClock()
    async with contextlib.AsyncExitStack() as stack:
        if fake is None:
            fake = await stack.enter_async_context(serving(make_fake(kind, clock)))
        assert fake.clock is clock, "the fake keeps its log on the guard's clock"
        cfg = verdict_config(tmp, upstream.port, store_url, kind, fake.base_url, **overrides)
        section = cfg["providers"][0]["api"] if api else cfg["providers"][0].pop("api")
        if configure is not None:
            configure(cfg)
        path = tmp / "c.yaml"
        async with running_guard(cfg, clock=clock, config_path=path) as guard:
            yield Harness(guard, clock, fake, upstream, kind, cfg=cfg, path=path, api=section)
