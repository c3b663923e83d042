"""The wire reply table of DESIGN.md §3, one case per row: a real SMTP client (a raw socket,
so every step's reply is seen as sent) against a real listener, a real recording upstream, a
real SQLite store and, for the recipient-domain rows, a real DNS server (NSD). Each case
asserts the exact code and enhanced status, the step that answered, and what the upstream
received. Rows with two outcomes (an AUTH failure and the lock-out after it; a sender and a
recipient without SMTPUTF8; a user's hourly and monthly cap) have one case for each."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from smtpguard.server import Server
from tests.support import PASSWORD, Behaviour, Upstream, base_config, free_port, running_guard
from tests.support.dns import NsdServer, nsd
from tests.support.eventually import eventually
from tests.support.hostile import RawClient, SmtpReply, message_bytes, session, terminated, with_starttls

pytestmark = pytest.mark.usefixtures("no_tracebacks")

Config = dict[str, Any]


@dataclass
class Submission:
    """One transaction over a raw socket; `steps` keeps every reply by the step it answered
    ("auth", "mail", "rcpt <address>", "data"). A refused RCPT does not end it while another
    recipient was accepted (the table's "earlier recipients stay accepted")."""

    message: bytes
    sender: str = "billing@acme.example"
    recipients: tuple[str, ...] = ("customer@example.com",)
    user: str = "acme-app"
    password: str = PASSWORD
    login: bool = True
    mail_params: str = ""
    """ESMTP parameters on MAIL, e.g. " SIZE=20000"."""
    steps: dict[str, SmtpReply] = field(default_factory=dict)

    async def run(self, port: int) -> Submission:
        c = await RawClient.connect(port)
        try:
            assert (await c.reply()).code == 220
            assert (await c.ehlo()).code == 250
            if self.login:
                self.steps["auth"] = await c.login(self.user, self.password)
                if self.steps["auth"].code != 235:
                    return self
            self.steps["mail"] = await c.command(f"MAIL FROM:<{self.sender}>{self.mail_params}")
            if self.steps["mail"].code != 250:
                return self
            for rcpt in self.recipients:
                self.steps[f"rcpt {rcpt}"] = await c.command(f"RCPT TO:<{rcpt}>")
            if all(r.code != 250 for k, r in self.steps.items() if k.startswith("rcpt ")):
                return self
            self.steps["data"] = await c.data(terminated(self.message))
            await c.command("QUIT")
        finally:
            await c.close()
        return self


def plain(key: str | None = "table:1", **kw: Any) -> Submission:
    return Submission(message_bytes(key), **kw)


Drive = Callable[[Server, Upstream], Awaitable[Submission]]


def once(submission: Callable[[], Submission]) -> Drive:
    async def drive(guard: Server, upstream: Upstream) -> Submission:
        return await submission().run(guard.ports[0])

    return drive


def after(first: Callable[[], Submission], then: Callable[[], Submission] | None = None) -> Drive:
    """`first`, then `then` (or `first` again): the second submission's replies count."""

    async def drive(guard: Server, upstream: Upstream) -> Submission:
        await first().run(guard.ports[0])
        return await (then or first)().run(guard.ports[0])

    return drive


@dataclass
class Row:
    id: str
    drive: Drive
    step: str
    code: int
    enhanced: str
    says: str = ""
    """A fragment the reply text must hold (the list, cap, header or user it names)."""
    starts: str = ""
    """What the reply text (its enhanced code first) must begin with."""
    delivered: int = 0
    """Messages the upstream received in the whole case."""
    configure: Callable[[Config, Path], None] = lambda cfg, tmp: None
    dns: bool = False


def setting(**overrides: Any) -> Callable[[Config, Path], None]:
    """Sets cfg keys given as a__b__c=value, as base_config's overrides do."""

    def configure(cfg: Config, tmp: Path) -> None:
        for dotted, value in overrides.items():
            node = cfg
            *parents, last = dotted.split("__")
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
            node[last] = value

    return configure


# --- the rows that need more than one submission or a store write --------------------------
async def auth_lockout(guard: Server, upstream: Upstream) -> Submission:
    # limits.auth_failures is 2 here: the first bad AUTH is 535, the second locks the IP out.
    async with session(guard.ports[0], login=False) as c:
        first = await c.login("acme-app", "guess-1")
        assert (first.code, first.enhanced) == (535, "5.7.8"), first
        s = Submission(b"")
        s.steps["auth"] = await c.login("acme-app", "guess-2")
        assert await c.closed(), "the lock-out disconnects"
    return s


def starttls_listener(cfg: Config, tmp: Path) -> None:
    with_starttls(cfg, tmp)


async def suppressed(guard: Server, upstream: Upstream) -> Submission:
    assert guard.store is not None
    await guard.store.suppress_add("acme", "gone@example.com", "bounced", guard.clock())
    return await plain(recipients=("gone@example.com",)).run(guard.ports[0])


async def in_flight(guard: Server, upstream: Upstream) -> Submission:
    # The first submission's upstream transaction is held open until the second is answered.
    hold = asyncio.Event()
    upstream.handler.script = [Behaviour(hold_after_dot=hold)]
    first = asyncio.create_task(plain("table:busy").run(guard.ports[0]))
    try:
        await eventually(lambda: len(upstream.received), timeout=10, interval=0.01)
        assert len(upstream.received) == 1, "the first submission never reached the upstream"
        second = await plain("table:busy").run(guard.ports[0])
    finally:
        hold.set()
    assert (await first).steps["data"].code == 250
    return second


async def zone_paused_by_operator(guard: Server, upstream: Upstream) -> Submission:
    assert guard.store is not None
    await guard.store.set_paused("acme", True)
    return await plain().run(guard.ports[0])


async def class_paused(guard: Server, upstream: Upstream) -> Submission:
    assert guard.store is not None
    # Before the first submission: the listener's copy of the paused classes is read fresh.
    await guard.store.set_class_paused("acme", "bulk", True)
    return await Submission(message_bytes("table:bulk", extra=[b"X-Message-Class: bulk"])).run(guard.ports[0])


def no_provider(cfg: Config, tmp: Path) -> None:
    cfg["providers"][0]["port"] = free_port()  # nothing listens there: refused at connect


def user_cap(**caps: int) -> Callable[[Config, Path], None]:
    def configure(cfg: Config, tmp: Path) -> None:
        cfg["zones"]["acme"]["users"][0].update(caps)

    return configure


def delivered_once() -> Drive:
    async def drive(guard: Server, upstream: Upstream) -> Submission:
        first = await plain("table:dup").run(guard.ports[0])
        again = await plain("table:dup").run(guard.ports[0])
        sg_id = first.steps["data"].text.split("[sg:")[1].split("]")[0]
        # the original smtpguard id and the upstream's queue id (DESIGN.md §3)
        assert sg_id in again.steps["data"].text and "Q1" in again.steps["data"].text, again.steps
        return again

    return drive


def upstream_script(*behaviours: Behaviour) -> Callable[[Drive], Drive]:
    def wrap(drive: Drive) -> Drive:
        async def scripted(guard: Server, upstream: Upstream) -> Submission:
            upstream.handler.script = list(behaviours)
            return await drive(guard, upstream)

        return scripted

    return wrap


def recipient_domain(id: str, address: str, code: int, enhanced: str) -> Row:
    """A row refused at RCPT by the recipient's domain, judged in the test zone NSD serves."""
    return Row(id, once(lambda: plain(recipients=(address,))), f"rcpt {address}", code, enhanced, dns=True)


SO_MANY = tuple(f"r{i}@example.com" for i in range(3))

ROWS = [
    Row("mail-before-auth", once(lambda: plain(login=False)), "mail", 530, "5.7.0"),
    Row("auth-bad-credentials", once(lambda: plain(password="wrong")), "auth", 535, "5.7.8"),
    Row(
        "auth-failures-lock-out",
        auth_lockout,
        "auth",
        421,
        "4.7.0",
        configure=setting(limits__auth_failures=2),
    ),
    Row(
        "auth-before-tls",
        once(plain),
        "auth",
        538,
        "5.7.11",
        configure=starttls_listener,
    ),
    Row("envelope-sender-not-mapped", once(lambda: plain(sender="ceo@evil.example")), "mail", 550, "5.7.1"),
    Row(
        "header-from-not-mapped",
        once(lambda: Submission(message_bytes("table:1", from_header=b"From: ceo@evil.example"))),
        "data",
        550,
        "5.7.1",
    ),
    Row(
        "plan-without-send-as",
        once(plain),
        "mail",
        550,
        "5.7.1",
        "send-as",
        configure=setting(zones__acme__plan="free"),
    ),
    Row("recipient-suppressed", suppressed, "rcpt gone@example.com", 550, "5.1.1", "acme suppression list"),
    Row(
        "too-many-recipients",
        once(lambda: plain(recipients=SO_MANY)),
        "rcpt r2@example.com",
        452,
        "4.5.3",
        delivered=1,
        configure=setting(limits__max_recipients=2),
    ),
    Row(
        "message-over-max-size",
        once(lambda: Submission(message_bytes("table:big", body=(b"x" * 998 + b"\r\n") * 12))),
        "data",
        552,
        "5.3.4",
        configure=setting(limits__max_message_size="10kB"),
    ),
    Row(
        "declared-size-over-max-size",
        once(lambda: plain(mail_params=" SIZE=20000")),
        "mail",
        552,
        "5.3.4",
        configure=setting(limits__max_message_size="10kB"),
    ),
    Row(
        "bare-lf-smuggling",
        once(lambda: Submission(message_bytes("table:lf", body=b"one\nMAIL FROM:<x@y>\r\n"))),
        "data",
        550,
        "5.5.2",
    ),
    Row(
        "missing-event-key-rejected",
        once(lambda: plain(None)),
        "data",
        550,
        "5.7.0",
        "X-Event-Key",
        configure=setting(zones__acme__missing_key="reject"),
    ),
    Row("malformed-event-key", once(lambda: plain("two words")), "data", 550, "5.6.0"),
    Row("key-already-delivered", delivered_once(), "data", 250, "2.0.0", "duplicate", delivered=1),
    Row(
        "key-reused-for-another-message",
        after(
            lambda: Submission(message_bytes("table:re", body=b"first\r\n")),
            lambda: Submission(message_bytes("table:re", body=b"second\r\n")),
        ),
        "data",
        550,
        "5.7.0",
        "reused",
        delivered=1,
    ),
    Row(
        "key-in-flight-elsewhere",
        in_flight,
        "data",
        451,
        "4.7.1",
        delivered=1,
        configure=setting(event_key__inflight_wait="0s"),
    ),
    Row(
        "key-deferred-retried-too-soon",
        upstream_script(Behaviour(data="451 4.3.0 try again later"))(after(plain)),
        "data",
        451,
        "4.7.1",
        "retry after",
    ),
    Row(
        "key-failed-upstream-5xx",
        upstream_script(Behaviour(data="554 5.6.0 content rejected"))(after(plain)),
        "data",
        554,
        "5.6.0",
        "content rejected",
    ),
    Row(
        "key-outcome-unknown",
        upstream_script(Behaviour(drop_after_dot=True))(after(plain)),
        "data",
        451,
        "4.3.0",
        "held",
        delivered=1,
    ),
    Row("zone-paused", zone_paused_by_operator, "data", 451, "4.7.0", "paused"),
    Row(
        "hourly-cap-reached",
        once(plain),
        "data",
        451,
        "4.7.0",
        "slot frees",
        configure=setting(zones__acme__hourly_cap=0),
    ),
    Row(
        "monthly-cap-reached",
        once(plain),
        "data",
        550,
        "5.7.0",
        "Monthly cap",
        configure=setting(zones__acme__monthly_cap=0),
    ),
    Row("no-provider-available", once(plain), "data", 451, "4.4.1", configure=no_provider),
    Row(
        "upstream-reply-passed-through",
        # an enhanced code and text of the upstream's own, not smtpguard's 2.0.0
        upstream_script(Behaviour(accept="250 2.6.0 <x@up> accepted as Q{queue_id}"))(once(plain)),
        "data",
        250,
        "2.6.0",
        "] <x@up> accepted as QQ1",
        starts="2.6.0 [sg:",
        delivered=1,
    ),
    Row(
        "non-ascii-sender-without-smtputf8",
        once(lambda: plain(sender="jöe@acme.example")),
        "mail",
        553,
        "5.6.7",
    ),
    Row(
        "non-ascii-recipient-without-smtputf8",
        once(lambda: plain(recipients=("customer@example.com", "jöe@example.com"))),
        "rcpt jöe@example.com",
        553,
        "5.6.7",
        delivered=1,
    ),
    Row(
        "smtputf8-declared-route-without-it",
        # the first (ASCII) message lets the route learn from the provider's EHLO
        after(
            lambda: plain("table:ascii"),
            lambda: plain("table:utf8", mail_params=" SMTPUTF8", recipients=("jöe@example.com",)),
        ),
        "rcpt jöe@example.com",
        553,
        "5.6.7",
        "does not offer SMTPUTF8",
        delivered=1,
    ),
    recipient_domain("recipient-domain-null-mx", "a@nullmx.test", 556, "5.1.10"),
    recipient_domain("recipient-domain-cannot-receive", "a@nowhere.test", 550, "5.1.2"),
    Row("message-class-paused", class_paused, "data", 451, "4.7.0", "class bulk"),
    Row(
        "user-hourly-cap-reached",
        once(plain),
        "data",
        451,
        "4.7.0",
        "user acme-app",
        configure=user_cap(hourly_cap=0),
    ),
    Row(
        "user-monthly-cap-reached",
        once(plain),
        "data",
        550,
        "5.7.0",
        "user acme-app",
        configure=user_cap(monthly_cap=0),
    ),
]

# The situations of DESIGN.md §3's table, in its order, by the cases that cover each.
TABLE = {
    "MAIL before AUTH": ["mail-before-auth"],
    "AUTH with bad credentials": ["auth-bad-credentials", "auth-failures-lock-out"],
    "AUTH before TLS on a starttls listener": ["auth-before-tls"],
    "envelope sender not mapped": ["envelope-sender-not-mapped"],
    "header From: not mapped": ["header-from-not-mapped"],
    "zone plan without send-as": ["plan-without-send-as"],
    "recipient on a suppression list": ["recipient-suppressed"],
    "too many recipients": ["too-many-recipients"],
    "message over max_message_size": ["message-over-max-size", "declared-size-over-max-size"],
    "bare LF, bare CR or NUL": ["bare-lf-smuggling"],
    "missing X-Event-Key with missing_key: reject": ["missing-event-key-rejected"],
    "malformed key": ["malformed-event-key"],
    "key already delivered": ["key-already-delivered"],
    "key reused with a different message": ["key-reused-for-another-message"],
    "key in_flight elsewhere": ["key-in-flight-elsewhere"],
    "key deferred and retried before min_retry_interval": ["key-deferred-retried-too-soon"],
    "key failed (upstream 5xx)": ["key-failed-upstream-5xx"],
    "key unknown": ["key-outcome-unknown"],
    "zone paused": ["zone-paused"],
    "hourly cap reached": ["hourly-cap-reached"],
    "monthly cap reached": ["monthly-cap-reached"],
    "no provider available": ["no-provider-available"],
    "upstream replies": ["upstream-reply-passed-through"],
    "non-ASCII address without SMTPUTF8, or SMTPUTF8 the route lacks": [
        "non-ascii-sender-without-smtputf8",
        "non-ascii-recipient-without-smtputf8",
        "smtputf8-declared-route-without-it",
    ],
    "recipient domain publishes a null MX": ["recipient-domain-null-mx"],
    "recipient domain cannot receive mail": ["recipient-domain-cannot-receive"],
    "message class paused": ["message-class-paused"],
    "the SMTP user's own cap reached": ["user-hourly-cap-reached", "user-monthly-cap-reached"],
}


def test_every_row_of_the_table_has_a_case_and_every_case_a_row() -> None:
    assert len(TABLE) == 28
    covered = [case for cases in TABLE.values() for case in cases]
    assert sorted(covered) == sorted(row.id for row in ROWS)


@pytest.fixture(scope="module")
def dns_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NsdServer]:
    records = ["nullmx IN MX 0 ."]
    with nsd(tmp_path_factory.mktemp("dns"), "test", records) as server:
        yield server


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
async def test_reply(row: Row, tmp: Path, upstream: Upstream, request: pytest.FixtureRequest) -> None:
    cfg = base_config(tmp, upstream.port)
    row.configure(cfg, tmp)
    if row.dns:
        server: NsdServer = request.getfixturevalue("dns_server")
        cfg["dns"] = {"nameservers": [server.nameserver], "timeout": "2s"}
        cfg["zones"]["acme"]["recipient_domains"] = "check"
    async with running_guard(cfg) as guard:
        submission = await row.drive(guard, upstream)
    reply = submission.steps.get(row.step)
    assert reply is not None, f"no reply at {row.step}: {submission.steps}"
    assert (reply.code, reply.enhanced) == (row.code, row.enhanced), reply
    assert row.says in reply.text and reply.text.startswith(row.starts), reply
    assert len(upstream.received) == row.delivered, [r.header("X-Event-Key") for r in upstream.received]
