"""The SQL written once for SQLite and PostgreSQL (store/sql/): each dialect's rendering,
and the provider-health statements rendered for PostgreSQL byte for byte as its store wrote
them before they were shared (the contract suite runs them on both stores)."""

from __future__ import annotations

from smtpguard.store.sql import operations
from smtpguard.store.sql.statements import Plan


def test_a_plan_renders_parameters_and_bytewise_order_per_dialect() -> None:
    plan = Plan("SELECT a FROM t WHERE x = ? AND y = ? ORDER BY a{bytewise}, b", (1, "y"))
    assert plan.sqlite() == ("SELECT a FROM t WHERE x = ? AND y = ? ORDER BY a, b", (1, "y"))
    assert plan.postgres() == ('SELECT a FROM t WHERE x = %s AND y = %s ORDER BY a COLLATE "C", b', (1, "y"))


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
