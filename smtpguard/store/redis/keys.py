"""Every Redis key smtpguard writes, named in one place.

A zone's keys share its hash tag (`sg:{zone}:…`), so each script touches one slot; the
fleet's shared keys have tags of their own (`{providers}`, `{pauses}`, `{rate:…}`, …).
"""

from __future__ import annotations

from smtpguard.policy.events import bare_message_id
from smtpguard.policy.ledger import Record
from smtpguard.policy.limits import CapCheck

# How often one process re-announces a zone in the zone set (it survives a Redis data loss).
_ZONE_ANNOUNCE_EVERY = 300.0
_ZONES = "sg:zones"
# Zones that may have store-and-forward entries: what claim() looks at. A zone is added after
# each enqueue and dropped by a claim that finds its queue empty; every
# _ZONE_ANNOUNCE_EVERY a claim also looks at every known zone, in case an enqueue died
# between its write and that add.
_QUEUED_ZONES = "sg:queued-zones"
_LANES_LISTED = "sg:lanes-listed"
"""Set once every zone's set of lane names holds the lanes of its queue entries."""
_STATES_LISTED = "sg:states-listed"
"""Set once every zone's per-state sets (st:<state>) hold the records written before them."""
_SUPP_FOLDED = "sg:supp-folded"
"""Set once every suppression list in this Redis is keyed by suppression_key()."""
_PROBES = "sg:{providers}:probes"
"""Hash (instance, provider) → (ready, detail, at): each instance's last probe, for `stats`."""
_CIRCUITS = "sg:{providers}:circuits"
"""Hash (instance, provider) → (circuit, since): each instance's breakers, for `stats`."""
_THROTTLES = "sg:{providers}:throttles"
"""Hash provider → until: providers throttled by a rate-limit reply (DESIGN.md §16)."""
_PAUSED_CLASSES = "sg:{pauses}:classes"
"""Set of "zone\0class": every message class paused (DESIGN.md §16), read whole."""

# The queue of a zone (DESIGN.md §4a), every key under the zone's hash tag:
#   q:<key>       hash: lane, prio, due, enq, from, rcpt (JSON), body — the message itself
#   lane:<lane>   zset: key → due time (HELD: never due); every entry, claimed or not
#   claimed       zset: key → claimed until; an entry is hidden while its score >= now
#   claimer       hash: key → the token of the claim call that holds it (a retried run
#                 of that call gets it back)
#   queue         set: every key with an entry (queue listing, and "is this zone's queue empty")
# Scripts that must find entries they were not told about (claim, listing, requeue's lane)
# build those keys from the zone prefix: each still hashes to the zone's slot, so the
# script stays on one Cluster node.


def _zone_key(zone: str, name: str) -> str:
    return f"sg:{{{zone}}}:{name}"


def _zone_prefix(zone: str) -> str:
    """What scripts build the zone's further keys from (`q:<key>`, `lane:<lane>`, …)."""
    return _zone_key(zone, "")


# The ledger of a zone.
def _index_key(zone: str) -> str:
    """zset: record key → updated_at, every record of the zone (purge and listings walk it)."""
    return _zone_key(zone, "idx")


def _state_key(zone: str, state: str) -> str:
    """zset: record key → updated_at, the zone's records in one state."""
    return _zone_key(zone, f"st:{state}")


def _ids_key(zone: str) -> str:
    """hash: `s:`/`m:`/`u:` + smtpguard id / Message-ID / upstream id → record key."""
    return _zone_key(zone, "ids")


def _paused_key(zone: str) -> str:
    """string, present while the zone is paused."""
    return _zone_key(zone, "paused")


# A zone's caps.
def _sends_key(zone: str) -> str:
    """zset: the zone's counted sends (token → time), the hourly window."""
    return _zone_key(zone, "sends")


def _month_key(zone: str, month: str) -> str:
    """counter: the zone's sends of one month."""
    return _zone_key(zone, f"month:{month}")


def _user_window_key(zone: str, user: str) -> str:
    """zset: one user's counted sends, the user's hourly window."""
    return _zone_key(zone, f"us:{user}")


def _user_month_key(zone: str, user: str, month: str) -> str:
    """counter: one user's sends of one month."""
    return _zone_key(zone, f"um:{user}:{month}")


def _user_tokens_key(zone: str) -> str:
    """hash: cap token → what its user unit counted (read by a refund)."""
    return _zone_key(zone, "utok")


# A zone's suppression list, counters, audit log and provider events.
def _supp_key(zone: str) -> str:
    """hash: suppression_key(address) → JSON {reason, at}."""
    return _zone_key(zone, "supp")


def _supp_version_key(zone: str) -> str:
    """counter, moved by every change of the zone's suppression list."""
    return _zone_key(zone, "supp:v")


def _counts_key(zone: str) -> str:
    """hash: stat name → count."""
    return _zone_key(zone, "counts")


def _audit_key(zone: str) -> str:
    """list: JSON audit entries, newest first."""
    return _zone_key(zone, "audit")


def _events_key(zone: str, key: str) -> str:
    """list: the provider events applied to one record (JSON)."""
    return _zone_key(zone, f"pev:{key}")


def _event_ids_key(zone: str) -> str:
    """zset: `source\0id` → received_at, the provider events already applied."""
    return _zone_key(zone, "pev-ids")


# The queue of a zone (see above).
def _queue_key(zone: str) -> str:
    return _zone_key(zone, "queue")


def _claimed_key(zone: str) -> str:
    return _zone_key(zone, "claimed")


def _lanes_key(zone: str) -> str:
    """set: the names of the zone's lanes (only grows)."""
    return _zone_key(zone, "lanes")


def _user_keys(zone: str, cap: CapCheck | None) -> list[str]:
    """A user's window, month counter and the zone's token map (lib/cap_unit.lua); placeholders
    under the zone's tag when the unit has no user cap, so the script's KEYS stay fixed."""
    user = cap.user if cap is not None and cap.user_caps is not None else None
    month = cap.month if cap is not None else "-"
    if user is None:
        return [_zone_key(zone, "us:"), _zone_key(zone, "um:"), _user_tokens_key(zone)]
    return [_user_window_key(zone, user), _user_month_key(zone, user, month), _user_tokens_key(zone)]


def _user_args(cap: CapCheck | None) -> list[str | int | float]:
    if cap is None or cap.user is None or cap.user_caps is None:
        return ["0", 0, 0, ""]
    return ["1", cap.user_caps.monthly, cap.user_caps.hourly, cap.user]


def _record_key(zone: str, key: str) -> str:
    return _zone_key(zone, f"ev:{key}")


def _entry_key(zone: str, key: str) -> str:
    return _zone_key(zone, f"q:{key}")


def _lane_key(zone: str, lane: str) -> str:
    return _zone_key(zone, f"lane:{lane}")


def _rate_key(provider: str) -> str:
    return f"sg:{{rate:{provider}}}:tat"


def _connections_key(provider: str) -> str:
    return f"sg:{{conn:{provider}}}:slots"


def _auth_key(ip: str) -> str:
    return f"sg:{{auth:{ip}}}:fail"


def _nonce_key(name: str) -> str:
    return f"sg:nonce:{name}"


def _ids(r: Record) -> tuple[str, str, str]:
    """What lua/lib/indexes.lua indexes the record under: its smtpguard id, its
    Message-ID without <>, its upstream id."""
    return (r.sg_id, bare_message_id(r.message_id) if r.message_id else "", r.upstream_id or "")


_ID_PREFIX: dict[str, tuple[str, int]] = {
    "sg_id": ("s:", 0),
    "message_id": ("m:", 1),
    "upstream_id": ("u:", 2),
}
