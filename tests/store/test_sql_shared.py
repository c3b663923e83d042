"""The SQL written once for SQLite and PostgreSQL (store/sql/): each dialect's rendering
(the purge's rule among them), and the statements of the fleet (provider health, throttles,
connection slots, AUTH failures), the zone controls (pauses, counters, suppression) and the
desk (provider events, the zone audit, queue depths, cap usage, nonces, finding and listing
records) rendered for PostgreSQL byte for byte, step for step, as its store ran them before
they were shared (the contract suite runs them on both stores)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from smtpguard.store.base import StoredEvent, ZoneAudit, id_forms
from smtpguard.store.postgres.desk import ID_COLUMNS, id_lookup
from smtpguard.store.sql import operations, purge
from smtpguard.store.sql.statements import Plan, Result, Script

T = TypeVar("T")


def test_a_plan_renders_parameters_and_bytewise_order_per_dialect() -> None:
    plan = Plan("SELECT a FROM t WHERE x = ? AND y = ? ORDER BY a{bytewise}, b", (1, "y"))
    assert plan.sqlite() == ("SELECT a FROM t WHERE x = ? AND y = ? ORDER BY a, b", (1, "y"))
    assert plan.postgres() == ('SELECT a FROM t WHERE x = %s AND y = %s ORDER BY a COLLATE "C", b', (1, "y"))


def test_an_index_hint_is_given_to_sqlite_only_where_the_file_has_the_index() -> None:
    plan = Plan("SELECT a FROM t{indexed t_by_a} WHERE x = ?", (1,))
    assert plan.sqlite({"t_by_a", "other"}) == ("SELECT a FROM t INDEXED BY t_by_a WHERE x = ?", (1,))
    assert plan.sqlite({"other"}) == ("SELECT a FROM t WHERE x = ?", (1,))
    assert plan.sqlite() == ("SELECT a FROM t WHERE x = ?", (1,))
    assert plan.postgres() == ("SELECT a FROM t WHERE x = %s", (1,))


def test_a_number_in_a_json_column_is_read_per_dialect() -> None:
    plan = Plan("SELECT 1 FROM t o WHERE {number data.expires_at} > ? AND {number o.data.n} IS NULL", (1.5,))
    assert plan.sqlite() == (
        "SELECT 1 FROM t o WHERE json_extract(data, '$.expires_at') > ? "
        "AND json_extract(o.data, '$.n') IS NULL",
        (1.5,),
    )
    assert plan.postgres() == (
        "SELECT 1 FROM t o WHERE (data::json->>'expires_at')::float8 > %s "
        "AND (o.data::json->>'n')::float8 IS NULL",
        (1.5,),
    )


def test_the_purge_renders_per_dialect() -> None:
    """The rule each store wraps its own way (one statement, or batches by ctid); the rest
    as PostgreSQL ran it before it was shared (SQLite's differs only in its placeholders)."""
    where = purge.purgeable(10.0, 20.0)
    params = (10.0, "in_flight", "queued", "deferred", 20.0)
    rule = (
        "updated_at < ? AND state NOT IN (?, ?) AND NOT (state = ? AND ({expires} IS NULL OR {expires} > ?) "
        "AND EXISTS (SELECT 1 FROM queue q WHERE q.zone = events.zone AND q.key = events.key))"
    )
    assert where.sqlite() == (rule.format(expires="json_extract(data, '$.expires_at')"), params)
    assert where.postgres() == (
        rule.replace("?", "%s").format(expires="(data::json->>'expires_at')::float8"),
        params,
    )
    orphans = (
        "DELETE FROM queue WHERE NOT EXISTS "
        "(SELECT 1 FROM events e WHERE e.zone = queue.zone AND e.key = queue.key)"
    )
    assert purge.ORPHANED_ENTRIES.sqlite() == purge.ORPHANED_ENTRIES.postgres() == (orphans, ())
    assert purge.WINDOW_KEEP == 7200
    assert [plan.postgres() for plan in purge.aged_out(10_000.0, 1000.0)] == [
        ("DELETE FROM auth_failures WHERE at < %s", (2800.0,)),
        ("DELETE FROM user_sends WHERE at < %s", (2800.0,)),
        ("DELETE FROM provider_events WHERE received_at < %s", (9000.0,)),
        ("DELETE FROM nonces WHERE until < %s", (10_000.0,)),
        ("DELETE FROM zone_audit WHERE at < %s", (9000.0,)),
    ]


def test_provider_health_renders_for_postgresql_as_before() -> None:
    assert operations.set_circuit("i", "p", "open", 1.5).postgres() == (
        "INSERT INTO circuits (instance, provider, circuit, at) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT (instance, provider) DO UPDATE SET circuit = excluded.circuit, at = excluded.at",
        ("i", "p", "open", 1.5),
    )
    assert operations.CIRCUITS.postgres() == (
        "SELECT instance, provider, circuit, at FROM circuits "
        'ORDER BY provider COLLATE "C", instance COLLATE "C"',
        (),
    )
    assert operations.set_probe("i", "p", True, "ok", 2.5).postgres() == (
        "INSERT INTO probes (instance, provider, ready, detail, at) VALUES (%s, %s, %s, %s, %s) "
        "ON CONFLICT (instance, provider) DO UPDATE SET ready = excluded.ready, "
        "detail = excluded.detail, at = excluded.at",
        ("i", "p", True, "ok", 2.5),
    )
    assert operations.PROBES.postgres() == (
        "SELECT instance, provider, ready, detail, at FROM probes ORDER BY provider, instance",
        (),
    )


def _steps(script: Script[T], results: list[Result]) -> tuple[list[tuple[str, tuple[Any, ...]]], T]:
    """The PostgreSQL statements a script runs when sent `results` in turn, and its answer."""
    steps: list[tuple[str, tuple[Any, ...]]] = []
    feed = iter(results)
    step = next(script)
    while True:
        steps.append(step.postgres())
        try:
            step = script.send(next(feed))
        except StopIteration as done:
            answer: T = done.value
            return steps, answer


NONE = Result([], 0)


def test_connection_slots_and_auth_failures_render_for_postgresql_as_before() -> None:
    lock = ("SELECT pg_advisory_xact_lock(hashtext(%s))", ("conn:p",))
    delete = ("DELETE FROM connection_slots WHERE provider = %s AND until <= %s", ("p", 5.0))
    update = ("UPDATE connection_slots SET until = %s WHERE provider = %s AND holder = %s", (9.0, "p", "h"))
    held = ("SELECT count(*) FROM connection_slots WHERE provider = %s", ("p",))
    insert = ("INSERT INTO connection_slots (provider, holder, until) VALUES (%s, %s, %s)", ("p", "h", 9.0))
    hold = lambda: operations.hold_connection("p", "h", 2, 9.0, 5.0)  # noqa: E731
    # Its own slot: extended, nothing counted.
    assert _steps(hold(), [NONE, NONE, Result([], 1)]) == ([lock, delete, update], True)
    # A new holder under the limit takes a slot; at the limit it is refused.
    assert _steps(hold(), [NONE, NONE, NONE, Result([(1,)], -1), NONE]) == (
        [lock, delete, update, held, insert],
        True,
    )
    assert _steps(hold(), [NONE, NONE, NONE, Result([(2,)], -1)]) == ([lock, delete, update, held], False)
    assert operations.drop_connection("p", "h").postgres() == (
        "DELETE FROM connection_slots WHERE provider = %s AND holder = %s",
        ("p", "h"),
    )
    assert operations.throttled(3.0).postgres() == (
        "SELECT provider, until FROM throttles WHERE until > %s",
        (3.0,),
    )
    counted = ("SELECT count(*) FROM auth_failures WHERE ip = %s AND at > %s", ("192.0.2.1", 70.0))
    assert _steps(operations.auth_failure("192.0.2.1", 100.0, 30.0), [NONE, NONE, Result([(4,)], -1)]) == (
        [
            ("SELECT pg_advisory_xact_lock(hashtext(%s))", ("auth:192.0.2.1",)),
            ("INSERT INTO auth_failures (ip, at) VALUES (%s, %s)", ("192.0.2.1", 100.0)),
            counted,
        ],
        4,
    )
    assert operations.auth_failures("192.0.2.1", 100.0, 30.0).postgres() == counted


def test_zone_controls_render_for_postgresql_as_before() -> None:
    assert operations.set_paused("z", True).postgres() == (
        "INSERT INTO paused (zone) VALUES (%s) ON CONFLICT DO NOTHING",
        ("z",),
    )
    assert operations.set_paused("z", False).postgres() == ("DELETE FROM paused WHERE zone = %s", ("z",))
    assert operations.is_paused("z").postgres() == ("SELECT 1 FROM paused WHERE zone = %s", ("z",))
    assert operations.set_class_paused("z", "bulk", True).postgres() == (
        "INSERT INTO paused_classes (zone, class) VALUES (%s, %s) ON CONFLICT DO NOTHING",
        ("z", "bulk"),
    )
    assert operations.set_class_paused("z", "bulk", False).postgres() == (
        "DELETE FROM paused_classes WHERE zone = %s AND class = %s",
        ("z", "bulk"),
    )
    assert operations.PAUSED_CLASSES.postgres() == ("SELECT zone, class FROM paused_classes", ())
    assert operations.counters("z").postgres() == ("SELECT name, value FROM counters WHERE zone = %s", ("z",))


def test_suppression_renders_for_postgresql_as_before() -> None:
    # The address is folded to its suppression key, as each store folded it before.
    assert operations.suppressed("z", "Ann@Example.COM").postgres() == (
        "SELECT zone FROM suppression WHERE address = %s AND zone IN (%s, 'global') "
        "ORDER BY zone = 'global' LIMIT 1",
        ("ann@example.com", "z"),
    )
    insert = (
        "INSERT INTO suppression (zone, address, reason, at) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT DO NOTHING RETURNING 1",
        ("z", "ann@example.com", "bounce", 7.0),
    )
    bump = (
        "INSERT INTO supp_versions (zone, v) VALUES (%s, 1) "
        "ON CONFLICT (zone) DO UPDATE SET v = supp_versions.v + 1",
        ("z",),
    )
    add = lambda: operations.suppress_add("z", "Ann@Example.COM", "bounce", 7.0)  # noqa: E731
    # Listed: the zone's version is bumped; already listed: nothing more is written.
    assert _steps(add(), [Result([(1,)], 1), NONE]) == ([insert, bump], True)
    assert _steps(add(), [NONE]) == ([insert], False)
    delete = (
        "DELETE FROM suppression WHERE zone = %s AND address = %s RETURNING 1",
        ("z", "ann@example.com"),
    )
    remove = lambda: operations.suppress_remove("z", "Ann@Example.COM")  # noqa: E731
    assert _steps(remove(), [Result([(1,)], 1), NONE]) == ([delete, bump], True)
    assert _steps(remove(), [NONE]) == ([delete], False)
    assert operations.suppress_list("z").postgres() == (
        'SELECT zone, address, reason, at FROM suppression WHERE zone = %s ORDER BY address COLLATE "C"',
        ("z",),
    )
    assert operations.suppress_list("z").sqlite() == (
        "SELECT zone, address, reason, at FROM suppression WHERE zone = ? ORDER BY address",
        ("z",),
    )
    assert operations.suppression_versions("z").postgres() == (
        "SELECT zone, v FROM supp_versions WHERE zone IN (%s, 'global')",
        ("z",),
    )


def test_provider_events_and_the_desk_render_for_postgresql_as_before() -> None:
    event = StoredEvent(
        at=5.0, source="sendgrid", type="bounce", provider_type="bounce", recipient="Ann@Example.COM",
        status="5.1.1", id="ev-1", effect="suppressed", received_at=6.0,
    )  # fmt: skip
    data = json.dumps(event.to_dict(), separators=(",", ":"))
    insert = (
        "INSERT INTO provider_events (zone, source, event_id, key, received_at, data) "
        "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING 1",
        ("z", "sendgrid", "ev-1", "k", 6.0, data),
    )
    listed = (
        "INSERT INTO suppression (zone, address, reason, at) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT DO NOTHING RETURNING 1",
        ("z", "ann@example.com", "bounce", 6.0),
    )
    bump = (
        "INSERT INTO supp_versions (zone, v) VALUES (%s, 1) "
        "ON CONFLICT (zone) DO UPDATE SET v = supp_versions.v + 1",
        ("z",),
    )
    one = Result([(1,)], 1)
    # A new suppressing event lists its recipient; a repeated one changes nothing.
    assert _steps(operations.apply_event("z", "k", event, "bounce"), [one, one, NONE]) == (
        [insert, listed, bump],
        True,
    )
    assert _steps(operations.apply_event("z", "k", event, "bounce"), [NONE]) == ([insert], False)
    assert _steps(operations.apply_event("z", "k", event, None), [one]) == ([insert], True)
    assert operations.audit_add("z", ZoneAudit(1.0, "ops", "pause", "", "why")).postgres() == (
        "INSERT INTO zone_audit (zone, at, actor, action, key, note) VALUES (%s, %s, %s, %s, %s, %s)",
        ("z", 1.0, "ops", "pause", "", "why"),
    )
    assert operations.QUEUE_DEPTHS.postgres() == (
        "SELECT zone, lane, count(*) FROM queue GROUP BY zone, lane",
        (),
    )


def test_cap_usage_and_nonces_render_for_postgresql_as_before() -> None:
    assert operations.cap_usage_of("z", 7200.0, "2026-12").postgres() == (
        "SELECT (SELECT count(*) FROM sends WHERE zone = %s AND at >= %s), "
        "(SELECT sum(used) FROM monthly WHERE zone = %s AND month = %s)",
        ("z", 3600.0, "z", "2026-12"),
    )
    taken = (
        "INSERT INTO nonces (name, digest, until) VALUES (%s, %s, %s) "
        "ON CONFLICT (name) DO UPDATE SET digest = excluded.digest, until = excluded.until "
        "WHERE nonces.until < %s RETURNING digest",
        ("svix:m1", "d1", 400.0, 100.0),
    )
    current = ("SELECT digest FROM nonces WHERE name = %s", ("svix:m1",))
    nonce = lambda: operations.remember_nonce("svix:m1", "d1", 400.0, 100.0)  # noqa: E731
    # Free (new or expired): taken at once. Live: answered by its digest, nothing written.
    assert _steps(nonce(), [Result([("d1",)], 1)]) == ([taken], True)
    assert _steps(nonce(), [NONE, Result([("d1",)], 1)]) == ([taken, current], True)
    assert _steps(nonce(), [NONE, Result([("d2",)], 1)]) == ([taken, current], False)
    assert _steps(nonce(), [NONE, NONE]) == ([taken, current], False)


def test_finding_records_renders_for_postgresql_as_before() -> None:
    sg = 'substring({t}data from \'"sg_id":"([^"]*)"\')'
    for field, value, column, wanted in [
        ("message_id", " <m1@x> ", "{t}mid", "m1@x"),
        ("sg_id", " sg1 ", sg, "sg1"),
        ("upstream_id", " up1 ", "{t}uid", "up1"),
    ]:
        assert ID_COLUMNS[field] == column
        found, forms = id_lookup(field, value)
        assert (found, forms) == (column, [wanted])
        assert operations.find_records(found, forms).postgres() == (
            f"SELECT data FROM events WHERE {column.format(t='')} = %s LIMIT 100",
            (wanted,),
        )
        assert operations.records_for_event(found, forms).postgres() == (
            f"SELECT e.data FROM events e WHERE {column.format(t='e.')} = %s AND NOT EXISTS "
            f"(SELECT 1 FROM events o WHERE {column.format(t='o.')} = %s AND o.zone <> e.zone) "
            "ORDER BY e.updated_at DESC LIMIT 100",
            (wanted, wanted),
        )
    # SQLite reads the ids out of the record's JSON, through the index on each path, and a
    # Message-ID in both its forms.
    column = "json_extract({t}data, '$.message_id')"
    assert operations.records_for_event(column, id_forms("message_id", "<m1@x>")).sqlite() == (
        "SELECT e.data FROM events e WHERE json_extract(e.data, '$.message_id') IN (?, ?) AND NOT EXISTS "
        "(SELECT 1 FROM events o WHERE json_extract(o.data, '$.message_id') IN (?, ?) AND o.zone <> e.zone) "
        "ORDER BY e.updated_at DESC LIMIT 100",
        ("m1@x", "<m1@x>", "m1@x", "<m1@x>"),
    )


def test_listing_records_renders_for_postgresql_as_before() -> None:
    assert operations.list_records("z", None, None, None, 50).postgres() == (
        "SELECT data FROM events WHERE zone = %s ORDER BY updated_at DESC LIMIT %s",
        ("z", 50),
    )
    assert operations.list_records("z", "held", 1.0, 2.0, 50).postgres() == (
        "SELECT data FROM events WHERE zone = %s AND state = %s AND updated_at >= %s AND updated_at < %s "
        "ORDER BY updated_at DESC LIMIT %s",
        ("z", "held", 1.0, 2.0, 50),
    )
    # SQLite is steered to the index of the filter, as its store did before.
    indexes = {"events_zone_state", "events_zone_updated"}
    assert operations.list_records("z", None, 1.0, None, 50).sqlite(indexes)[0] == (
        "SELECT data FROM events INDEXED BY events_zone_updated WHERE zone = ? AND updated_at >= ? "
        "ORDER BY updated_at DESC LIMIT ?"
    )
    assert operations.list_records("z", "held", None, None, 50).sqlite(indexes)[0] == (
        "SELECT data FROM events INDEXED BY events_zone_state WHERE zone = ? AND state = ? "
        "ORDER BY updated_at DESC LIMIT ?"
    )


def test_the_queue_listing_renders_for_postgresql_as_before() -> None:
    # As before but for the cast, now written CAST(… AS text) (SQLite has no `::`).
    assert operations.queue_entries("z").postgres() == (
        "SELECT q.zone, q.key, q.lane, e.state, q.due_at, q.claimed_until, q.enqueued_at, "
        "length(q.content) FROM queue q LEFT JOIN events e ON e.zone = q.zone AND e.key = q.key "
        "WHERE (CAST(%s AS text) IS NULL OR q.zone = %s) ORDER BY q.priority, q.due_at, q.zone, q.key",
        ("z", "z"),
    )
    assert operations.QUEUE_LANES.postgres() == ("SELECT DISTINCT lane FROM queue", ())
