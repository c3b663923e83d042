"""The example alerting rules in docs/ (DESIGN.md §16): valid for Prometheus's own checker,
each alert fires on the series its unit test feeds it, and every metric they name is on a
running smtpguard's /metrics — so a renamed metric breaks this test, not an operator's
paging."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.ops.test_metrics import exposed_names
from tests.ops.test_ops import http_get
from tests.support import Upstream, base_config, message, running_guard, send

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "prometheus-rules.yml"
RULE_TESTS = ROOT / "docs" / "prometheus-rules.test.yml"

_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
}
_PROMQL_WORDS |= {"offset", "inf", "nan"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe is not None, (
        "promtool is missing: Debian's prometheus package ships it (scripts/test installs it)"
    )
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, cwd=RULES.parent)


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: what is left once label matchers, ranges,
    grouping clauses, strings, function calls and keywords are taken out."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\s*\()?", text):
        word = m.group(0).rstrip("( \t")
        if m.group(1) or word.lower() in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def rule_metrics() -> dict[str, set[str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: metric_names(rule["expr"]) for group in groups for rule in group["rules"]}


def test_promtool_accepts_the_rules_and_each_alert_fires_in_its_unit_test() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 9 rules found" in checked.stdout, checked.stdout
    tested = promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Every alert has a firing case in the unit test file.
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing = {t["alertname"] for case in cases for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert firing == set(rule_metrics())


def test_the_expression_parser_finds_names_only() -> None:
    expr = 'max by (zone, window) (rate(smtpguard_a_total{x="y z"}[5m])) / on(zone) smtpguard_b >= 0.8'
    assert metric_names(expr) == {"smtpguard_a_total", "smtpguard_b"}


async def test_every_metric_the_rules_name_is_on_a_real_metrics_page(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, metrics={"address": "127.0.0.1:0"})
    cfg["zones"]["acme"]["alert_at"] = [0.8, 0.95]
    async with running_guard(cfg) as guard:
        assert (await send(guard.ports[0], message("rules:1"))).code == 250
        assert guard.health is not None
        status, body = await http_get(guard.health.port, "/metrics")
    assert status == 200
    exposed = exposed_names(body)
    wanted = rule_metrics()
    assert all(wanted.values()), wanted
    missing = {alert: names - exposed for alert, names in wanted.items() if names - exposed}
    assert not missing, f"the rules name metrics smtpguard does not expose: {missing}"
