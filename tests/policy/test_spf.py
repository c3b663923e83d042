"""The pure SPF walk (policy/spf.py) and doctor's verdicts (policy/readiness.py): no DNS,
the lookups are given as data. RFC 7208 §4.6.4's limits at and over their boundaries."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from smtpguard.policy import readiness as v
from smtpguard.policy.dnsdata import Lookup
from smtpguard.policy.readiness import ProbeResult
from smtpguard.policy.spf import Needs, Query, SpfTree, walk

VOID = Lookup("nxdomain", ttl=60)
EMPTY = Lookup("nodata", ttl=60)


def spf(record: str) -> Lookup:
    return Lookup("ok", (record,), 300)


def run(domain: str, dns: Mapping[Query, Lookup]) -> SpfTree:
    """Walk as doctor does, round after round, fetching from `dns` (absent names: NXDOMAIN)."""
    known: dict[Query, Lookup] = {}
    for _ in range(20):
        result = walk(domain, known)
        if isinstance(result, SpfTree):
            return result
        for q in result.queries:
            known[q] = dns.get(q, VOID)
    raise AssertionError("did not end")


def chain(n: int) -> dict[Query, Lookup]:
    dns = {("TXT", "x.test"): spf("v=spf1 include:l1.test -all")}
    for i in range(1, n):
        dns[("TXT", f"l{i}.test")] = spf(f"v=spf1 include:l{i + 1}.test -all")
    dns[("TXT", f"l{n}.test")] = spf("v=spf1 ip4:192.0.2.1 -all")
    return dns


def test_the_walk_asks_for_what_it_needs_then_judges() -> None:
    first = walk("x.test", {})
    assert first == Needs(frozenset({("TXT", "x.test")}))
    second = walk("x.test", {("TXT", "x.test"): spf("v=spf1 include:p.test mx a:h.test -all")})
    assert isinstance(second, Needs)
    assert second.queries == {("TXT", "p.test"), ("MX", "x.test"), ("A", "h.test")}


def test_ten_querying_terms_pass_eleven_fail() -> None:
    ten = run("x.test", chain(10))
    assert ten.terms == 10 and ten.errors == ()
    eleven = run("x.test", chain(11))
    assert eleven.terms == 11
    assert any("more than 10 DNS-querying terms" in e for e in eleven.errors)


def test_the_walk_stops_at_the_limit_without_fetching_the_rest() -> None:
    fetched: list[Query] = []
    dns = chain(50)
    known: dict[Query, Lookup] = {}
    while not isinstance(result := walk("x.test", known), SpfTree):
        for q in result.queries:
            fetched.append(q)
            known[q] = dns[q]
    assert len(fetched) <= 12 and result.terms == 11


def test_an_include_loop_ends_at_the_limit() -> None:
    tree = run("loop.test", {("TXT", "loop.test"): spf("v=spf1 include:loop.test -all")})
    assert any("more than 10" in e for e in tree.errors)


@pytest.mark.parametrize(("voids", "ok"), [(0, True), (1, True), (2, True), (3, False)])
def test_void_lookups_over_two_fail(voids: int, ok: bool) -> None:
    terms = " ".join(f"a:gone{i}.test" for i in range(voids))
    tree = run("x.test", {("TXT", "x.test"): spf(f"v=spf1 {terms} -all")})
    assert tree.voids == voids
    assert (tree.errors == ()) is ok


def test_an_empty_answer_is_a_void_lookup_too() -> None:
    dns = {
        ("TXT", "x.test"): spf("v=spf1 mx:a.test mx:b.test mx:c.test -all"),
        ("MX", "a.test"): EMPTY,
        ("MX", "b.test"): EMPTY,
        ("MX", "c.test"): Lookup("ok", ("10 mx.c.test",), 300),
        ("A", "mx.c.test"): Lookup("ok", ("192.0.2.1",), 300),
    }
    assert run("x.test", dns).voids == 2 and run("x.test", dns).errors == ()


def test_every_querying_term_counts() -> None:
    record = "v=spf1 a mx ptr exists:%{i}.e.test include:p.test redirect=r.test"
    dns = {
        ("TXT", "x.test"): spf(record),
        ("A", "x.test"): Lookup("ok", ("192.0.2.1",), 1),
        ("MX", "x.test"): Lookup("ok", ("10 m.x.test",), 1),
        ("TXT", "p.test"): spf("v=spf1 ip4:192.0.2.0/24 ip6:2001:db8::/32 -all"),
        ("TXT", "r.test"): spf("v=spf1 -all"),
    }
    tree = run("x.test", dns)
    # a, mx, ptr, exists (a macro: counted, not followed), include, redirect
    assert tree.terms == 6 and tree.errors == ()
    assert "include:p.test" in tree.mechanisms and "-all" in tree.mechanisms


def test_redirect_is_ignored_when_the_record_has_all() -> None:
    tree = run("x.test", {("TXT", "x.test"): spf("v=spf1 -all redirect=r.test")})
    assert tree.terms == 0 and tree.errors == ()


@pytest.mark.parametrize(
    ("records", "error"),
    [
        ((), "no v=spf1 record"),
        (("google-site-verification=1",), "no v=spf1 record"),
        (("v=spf1 -all", "v=spf1 ~all"), "2 v=spf1 records"),
    ],
)
def test_record_errors(records: tuple[str, ...], error: str) -> None:
    lookup = Lookup("ok", records, 300) if records else EMPTY
    tree = run("x.test", {("TXT", "x.test"): lookup})
    assert any(error in e for e in tree.errors)


def test_an_include_without_spf_and_a_failed_lookup_are_errors() -> None:
    tree = run("x.test", {("TXT", "x.test"): spf("v=spf1 include:none.test -all")})
    assert any("include none.test: no v=spf1 record" in e for e in tree.errors)
    tree = run(
        "x.test",
        {
            ("TXT", "x.test"): spf("v=spf1 include:p.test -all"),
            ("TXT", "p.test"): Lookup("error", detail="SERVFAIL"),
        },
    )
    assert any("SERVFAIL" in e for e in tree.errors)


def test_v_spf10_is_not_spf() -> None:
    tree = run("x.test", {("TXT", "x.test"): spf("v=spf10 include:p.test")})
    assert any("no v=spf1 record" in e for e in tree.errors)


@pytest.mark.parametrize(
    ("record", "error"),
    [
        ("v=spf1 + -all", "invalid term '+'"),
        ("v=spf1 . -all", "invalid term '.'"),
        ("v=spf1 -all +", "invalid term '+'"),  # parsed whole, even after all
        ("v=spf1 include: -all", "empty domain-spec"),
        ("v=spf1 a: -all", "empty domain-spec"),
        ("v=spf1 mx:/24 -all", "empty domain-spec"),
        ("v=spf1 include -all", "needs ':' and a domain"),
        ("v=spf1 ip4 -all", "needs an address"),
        ("v=spf1 foo:bar.test -all", "unknown mechanism 'foo:bar.test'"),
        ("v=spf1 redirect=a.test redirect=b.test", "more than one redirect="),
        ("v=spf1 redirect=", "redirect= without a domain"),
    ],
)
def test_invalid_records_are_a_permerror(record: str, error: str) -> None:
    tree = run("x.test", {("TXT", "x.test"): spf(record), **P})
    assert any(error in e for e in tree.errors), tree.errors
    assert v.judge_spf(tree, "include:p.test")[0] == "error"


def test_an_invalid_included_record_names_the_include() -> None:
    tree = run(
        "x.test", {("TXT", "x.test"): spf("v=spf1 include:p.test -all"), ("TXT", "p.test"): spf("v=spf1 +")}
    )
    assert tree.errors == ("include p.test: invalid term '+' (RFC 7208 §4.6.1: permerror)",)


def test_terms_after_all_are_neither_counted_nor_reached() -> None:
    tree = run("x.test", {("TXT", "x.test"): spf("v=spf1 -all include:p.test a mx redirect=r.test"), **P})
    assert tree.terms == 0 and tree.voids == 0 and tree.errors == ()
    assert "include:p.test" not in tree.mechanisms
    assert v.judge_spf(tree, "include:p.test")[0] == "error"
    # Eleven querying terms after all: not over the limit.
    tree = tree_of("v=spf1 ~all " + " ".join(f"a:h{i}.test" for i in range(11)))
    assert tree.terms == 0 and tree.errors == ()


@pytest.mark.parametrize(
    ("qualifier", "status"), [("", "ok"), ("+", "ok"), ("-", "error"), ("~", "error"), ("?", "error")]
)
def test_a_provider_under_a_non_pass_include_is_not_reached(qualifier: str, status: str) -> None:
    extra = {**P, ("TXT", "mid.test"): spf("v=spf1 include:p.test -all")}
    tree = tree_of(f"v=spf1 {qualifier}include:mid.test -all", extra)
    assert tree.errors == () and tree.terms == 2  # still counted either way
    got, detail = v.judge_spf(tree, "include:p.test")
    assert got == status, detail


def mx_answer(n: int) -> Lookup:
    return Lookup("ok", tuple(f"10 mx{i}.x.test" for i in range(n)), 300)


def addresses(n: int) -> dict[Query, Lookup]:
    return {("A", f"mx{i}.x.test"): Lookup("ok", ("192.0.2.1",), 300) for i in range(n)}


def test_mx_with_more_than_ten_records_is_a_permerror() -> None:
    ten = tree_of("v=spf1 mx -all", {("MX", "x.test"): mx_answer(10), **addresses(10)})
    assert ten.errors == () and ten.voids == 0
    eleven = tree_of("v=spf1 mx -all", {("MX", "x.test"): mx_answer(11), **addresses(11)})
    assert any("mx:x.test: 11 MX records, more than 10" in e for e in eleven.errors), eleven.errors


def test_mx_hosts_without_addresses_are_void_lookups() -> None:
    tree = tree_of(
        "v=spf1 mx -all",
        {("MX", "x.test"): mx_answer(3), ("A", "mx0.x.test"): Lookup("ok", ("192.0.2.1",), 1)},
    )
    assert tree.voids == 2 and tree.errors == ()
    tree = tree_of("v=spf1 mx -all", {("MX", "x.test"): mx_answer(3)})
    assert tree.voids == 3 and any("3 void lookups" in e for e in tree.errors)


def test_ptr_is_a_warning() -> None:
    status, detail = v.judge_spf(tree_of("v=spf1 ptr include:p.test -all", P), "include:p.test")
    assert status == "warning" and "ptr" in detail


def test_a_macro_in_redirect_is_counted_not_followed() -> None:
    known: dict[Query, Lookup] = {("TXT", "x.test"): spf("v=spf1 redirect=%{d}.r.test")}
    tree = walk("x.test", known)
    assert isinstance(tree, SpfTree), tree
    assert tree.terms == 1 and tree.errors == ()


# --- the verdicts ----------------------------------------------------------------------------
def tree_of(record: str, extra: dict[Query, Lookup] | None = None) -> SpfTree:
    return run("x.test", {("TXT", "x.test"): spf(record), **(extra or {})})


P = {("TXT", "p.test"): spf("v=spf1 ip4:192.0.2.0/24 -all")}


@pytest.mark.parametrize(
    ("record", "provider_spf", "status", "words"),
    [
        ("v=spf1 include:p.test -all", "include:p.test", "ok", "reached"),
        ("v=spf1 +include:P.test. ~all", "include:p.test", "ok", "reached"),
        ("v=spf1 include:p.test ?all", "include:p.test", "warning", "?all"),
        ("v=spf1 include:p.test +all", "include:p.test", "warning", "+all"),
        ("v=spf1 include:p.test all", "include:p.test", "warning", "+all"),
        ("v=spf1 include:p.test -all", None, "warning", "no spf configured"),
        ("v=spf1 include:q.test -all", "include:p.test", "error", "not reached"),
    ],
)
def test_judge_spf(record: str, provider_spf: str | None, status: str, words: str) -> None:
    extra = {**P, ("TXT", "q.test"): spf("v=spf1 -all")}
    got, detail = v.judge_spf(tree_of(record, extra), provider_spf)
    assert got == status and words in detail


def test_the_provider_is_reached_through_a_nested_include() -> None:
    extra = {**P, ("TXT", "_spf.x.test"): spf("v=spf1 include:p.test -all")}
    assert v.judge_spf(tree_of("v=spf1 include:_spf.x.test -all", extra), "include:p.test")[0] == "ok"


@pytest.mark.parametrize(
    ("answers", "status"),
    [
        ([("s1", Lookup("ok", ("v=DKIM1; k=rsa; p=MIGf",), 1))], "ok"),
        ([("s1", Lookup("ok", ("k=rsa; p=MIG f",), 1))], "ok"),
        ([("s1", Lookup("ok", ("v=DKIM1; p=",), 1))], "error"),
        ([("s1", VOID)], "error"),
        ([("s1", Lookup("ok", ("v=DKIM1; p=MIGf",), 1)), ("s2", VOID)], "error"),
        ([("s1", Lookup("error", detail="timeout"))], "error"),
        ([], "warning"),
    ],
)
def test_judge_dkim(answers: list[tuple[str, Lookup]], status: str) -> None:
    assert v.judge_dkim(answers)[0] == status


@pytest.mark.parametrize(
    ("own", "inherited", "status"),
    [
        (Lookup("ok", ("v=DMARC1; p=reject",), 1), None, "ok"),
        (Lookup("ok", ("v=DMARC1; p=quarantine",), 1), None, "ok"),
        (Lookup("ok", ("v=DMARC1; p=none",), 1), None, "warning"),
        (VOID, None, "warning"),
        (VOID, ("x.test", Lookup("ok", ("v=DMARC1; p=reject",), 1)), "ok"),
        (VOID, ("x.test", Lookup("ok", ("v=DMARC1; p=reject; sp=none",), 1)), "warning"),
        (Lookup("error", detail="SERVFAIL"), None, "warning"),
    ],
)
def test_judge_dmarc(own: Lookup, inherited: tuple[str, Lookup] | None, status: str) -> None:
    assert v.judge_dmarc(own, inherited)[0] == status


@pytest.mark.parametrize(
    ("mx", "expected", "status"),
    [
        (Lookup("ok", ("10 mx1.x.test",), 1), ["mx1.x.test"], "ok"),
        (Lookup("ok", ("10 mx1.x.test",), 1), None, "ok"),
        (Lookup("ok", ("10 mx1.x.test", "20 old.y.test"), 1), ["mx1.x.test"], "warning"),
        (Lookup("ok", ("0 .",), 1), None, "error"),
        (Lookup("ok", ("0 .", "10 mx1.x.test"), 1), None, "warning"),
        (Lookup("error", detail="timeout"), None, "error"),
        (VOID, None, "error"),
    ],
)
def test_judge_mx(mx: Lookup, expected: list[str] | None, status: str) -> None:
    assert v.judge_mx(mx, expected)[0] == status


ADDR = Lookup("ok", ("192.0.2.1",), 1)


@pytest.mark.parametrize(
    ("a", "aaaa", "status", "words"),
    [
        (ADDR, EMPTY, "ok", "A/AAAA"),
        (EMPTY, Lookup("ok", ("2001:db8::1",), 1), "ok", "A/AAAA"),
        (EMPTY, EMPTY, "error", "no MX and no A/AAAA"),
        (Lookup("error", detail="SERVFAIL"), EMPTY, "error", "SERVFAIL"),
    ],
)
def test_judge_mx_without_mx_reads_the_addresses(a: Lookup, aaaa: Lookup, status: str, words: str) -> None:
    got, detail = v.judge_mx(EMPTY, None, a, aaaa)
    assert got == status and words in detail


@pytest.mark.parametrize(
    ("own", "status", "words"),
    [
        (Lookup("ok", ("v=DMARC1; rua=mailto:d@x.test",), 1), "warning", "no p= tag"),
        (Lookup("ok", ("v=DMARC1; p=reject", "v=DMARC1; p=none"), 1), "error", "more than one"),
    ],
)
def test_judge_dmarc_without_p_and_with_two_records(own: Lookup, status: str, words: str) -> None:
    got, detail = v.judge_dmarc(own, None)
    assert got == status and words in detail


DAY = 86400.0


@pytest.mark.parametrize(
    ("result", "status"),
    [
        (ProbeResult(True, "ok", cert_not_after=1000 + 90 * DAY), "ok"),
        (ProbeResult(True, "ok", cert_not_after=1000 + 14 * DAY + 1), "ok"),
        (ProbeResult(True, "ok", cert_not_after=1000 + 13 * DAY), "warning"),
        (ProbeResult(True, "ok"), "ok"),
        (ProbeResult(False, "STARTTLS: certificate expired", cert_expired=True), "error"),
        (ProbeResult(False, "AUTH: 535 5.7.8 no"), "error"),
    ],
)
def test_judge_probe(result: ProbeResult, status: str) -> None:
    assert v.judge_probe(result, now=1000.0)[0] == status


def test_sender_domains() -> None:
    assert v.sender_domains(["billing@Acme.test", "@notify.acme.test", "x@acme.test"]) == [
        "acme.test",
        "notify.acme.test",
    ]
