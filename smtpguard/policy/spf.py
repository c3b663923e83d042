"""An SPF include tree walked over fetched records, with RFC 7208 §4.6.4's limits.

Pure: the walk never queries anything. It reads the lookups it is given and, when it needs
more, says which (`Needs`); the adapter fetches those and walks again with them added. A
tree that exceeds the 10-term limit is judged as soon as the limit is crossed, so a loop
(`include:` of itself) or an endless chain ends after a bounded number of rounds.

Without a client IP nothing is evaluated: every term up to `all` of every record reached is
counted, as receivers may have to (the limit is on terms that may cause queries, not on the
first match), and the mechanisms seen are collected so the provider's can be looked for.
A record is parsed whole first: a term that is not RFC 7208 §4.6.1 syntax, an unknown
mechanism, or two `redirect=` make it a permerror before anything is counted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from smtpguard.policy.dnsdata import Lookup, mx_records

MAX_QUERYING_TERMS = 10
"""RFC 7208 §4.6.4: include, a, mx, ptr, exists and redirect, all records together."""
MAX_VOID_LOOKUPS = 2
"""RFC 7208 §4.6.4: lookups answered NXDOMAIN or with no records."""
MAX_MX_RECORDS = 10
"""RFC 7208 §4.6.4: an `mx` mechanism whose domain has more MX records is a permerror."""

Query = tuple[str, str]
"""(record type, name): ("TXT", "_spf.example.com")."""

_QUERYING = ("include", "a", "mx", "ptr", "exists")
_MECHANISMS = ("all", "include", "a", "mx", "ptr", "ip4", "ip6", "exists")
_QUALIFIERS = "+-~?"
_NAME = re.compile(r"[a-z][a-z0-9_.-]*")
"""RFC 7208 §12: a mechanism's or a modifier's name."""


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
    """Every mechanism reached through `+`/unqualified includes only, normalised
    (`include:mailgun.org`, qualifier `+` dropped): under `-include:` or `~include:` a
    provider's mechanism does not authorise it."""
    warnings: tuple[str, ...] = ()
    """What works but should be changed (a `ptr` mechanism), one line each."""


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


@dataclass(frozen=True, slots=True)
class Term:
    """One mechanism of a record, parsed."""

    text: str
    """normalise(the term as written)."""
    qualifier: str
    """"+", "-", "~", "?", or "" (which means "+")."""
    name: str
    target: str
    """The domain-spec (lowercase, no trailing dot, no CIDR length); "" when the mechanism
    has none (`a`, `mx`, `ptr`: the current domain)."""


@dataclass(frozen=True, slots=True)
class Parsed:
    mechanisms: tuple[Term, ...]
    redirect: str | None


def parse(record: str) -> Parsed | str:
    """A `v=spf1` record's terms (RFC 7208 §4.6.1, §12), or the permerror's reason."""
    mechanisms: list[Term] = []
    redirect: str | None = None
    for word in record.split()[1:]:
        lower = word.lower()
        name, eq, value = lower.partition("=")
        if eq and _NAME.fullmatch(name):
            if name != "redirect":
                continue  # exp= and unknown modifiers: no lookup counted (RFC 7208 §6)
            if redirect is not None:
                return "more than one redirect= modifier (RFC 7208 §6: permerror)"
            redirect = value.rstrip(".")
            if not redirect:
                return "redirect= without a domain (RFC 7208 §6.1: permerror)"
            continue
        term = _mechanism(word, lower)
        if isinstance(term, str):
            return term
        mechanisms.append(term)
    return Parsed(tuple(mechanisms), redirect)


def _mechanism(word: str, lower: str) -> Term | str:
    qualifier = lower[0] if lower[:1] and lower[0] in _QUALIFIERS else ""
    bare = lower[len(qualifier) :]
    name = re.split(r"[:/]", bare, maxsplit=1)[0]
    rest = bare[len(name) :]
    if not _NAME.fullmatch(name):
        return f"invalid term {word!r} (RFC 7208 §4.6.1: permerror)"
    if name not in _MECHANISMS:
        return f"unknown mechanism {word!r} (RFC 7208 §5: permerror)"
    target = ""
    if name in ("ip4", "ip6"):
        if not rest.startswith(":") or len(rest) == 1:
            return f"invalid term {word!r}: {name} needs an address (permerror)"
    elif name == "all":
        if rest:
            return f"invalid term {word!r} (RFC 7208 §5.1: permerror)"
    elif rest.startswith(":"):
        target = rest[1:].split("/", 1)[0].rstrip(".")
        if not target:
            return f"invalid term {word!r}: empty domain-spec after ':' (RFC 7208 §4.6.1: permerror)"
    elif name in ("include", "exists") or (rest and not rest.startswith("/")) or (name == "ptr" and rest):
        return f"invalid term {word!r}: {name} needs ':' and a domain (RFC 7208 §5: permerror)"
    return Term(normalise(word), qualifier, name, target)


@dataclass
class _Walk:
    lookups: Mapping[Query, Lookup]
    missing: set[Query] = field(default_factory=set)
    terms: int = 0
    voids: int = 0
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
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

    def record(self, domain: str, top: bool, via: str, reached: bool = True) -> None:
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
        parsed = parse(records[0])
        if isinstance(parsed, str):
            self.errors.append(f"{via}{domain}: {parsed}")
            return
        self.terms_of(domain, parsed, top, reached)

    def terms_of(self, domain: str, parsed: Parsed, top: bool, reached: bool) -> None:
        for term in parsed.mechanisms:
            if self.over():
                return
            if reached:
                self.mechanisms.add(term.text)
            if term.name == "all":
                if top:
                    self.all_qualifier = term.qualifier or "+"
                # RFC 7208 §5.1: what follows `all` is never tested, so never counted; and
                # §6.1: a record with `all` ignores its redirect=.
                return
            if term.name not in _QUERYING:
                continue
            self.terms += 1
            if self.over():
                return
            if term.name == "ptr":
                self.warnings.append(
                    f"{domain}: {term.text} (RFC 7208 §5.5: do not use ptr; it is slow and "
                    "receivers may skip it)"
                )
            target = term.target or domain
            if "%" in target:
                continue  # a macro needs the client's IP or sender: counted, not followed
            if term.name == "include":
                # Only a `+` (or unqualified) include passes its matches on as a pass.
                self.record(
                    target, top=False, via="include ", reached=reached and term.qualifier in ("", "+")
                )
            elif term.name in ("a", "exists"):
                self.fetched(("A", target))
            elif term.name == "mx":
                self.mx_hosts(target)
        if parsed.redirect and not self.over():
            self.terms += 1
            if not self.over() and "%" not in parsed.redirect:
                self.record(parsed.redirect, top=top, via="redirect ", reached=reached)

    def mx_hosts(self, target: str) -> None:
        """RFC 7208 §4.6.4: more than 10 MX records is a permerror; the MX hosts' address
        lookups (A, as for an IPv4 client) count as void lookups when empty."""
        lookup = self.fetched(("MX", target))
        if lookup is None or lookup.status != "ok":
            return
        records = mx_records(lookup)
        if len(records) > MAX_MX_RECORDS:
            self.errors.append(
                f"mx:{target}: {len(records)} MX records, more than {MAX_MX_RECORDS} "
                "(RFC 7208 §4.6.4: permerror)"
            )
            return
        for r in records:
            if r.exchange != "." and not self.over():
                self.fetched(("A", r.exchange))


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
    return SpfTree(
        w.terms, w.voids, tuple(errors), w.all_qualifier, frozenset(w.mechanisms), tuple(w.warnings)
    )
