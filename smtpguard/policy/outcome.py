"""What an upstream attempt came to, and the reply the client gets for it (DESIGN.md §3, §6).

The relay reports facts (which provider, what it answered, how far the transaction got);
this module classifies them. Only two facts matter for safety: whether the final dot may
have reached the provider, and whether the provider answered after it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from smtpguard import replies
from smtpguard.replies import Reply

_ENHANCED = re.compile(r"^([245])\.(\d{1,3})\.(\d{1,3})\s*")
_QUEUE_ID = re.compile(r"(?:\bqueued as\s+|\bid[=:]\s*)<?([A-Za-z0-9._@=+-]{1,128})>?", re.IGNORECASE)
# Amazon SES (and others) answer `250 Ok <message id>` and nothing else: one long token.
_OK_ID = re.compile(
    r"^(?:[245]\.\d{1,3}\.\d{1,3}\s+)?ok:?\s+<?([A-Za-z0-9._@=+-]{16,128})>?\s*$", re.IGNORECASE
)


class Kind(StrEnum):
    DELIVERED = "delivered"
    DEFERRED = "deferred"
    FAILED = "failed"
    UNKNOWN = "unknown"
    UNAVAILABLE = "unavailable"
    """No provider took the transaction as far as MAIL: nothing can have been accepted."""


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: Kind
    provider: str | None
    reply: Reply | None = None
    upstream_id: str | None = None
    detail: str = ""
    rejected: tuple[tuple[str, Reply], ...] = field(default=())
    """Recipients the provider refused while it accepted the message for others."""
    accepted: tuple[str, ...] = field(default=())
    data_sent: bool | None = None
    """Whether DATA went to the provider in this attempt (its history records the phase it
    reached); None leaves it to the record's phase."""
    wait_until: float | None = None
    """Unavailable only because the route's providers are throttled or out of max_rate or
    max_connections slots (DESIGN.md §16): usable again from this time. Queued mail waits
    for it without an attempt counted; a synchronous client hears 451 4.4.1."""


def split_enhanced(code: int, text: str) -> tuple[str, str]:
    """Split `2.0.0 Ok: queued as X` into ("2.0.0", "Ok: queued as X").

    A reply without an enhanced code gets the class default (RFC 3463 X.0.0), so every reply
    smtpguard passes on has one.
    """
    m = _ENHANCED.match(text)
    if m and m.group(1) == str(code)[0]:
        return m.group(0).strip(), text[m.end() :]
    return f"{str(code)[0]}.0.0", text


def upstream_reply(code: int, text: str) -> Reply:
    enhanced, rest = split_enhanced(code, " ".join(text.split()))
    return Reply(code, enhanced, rest)


def queue_id(text: str) -> str | None:
    """The upstream's queue id, as Postfix, Exim and most providers put it in their 250."""
    m = _QUEUE_ID.search(text) or _OK_ID.match(text)
    return m.group(1) if m else None


def classify_reply(code: int) -> Kind:
    if 200 <= code < 300:
        return Kind.DELIVERED
    if 400 <= code < 500:
        return Kind.DEFERRED
    return Kind.FAILED


def is_recipient_unknown(reply: Reply) -> bool:
    """Upstream 5.1.x: the address itself is bad, so it goes on the zone's suppression list."""
    return reply.permanent and reply.enhanced.startswith("5.1.")


def client_reply(outcome: Outcome, sg_id: str) -> Reply:
    if outcome.kind is Kind.UNKNOWN:
        return Reply(
            451,
            "4.3.0",
            # detail carries exception text: never let it break the reply line.
            f"[sg:{sg_id}] Upstream outcome unknown ({replies.safe(outcome.detail)}); held, not re-sent",
        )
    if outcome.kind is Kind.UNAVAILABLE or outcome.reply is None:
        return replies.no_provider()
    r = outcome.reply
    text = r.text
    if outcome.kind is Kind.DELIVERED and outcome.rejected:
        refused = ", ".join(f"<{addr}> {rep.code}" for addr, rep in outcome.rejected[:5])
        text = f"{text}; accepted for {len(outcome.accepted)}, refused {refused}"
    # A 421 closes the session it is sent on (RFC 5321 §3.8): the provider's with
    # smtpguard, not the client's, which goes on. Passed on as 421, the client would drop
    # a session smtpguard keeps open; 451 says the same of the message (try later). And a
    # message the provider took is 250 to the client whatever 2xx the provider chose (221,
    # 251): 250 is the one success reply to the end of data (RFC 5321 §4.3.2), the only one
    # client libraries accept there.
    code = 451 if r.code == 421 else 250 if outcome.kind is Kind.DELIVERED else r.code
    return replies.upstream(code, r.enhanced, sg_id, text)
