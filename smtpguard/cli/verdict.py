"""`smtpguard verdict ZONE KEY` (DESIGN.md §19): ask the provider's log about an `unknown`
record now, settle it as the verdict loop would, and print what the log said.

Exit 0 on a verdict (accepted, refused, not accepted) and for a record that is not `unknown`
(printed with its state, left alone); 3 when there is no verdict yet (the log shows nothing
conclusive, the API failed, or past `give_up`) or no such record.
"""

from __future__ import annotations

import argparse
from typing import Any

from smtpguard.cli.context import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    CLIError,
    NotFound,
    _config,
    _zone,
    emit,
    iso,
    on_store,
)
from smtpguard.config import Config
from smtpguard.logs import logfmt_value
from smtpguard.policy.ledger import Record, State
from smtpguard.policy.verdicts import LogEntry
from smtpguard.store import Store


def cmd_verdict(args: argparse.Namespace) -> int:
    config = _config(args)
    zone = _zone(config, args.zone)
    doc = on_store(config, lambda store: _verdict(config, store, zone, args.key))
    if args.json:
        emit(doc)
    else:
        _print(doc)
    return EXIT_OK if doc["verdict"] not in ("none_yet", "gave_up") else EXIT_NOT_FOUND


async def _verdict(config: Config, store: Store, zone: str, key: str) -> dict[str, Any]:
    # aiohttp (the `events` extra) is needed only here and in serve's loop
    from smtpguard.verdicts import api_key, client_for
    from smtpguard.verdicts.ask import ask, record_attempt
    from smtpguard.verdicts.loop import settings_of
    from smtpguard.verdicts.settle import settle

    rec = await store.get(zone, key)
    if rec is None:
        raise NotFound(f"no record for zone {zone} key {key!r}")
    doc: dict[str, Any] = {"zone": zone, "key": key}
    if rec.state is not State.UNKNOWN:
        return {**doc, "state": rec.state.value, "verdict": None, "note": "not unknown; left alone"}
    attempt = record_attempt(rec)
    where = [i for i, p in enumerate(config.providers) if attempt is not None and p.name == attempt.provider]
    api = getattr(config.providers[where[0]], "api", None) if where else None
    if attempt is None or api is None:
        via = attempt.provider if attempt is not None else "no provider"
        raise CLIError(f"{zone} {key}: its attempt went through {via}, which has no `api` to ask")
    client = client_for(attempt.provider, api, api_key(api, f"providers[{where[0]}].api"))
    try:
        asked = await ask(client, rec, attempt, settings_of(config), store.now())
    finally:
        await client.close()
    doc |= {
        "provider": attempt.provider,
        "attempt_at": iso(attempt.at),
        "verdict": asked.verdict.kind.value,
        "log": [_entry(e) for e in asked.entries],
        "ingested_past": asked.proof,
        "absence_provable": asked.provable,
        "error": asked.error,
    }
    written: Record | None = None
    if asked.verdict.settles:
        written = await settle(
            store, zone, key, asked.verdict, "api", attempt.provider,
            attempt_id=rec.sg_id, min_retry_interval=config.event_key.min_retry_interval,
        )  # fmt: skip
    now = written or await store.get(zone, key) or rec
    return {**doc, "state": now.state.value, "settled": written is not None}


def _entry(e: LogEntry) -> dict[str, Any]:
    return {
        "kind": e.kind.value,
        "at": iso(e.at),
        "message_id": e.message_id,
        "tag": e.tag,
        "upstream_id": e.upstream_id,
        "reason": e.reason,
    }


def _print(doc: dict[str, Any]) -> None:
    head = f"{doc['zone']} {doc['key']}"
    if doc["verdict"] is None:
        print(f"{head}: {doc['state']} ({doc['note']})")
        return
    print(f"{head}: asked {doc['provider']} about the attempt at {doc['attempt_at']}")
    if doc["error"]:
        print(f"  the log could not be read: {doc['error']}")
    for e in doc["log"]:
        # The log's text is the provider's or any sender's: escaped as a log line is, so a
        # terminal control sequence in it is shown, never obeyed.
        fields = " ".join(
            f"{k}={logfmt_value(e[k])}" for k in ("message_id", "tag", "upstream_id", "reason") if e[k]
        )
        print(f"  log: {e['at']} {e['kind']} {fields}")
    if not doc["log"] and not doc["error"]:
        print("  log: nothing about this message")
    if not doc["absence_provable"] and doc["verdict"] in ("none_yet", "gave_up"):
        # A log the message never went to, or a search by an id it never carried, finds
        # nothing whether the provider took it or not.
        print(
            f"  absence proves nothing here: the message is not known to have gone to this log of "
            f"{doc['provider']}, or to carry what it is searched by (sent before the provider's "
            "api was configured or changed, or noted by an earlier release); an operator decides "
            "(resolve)"
        )
    print(f"  verdict: {doc['verdict'].replace('_', ' ')}; the record is {doc['state']}")
