"""A CLI that scripts can trust: options anywhere, no store created by a look-up, exit codes
that tell "no such record" from "no store", `--json` with a schema everywhere, CSV with a
BOM, OS errors that keep the path, and a sink that never overwrites a message."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiosmtpd.smtp import Envelope

from smtpguard.cli import EXIT_CODES, EXIT_NOT_FOUND, EXIT_STORE, JSON_SCHEMA, build_parser, main
from smtpguard.sink import SinkHandler, deliver, prepare
from tests.support import (
    Behaviour,
    Upstream,
    base_config,
    free_port,
    message,
    running_guard,
    send,
    write_config,
)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def document(out: str) -> dict[str, object]:
    doc = json.loads(out)
    assert isinstance(doc, dict) and doc["schema"] == JSON_SCHEMA
    return doc


@pytest.fixture
def in_tmp(tmp: Path) -> Iterator[Path]:
    """Work from an empty directory, as an operator in the wrong one would."""
    before = Path.cwd()
    os.chdir(tmp)
    try:
        yield tmp
    finally:
        os.chdir(before)


async def filled_store(tmp: Path, upstream: Upstream) -> Path:
    """A store with one delivered event `k1` and one failed `k2`, written by a real guard."""
    upstream.handler.script = [Behaviour(), Behaviour(data="554 5.7.1 policy")]
    cfg = base_config(tmp, upstream.port)
    path = write_config(tmp / "smtpguard.yaml", cfg)
    async with running_guard(cfg) as guard:
        assert (await send(guard.ports[0], message("k1"))).code == 250
        assert (await send(guard.ports[0], message("k2"))).code == 554
    return path


async def test_config_option_anywhere_on_the_line(
    tmp: Path, upstream: Upstream, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(await filled_store(tmp, upstream))
    lines = [
        ["-c", path, "history", "acme", "k1", "--json"],
        ["history", "-c", path, "acme", "k1", "--json"],
        ["history", "acme", "-c", path, "k1", "--json"],
        ["history", "--json", "acme", "k1", "-c", path],
        [f"--config={path}", "history", "acme", "k1", "--json"],
    ]
    for argv in lines:
        code, out, err = await asyncio.to_thread(run, capsys, *argv)
        assert code == 0, (argv, err)
        assert document(out)["state"] == "delivered"
    # The line the docs give, which stock argparse refused ("unrecognized arguments").
    for argv in (["queue", "list", "-c", path, "acme"], ["queue", "list", "-c", path, "acme", "--json"]):
        code, out, err = await asyncio.to_thread(run, capsys, *argv)
        assert code == 0, err
    assert document(out)["entries"] == []
    # After the command, -c wins over one given before it.
    code, _, err = await asyncio.to_thread(run, capsys, "-c", str(tmp / "missing.yaml"), "stats", "-c", path)
    assert code == 0, err


@pytest.mark.parametrize(
    "argv",
    [
        ["history", "demo", "k1"],
        ["history", "demo", "k1", "--json"],
        ["stats"],
        ["queue", "list"],
        ["suppress", "list", "demo"],
        ["suppress", "export", "global"],
        ["resolve", "demo", "k1", "--as", "retry"],
        ["pause", "demo"],
        ["suppress", "add", "demo", "x@example.com"],
    ],
)
def test_no_command_creates_the_store(
    in_tmp: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    root = Path(__file__).resolve().parents[2]
    # The shipped config names a relative store: var/smtpguard.db under the working directory.
    code, out, err = run(capsys, *argv, "-c", str(root / "conf" / "smtpguard.yaml"))
    assert code == EXIT_STORE
    assert "var/smtpguard.db" in err and "does not exist" in err and str(in_tmp) in err
    assert "no record" not in err and out == ""
    assert not (in_tmp / "var").exists(), "neither the file nor its directory is created"


async def test_exit_codes_tell_no_record_from_no_store(
    tmp: Path, upstream: Upstream, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(await filled_store(tmp, upstream))
    for argv in (
        ["history", "acme", "nope"],
        ["resolve", "acme", "nope", "--as", "delivered"],
        ["release", "acme", "nope"],
        ["queue", "drop", "acme", "nope"],
        ["suppress", "remove", "acme", "nobody@example.com"],
    ):
        code, _, err = await asyncio.to_thread(run, capsys, *argv, "-c", path)
        assert code == EXIT_NOT_FOUND == 3, (argv, err)
    # A state that does not allow it is a refusal, 1.
    code, _, err = await asyncio.to_thread(run, capsys, "release", "acme", "k1", "-c", path)
    assert code == 1 and "not failed" in err
    # A store that cannot be reached: 4, whatever the command.
    cfg = base_config(tmp, upstream.port)
    cfg["store"] = {"url": f"redis://127.0.0.1:{free_port()}/0"}
    down = str(write_config(tmp / "down.yaml", cfg))
    code, _, err = await asyncio.to_thread(run, capsys, "history", "acme", "k1", "-c", down)
    assert code == EXIT_STORE == 4 and "store unavailable" in err
    # And they are what --help says.
    helptext = build_parser().format_help()
    for code, meaning in EXIT_CODES.items():
        assert f"{code}  {meaning}" in helptext


async def test_json_carries_a_schema_everywhere(
    tmp: Path, upstream: Upstream, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(await filled_store(tmp, upstream))
    csv_file = tmp / "s.csv"
    csv_file.write_text("address,reason\na@example.com,bounced\n")
    checks: list[tuple[list[str], dict[str, object]]] = [
        (["check-config"], {"ok": True, "zones": 2}),
        (["history", "acme", "k1"], {"state": "delivered", "key": "k1"}),
        (["stats", "acme"], {}),
        (["queue", "list"], {"entries": []}),
        (["pause", "acme"], {"zone": "acme", "paused": True}),
        (["resume", "acme"], {"zone": "acme", "paused": False}),
        (["suppress", "add", "acme", "b@example.com"], {"address": "b@example.com", "added": True}),
        (["suppress", "import", "acme", str(csv_file)], {"rows": 1, "added": 1}),
        (["suppress", "remove", "acme", "b@example.com"], {"removed": True}),
        (["release", "acme", "k2"], {"zone": "acme", "key": "k2", "state": "deferred"}),
    ]
    for argv, expect in checks:
        code, out, err = await asyncio.to_thread(run, capsys, *argv, "--json", "-c", path)
        assert code == 0, (argv, err)
        doc = document(out)
        assert {k: doc[k] for k in expect} == expect, (argv, doc)
    code, out, _ = await asyncio.to_thread(run, capsys, "suppress", "list", "acme", "--json", "-c", path)
    assert [e["address"] for e in document(out)["entries"]] == ["a@example.com"]  # type: ignore[attr-defined]
    # A refused config is a document too, with the problems an operator would read.
    bad_cfg = base_config(tmp, upstream.port)
    bad_cfg["zones"]["acme"]["plan"] = "gold"
    bad = write_config(tmp / "bad.yaml", bad_cfg)
    code, out, err = await asyncio.to_thread(run, capsys, "check-config", "--json", "-c", str(bad))
    doc = document(out)
    assert code == 1 and doc["ok"] is False
    assert any("zones.acme.plan (line" in p for p in doc["problems"])  # type: ignore[attr-defined]
    assert "zones.acme.plan" in err


async def test_csv_import_accepts_a_byte_order_mark(
    tmp: Path, upstream: Upstream, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(await filled_store(tmp, upstream))
    csv_file = tmp / "export.csv"
    # What a spreadsheet's "CSV UTF-8" export writes: a BOM before the header.
    csv_file.write_bytes(b"\xef\xbb\xbfaddress,reason\r\nbom1@example.com,complained\r\n")
    code, _, err = await asyncio.to_thread(
        run, capsys, "suppress", "import", "acme", str(csv_file), "-c", path
    )
    assert code == 0, err
    code, out, _ = await asyncio.to_thread(run, capsys, "suppress", "export", "acme", "-c", path)
    assert out.splitlines()[1].startswith("bom1@example.com,complained,")
    no_header = tmp / "plain.csv"
    no_header.write_bytes(b"\xef\xbb\xbfbom2@example.com\n")
    code, _, err = await asyncio.to_thread(
        run, capsys, "suppress", "import", "acme", str(no_header), "-c", path
    )
    assert code == 0, err
    latin = tmp / "latin.csv"
    latin.write_bytes("caf\xe9@example.com\n".encode("latin-1"))
    code, _, err = await asyncio.to_thread(run, capsys, "suppress", "import", "acme", str(latin), "-c", path)
    assert code == 1 and str(latin) in err and "UTF-8" in err and "Traceback" not in err


def test_os_errors_keep_the_path(tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp / "a-file"
    blocker.write_text("")
    maildir = blocker / "sink"
    code, _, err = run(capsys, "sink", "--listen", f"127.0.0.1:{free_port()}", "--maildir", str(maildir))
    assert code == 1
    assert str(blocker) in err and "Not a directory" in err and "Traceback" not in err
    missing = tmp / "nope.csv"
    root = Path(__file__).resolve().parents[2]
    code, _, err = run(
        capsys, "suppress", "import", "demo", str(missing), "-c", str(root / "conf" / "smtpguard.yaml")
    )
    assert code == 1 and str(missing) in err


def test_help_explains_each_command() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    for name, sub in commands.choices.items():  # type: ignore[union-attr]
        text = sub.format_help()
        assert sub.description and len(sub.description) > 40, name
        assert "exit codes:" in text, name


# --- sink ------------------------------------------------------------------------------------
def test_sink_never_overwrites_a_message(tmp: Path) -> None:
    maildir = tmp / "sink"
    prepare(maildir)
    assert deliver(maildir, "same", b"first")
    assert not deliver(maildir, "same", b"second")
    assert (maildir / "new" / "same").read_bytes() == b"first"
    assert list((maildir / "tmp").iterdir()) == []


async def test_sink_picks_another_name_when_one_is_taken(tmp: Path) -> None:
    maildir = tmp / "sink"
    prepare(maildir)
    (maildir / "new" / "taken").write_bytes(b"from before a restart")
    names = iter(["taken", "taken", "fresh"])
    handler = SinkHandler(maildir, names=lambda n: next(names))

    env = Envelope()
    env.mail_from = "a@example.com"
    env.rcpt_tos = ["b@example.com"]
    env.original_content = b"Subject: x\r\n\r\nbody\r\n"
    reply = await handler.handle_DATA(None, None, env)  # type: ignore[arg-type]
    assert reply == "250 2.0.0 Ok: queued as fresh"
    assert (maildir / "new" / "taken").read_bytes() == b"from before a restart"
    assert b"body" in (maildir / "new" / "fresh").read_bytes()


async def test_a_restarted_sink_keeps_every_message(tmp: Path) -> None:
    maildir = tmp / "sink"
    for round_ in range(2):
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "smtpguard", "sink", "--listen", f"127.0.0.1:{port}",
            "--maildir", str(maildir), stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            assert b"listening" in await asyncio.wait_for(proc.stdout.readline(), 15)
            for i in range(3):
                reply = await send(port, message(f"r{round_}-{i}"), user="")
                assert reply.code == 250
        finally:
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
    keys = sorted(
        line.split(b":", 1)[1].strip().decode()
        for f in (maildir / "new").iterdir()
        for line in f.read_bytes().splitlines()
        if line.startswith(b"X-Event-Key:")
    )
    assert keys == [f"r{r}-{i}" for r in range(2) for i in range(3)]


async def test_double_dash_ends_the_options_for_keys_and_addresses_starting_with_a_dash(
    tmp: Path, upstream: Upstream, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = base_config(tmp, upstream.port)
    path = str(write_config(tmp / "smtpguard.yaml", cfg))
    async with running_guard(cfg) as guard:
        for key in ("--json", "-k1"):
            assert (await send(guard.ports[0], message(key))).code == 250
    for argv, key in (
        (["history", "-c", path, "--", "acme", "--json"], "--json"),
        (["history", "-c", path, "acme", "--", "--json"], "--json"),
        (["history", "--json", "-c", path, "--", "acme", "-k1"], "-k1"),
    ):
        code, out, err = await asyncio.to_thread(run, capsys, *argv)
        assert code == 0, (argv, err)
        if argv[1] == "--json":
            assert document(out)["key"] == key
        else:
            assert key in out and not out.lstrip().startswith("{"), out
    code, _, err = await asyncio.to_thread(
        run, capsys, "suppress", "add", "-c", path, "--reason", "test", "--", "acme", "-x@example.com"
    )
    assert code == 0, err
    code, out, err = await asyncio.to_thread(run, capsys, "suppress", "list", "acme", "--json", "-c", path)
    assert code == 0, err
    assert "-x@example.com" in out


# The tables of an earlier version's store (commit 08b576c): no probes, provider_events,
# zone_audit or nonces, and none of the later indexes on events.
_OLD_SCHEMA = """
CREATE TABLE events (
    zone TEXT NOT NULL, key TEXT NOT NULL, version INTEGER NOT NULL, state TEXT NOT NULL,
    updated_at REAL NOT NULL, data TEXT NOT NULL, PRIMARY KEY (zone, key)) WITHOUT ROWID;
CREATE INDEX events_updated ON events (updated_at);
CREATE TABLE sends (
    zone TEXT NOT NULL, token TEXT NOT NULL, at REAL NOT NULL, month TEXT NOT NULL,
    PRIMARY KEY (zone, token)) WITHOUT ROWID;
CREATE INDEX sends_zone_at ON sends (zone, at);
CREATE TABLE send_counts (zone TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE monthly (
    zone TEXT NOT NULL, month TEXT NOT NULL, used INTEGER NOT NULL,
    PRIMARY KEY (zone, month)) WITHOUT ROWID;
CREATE TABLE paused (zone TEXT PRIMARY KEY);
CREATE TABLE suppression (
    zone TEXT NOT NULL, address TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (zone, address)) WITHOUT ROWID;
CREATE TABLE supp_versions (zone TEXT PRIMARY KEY, v INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE auth_failures (ip TEXT NOT NULL, at REAL NOT NULL);
CREATE INDEX auth_failures_ip_at ON auth_failures (ip, at);
CREATE TABLE queue (
    zone TEXT NOT NULL, key TEXT NOT NULL, lane TEXT NOT NULL, priority INTEGER NOT NULL,
    due_at REAL NOT NULL, claimed_until REAL, enqueued_at REAL NOT NULL, sender TEXT NOT NULL,
    recipients TEXT NOT NULL, content BLOB NOT NULL, smtputf8 INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (zone, key)) WITHOUT ROWID;
CREATE INDEX queue_lane_due ON queue (lane, due_at);
CREATE TABLE circuits (
    instance TEXT NOT NULL, provider TEXT NOT NULL, circuit TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (instance, provider)) WITHOUT ROWID;
CREATE TABLE counters (
    zone TEXT NOT NULL, name TEXT NOT NULL, value INTEGER NOT NULL,
    PRIMARY KEY (zone, name)) WITHOUT ROWID;
"""


async def test_a_store_of_an_older_version_reads_as_empty_where_its_tables_are_missing(
    tmp: Path, upstream: Upstream, capsys: pytest.CaptureFixture[str]
) -> None:
    import sqlite3

    await filled_store(tmp, upstream)
    current = tmp / "state.db"
    cfg = base_config(tmp, upstream.port)
    assert cfg["store"]["url"].endswith(str(current))
    # The same rows in a file with the earlier version's tables only.
    old = tmp / "old.db"
    with contextlib.closing(sqlite3.connect(old)) as conn:
        conn.executescript(_OLD_SCHEMA)
        conn.execute("ATTACH DATABASE ? AS cur", (str(current),))
        for table in ("events", "sends", "send_counts", "monthly", "counters"):
            conn.execute(f"INSERT INTO {table} SELECT * FROM cur.{table}")
        conn.commit()
    cfg["store"] = {"url": f"sqlite:///{old}"}
    path = write_config(tmp / "old.yaml", cfg)
    before = {r for (r,) in sqlite3.connect(old).execute("SELECT name FROM sqlite_master")}
    for argv in (
        ["stats", "--json"],
        ["history", "acme", "k1", "--json"],
        ["list", "acme", "--json"],
        ["list", "acme", "--state", "delivered", "--json"],
        ["suppress", "list", "acme", "--json"],
        ["queue", "list", "--json"],
    ):
        code, out, err = await asyncio.to_thread(run, capsys, *argv, "-c", str(path))
        assert code == 0, (argv, err)
        doc = document(out)
        if argv[0] == "history":
            assert doc["state"] == "delivered" and doc["audit"] == []
        if argv[0] == "list":
            assert "k1" in out
    # Read-only: the file is not upgraded behind serve's back.
    assert {r for (r,) in sqlite3.connect(old).execute("SELECT name FROM sqlite_master")} == before


async def test_export_into_a_closed_pipe_exits_quietly(
    tmp: Path, upstream: Upstream, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess

    path = str(await filled_store(tmp, upstream))
    csv_file = tmp / "many.csv"
    csv_file.write_text("".join(f"user{i}@example.com,bounced\n" for i in range(5000)))
    code, _, err = await asyncio.to_thread(
        run, capsys, "suppress", "import", "acme", str(csv_file), "-c", path
    )
    assert code == 0, err
    # `smtpguard suppress export acme | head -1`: the reader goes away after one line.
    export = ["suppress", "export", "acme", "-c", path]
    done = await asyncio.to_thread(
        subprocess.run,
        ["bash", "-c", 'set -o pipefail; "$@" | head -1', "-", sys.executable, "-m", "smtpguard", *export],
        capture_output=True,
        timeout=60,
    )
    assert done.stdout == b"address,reason,at\n"
    assert (done.returncode, done.stderr) == (0, b"")


def test_sink_without_hard_links_writes_new_directly_and_still_never_overwrites(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tmp/ on another filesystem than new/: a hard link between them fails (EXDEV), as it
    # does on a filesystem without hard links. Where /dev/shm is not another filesystem,
    # that fault cannot be caused here, and os.link is made to fail the same way.
    import errno
    import shutil
    import tempfile

    maildir = tmp / "sink"
    prepare(maildir)
    shm = Path("/dev/shm")
    elsewhere: Path | None = None
    if shm.is_dir() and shm.stat().st_dev != tmp.stat().st_dev:
        elsewhere = Path(tempfile.mkdtemp(dir=shm))
        (maildir / "tmp").rmdir()
        (maildir / "tmp").symlink_to(elsewhere)
    else:

        def no_links(src: object, dst: object) -> None:
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "link", no_links)
    try:
        assert deliver(maildir, "one", b"first")
        assert not deliver(maildir, "one", b"second")
        assert (maildir / "new" / "one").read_bytes() == b"first"
        assert list((elsewhere or maildir / "tmp").iterdir()) == []
    finally:
        if elsewhere is not None:
            shutil.rmtree(elsewhere)


def test_doctor_help_gives_the_exit_codes_doctor_uses(tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    text = commands.choices["doctor"].format_help()  # type: ignore[index]
    assert "2  bad config, unknown zone or bad usage" in text
    assert "1  at least one check is an error" in text
    assert EXIT_CODES[1] not in text
    # And doctor does what it says: a bad config is 2.
    bad = tmp / "bad.yaml"
    bad.write_text("zones: [\n")
    code, _, err = run(capsys, "doctor", "-c", str(bad), "--no-probe")
    assert code == 2 and "invalid YAML" in err
