"""policy/receivers.py (DESIGN.md §21): the suffix match, MX hosts from a lookup, the table
the config overrides, the RCPT decision and the alert windows — pure, no DNS and no clock."""

from __future__ import annotations

import pytest

from smtpguard.policy.dnsdata import Lookup
from smtpguard.policy.receivers import (
    DEFAULT_RECEIVERS,
    OTHER,
    AlertRule,
    AlertWindows,
    control_name,
    domain_of,
    match,
    mx_hosts,
    rcpt_refusal,
    receiver_counts,
    receiver_of_control,
    shaped_receiver,
    table,
)


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        (("aspmx.l.google.com",), "gmail"),
        (("google.com",), "gmail"),
        (("notgoogle.com",), OTHER),
        (("x.mail.protection.outlook.com",), "microsoft"),
        (("mta5.am0.yahoodns.net",), "yahoo"),
        (("mx01.mail.icloud.com",), "apple"),
        (("mx.hosting.example", "alt.aspmx.l.google.com"), "gmail"),  # a later host may match
        ((), OTHER),
    ],
)
def test_suffix_match(hosts: tuple[str, ...], expected: str) -> None:
    assert match(hosts, DEFAULT_RECEIVERS) == expected


def test_mx_hosts_most_preferred_first_and_the_domain_without_mx() -> None:
    ok = Lookup("ok", ("20 b.example", "10 A.Example"), ttl=300)
    assert mx_hosts("d.test", ok) == (("a.example", "b.example"), 300)
    assert mx_hosts("d.test", Lookup("nodata", ttl=60)) == (("d.test",), 60)
    assert mx_hosts("d.test", Lookup("nxdomain", ttl=0)) == (("d.test",), 1.0)  # clamped
    assert mx_hosts("d.test", Lookup("ok", ("0 .",), ttl=300)) == (("d.test",), 300)  # null MX
    assert mx_hosts("d.test", Lookup("error", detail="SERVFAIL")) is None


def test_table_override_replace_add_remove() -> None:
    t = table({"gmail": ["Google.com."], "corp": ["corp.example"], "apple": []})
    assert t["gmail"] == ("google.com",) and t["corp"] == ("corp.example",)
    assert "apple" not in t and t["yahoo"] == ("yahoodns.net",)


def test_domains_and_controls() -> None:
    assert domain_of("A@Gm.Test.") == "gm.test"
    assert domain_of("a@[192.0.2.1]") is None
    assert receiver_of_control(control_name("yahoo")) == "yahoo"
    assert receiver_of_control("transactional") is None


def test_rcpt_refusal() -> None:
    paused = rcpt_refusal("yahoo", True, None)
    assert paused is not None and (paused.code, paused.enhanced) == (451, "4.7.1") and "paused" in paused.text
    over = rcpt_refusal("microsoft", False, False)
    assert over is not None and over.code == 451 and "max_rate" in over.text
    assert rcpt_refusal("gmail", False, True) is None
    assert rcpt_refusal("gmail", False, None) is None


def test_receiver_counts_from_the_stored_counters() -> None:
    got = receiver_counts(
        {"sent": 9, "receiver:gmail:sent": 4, "receiver:gmail:bounce": 1, "receiver:x:junk": 3}
    )
    assert got == {"gmail": {"sent": 4, "bounce": 1, "complaint": 0, "deferred": 0, "delivered": 0}}


def test_an_alert_crosses_once_per_window() -> None:
    rule = AlertRule(3600.0, {"complaint_rate": 0.1, "bounce_rate": 0.5})
    windows = AlertWindows()
    t = 7200.0  # the start of a window

    def seen(totals: dict[str, int], at: float) -> list[str]:
        return windows.observe("acme", "gmail", rule, totals, at)

    # The first reading is where counting starts (a restart does not count the past again).
    assert seen({"sent": 500, "complaint": 400}, t) == []
    assert seen({"sent": 500, "complaint": 401}, t + 1) == []  # no sends
    assert seen({"sent": 509, "complaint": 401}, t + 2) == ["complaint_rate"]
    assert windows.rate("acme", "gmail", "complaint_rate") == 1 / 9
    assert seen({"sent": 509, "complaint": 405}, t + 3) == []  # given
    assert windows.active("acme", "gmail", rule, t + 3599) == {"complaint_rate"}
    assert windows.active("acme", "gmail", rule, t + 3600) == set()
    # The next window starts from the last reading of this one: 1 complaint in 20 is 5%.
    assert seen({"sent": 529, "complaint": 406}, t + 3601) == []
    assert seen({"sent": 529, "complaint": 407}, t + 3602) == ["complaint_rate"]
    assert windows.rate("acme", "gmail", "complaint_rate") == 0.1
    # A window with no reading in between: the next reading starts afresh.
    assert seen({"sent": 900, "complaint": 900}, t + 4 * 3600) == []
    assert windows.observe(
        "acme", "gmail", rule, {"sent": 910, "bounce": 5, "complaint": 900}, t + 4 * 3600 + 1
    ) == ["bounce_rate"]


def test_dns_trouble_is_counted_as_other_but_never_shaped() -> None:
    assert shaped_receiver((), DEFAULT_RECEIVERS) is None
    assert shaped_receiver(("mx.hosting.example",), DEFAULT_RECEIVERS) == OTHER
    assert shaped_receiver(("aspmx.l.google.com",), DEFAULT_RECEIVERS) == "gmail"
