"""An SPF include tree walked over fetched records, with RFC 7208 §4.6.4's limits.

Pure: the walk never queries anything. It reads the lookups it is given and, when it needs
more, says which (`Needs`); the adapter fetches those and walks again with them added. A
tree that exceeds the 10-term limit is judged as soon as the limit is crossed, so a loop
(`include:` of itself) or an endless chain ends after a bounded number of rounds.

Without a client IP nothing is evaluated: every term of every record reached is counted,
as receivers may have to (the limit is on terms that may cause queries, not on the first
match), and the mechanisms seen are collected so the provider's can be looked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from smtpguard.policy.dnsdata import Lookup

MAX_QUERYING_TERMS = 10
"""RFC 7208 §4.6.4: include, a, mx, ptr, exists and redirect, all records together."""
MAX_VOID_LOOKUPS = 2
"""RFC 7208 §4.6.4: lookups answered NXDOMAIN or with no records."""

Query = tuple[str, str]
"""(record type, name): ("TXT", "_spf.example.com")."""

_QUERYING = ("include", "a", "mx", "ptr", "exists")
_QUALIFIERS = "+-~?"


@dataclass(frozen=True, slots=True)
class Needs:
    queries: frozenset[Query]


@dataclass(frozen=True, slots=True)
class SpfTree:
    terms: int
    """DNS-querying terms counted over the whole tree."""
    voids: int
    errors: tuple[str, ...]
    """What makes the record unusable (RFC 7208 permerror/temperror), one line each."""
    all_qualifier: str | None
    """The top-level record's `all` qualifier ("+", "-", "~", "?"), None without `all`."""
    mechanisms: frozenset[str]
    """Every mechanism reached, normalised (`include:mailgun.org`, qualifier `+` dropped)."""


def normalise(term: str) -> str:
    """`+include:Mailgun.ORG.` → `include:mailgun.org`; other qualifiers are kept."""
    t = term.strip().lower()
    if t.startswith("+"):
        t = t[1:]
    return t.rstrip(".")


def spf_records(lookup: Lookup) -> list[str]:
    """The `v=spf1` records of a TXT answer (RFC 7208 §4.5: the version tag, then a space
    or the end)."""
    return [r for r in lookup.records if r.lower() == "v=spf1" or r.lower().startswith("v=spf1 ")]


@dataclass
class _Walk:
    lookups: Mapping[Query, Lookup]
    missing: set[Query] = field(default_factory=set)
    terms: int = 0
    voids: int = 0
    errors: list[str] = field(default_factory=list)
    mechanisms: set[str] = field(default_factory=set)
    all_qualifier: str | None = None

    def over(self) -> bool:
        return self.terms > MAX_QUERYING_TERMS or self.voids > MAX_VOID_LOOKUPS

    def fetched(self, query: Query, counted: bool = True) -> Lookup | None:
        got = self.lookups.get(query)
        if got is None:
            self.missing.add(query)
            return None
        if got.void and counted:
            self.voids += 1
        return got

    def record(self, domain: str, top: bool, via: str) -> None:
        # The first lookup (the sender domain's own record) is not a term's: not a void one.
        lookup = self.fetched(("TXT", domain), counted=bool(via))
        if lookup is None:
            return
        if lookup.status == "error":
            self.errors.append(f"{via}{domain}: TXT lookup failed ({lookup.detail})")
            return
        records = spf_records(lookup)
        if not records:
            # A top-level domain without SPF is "none"; included or redirected, a permerror.
            self.errors.append(f"{via}{domain}: no v=spf1 record")
            return
        if len(records) > 1:
            self.errors.append(f"{via}{domain}: {len(records)} v=spf1 records (RFC 7208 §4.5: permerror)")
            return
        self.terms_of(domain, records[0], top)

    def terms_of(self, domain: str, record: str, top: bool) -> None:
        words = record.split()[1:]
        has_all = False
        redirect: str | None = None
        for word in words:
            if self.over():
                return
            term = normalise(word)
            if term.startswith("redirect="):
                redirect = term.split("=", 1)[1]
                continue
            if "=" in term.split(":", 1)[0]:
                continue  # exp= and unknown modifiers: no lookup counted (RFC 7208 §6)
            qualifier = term[0] if term[0] in _QUALIFIERS else ""
            bare = term[1:] if qualifier else term
            name, _, target = bare.partition(":")
            name = name.split("/", 1)[0]
            self.mechanisms.add(term)
            if name == "all":
                has_all = True
                if top:
                    self.all_qualifier = qualifier or "+"
                continue
            if name not in _QUERYING:
                continue
            self.terms += 1
            if self.over():
                return
            target = target.split("/", 1)[0] or domain
            if "%" in target:
                continue  # a macro needs the client's IP or sender: counted, not followed
            if name == "include":
                self.record(target, top=False, via="include ")
            elif name in ("a", "exists"):
                self.fetched(("A", target))
            elif name == "mx":
                self.fetched(("MX", target))
        # RFC 7208 §6.1: redirect is ignored when the record has an `all` mechanism.
        if redirect and not has_all and not self.over():
            self.terms += 1
            if not self.over():
                self.record(redirect, top=top, via="redirect ")


def walk(domain: str, lookups: Mapping[Query, Lookup]) -> SpfTree | Needs:
    """The domain's SPF tree as far as `lookups` reach: the verdict when nothing more is
    needed (or the limits are crossed already), else the queries to fetch next."""
    w = _Walk(lookups)
    w.record(domain.lower().rstrip("."), top=True, via="")
    if w.missing and not w.over():
        return Needs(frozenset(w.missing))
    errors = list(w.errors)
    if w.terms > MAX_QUERYING_TERMS:
        errors.append(
            f"more than {MAX_QUERYING_TERMS} DNS-querying terms (include, a, mx, ptr, exists, "
            "redirect): receivers answer permerror (RFC 7208 §4.6.4)"
        )
    if w.voids > MAX_VOID_LOOKUPS:
        errors.append(
            f"{w.voids} void lookups, more than {MAX_VOID_LOOKUPS}: receivers answer permerror "
            "(RFC 7208 §4.6.4)"
        )
    return SpfTree(w.terms, w.voids, tuple(errors), w.all_qualifier, frozenset(w.mechanisms))
