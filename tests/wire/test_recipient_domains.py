"""`recipient_domains: check` (DESIGN.md §3, §12): RCPT refuses a null-MX domain (556 5.1.10)
and one that cannot receive mail (550 5.1.2), accepts when DNS is in trouble, keeps each
verdict for the answer's TTL, and reserves nothing. Against a real DNS server (NSD) and a
real listener and upstream."""

from __future__ import annotations

import asyncio
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiosmtplib
import dns.name
import pytest

from smtpguard.config import DnsConfig
from smtpguard.policy.dnsdata import Lookup
from smtpguard.policy.limits import month_of
from smtpguard.policy.recipients import TROUBLE_TTL, judge
from smtpguard.readiness.dns import DnsClient
from smtpguard.recipient_domains import RecipientDomains
from tests.support import PASSWORD, FakeClock, Upstream, base_config, message, running_guard, send
from tests.support.dns import NsdServer, bad_resolver, nsd, slow_resolver, txt
from tests.support.eventually import eventually

RECORDS = [
    "good IN MX 10 mx1.good.test.",
    "mx1.good IN A 127.0.0.1",
    "nullmx IN MX 0 .",
    "nomail IN TXT " + txt("just a name, no mail"),
    "aonly IN A 192.0.2.7",
    "v6only IN AAAA 2001:db8::7",
    # straße.test by IDNA 2008 is xn--strae-oqa.test (null MX); IDNA 2003 would make it
    # strasse.test, another domain, which takes mail.
    "xn--strae-oqa IN MX 0 .",
    "strasse IN MX 10 mx1.good.test.",
]


@pytest.fixture(scope="module")
def dns_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NsdServer]:
    with nsd(tmp_path_factory.mktemp("dns"), "test", RECORDS, ttl=120, negative=60) as server:
        yield server


def checking_config(tmp: Path, upstream: Upstream, nameserver: str, timeout: str = "2s") -> dict[str, Any]:
    cfg = base_config(tmp, upstream.port)
    cfg["dns"] = {"nameservers": [nameserver], "timeout": timeout}
    cfg["zones"]["acme"]["recipient_domains"] = "check"
    return cfg


@pytest.mark.parametrize(
    ("recipient", "code", "enhanced"),
    [
        ("someone@nullmx.test", 556, "5.1.10"),
        ("someone@nowhere.test", 550, "5.1.2"),
        ("someone@nomail.test", 550, "5.1.2"),
        ("someone@good.test", 250, ""),
        ("someone@aonly.test", 250, ""),
        ("someone@v6only.test", 250, ""),
        ("someone@NullMX.Test", 556, "5.1.10"),
    ],
    ids=["null-mx", "no-such-domain", "no-mx-no-address", "mx", "implicit-mx-a", "implicit-mx-aaaa", "case"],
)
async def test_rcpt_answers_by_the_recipient_domain(
    tmp: Path, upstream: Upstream, dns_server: NsdServer, recipient: str, code: int, enhanced: str
) -> None:
    async with running_guard(checking_config(tmp, upstream, dns_server.nameserver)) as guard:
        reply = await send(guard.ports[0], message(to=recipient), recipients=[recipient])
        assert reply.code == code, reply
        assert guard.store is not None
        now = time.time()
        if code == 250:
            assert len(upstream.received) == 1
            assert await guard.store.get("acme", "invoice:acme:1") is not None
            assert (await guard.store.cap_usage("acme", now, month_of(now))).hour == 1
        else:
            assert reply.text.startswith(enhanced), reply
            assert upstream.received == [] and upstream.handler.transactions == 0
            # Refused at RCPT: no ledger record, no cap unit.
            assert guard.store is not None
            assert await guard.store.get("acme", "invoice:acme:1") is None
            now = time.time()
            assert (await guard.store.cap_usage("acme", now, month_of(now))).hour == 0


async def test_refused_recipient_leaves_the_others_accepted(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    async with running_guard(checking_config(tmp, upstream, dns_server.nameserver)) as guard:
        reply = await send(
            guard.ports[0],
            message(),
            recipients=["a@good.test", "b@nullmx.test", "c@nowhere.test", "d@aonly.test"],
        )
        # The helper reports the first refused recipient; the message went to the others.
        assert reply.code == 556, reply
        await upstream.wait_received(1)
        assert upstream.received[0].rcpt_tos == ["a@good.test", "d@aonly.test"]
        # One event, one record and one cap unit: the refused recipients spent nothing.
        assert guard.store is not None
        assert await guard.store.get("acme", "invoice:acme:1") is not None
        now = time.time()
        assert (await guard.store.cap_usage("acme", now, month_of(now))).hour == 1


async def test_zone_without_the_check_accepts_a_null_mx_domain(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    cfg = checking_config(tmp, upstream, dns_server.nameserver)
    cfg["zones"]["acme"]["recipient_domains"] = False  # YAML `off`/`false`: off
    async with running_guard(cfg) as guard:
        assert guard.handler is not None and guard.handler.recipient_domains is None
        reply = await send(guard.ports[0], message(), recipients=["x@nullmx.test"])
        assert reply.code == 250 and len(upstream.received) == 1


@pytest.mark.parametrize("silent", [True, False], ids=["resolver-never-answers", "servfail"])
async def test_dns_trouble_accepts(tmp: Path, upstream: Upstream, silent: bool) -> None:
    with bad_resolver(silent) as resolver:
        cfg = checking_config(tmp, upstream, resolver.nameserver, timeout="500ms")
        async with running_guard(cfg) as guard:
            started = time.monotonic()
            reply = await send(guard.ports[0], message(), recipients=["x@nullmx.test"])
            took = time.monotonic() - started
            assert reply.code == 250, reply
            assert len(upstream.received) == 1
            assert resolver.queries >= 1
            # The wait is bounded by dns.timeout (0.5 s), not by the client's patience.
            assert took < 2 * 0.5 + 0.3, took


# --- the cache, on an injected clock ---------------------------------------------------------
async def test_verdicts_are_kept_for_the_answer_ttl(dns_server: NsdServer) -> None:
    clock = FakeClock()
    checker = RecipientDomains(DnsClient(DnsConfig(nameservers=[dns_server.nameserver])), clock)
    assert (await checker.refusal("a@nullmx.test")) is not None
    assert (await checker.refusal("b@nullmx.test")) is not None
    assert checker.lookups == 1
    clock.t += 119  # the zone's TTL is 120s
    await checker.refusal("c@nullmx.test")
    assert checker.lookups == 1
    clock.t += 2
    await checker.refusal("d@nullmx.test")
    assert checker.lookups == 2
    # A negative answer is kept for the zone's negative TTL (SOA minimum, 60s).
    await checker.refusal("a@nowhere.test")
    clock.t += 59
    await checker.refusal("a@nowhere.test")
    assert checker.lookups == 3
    clock.t += 2
    await checker.refusal("a@nowhere.test")
    assert checker.lookups == 4


async def test_trouble_is_kept_briefly_so_a_dead_resolver_does_not_slow_every_rcpt() -> None:
    with bad_resolver(silent=False) as resolver:
        clock = FakeClock()
        checker = RecipientDomains(
            DnsClient(DnsConfig(nameservers=[resolver.nameserver], timeout=0.5)), clock
        )
        assert await checker.refusal("a@x.test") is None
        assert await checker.refusal("b@x.test") is None
        assert checker.lookups == 1
        clock.t += TROUBLE_TTL + 1
        assert await checker.refusal("c@x.test") is None
        assert checker.lookups == 2


async def test_concurrent_rcpts_share_one_lookup(dns_server: NsdServer) -> None:
    checker = RecipientDomains(DnsClient(DnsConfig(nameservers=[dns_server.nameserver])), FakeClock())
    replies = await asyncio.gather(*(checker.refusal(f"u{i}@nullmx.test") for i in range(20)))
    assert all(r is not None and r.code == 556 for r in replies)
    assert checker.lookups == 1


async def test_a_cancelled_first_waiter_leaves_the_others_their_verdict(dns_server: NsdServer) -> None:
    """The first RCPT's session goes away (aiosmtpd cancels it) while the lookup it started
    is under way: the sessions waiting on the same domain still get the verdict."""
    with slow_resolver(dns_server, delay=0.5) as resolver:
        checker = RecipientDomains(
            DnsClient(DnsConfig(nameservers=[resolver.nameserver], timeout=3)), FakeClock()
        )
        first = asyncio.create_task(checker.refusal("a@nullmx.test"))
        # The first one's lookup is under way (the resolver holds it 0.5 s) ...
        started = await eventually(lambda: checker.lookups, lambda n: n == 1, timeout=5, interval=0.01)
        assert started == 1
        others = [asyncio.create_task(checker.refusal(f"u{i}@nullmx.test")) for i in range(3)]
        # ... and the others join it at their first step (nothing before it awaits).
        await asyncio.sleep(0)
        first.cancel()
        replies = await asyncio.gather(*others)
        assert all(r is not None and r.code == 556 for r in replies), replies
        assert first.cancelled()
        assert checker.lookups == 1
        # The verdict was kept: a later RCPT is answered from the cache.
        assert (await checker.refusal("z@nullmx.test")) is not None and checker.lookups == 1


async def test_a_client_hanging_up_mid_rcpt_leaves_the_other_sessions_connected(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    with slow_resolver(dns_server, delay=1.0) as resolver:
        async with running_guard(checking_config(tmp, upstream, resolver.nameserver, timeout="3s")) as guard:
            quitter = aiosmtplib.SMTP(hostname="127.0.0.1", port=guard.ports[0], start_tls=False, timeout=10)
            await quitter.connect()
            await quitter.login("acme-app", PASSWORD)
            await quitter.mail("billing@acme.example")
            assert guard.handler is not None and guard.handler.recipient_domains is not None
            domains = guard.handler.recipient_domains
            # Each RCPT's check counted as it begins (the real one runs): both sessions must be
            # waiting on the one lookup when the quitter goes, not one of them on the cache.
            checks: list[str] = []
            check = domains.refusal

            async def counted(address: str) -> Any:
                checks.append(address)
                return await check(address)

            domains.refusal = counted  # type: ignore[method-assign]
            rcpt = asyncio.create_task(quitter.rcpt("a@nullmx.test"))
            other = asyncio.create_task(send(guard.ports[0], message(), recipients=["b@nullmx.test"]))
            both = await eventually(lambda: len(checks), lambda n: n == 2, timeout=5, interval=0.01)
            # The quitter's RCPT still waits: the lookup was under way when the other's began.
            assert both == 2 and domains.lookups == 1 and not rcpt.done(), (checks, domains.lookups)
            quitter.close()
            rcpt.cancel()
            reply = await other
            assert reply.code == 556 and reply.text.startswith("5.1.10"), reply
            assert guard.handler is not None and guard.handler.recipient_domains is not None
            assert guard.handler.recipient_domains.lookups == 1


async def test_one_deadline_for_the_whole_verdict(dns_server: NsdServer) -> None:
    """No MX (answered after 0.4 s), then A/AAAA never answered: the RCPT waits dns.timeout
    in all, not the MX's wait plus a full timeout more."""
    with slow_resolver(dns_server, delay=0.4, delays={"A": None, "AAAA": None}) as resolver:
        checker = RecipientDomains(
            DnsClient(DnsConfig(nameservers=[resolver.nameserver], timeout=1.0)), FakeClock()
        )
        started = time.monotonic()
        assert await checker.refusal("a@aonly.test") is None  # timeout: accepted
        took = time.monotonic() - started
        assert took < 1.0 + 0.25, took
        assert resolver.queries >= 2  # the A/AAAA lookups were asked


@pytest.mark.parametrize("resolv_conf", ["missing", "empty"])
async def test_without_a_system_resolver_recipients_are_accepted_and_the_lookup_says_why(
    tmp: Path, resolv_conf: str
) -> None:
    path = tmp / "resolv.conf"
    if resolv_conf == "empty":
        path.write_text("# nothing here\n")
    client = DnsClient(DnsConfig(), resolv_conf=str(path))
    lookup = await client.lookup("MX", "nullmx.test")
    assert lookup.status == "error" and "set dns.nameservers" in lookup.detail, lookup
    assert await RecipientDomains(client, FakeClock()).refusal("a@nullmx.test") is None


# --- IDNA ------------------------------------------------------------------------------------
async def test_internationalised_domains_are_looked_up_by_idna_2008(
    dns_server: NsdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As without the `idna` package: dnspython's default codec falls back to IDNA 2003.
    monkeypatch.setattr(dns.name, "IDNA_DEFAULT", dns.name.IDNA_2003)
    checker = RecipientDomains(DnsClient(DnsConfig(nameservers=[dns_server.nameserver])), FakeClock())
    reply = await checker.refusal("kunde@straße.test")
    assert reply is not None and reply.code == 556, reply  # xn--strae-oqa.test, not strasse.test
    # A name IDNA 2008 refuses (U+2603 is not a valid label character): accepted, unlooked-up.
    assert await checker.refusal("x@\u2603.test") is None
    lookup = await DnsClient(DnsConfig(nameservers=[dns_server.nameserver])).lookup("MX", "\u2603.test")
    assert lookup.status == "error" and "IDNA 2008" in lookup.detail


def test_the_idna_package_is_a_dependency() -> None:
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert any(d.replace(" ", "").startswith(("dnspython[idna]", "idna")) for d in project["dependencies"])


# --- the pure verdicts -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mx", "a", "aaaa", "verdict"),
    [
        (Lookup("ok", ("0 .",), 300), None, None, "null_mx"),
        (Lookup("ok", ("0 .", "10 mx.example"), 300), None, None, "accept"),
        (Lookup("ok", ("10 .",), 300), None, None, "accept"),
        (Lookup("ok", ("10 mx.example",), 300), None, None, "accept"),
        (Lookup("nxdomain", ttl=60), None, None, "no_domain"),
        (Lookup("nodata", ttl=60), Lookup("nodata", ttl=60), Lookup("nodata", ttl=60), "no_mail"),
        (Lookup("nodata", ttl=60), Lookup("ok", ("192.0.2.1",), 60), Lookup("nodata", ttl=60), "accept"),
        (Lookup("nodata", ttl=60), Lookup("error", detail="timeout"), Lookup("nodata", ttl=60), "accept"),
        (Lookup("error", detail="SERVFAIL"), None, None, "accept"),
        (Lookup("error", detail="timeout"), None, None, "accept"),
    ],
)
def test_judge(mx: Lookup, a: Lookup | None, aaaa: Lookup | None, verdict: str) -> None:
    assert judge(mx, a, aaaa).verdict == verdict
