"""Which PostgreSQL server of a multi-host store URL may take writes (DESIGN.md §18).

libpq takes the first host that accepts writes. After a failover, an old primary restarted
read-write also accepts them: two servers, each with its own copy of the ledger, and
whichever libpq reaches first is written (a key reserved on one is free on the other: a
second send). So when two members accept writes, only the one on the newer timeline is
written (a promotion starts a new timeline; the old primary stays on the one it had), and
only among servers of the same cluster (one system identifier). Equal timelines, or two
clusters, cannot be told apart: neither is written.

What was seen is remembered: a server on an older timeline of the cluster than one seen
accepting writes before is never written again, even when it is the only one left (the
promoted server restarting, or cut off for a moment, would otherwise hand the fleet back
to the old primary and its ledger of before the failover: every event since sent again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Member:
    """A server of the URL that accepts writes, as it describes itself."""

    name: str
    """host:port, as the URL names it."""
    system_id: str
    """pg_control_system().system_identifier: the same for a primary and its standbys."""
    timeline: int


@dataclass(frozen=True)
class Choice:
    write_to: Member | None
    """The one server to write to; None with `refuse` False: libpq may choose (fewer than
    two accept writes, nothing to fence)."""
    refuse: bool = False
    """Write to none (451 4.3.0 until an operator stops one of them)."""
    fenced: tuple[Member, ...] = ()
    reason: str = ""
    newest: Member | None = field(default=None, compare=False)
    """The newest timeline seen accepting writes so far (kept for the next decision)."""


def superseded(member: Member, newest: Member | None) -> bool:
    """On an older timeline of the cluster than a server already seen accepting writes:
    an old primary, whose ledger lacks everything written since the failover."""
    return newest is not None and member.system_id == newest.system_id and member.timeline < newest.timeline


def seen(newest: Member | None, member: Member) -> Member | None:
    """`newest` after `member` was written to."""
    if newest is None or (member.system_id == newest.system_id and member.timeline > newest.timeline):
        return member
    return newest


def choose(writable: Sequence[Member], newest: Member | None = None) -> Choice:
    """`newest`: the previous Choice's, so what was seen is never forgotten."""
    old = tuple(m for m in writable if superseded(m, newest))
    current = [m for m in writable if m not in old]
    choice = _among(current)
    if old:
        assert newest is not None
        names = ", ".join(f"{m.name} (timeline {m.timeline})" for m in old)
        why = f"{names} fenced: on an older timeline than {newest.timeline}, seen accepting writes before"
        if choice.refuse or choice.write_to is not None:
            choice = replace(choice, fenced=old + choice.fenced, reason=f"{choice.reason}; {why}")
        elif current:
            choice = Choice(current[0], False, old, why)  # pinned: libpq would take either
        else:
            choice = Choice(None, True, old, f"{why}; no server on a newer timeline accepts writes")
    written = choice.write_to or (current[0] if len(current) == 1 and not choice.refuse else None)
    return replace(choice, newest=newest if written is None else seen(newest, written))


def _among(writable: Sequence[Member]) -> Choice:
    if len(writable) < 2:
        return Choice(None)
    if len({m.system_id for m in writable}) > 1:
        names = ", ".join(f"{m.name} (system {m.system_id})" for m in writable)
        return Choice(None, True, tuple(writable), f"servers of different clusters accept writes: {names}")
    newest = max(m.timeline for m in writable)
    top = [m for m in writable if m.timeline == newest]
    if len(top) > 1:
        names = ", ".join(m.name for m in top)
        return Choice(None, True, tuple(writable), f"{names} accept writes on the same timeline {newest}")
    winner = top[0]
    fenced = tuple(m for m in writable if m is not winner)
    older = ", ".join(f"{m.name} (timeline {m.timeline})" for m in fenced)
    return Choice(winner, False, fenced, f"{older} fenced: {winner.name} is on the newer timeline {newest}")
