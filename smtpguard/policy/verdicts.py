"""Verdicts: what a provider's own log proves about an `unknown` outcome (DESIGN.md §19).

Pure: the log entries are already fetched and typed, and every time is an argument. The
verdict loop, `smtpguard verdict` and the webhook path all ask `verdict()`; they differ only
in how they gathered the entries.

The rules, in the order they are tried:

1. An entry *matches* the attempt when it went through the attempt's provider, lies within
   the attempt's time ± WINDOW, and carries smtpguard's tag for the record, or carries no tag
   of its own and the attempt's Message-ID. An entry with someone else's tag never matches,
   whatever its Message-ID: a client may reuse a Message-ID, a tag is smtpguard's.
2. A matching acceptance is `accepted`, with the log's upstream id.
3. A matching refusal or drop at acceptance, and no matching acceptance, is `refused`: the
   provider will not deliver it, and a resend would be refused again. An acceptance wins
   when both match (an earlier attempt refused, a later one taken): `failed` invites the
   application to send the message another way, which would be the duplicate this product
   exists to prevent, while `delivered` for a message the provider then dropped is what its
   webhook or reconciliation reports next.
4. Nothing matching: `not_accepted` only once `absent_after` has passed since the attempt
   *and* the log already shows a later acceptance of another message through the same
   provider (proof that it has ingested past the attempt; logs are eventually consistent)
   *and* the log was searched by an id the message is known to carry (`absence_provable`).
   This is the one verdict that leads to a send, so it needs all three.
5. Otherwise `none_yet`, or `gave_up` once `give_up` has passed: the loop stops and the
   record waits for an operator. Past `give_up` evidence of acceptance or refusal still
   settles (it sends nothing), but absence never does.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from smtpguard.policy import events

WINDOW = 600.0
"""Seconds either side of the attempt's time within which a log entry may be its message:
wide enough for clock skew and the provider's queueing, narrow enough that a Message-ID a
client reused a day later is not taken for this one."""


class LogKind(StrEnum):
    """What one log entry says happened when the provider took (or would not take) a message."""

    ACCEPTED = "accepted"
    REFUSED = "refused"
    """Refused at acceptance (Mailgun `rejected`)."""
    DROPPED = "dropped"
    """Taken, then dropped without a delivery attempt (SendGrid `dropped`)."""


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One entry of a provider's log, as a client (smtpguard/verdicts/) reduces it."""

    provider: str
    """smtpguard's name for the provider whose log this is (providers[].name)."""
    kind: LogKind
    at: float
    """Unix seconds, as the log gives them."""
    message_id: str | None = None
    """The Message-ID header the log shows, with or without the surrounding <>."""
    tag: str | None = None
    """smtpguard's tag as the log echoes it (the zone-qualified event key), if any."""
    upstream_id: str | None = None
    """The provider's own id for the message (what its 250 named)."""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Attempt:
    """The sending attempt whose outcome is unknown."""

    provider: str
    at: float
    """When the final dot went: the attempt's time."""
    tag: str | None
    message_id: str | None
    until: float | None = None
    """The latest moment the message may have reached the provider, when later than `at`:
    an owner that lost its lease may have been in DATA until then (Record.lost_until).
    Absence is proved, and `absent_after` counted, from here, not from `at`."""
    tagged: str | None = None
    """The kind of tag the relay wrote into the message (Record.tagged); None when it is not
    known to have written one. `tag` is what smtpguard's tag for the record reads either way:
    an entry carrying it is the record's whatever this says."""
    log: str | None = None
    """The log the provider's `api` named when the message went (Record.log, `log_identity`);
    None when it had none, or the note is older than the field."""

    @property
    def latest(self) -> float:
        return self.at if self.until is None else max(self.at, self.until)


SEARCHED_BY_TAG = frozenset({"sendgrid", "postmark"})
"""Logs that find a message by smtpguard's tag alone: neither shows the Message-ID header."""


def log_identity(kind: str, base_url: str, domain: str | None, key: str) -> str:
    """Which log a provider's `api` reads: its kind, where its API is, Mailgun's domain, and
    the key, whose account (SendGrid) or server (Postmark) the log is. Noted with each
    attempt and held by each log client: a log proves absent only a message that went while
    it was the provider's log. `kind:` and a short SHA-256, never the key."""
    seen = "\0".join((kind, base_url.rstrip("/"), domain or "", key))
    return f"{kind}:{hashlib.sha256(seen.encode()).hexdigest()[:16]}"


def login_of_another_domain(username: str | None, domain: str) -> bool:
    """A Mailgun SMTP login of another domain than the api's (`postmaster@mg2…` under
    `domain: mg…`): Mailgun's SMTP credentials are a domain's, so the messages go to that
    domain's log, which the api never reads; such a provider notes no log. A login naming no
    domain is not judged."""
    _, at, login = (username or "").rpartition("@")
    return bool(at) and login.lower().rstrip(".") != domain.lower().rstrip(".")


def log_kind(log: str) -> str:
    """The provider kind of a `log_identity`."""
    return log.partition(":")[0]


def absence_provable(attempt: Attempt, log: str | None) -> bool:
    """Can a look at the log `log` (a `log_identity`) that finds nothing of the attempt prove
    its message absent (rule 4)? Only when it is the log the provider's `api` named when the
    message went (`Attempt.log`): another domain, account or server never held it, and a
    reload may since have pointed the provider's name at one. And only when the look searched
    by an id the message is known to carry.
    SendGrid's and Postmark's logs are searched by their own tag: a message sent before that
    tag was written (before the provider's `api:` or webhook source was configured, or by a
    release that did not note it) is absent from the search whether or not it was accepted,
    and `not accepted` would send it a second time. Mailgun's log is searched by the
    Message-ID, which every message smtpguard relays carries, when the field is one msg-id
    the log names the message by (`searchable_message_id`), else by its tag. A message noted
    with SendGrid's or Postmark's tag went to a provider configured as that one, whose
    messages another log never holds (a reload has since given its name to another)."""
    if log is None or attempt.log != log:
        return False
    kind = log_kind(log)
    if kind in SEARCHED_BY_TAG:
        return attempt.tagged == kind
    if attempt.tagged in SEARCHED_BY_TAG:
        return False
    return searchable_message_id(attempt.message_id) is not None or attempt.tagged == kind


_MSG_ID = re.compile(r"<([^<>()\s]+)>|([^<>()\s]+)")


def searchable_message_id(value: str | None) -> str | None:
    """The msg-id of a Message-ID field, without its <>, as a log that parses the field
    (Mailgun's) names the message, when the field is that one msg-id and nothing more; None
    otherwise. A field naming no message (`<>`, empty) or holding more than its msg-id (a
    comment, RFC 5322 CFWS; a second id) is logged under the msg-id alone or under the
    provider's own, never as smtpguard read it: searched or matched as written, the message
    is not found whether or not it was taken."""
    found = None if value is None else _MSG_ID.fullmatch(value.strip())
    return None if found is None else found.group(1) or found.group(2)


def window(attempt: Attempt) -> tuple[float, float]:
    """The times a log entry of the attempt's message may carry."""
    return attempt.at - WINDOW, attempt.latest + WINDOW


class VerdictKind(StrEnum):
    """Also the `verdict` label of smtpguard_verdicts_total, so its values are bounded."""

    ACCEPTED = "accepted"
    REFUSED = "refused"
    NOT_ACCEPTED = "not_accepted"
    NONE_YET = "none_yet"
    GAVE_UP = "gave_up"


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    upstream_id: str | None = None
    """accepted: the provider's id from the log (may be None when the log shows none)."""
    reason: str | None = None
    """refused: the log's reason."""
    entry: LogEntry | None = None
    """The entry the verdict rests on (accepted, refused)."""

    @property
    def settles(self) -> bool:
        """Does the record leave `unknown`?"""
        return self.kind in (VerdictKind.ACCEPTED, VerdictKind.REFUSED, VerdictKind.NOT_ACCEPTED)


def bare_message_id(value: str | None) -> str | None:
    """events.bare_message_id for a Message-ID that may be missing: None for none, or for
    one with nothing inside its <>."""
    return None if value is None else events.bare_message_id(value) or None


def matches(attempt: Attempt, entry: LogEntry) -> bool:
    """Is this log entry about the attempt's message? (rule 1 above)"""
    first, last = window(attempt)
    if entry.provider != attempt.provider or not first <= entry.at <= last:
        return False
    if entry.tag is not None:
        return attempt.tag is not None and entry.tag == attempt.tag
    ours = searchable_message_id(attempt.message_id)
    return ours is not None and bare_message_id(entry.message_id) == ours


def ingested_past(attempt: Attempt, entries: Iterable[LogEntry]) -> bool:
    """The ingestion proof from entries a client fetched: an acceptance of another message,
    through the same provider, logged later than the attempt could have reached it."""
    return any(
        e.provider == attempt.provider
        and e.kind is LogKind.ACCEPTED
        and e.at > attempt.latest
        and not matches(attempt, e)
        for e in entries
    )


def verdict(
    attempt: Attempt,
    entries: Iterable[LogEntry],
    *,
    now: float,
    absent_after: float,
    give_up: float,
    proof_of_ingestion: bool,
    log: str | None,
) -> Verdict:
    """The §19 table for one record. `proof_of_ingestion`: the log already holds an acceptance
    through the same provider later than the attempt (see `ingested_past`); `log`: the log
    the entries come from, a `log_identity` (see `absence_provable`)."""
    mine = [e for e in entries if matches(attempt, e)]
    acceptance = _earliest(e for e in mine if e.kind is LogKind.ACCEPTED)
    if acceptance is not None:
        return Verdict(VerdictKind.ACCEPTED, acceptance.upstream_id, None, acceptance)
    refusal = _earliest(e for e in mine if e.kind in (LogKind.REFUSED, LogKind.DROPPED))
    if refusal is not None:
        return Verdict(
            VerdictKind.REFUSED, refusal.upstream_id, refusal.reason or refusal.kind.value, refusal
        )
    if now >= attempt.at + give_up:
        return Verdict(VerdictKind.GAVE_UP)
    if now >= attempt.latest + absent_after and proof_of_ingestion and absence_provable(attempt, log):
        return Verdict(VerdictKind.NOT_ACCEPTED)
    return Verdict(VerdictKind.NONE_YET)


def _earliest(entries: Iterable[LogEntry]) -> LogEntry | None:
    return min(entries, key=lambda e: e.at, default=None)


# --- when to look ---------------------------------------------------------------------------
def next_look(
    unknown_since: float, last_look: float | None, *, after: float, every: float, give_up: float
) -> float | None:
    """When the loop next asks the provider's log about a record that turned `unknown` at
    `unknown_since` and was last asked at `last_look` (None: never). None: never again (past
    `give_up`, the record is the operator's)."""
    due = unknown_since + after if last_look is None else max(last_look + every, unknown_since + after)
    return due if due < unknown_since + give_up else None


def due(
    unknown_since: float, last_look: float | None, now: float, *, after: float, every: float, give_up: float
) -> bool:
    at = next_look(unknown_since, last_look, after=after, every=every, give_up=give_up)
    return at is not None and now >= at


# --- webhooks that prove acceptance ---------------------------------------------------------
ACCEPTING_EVENTS: dict[str, frozenset[str]] = {
    "mailgun": frozenset({"accepted", "delivered"}),
    "sendgrid": frozenset({"processed", "delivered"}),
    "svix": frozenset({"email.sent", "email.delivered"}),  # Resend delivers through Svix
    "postmark": frozenset({"Delivery"}),
    "ses": frozenset({"Send", "Delivery"}),
}
"""Per §13 source kind, the provider's own event type names that prove the provider took
the message (its 250 was given, whatever the reply's fate on the way back)."""


def proves_acceptance(source_kind: str, provider_type: str) -> bool:
    """Does a signed event of this source kind and provider event type settle an `unknown`
    record as accepted? Spelling is the provider's: Postmark's RecordType and SES's
    eventType/notificationType are capitalised, the others are not."""
    return provider_type in ACCEPTING_EVENTS.get(source_kind, frozenset())
