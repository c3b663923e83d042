"""Which PostgreSQL server of a multi-host store URL may take writes (DESIGN.md §18).

libpq takes the first host that accepts writes. After a failover, an old primary restarted
read-write also accepts them: two servers, each with its own copy of the ledger, and
whichever libpq reaches first is written (a key reserved on one is free on the other: a
second send). So when two members accept writes, only the one on the newer timeline is
written (a promotion starts a new timeline; the old primary stays on the one it had), and
only among servers of the same cluster (one system identifier). Equal timelines, or two
clusters, cannot be told apart: neither is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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


def choose(writable: Sequence[Member]) -> Choice:
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
