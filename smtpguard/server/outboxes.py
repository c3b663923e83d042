"""The outbox readers of one serve (DESIGN.md §20): one per source, started with it, and on
SIGHUP replaced for every source the file added, changed (url, table, zone, user, poll,
batch) or removed, or whose password file now holds another secret. A reader left running
on a source that is gone would go on sending its rows, as a zone that may no longer exist."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from smtpguard.config import OutboxSource

if TYPE_CHECKING:
    from smtpguard.outbox.reader import OutboxReader
    from smtpguard.outbox.submit import EnvelopeChecks
    from smtpguard.submission import Principal, Result, Submitter

Make = Callable[[str, OutboxSource, str | None], "OutboxReader"]


def maker(
    submitter: Submitter,
    clock: Callable[[], float],
    on_result: Callable[[Principal, Result], None],
    on_counts: Callable[[str, dict[str, int], float | None], None],
    checks: Callable[[], EnvelopeChecks | None],
) -> Make:
    """How this serve builds the reader of one source (name, source, password)."""

    def make(name: str, src: OutboxSource, password: str | None) -> OutboxReader:
        from smtpguard.outbox.reader import OutboxReader  # psycopg: only with an outbox

        return OutboxReader(name, src, password, submitter, clock, on_result, on_counts, checks)

    return make


def replace_readers(
    running: list[OutboxReader],
    sources: Mapping[str, OutboxSource],
    passwords: Mapping[str, str | None],
    make: Make,
) -> tuple[list[OutboxReader], list[OutboxReader]]:
    """(the readers that serve `sources` now, the ones halted, for the caller to await).

    No await here: the reload's swap calls it, so no row of a removed source is submitted
    under the new file. A reader whose source is unchanged keeps running untouched."""
    kept = {r.name: r for r in running if r.serves(sources.get(r.name), passwords.get(r.name))}
    halted = [r for r in running if kept.get(r.name) is not r]
    for reader in halted:
        reader.halt()
    serving = []
    for name, src in sources.items():
        found = kept.get(name)
        if found is None:
            found = make(name, src, passwords.get(name))
            found.start()
        serving.append(found)
    return serving, halted
