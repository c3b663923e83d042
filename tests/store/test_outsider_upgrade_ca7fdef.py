"""A rolling upgrade from ca7fdef, the release before the rest of an event (docs/receivers.md
"Shaping"): that release serves from its own `git archive` tree on the store this one
serves from too, both behind one NSD that gives yahoo and gmail recipients their receivers.
A receiver paused holds its recipient at RCPT (451 4.7.1) while the transaction's others are
relayed; the client's queue retries what it was told to retry, at whichever instance the
load balancer gives it. What the recording upstream received is counted per recipient:
nothing may be sent twice, and no recipient may be lost beyond what the document admits
(a held recipient's retry answered 550 reused by the old instance). Also: keys ASCII cannot
carry and provider events across the two releases, a pooled connection the provider ends at
RCPT on either, and the rest of an event on two instances of this release (the cache of
delivered events)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosmtplib
import pytest
import redis

from smtpguard import desk
from smtpguard.policy import ledger
from smtpguard.policy.decisions import Decision
from smtpguard.policy.events import tag_value
from smtpguard.policy.ledger import Answer, LedgerSettings, Proceed, Submission
from smtpguard.policy.outcome import Kind, Outcome
from smtpguard.replies import Reply
from smtpguard.server import Server
from smtpguard.settled import SettledCache
from tests.events.test_events import RCPT, events_config, events_port, suppressed
from tests.support import (
    PASSWORD,
    Behaviour,
    RedisServer,
    Upstream,
    base_config,
    message,
    running_guard,
    send,
)
from tests.support import events as ev
from tests.support.dns import NsdServer, nsd
from tests.support.eventually import eventually
from tests.support.releases import extract_release, release_serving

BEFORE = "ca7fdef"
RECORDS = [
    "gm IN MX 5 aspmx.l.google.com.",
    "yh IN MX 1 mta5.am0.yahoodns.net.",
    "ms IN MX 5 ms-test.mail.protection.outlook.com.",
]
Y, G, M = "y@yh.test", "g@gm.test", "m@ms.test"
BOTH = [Y, G]


@pytest.fixture(scope="module")
def before(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return extract_release(BEFORE, tmp_path_factory.mktemp("release"))


@pytest.fixture(scope="module")
def dns_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NsdServer]:
    with nsd(tmp_path_factory.mktemp("dns"), "test", RECORDS, ttl=300, negative=60) as server:
        yield server


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request: pytest.FixtureRequest, tmp: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp / 'state.db'}"
    server: RedisServer = request.getfixturevalue("redis_server")
    redis.Redis(port=server.port).flushall()
    return server.url


@dataclass
class Txn:
    """One transaction's replies: each RCPT's code, then DATA's (None: never reached)."""

    rcpt: dict[str, int]
    data: tuple[int, str] | None

    def __str__(self) -> str:
        return f"rcpt={self.rcpt} data={self.data}"


async def transaction(port: int, key: str | None, rcpts: list[str], *, data: bool = True) -> Txn:
    """The client's side of one transaction, every reply kept (a held RCPT does not end it):
    the same message whichever of the event's recipients it names, as a client's queue keeps it."""
    client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, start_tls=False, timeout=20)
    await client.connect()
    try:
        await client.login("acme-app", PASSWORD)
        await client.mail("billing@acme.example")
        codes: dict[str, int] = {}
        for r in rcpts:
            try:
                codes[r] = (await client.rcpt(r)).code
            except aiosmtplib.SMTPRecipientRefused as e:
                codes[r] = e.code
        if not data or not any(c == 250 for c in codes.values()):
            await client.rset()
            return Txn(codes, None)
        raw = message(key, to=", ".join(BOTH), subject="Order shipped").as_bytes()
        raw = raw.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
        try:
            resp = await client.data(raw)
            return Txn(codes, (resp.code, resp.message))
        except aiosmtplib.SMTPResponseException as e:
            return Txn(codes, (e.code, e.message))
    finally:
        with contextlib.suppress(Exception):
            await client.quit()
        client.close()


@dataclass
class Fleet:
    old: int
    new: int
    guard: Server

    async def pause_yahoo(self, paused: bool) -> None:
        await self.pause("yahoo", paused)

    async def pause(self, receiver: str, paused: bool) -> None:
        """Pause or resume a receiver for zone acme (the CLI's store write), and wait until both
        instances' copies have it (the old one's read at RCPT with no DATA: nothing sent)."""
        assert self.guard.store is not None and self.guard.assembly.receivers is not None
        await desk.set_receiver_paused(self.guard.store, "acme", receiver, paused, "cli:test")
        await self.guard.assembly.receivers.gate.pauses.paused()
        want, who = 451 if paused else 250, {"yahoo": Y, "microsoft": M}[receiver]
        for port in (self.old, self.new):
            probe = await eventually(
                lambda p=port: transaction(p, None, [who], data=False),  # type: ignore[misc]
                lambda t: t.rcpt[who] == want,
                timeout=10,
                interval=0.2,
            )
            assert probe.rcpt[who] == want, (port, probe)


@contextlib.asynccontextmanager
async def fleet(
    tmp: Path,
    before: Path | None,
    upstream: Upstream,
    dns: NsdServer,
    store_url: str,
    **overrides: Any,
) -> AsyncIterator[Fleet]:
    """The old release (at `before`; None: this one again, in this process) and this one."""
    cfgs = []
    for instance in ("old", "new"):
        cfg = base_config(
            tmp,
            upstream.port,
            instance=instance,
            store__url=store_url,
            event_key__min_retry_interval="1s",
            **overrides,
        )
        if store_url.startswith("redis"):
            cfg["store"]["unsafe"] = True
        cfg["dns"] = {"nameservers": [dns.nameserver], "timeout": "2s"}
        cfg["receivers"] = {}
        cfgs.append(cfg)
    if before is None:
        async with running_guard(cfgs[0]) as other, running_guard(cfgs[1]) as guard:
            yield Fleet(other.ports[0], guard.ports[0], guard)
        return
    async with release_serving(before, cfgs[0], tmp) as old_port, running_guard(cfgs[1]) as guard:
        yield Fleet(old_port, guard.ports[0], guard)


def per_recipient(upstream: Upstream) -> Counter[str]:
    return Counter(r for m in upstream.received for r in m.rcpt_tos)


async def test_the_rest_bounced_between_the_releases_is_sent_once(
    tmp: Path, before: Path, upstream: Upstream, dns_server: NsdServer, store_url: str
) -> None:
    """The event starts at this release with yahoo paused (g sent, y held and owed). The
    rest goes to the old instance first (550 reused, as documented), then here (sent), and
    every transaction of the event is then resubmitted at both instances."""
    async with fleet(tmp, before, upstream, dns_server, store_url) as f:
        await f.pause_yahoo(True)
        first = await transaction(f.new, "ship:1", BOTH)
        assert first.rcpt == {Y: 451, G: 250} and first.data and first.data[0] == 250, first
        await upstream.wait_received(1)
        await f.pause_yahoo(False)
        at_old = await transaction(f.old, "ship:1", [Y])
        at_new = await transaction(f.new, "ship:1", [Y])
        again = [await transaction(port, "ship:1", rcpts) for port in (f.old, f.new) for rcpts in ([Y], BOTH)]
    print("rest at old:", at_old, "at new:", at_new, "again:", [str(t) for t in again])
    print("upstream:", per_recipient(upstream))
    assert at_old.data and at_old.data[0] == 550 and "reused" in at_old.data[1], at_old
    assert at_new.data and at_new.data[0] == 250 and "duplicate" not in at_new.data[1], at_new
    assert all(t.data and t.data[0] in (250, 550) for t in again), [str(t) for t in again]
    assert per_recipient(upstream) == {Y: 1, G: 1}


async def test_a_rest_held_again_in_part_is_sent_by_an_instance_that_saw_the_first_part(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    """Two instances of this release. The first part is sent at one (y and m held), which
    keeps it in its cache of delivered events; the rest goes to the other with m held again
    (y sent, m owed). The client's retry of m comes back to the first instance: it is the
    rest of the rest, owed by the record in the store, whatever the cache kept."""
    url = f"sqlite:///{tmp / 'state.db'}"
    async with fleet(tmp, None, upstream, dns_server, url) as f:
        one, two = f.old, f.new  # both this release
        await f.pause("yahoo", True)
        await f.pause("microsoft", True)
        first = await transaction(one, "ship:3", [Y, M, G])
        assert first.rcpt == {Y: 451, M: 451, G: 250} and first.data and first.data[0] == 250, first
        await f.pause("yahoo", False)
        rest = await transaction(two, "ship:3", [Y, M])
        assert rest.rcpt == {Y: 250, M: 451} and rest.data and rest.data[0] == 250, rest
        await f.pause("microsoft", False)
        last = await transaction(one, "ship:3", [M])
    print("first:", first, "rest:", rest, "last:", last, "upstream:", per_recipient(upstream))
    assert last.data and last.data[0] == 250 and "duplicate" not in last.data[1], last
    assert per_recipient(upstream) == {Y: 1, M: 1, G: 1}


DERIVED_TWICE = pytest.mark.xfail(
    strict=True,
    reason="not fixable here: a derived key is the fingerprint, which ca7fdef takes of the "
    "accepted recipients alone, so it finds no record under the key this release derived of "
    "every recipient named and sends the transaction again (g twice); docs/receivers.md "
    "says nothing is sent twice",
)


@pytest.mark.parametrize("first_at", ["old", pytest.param("new", marks=DERIVED_TWICE)])
async def test_a_derived_event_with_a_held_recipient_resubmitted_at_the_other_release(
    tmp: Path, before: Path, upstream: Upstream, dns_server: NsdServer, store_url: str, first_at: str
) -> None:
    """missing_key: derive (the key is the fingerprint). yahoo paused on both instances: y is
    held, g sent. The client did not see the 250 (lost on the way back) and resubmits the
    same transaction at the other release, y held again there: a duplicate for g. Here the
    old release's record is found under the key it derived (Submitter._as_recorded_before_owed);
    y's own retry, yahoo resumed, is sent once."""
    async with fleet(tmp, before, upstream, dns_server, store_url, zones__acme__missing_key="derive") as f:
        ports = (f.old, f.new) if first_at == "old" else (f.new, f.old)
        await f.pause_yahoo(True)
        first = await transaction(ports[0], None, BOTH)
        again = await transaction(ports[1], None, BOTH)
        print("first:", first, "again:", again, "upstream:", per_recipient(upstream))
        assert first.rcpt == {Y: 451, G: 250} and first.data and first.data[0] == 250, first
        assert again.data and again.data[0] == 250 and "duplicate" in again.data[1], again
        assert per_recipient(upstream) == {G: 1}
        await f.pause_yahoo(False)
        rest = await transaction(ports[1], None, [Y])
        after = [await transaction(port, None, [Y]) for port in ports]
        # (Resubmitted with y no longer held, the transaction is another fingerprint on the
        # old release, so another derived key: a new event there, as ca7fdef alone did.)
        await f.pause_yahoo(True)
        after += [await transaction(port, None, BOTH) for port in ports]
    print("rest:", rest, "after:", [str(t) for t in after], "upstream:", per_recipient(upstream))
    assert rest.data and rest.data[0] == 250 and "duplicate" not in rest.data[1], rest
    assert all(t.data and t.data[0] == 250 for t in after), [str(t) for t in after]
    assert per_recipient(upstream) == {G: 1, Y: 1}


OLD_REUSED = pytest.mark.xfail(
    strict=True,
    reason="not fixable here: ca7fdef hashes the accepted recipients alone and finds this "
    "release's record (of every recipient named) another message: 550 reused, and g, never "
    "sent, misses it (docs/receivers.md admits only the held recipients may)",
)


@pytest.mark.parametrize(
    ("first_at", "derive"),
    [
        pytest.param("old", False, id="old-keyed"),
        pytest.param("old", True, id="old-derived"),
        pytest.param("new", False, id="new-keyed", marks=OLD_REUSED),
        # The old release derives another key, whose fresh record sends g (never sent).
        pytest.param("new", True, id="new-derived"),
    ],
)
async def test_a_deferred_event_with_a_held_recipient_retried_at_the_other_release(
    tmp: Path,
    before: Path,
    upstream: Upstream,
    dns_server: NsdServer,
    store_url: str,
    first_at: str,
    derive: bool,
) -> None:
    """yahoo paused on both instances: y is held at RCPT, and the upstream defers g's send
    (451 at the dot). The client's queue retries both at the other release, y held again:
    g, never sent, is owed the message. Here, a record of the old release's (of g alone) is
    this event's (Submission.accepted_fingerprint); there, this release's is not."""
    upstream.handler.script.append(Behaviour(data="451 4.3.0 try later"))
    key, mode = (None, "derive") if derive else ("ship:4", "reject")
    async with fleet(tmp, before, upstream, dns_server, store_url, zones__acme__missing_key=mode) as f:
        ports = (f.old, f.new) if first_at == "old" else (f.new, f.old)
        await f.pause_yahoo(True)
        first = await transaction(ports[0], key, BOTH)
        assert first.rcpt == {Y: 451, G: 250} and first.data and first.data[0] == 451, first
        again = await eventually(
            lambda: transaction(ports[1], key, BOTH),
            lambda t: t.data is None or "retry" not in t.data[1],
            timeout=10,
            interval=0.3,
        )
        print("first:", first, "again:", again, "upstream:", per_recipient(upstream))
        assert again.data and again.data[0] == 250 and "duplicate" not in again.data[1], again
        # Resubmitted at both (its 250 lost), y still held: nothing more. Then y's retry,
        # once yahoo is resumed, is the rest (sent once), and none of it goes again.
        resent = [await transaction(port, key, BOTH) for port in ports]
        await f.pause_yahoo(False)
        rest = await transaction(ports[1], key, [Y])
        after = [await transaction(port, key, [Y]) for port in ports]
        if not derive:
            # A derived key of all the recipients, none held, is another key on the old
            # release, and here one whose record the old release never wrote: a new event.
            after += [await transaction(port, key, BOTH) for port in ports]
        await f.pause_yahoo(True)
        after += [await transaction(port, key, BOTH) for port in ports]
    print("resent:", [str(t) for t in resent], "rest:", rest, "after:", [str(t) for t in after])
    assert all(t.data and t.data[0] in (250, 550) for t in [*resent, *after]), [*resent, *after]
    assert rest.data and rest.data[0] == 250 and "duplicate" not in rest.data[1], rest
    assert per_recipient(upstream) == {G: 1, Y: 1}


def test_only_a_record_of_the_release_before_owed_is_matched_by_the_accepted_recipients() -> None:
    """Pure: the ledger's side of the retry above. A record of g alone with no `owed` and no
    `parts` (what ca7fdef wrote of the transaction y held, g accepted) is the event of a
    submission whose accepted recipients are g and y held; a record of this release, which
    owes or has parts, is matched by its own fingerprints alone."""
    s, t0 = LedgerSettings(min_retry_interval=60.0, lease=30.0), 1_700_000_000.0
    named, accepted, held = "a" * 64, "b" * 64, "c" * 64

    def sub(fp: str, attempt: str, **kw: Any) -> Submission:
        return Submission("acme", "k1", fp, attempt, "i-1", "<m@app>", **kw)

    deferred = Outcome(Kind.DEFERRED, "primary", Reply(451, "4.3.0", "later"))
    delivered = Outcome(Kind.DELIVERED, "primary", Reply(250, "2.0.0", "ok"), upstream_id="Q1")
    old = ledger.decide(None, sub(accepted, "A1"), t0, s)
    assert isinstance(old, Proceed)
    before = ledger.settle(old.record, "A1", "i-1", deferred, t0 + 1, s)
    retry = sub(named, "A2", owed=held, accepted_fingerprint=accepted)
    taken = ledger.decide(before, retry, t0 + 120, s)
    assert isinstance(taken, Proceed), taken
    assert (taken.record.fingerprint, taken.record.owed, taken.record.parts) == (named, held, ())
    sent = ledger.settle(taken.record, "A2", "i-1", delivered, t0 + 121, s)
    again = ledger.decide(sent, sub(named, "A3", owed=held, accepted_fingerprint=accepted), t0 + 200, s)
    assert isinstance(again, Answer) and again.decision is Decision.DUPLICATE, again
    # The accepted recipients' transaction was never sent on its own: not a part. Here it
    # is another message, as for any record of this release.
    deferred_again = ledger.settle(taken.record, "A2", "i-1", deferred, t0 + 121, s)
    alone = ledger.decide(deferred_again, sub(accepted, "A5"), t0 + 300, s)
    assert isinstance(alone, Answer) and alone.decision is Decision.REUSED, alone
    rest = ledger.decide(sent, sub(held, "A4"), t0 + 300, s)
    assert isinstance(rest, Proceed) and rest.record.parts == (named,), rest
    # This release's record of the same recipients, owing another's: another message.
    owing = ledger.settle(old.record, "A1", "i-1", deferred, t0 + 1, s)
    owing = ledger.evolve(owing, owed="d" * 64)
    reused = ledger.decide(owing, retry, t0 + 120, s)
    assert isinstance(reused, Answer) and reused.decision is Decision.REUSED, reused


async def test_the_whole_event_sent_by_the_old_release_owes_nothing_after(
    tmp: Path, before: Path, upstream: Upstream, dns_server: NsdServer, store_url: str
) -> None:
    """The event starts here, yahoo paused: y is held (owed), the upstream defers g. The
    client's queue retries both at the old instance, yahoo resumed: both are sent there, and
    the old release's rewrite of the record drops `owed`. A client that also retries y alone
    (a queue kept per recipient) at this release must not send y again."""
    upstream.handler.script.append(Behaviour(data="451 4.3.0 try later"))
    async with fleet(tmp, before, upstream, dns_server, store_url) as f:
        await f.pause_yahoo(True)
        first = await transaction(f.new, "ship:5", BOTH)
        assert first.rcpt == {Y: 451, G: 250} and first.data and first.data[0] == 451, first
        await f.pause_yahoo(False)
        whole = await eventually(
            lambda: transaction(f.old, "ship:5", BOTH),
            lambda t: t.data is None or "retry" not in t.data[1],
            timeout=10,
            interval=0.3,
        )
        alone = [await transaction(port, "ship:5", [Y]) for port in (f.new, f.old)]
    print("whole at old:", whole, "y alone:", [str(t) for t in alone], "upstream:", per_recipient(upstream))
    assert whole.data and whole.data[0] == 250 and "duplicate" not in whole.data[1], whole
    assert all(t.data and t.data[0] in (250, 550) for t in alone), [str(t) for t in alone]
    assert per_recipient(upstream) == {G: 1, Y: 1}


async def test_a_rest_deferred_here_and_sent_by_the_old_release_is_sent_once(
    tmp: Path, before: Path, upstream: Upstream, dns_server: NsdServer, store_url: str
) -> None:
    """The rest of an event (y, held at RCPT while g was sent) is deferred by the upstream
    here; the client's retry of it goes to the old release, whose fingerprint of y alone is
    the record's: sent there, and the old release's rewrite drops `parts`. Every
    transaction of the event resubmitted at either release afterwards sends nothing."""
    async with fleet(tmp, before, upstream, dns_server, store_url) as f:
        await f.pause_yahoo(True)
        first = await transaction(f.new, "ship:6", BOTH)
        assert first.rcpt == {Y: 451, G: 250} and first.data and first.data[0] == 250, first
        await f.pause_yahoo(False)
        upstream.handler.script.append(Behaviour(data="451 4.3.0 try later"))
        deferred = await transaction(f.new, "ship:6", [Y])
        assert deferred.data and deferred.data[0] == 451, deferred
        at_old = await eventually(
            lambda: transaction(f.old, "ship:6", [Y]),
            lambda t: t.data is None or "retry" not in t.data[1],
            timeout=10,
            interval=0.3,
        )
        after = [await transaction(port, "ship:6", rcpts) for port in (f.new, f.old) for rcpts in ([Y], BOTH)]
        await f.pause_yahoo(True)
        after += [await transaction(port, "ship:6", BOTH) for port in (f.new, f.old)]
    print("rest at old:", at_old, "after:", [str(t) for t in after], "upstream:", per_recipient(upstream))
    assert at_old.data and at_old.data[0] == 250 and "duplicate" not in at_old.data[1], at_old
    assert all(t.data and t.data[0] in (250, 550) for t in after), [str(t) for t in after]
    assert per_recipient(upstream) == {G: 1, Y: 1}


IDEM = "Resend-Idempotency-Key"


def _raw(key: str, n: int) -> bytes:
    return (
        f"From: billing@acme.example\r\nTo: customer@example.com\r\nSubject: s{n}\r\n"
        f"X-Event-Key: {key}\r\n\r\nplain text\r\n"
    ).encode()


async def test_a_key_ascii_cannot_carry_is_one_event_across_the_releases(
    tmp: Path, before: Path, upstream: Upstream
) -> None:
    """Keys with non-ASCII letters (the old release wrote them raw in the provider's
    idempotency header, this one as `~b64:`; the ledger's key is the client's either way),
    each sent at one release and retried at the other: one message upstream per key."""
    url = f"sqlite:///{tmp / 'state.db'}"
    keys = ["facture:é", "注文:2026:1", "k" * 150 + "ü"]
    cfgs = []
    for instance in ("old", "new"):
        cfg = base_config(tmp, upstream.port, instance=instance, store__url=url)
        cfg["event_key"].pop("strip")
        cfg["providers"][0]["idempotency_header"] = IDEM
        cfgs.append(cfg)
    replies: dict[str, list[str]] = {}
    async with release_serving(before, cfgs[0], tmp) as old, running_guard(cfgs[1]) as guard:
        for i, key in enumerate(keys):
            ports = (old, guard.ports[0]) if i % 2 == 0 else (guard.ports[0], old)
            replies[key] = [str(await send(port, _raw(key, i))) for port in ports]
    fields = [r.header(IDEM) for r in upstream.received]
    print("replies:", replies, "upstream:", len(upstream.received), "idempotency:", fields)
    for key, (first, again) in replies.items():
        assert first.startswith("250") and again.startswith("250 ") and "duplicate" in again, (key, again)
    assert len(upstream.received) == len(keys)


async def test_a_pooled_connection_ended_at_rcpt_on_either_release_sends_each_event_once(
    tmp: Path, before: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    """The provider ends a pooled session with 421 at RCPT (RFC 5321 §3.8). The old release
    defers the event (451), and its client's retry comes here; this release asks again on a
    fresh connection (51dc2f1). Every event is then resubmitted at both: one message each."""
    url = f"sqlite:///{tmp / 'state.db'}"
    ended = Behaviour(rcpt={G: "421 4.4.2 closing connection"})
    async with fleet(tmp, before, upstream, dns_server, url) as f:
        warm = await transaction(f.old, "pool:1", [G])
        upstream.handler.script.append(ended)
        at_old = await transaction(f.old, "pool:2", [G])
        retried = await eventually(
            lambda: transaction(f.new, "pool:2", [G]),
            lambda t: t.data is None or "retry" not in t.data[1],
            timeout=10,
            interval=0.3,
        )
        upstream.handler.script.append(ended)
        at_new = await transaction(f.new, "pool:3", [G])
        again = [await transaction(port, f"pool:{n}", [G]) for n in (1, 2, 3) for port in (f.old, f.new)]
    keys = Counter(r.header("X-Event-Key") for r in upstream.received)
    print("warm:", warm, "old:", at_old, "retried:", retried, "new:", at_new, "upstream:", keys)
    assert warm.data and warm.data[0] == 250, warm
    assert at_old.data and at_old.data[0] == 451, at_old
    assert retried.data and retried.data[0] == 250 and "duplicate" not in retried.data[1], retried
    assert at_new.data and at_new.data[0] == 250, at_new
    assert all(t.data and t.data[0] == 250 and "duplicate" in t.data[1] for t in again), [*map(str, again)]
    assert keys == {"pool:1": 1, "pool:2": 1, "pool:3": 1}


def test_the_cache_of_delivered_events_keeps_none_that_owes_the_rest_of_its_event() -> None:
    """Pure: SettledCache holds delivered records only while nothing can take them out of
    `delivered`; the rest's send (owed) does, on any instance."""
    s, t0 = LedgerSettings(min_retry_interval=60.0, lease=30.0), 1_700_000_000.0
    delivered = Outcome(Kind.DELIVERED, "primary", Reply(250, "2.0.0", "ok"), upstream_id="Q1")
    cache = SettledCache()
    for owed in ("c" * 64, None):
        sub = Submission("acme", f"k-{owed is None}", "a" * 64, "A1", "i-1", None, owed=owed)
        verdict = ledger.decide(None, sub, t0, s)
        assert isinstance(verdict, Proceed)
        done = ledger.settle(verdict.record, "A1", "i-1", delivered, t0 + 1, s)
        cache.remember(done)
        kept = cache.get("acme", sub.key, t0 + 2, retention=86400)
        assert (kept is None) == (owed is not None), (owed, kept)


def _postmark_metadata(content: bytes) -> dict[str, str]:
    """What Postmark turns the relayed message's X-PM-Metadata-* fields into."""
    out: dict[str, str] = {}
    for line in content.split(b"\r\n\r\n", 1)[0].decode("utf-8", "replace").split("\r\n"):
        name, _, value = line.partition(":")
        if name.lower().startswith("x-pm-metadata-"):
            out.setdefault(name[len("x-pm-metadata-") :], value.strip())
    return out


@pytest.mark.parametrize("key", ["invoice:9", "facture:é"], ids=["ascii", "not-ascii"])
async def test_a_provider_event_for_a_message_the_old_release_sent_finds_its_record_here(
    tmp: Path, before: Path, upstream: Upstream, keys: ev.Keys, key: str
) -> None:
    """The old release relays through a Postmark-tagged provider; the bounce Postmark posts
    for it (its Metadata as the relayed message carried it) reaches this release's webhook
    listener: applied to the event's record, the address suppressed for the zone."""
    store = {"store__url": f"sqlite:///{tmp / 'state.db'}"}
    cfgs = [
        events_config(tmp, upstream, keys, store, only="postmark", instance=instance)
        for instance in ("old", "new")
    ]
    async with release_serving(before, cfgs[0], tmp) as old, running_guard(cfgs[1]) as guard:
        reply = await send(
            old, _raw(key, 9).replace(b"customer@example.com", RCPT.encode()), recipients=[RCPT]
        )
        assert reply.code == 250, reply
        (relayed,) = upstream.received
        bounce = ev.postmark_bounce(RCPT, "pm-unknown-id")
        bounce["Metadata"] = _postmark_metadata(relayed.content)
        status, doc = await ev.post(events_port(guard), "postmark", ev.postmark(keys, bounce))
        gone = await suppressed(guard, "acme")
    print("metadata:", bounce["Metadata"], "webhook:", status, doc, "suppressed:", gone)
    assert bounce["Metadata"] == {"smtpguard_key": tag_value(f"acme:{key}")}
    assert (status, doc["applied"]) == (200, 1), doc
    assert set(gone) == {RCPT}


LOST_BY_DUPLICATE = pytest.mark.xfail(
    strict=True,
    reason="not fixed: the event's record covers every recipient named, so the whole "
    "transaction resubmitted (its 250 lost) with y no longer held is answered 250 duplicate "
    "though y was never sent: the client's queue takes it as delivered to both (y 0 of 1)",
)


@LOST_BY_DUPLICATE
async def test_the_whole_transaction_resubmitted_once_its_held_recipient_is_released(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    """This release alone. yahoo paused: y held at RCPT, g sent, and the DATA reply lost on
    the way back (the client saw none). The client's queue retries the transaction as it
    holds it, y and g, after yahoo is resumed: y is owed the message, g has it."""
    url = f"sqlite:///{tmp / 'state.db'}"
    async with fleet(tmp, None, upstream, dns_server, url) as f:
        await f.pause_yahoo(True)
        first = await transaction(f.new, "ship:7", BOTH)
        assert first.rcpt == {Y: 451, G: 250} and first.data and first.data[0] == 250, first
        await f.pause_yahoo(False)
        again = await transaction(f.new, "ship:7", BOTH)
    print("first:", first, "again:", again, "upstream:", per_recipient(upstream))
    assert again.data and again.data[0] == 250, again
    assert per_recipient(upstream) == {G: 1, Y: 1}
