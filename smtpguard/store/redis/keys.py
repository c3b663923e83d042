"""Every Redis key smtpguard writes, named in one place.

A zone's keys share its hash tag (`sg:{zone}:…`), so each script touches one slot; the
fleet's shared keys have tags of their own (`{providers}`, `{pauses}`, `{rate:…}`, …).
"""

from __future__ import annotations

from smtpguard.events.model import bare_message_id
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


def _user_keys(zone: str, cap: CapCheck | None) -> list[str]:
    """A user's window, month counter and the zone's token map (USER_UNIT); placeholders
    under the zone's tag when the unit has no user cap, so the script's KEYS stay fixed."""
    user = cap.user if cap is not None and cap.user_caps is not None else None
    month = cap.month if cap is not None else "-"
    if user is None:
        return [_zone_key(zone, "us:"), _zone_key(zone, "um:"), _zone_key(zone, "utok")]
    return [_zone_key(zone, f"us:{user}"), _zone_key(zone, f"um:{user}:{month}"), _zone_key(zone, "utok")]


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
