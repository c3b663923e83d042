"""Receiving providers (DESIGN.md §21), as pure decisions: which mailbox provider a
recipient's MX hosts belong to, and whether a recipient of it may be taken now.

A recipient's receiver is found from its domain's MX hosts, matched by suffix against the
`receivers` table (built-in defaults below, which the config may override); a domain with no
MX is matched by its own name (RFC 5321 §5.1's implicit MX). Anything unmatched, and any DNS
trouble, is `other`: receiver shaping never delays or refuses mail because DNS is down.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from smtpguard import replies
from smtpguard.policy.dnsdata import Lookup
from smtpguard.replies import Reply

OTHER = "other"

DEFAULT_RECEIVERS: Mapping[str, tuple[str, ...]] = {
    "gmail": ("google.com", "googlemail.com"),
    "microsoft": ("outlook.com", "hotmail.com"),
    "yahoo": ("yahoodns.net",),
    "apple": ("icloud.com",),
}

NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
"""A receiver's name, also a metric label value: short, lower case, bounded by the config."""

EVENT_TYPES = frozenset({"delivered", "deferred", "bounce", "complaint"})
"""The provider event types counted per receiver (§21): the label's values stay bounded."""

TROUBLE_TTL = 30.0
"""How long a failed or timed-out MX lookup's `other` is kept: a dead resolver costs one
bounded wait per domain per this long, not one per RCPT."""
MAX_HOSTS = 10
"""MX hosts kept per domain, the most preferred: the receiver is the first of them that
matches, and an answer the domain's owner chose (a wildcard of hundreds of long names, 80 KB
kept per domain) must not make the cache of 10,000 domains hold hundreds of megabytes."""
MIN_TTL = 1.0
MAX_TTL = 86400.0

CONTROL_PREFIX = "receiver:"
"""A receiver's pause is kept beside the message-class pauses in the store's zone controls
(DESIGN.md §16), under this prefix, which no class name can take (config refuses it)."""

MIN_SENDS = 100
"""`alert.min_sends` unless set: sends to a receiver in a window before its shares are judged.
At 1,000 sends an hour, a steady 2% of bounces arriving a minute after their sends read as
6% one minute into each window (17 sends, one bounce): a 5% rule warned in 23 windows of 24."""

RCPT_BURST = 1.0
"""Seconds of `max_rate` a receiver's recipients may arrive early at RCPT (the GCRA's
tolerance): a transaction with a few recipients of one receiver is not split by a rate
meant for a sustained flow. Over any window W at most rate * (W + 1) + 1 are taken."""


def control_name(receiver: str) -> str:
    return CONTROL_PREFIX + receiver


SLOW_SUFFIX = ":slow"
"""`on_alert: slow` in force for a receiver: kept beside its pause (`receiver:R:slow`), so
every worker and instance taking its slots halves its rate, not only the one that judged."""


def slow_control(receiver: str) -> str:
    return control_name(receiver) + SLOW_SUFFIX


def receiver_of_control(name: str) -> str | None:
    """The receiver a stored control names, or None for a message class."""
    return name[len(CONTROL_PREFIX) :] if name.startswith(CONTROL_PREFIX) else None


def is_slow_control(name: str) -> bool:
    return name.startswith(CONTROL_PREFIX) and name.endswith(SLOW_SUFFIX)


def stat_name(receiver: str, kind: str) -> str:
    """The store counter a receiver's sends (`sent`) or events are kept under."""
    return f"receiver:{receiver}:{kind}"


def receiver_counts(counts: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """The store's counters of one zone → receiver → {sent, delivered, deferred, bounce,
    complaint}, for `stats`."""
    out: dict[str, dict[str, int]] = {}
    for name, n in counts.items():
        receiver = receiver_of_control(name)
        if receiver is None:
            continue
        rname, _, kind = receiver.partition(":")
        if kind in EVENT_TYPES or kind == "sent":
            row = out.setdefault(rname, dict.fromkeys(("sent", *sorted(EVENT_TYPES)), 0))
            row[kind] += n
    return dict(sorted(out.items()))


def table(overrides: Mapping[str, Sequence[str]] | None) -> dict[str, tuple[str, ...]]:
    """The built-in receivers with the config's over them: a name given replaces that
    receiver's suffixes (`[]` removes it); a new name adds one."""
    out = dict(DEFAULT_RECEIVERS)
    for name, suffixes in (overrides or {}).items():
        if suffixes:
            out[name] = tuple(normal_host(s) for s in suffixes)
        else:
            out.pop(name, None)
    return out


def normal_host(name: str) -> str:
    return name.strip().rstrip(".").lower()


def domain_of(address: str) -> str | None:
    """The recipient's domain, or None for an address literal (it names a host: no MX)."""
    domain = normal_host(address.rpartition("@")[2])
    if not domain or domain.startswith("["):
        return None
    return domain


def mx_hosts(domain: str, mx: Lookup) -> tuple[tuple[str, ...], float] | None:
    """The hosts mail for `domain` goes to, most preferred first, and how long that holds;
    None when DNS did not say (the caller counts the recipient as `other`, briefly)."""
    if mx.status == "error":
        return None
    if mx.status == "ok":
        ranked: list[tuple[int, str]] = []
        for text in mx.records:
            pref, _, host = text.partition(" ")
            host = normal_host(host)
            if host and host != ".":
                ranked.append((int(pref) if pref.isdigit() else 65535, host))
        if ranked:
            return tuple(h for _, h in sorted(ranked)[:MAX_HOSTS]), _clamp(mx.ttl)
    # No MX (or only a null MX): the domain itself is the one name there is to match.
    return (domain,), _clamp(mx.ttl)


def _clamp(ttl: float) -> float:
    return min(max(ttl, MIN_TTL), MAX_TTL)


def match(hosts: Iterable[str], receivers: Mapping[str, Sequence[str]]) -> str:
    """The receiver whose suffix the most preferred matching host ends with (the longest such
    suffix), else `other`.
    A suffix matches a whole label run: `google.com` matches `aspmx.l.google.com` and
    `google.com`, never `notgoogle.com`. A name with an escaped character (dnspython writes a
    label's own dot as a backslash and a dot: `mx.evil` + that + `google.com` is the label
    `evil.google` under `com`) is no host name and matches nothing."""
    for host in hosts:
        if "\\" in host:
            continue
        # The longest suffix that matches: a receiver the config adds under a built-in's
        # (`eu.outlook.com` under `outlook.com`) is its hosts' receiver, whatever the order.
        best: tuple[int, str] | None = None
        for name, suffixes in receivers.items():
            for suffix in suffixes:
                under = host == suffix or host.endswith("." + suffix)
                if under and (best is None or len(suffix) > best[0]):
                    best = (len(suffix), name)
        if best is not None:
            return best[1]
    return OTHER


def shaped_receiver(hosts: Sequence[str], receivers: Mapping[str, Sequence[str]]) -> str | None:
    """The receiver whose `paused` and `max_rate` apply to a recipient with these MX hosts;
    None when DNS did not say (no hosts): such a recipient is counted as `other` but never
    held as one — DNS trouble never holds mail up, even where `other` is paused."""
    return match(hosts, receivers) if hosts else None


@dataclass(frozen=True, slots=True)
class Shaping:
    """One zone's settings for one receiver (`zones.Z.receivers.R`), as policy needs them."""

    max_rate: float | None = None
    paused: bool = False
    alert: AlertRule | None = None
    on_alert: str | None = None

    @property
    def interval(self) -> float | None:
        return 1.0 / self.max_rate if self.max_rate else None


@dataclass(frozen=True, slots=True)
class AlertRule:
    window: float
    rates: Mapping[str, float]
    """kind (`complaint_rate`, `bounce_rate`, `deferral_rate`) → the share of sends that
    crosses it."""
    min_sends: int = 1
    """Sends in the window before a share is judged (`alert.min_sends`)."""


ALERT_KINDS: Mapping[str, str] = {
    "complaint_rate": "complaint",
    "bounce_rate": "bounce",
    "deferral_rate": "deferred",
}
"""Alert kind → the event type it counts."""


def next_turn(line: float | None, now: float, wait: float, interval: float) -> tuple[float, float]:
    """A queued entry refused a receiver's slot: when it asks again, and where this
    process's line of such entries then ends. Refusals take no slot, but every ask is a
    claim and a store write; entries refused together would otherwise all ask again when
    the next slot frees (N asks a slot for a backlog of N). Each gets its own turn, one
    `interval` after the last one given, so about one entry asks per slot that frees, in
    the order they were refused. With several workers each keeps its own line, and an
    entry that loses its turn to another's goes to the end of its line: asks per send are
    bounded by the workers, not by the backlog."""
    turn = max(line if line is not None else now, now + max(wait, 0.05))
    return turn, turn + interval


def rcpt_refusal(receiver: str, paused: bool, slot_granted: bool | None) -> Reply | None:
    """RCPT's answer for a recipient of `receiver` (relay mode): `451 4.7.1` while it is
    paused or over its `max_rate` (`slot_granted` False; None: no max_rate), else None.
    Only this recipient is refused; the transaction's others go on."""
    if paused:
        return replies.receiver_held(receiver, "paused")
    if slot_granted is False:
        return replies.receiver_held(receiver, "over its max_rate")
    return None


@dataclass(slots=True)
class _Window:
    wid: int
    base: dict[str, int]
    """The receiver's counters (sent, and each event type) as this window began."""
    last: dict[str, int]
    warned: set[str] = field(default_factory=set)


@dataclass(slots=True)
class AlertWindows:
    """A receiver's alert rates over consecutive windows, from the fleet's running counters
    (the store's, which every instance adds to), and the alerts already given in each: a
    rate crossed warns once per window, however long it stays crossed. Windows are aligned
    to the epoch (`floor(now / window)`). A window's counts start from the last reading of
    the window before (or from the first reading, after a start)."""

    windows: dict[tuple[str, str], _Window] = field(default_factory=dict)

    def observe(
        self, zone: str, receiver: str, rule: AlertRule, totals: Mapping[str, int], now: float
    ) -> list[str]:
        """The alert kinds newly crossed, given the counters read at `now`."""
        wid = int(now // rule.window)
        w = self.windows.get((zone, receiver))
        if w is None or w.wid not in (wid, wid - 1):
            w = _Window(wid, dict(totals), dict(totals))
        elif w.wid != wid:
            w = _Window(wid, w.last, dict(totals))
        else:
            w.last = dict(totals)
        self.windows[(zone, receiver)] = w
        sends = w.last.get("sent", 0) - w.base.get("sent", 0)
        if sends < max(rule.min_sends, 1):
            # No share of too few: events count from where the window began, so early in a
            # window those of the last one's sends (a bounce comes a minute after its send)
            # weigh against a handful of sends and a steady 2% reads as 6%.
            return []
        fresh = []
        for kind, threshold in rule.rates.items():
            if kind not in w.warned and self._count(w, kind) / sends >= threshold:
                w.warned.add(kind)
                fresh.append(kind)
        return fresh

    def active(self, zone: str, receiver: str, rule: AlertRule, now: float) -> set[str]:
        """The alert kinds given in the window `now` is in (the gauge's 1s)."""
        current = self.windows.get((zone, receiver))
        if current is None or current.wid != int(now // rule.window):
            return set()
        return set(current.warned)

    def rate(self, zone: str, receiver: str, kind: str) -> float:
        w = self.windows.get((zone, receiver))
        sends = w.last.get("sent", 0) - w.base.get("sent", 0) if w is not None else 0
        return self._count(w, kind) / sends if w is not None and sends > 0 else 0.0

    @staticmethod
    def _count(w: _Window, kind: str) -> int:
        event = ALERT_KINDS[kind]
        return w.last.get(event, 0) - w.base.get(event, 0)
