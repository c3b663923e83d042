"""Whether a failover can lose an acknowledged write: synchronous replication (DESIGN.md §18).

An asynchronous standby acknowledges nothing: promoted after a crash, it lacks the last
writes the primary acknowledged, and every reservation among them is free again (a second
send). With a failover configured (a multi-host URL) `serve` therefore refuses to start
unless the primary waits for a standby: a non-empty `synchronous_standby_names` and a
`synchronous_commit` that waits for it. Both are readable by any role (`current_setting`
is SHOW). Whether a synchronous standby is streaming right now is in pg_stat_replication,
whose sync_state only roles with pg_read_all_stats (pg_monitor) may read.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("smtpguard.store")
WARN_EVERY = 60.0

WAITS_FOR_STANDBY = ("on", "remote_write", "remote_apply")

# One round trip at connection setup (the pool's configure hook): the replication settings,
# whether a sync standby streams (NULL when the role may not see it), and the server's
# identity for fencing (system identifier and timeline; see policy/fencing.py). The
# timeline is the newer of the last checkpoint's and the current WAL file's: a promotion's
# first checkpoint may still be running.
FACTS_SQL = """
SELECT current_setting('synchronous_standby_names'),
       current_setting('synchronous_commit'),
       CASE WHEN pg_has_role(current_user, 'pg_read_all_stats', 'USAGE') THEN
           (SELECT count(*) FROM pg_stat_replication
             WHERE sync_state IN ('sync', 'quorum') AND state = 'streaming') END,
       pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on',
       (SELECT system_identifier::text FROM pg_control_system()),
       greatest(
           (SELECT timeline_id FROM pg_control_checkpoint()),
           CASE WHEN NOT pg_is_in_recovery() THEN
               ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int END),
       inet_server_port()
"""


@dataclass(frozen=True)
class ServerFacts:
    standby_names: str
    commit: str
    streaming_sync: int | None
    """Synchronous standbys streaming now; None: this role may not read it (no pg_monitor)."""
    read_only: bool
    system_id: str
    timeline: int
    port: int | None

    @classmethod
    def of(cls, row: tuple[Any, ...]) -> ServerFacts:
        names, commit, streaming, ro, sysid, timeline, port = row
        return cls(
            str(names), str(commit), None if streaming is None else int(streaming),
            bool(ro), str(sysid), int(timeline), None if port is None else int(port),
        )  # fmt: skip

    @property
    def waits_for_standby(self) -> bool:
        return bool(self.standby_names.strip()) and self.commit in WAITS_FOR_STANDBY

    @property
    def synchronous(self) -> bool | None:
        """A synchronous standby is streaming (None: not readable by this role)."""
        if not self.waits_for_standby:
            return False
        return None if self.streaming_sync is None else self.streaming_sync > 0


def failover_problem(facts: ServerFacts) -> str | None:
    """Why a failover of this primary may lose acknowledged writes, naming the setting."""
    if not facts.standby_names.strip():
        return (
            "postgresql synchronous_standby_names is empty while the store url names several "
            "hosts (a failover): a promoted asynchronous standby lacks the writes it had not "
            "received, and their events are sent again"
        )
    if facts.commit not in WAITS_FOR_STANDBY:
        return (
            f"postgresql synchronous_commit is {facts.commit!r} while the store url names several "
            "hosts (a failover): a commit does not wait for the synchronous standby "
            f"(use one of {', '.join(WAITS_FOR_STANDBY)})"
        )
    return None


class Replication:
    """What the last new connection (or the store's watch) saw of synchronous replication."""

    def __init__(self, failover_configured: bool) -> None:
        self.failover_configured = failover_configured
        self.synchronous: bool | None = None
        self._warned = float("-inf")

    def note(self, facts: ServerFacts) -> None:
        self.synchronous = facts.synchronous
        if not self.failover_configured:
            return
        if self.synchronous is False:
            # Refusing the only surviving copy would turn a failover into an outage: keep
            # writing, and say so until a synchronous standby is back.
            now = time.monotonic()
            if now - self._warned >= WARN_EVERY:
                self._warned = now
                log.warning(
                    "postgresql: no synchronous standby; a failover now may lose acknowledged "
                    "writes (send them again)",
                    extra={"problem": failover_problem(facts) or "no synchronous standby is streaming"},
                )
        elif self._warned > float("-inf"):
            self._warned = float("-inf")
            log.info("postgresql: a synchronous standby is back")
