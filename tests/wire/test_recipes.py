"""The client recipes of docs/recipes.md, run for real.

Each test points a real client library or program at an in-process smtpguard (SQLite store,
recording upstream) and submits the same business event twice, as an application does when
it retries: the upstream must receive the event once, and the client must see success both
times. Where the client exposes the final reply, the second one must say "duplicate".

The guard runs in the test's event loop, so every client runs off it: in a thread
(smtplib) or as a child process awaited with asyncio (Django, node, msmtp, swaks).
Missing tools fail the test: scripts/test installs msmtp and swaks, and node is on the machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import smtplib
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from email import policy
from email.message import EmailMessage
from pathlib import Path

import pytest
import yaml

from tests.support import PASSWORD, Upstream, base_config, free_port, password_hash, running_guard, send
from tests.support import message as support_message

USER = "acme-app"
SENDER = "billing@acme.example"
CUSTOMER = "customer@example.com"
NODEMAILER = "nodemailer@10"


def need(tool: str, how: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: {how}", pytrace=False)
    return path


async def run(
    argv: list[str], *, stdin: bytes = b"", env: dict[str, str] | None = None, timeout: float = 60
) -> tuple[int, str, str]:
    """A child process awaited on the event loop, so the in-process guard keeps serving."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def delivered_once(upstream: Upstream, key: str) -> None:
    keys = upstream.event_keys()
    assert keys.count(key) == 1, f"upstream received {keys.count(key)} copies of {key}: {keys}"
    assert len(upstream.received) == 1


# --- Python smtplib --------------------------------------------------------------------------
def invoice_message(invoice_id: int) -> EmailMessage:
    msg = EmailMessage()
    msg["From"] = SENDER
    msg["To"] = CUSTOMER
    msg["Subject"] = f"Invoice {invoice_id}"
    # The business event, not the attempt: every retry of this invoice carries the same key.
    msg["X-Event-Key"] = f"invoice:acme:{invoice_id}"
    msg.set_content(f"Your invoice {invoice_id} is attached.\n")
    msg.add_attachment(b"%PDF-1.4 fake", maintype="application", subtype="pdf", filename="invoice.pdf")
    return msg


def smtplib_send(port: int, invoice_id: int) -> dict[str, tuple[int, bytes]]:
    """docs/recipes.md, Python smtplib (STARTTLS left out: the test listener is loopback)."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as smtp:
        smtp.login(USER, PASSWORD)
        return smtp.send_message(invoice_message(invoice_id))


def smtplib_send_with_reply(port: int, invoice_id: int) -> tuple[int, str]:
    """docs/recipes.md, reading smtpguard's final reply (it carries the [sg:ID])."""
    msg = invoice_message(invoice_id)
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as smtp:
        smtp.login(USER, PASSWORD)
        smtp.mail(SENDER)
        smtp.rcpt(CUSTOMER)
        # smtplib sends bytes as they are: they must already end lines in CRLF, or smtpguard
        # refuses them as bare LF (550 5.5.2). policy.SMTP does that; send_message() too.
        code, text = smtp.data(msg.as_bytes(policy=policy.SMTP))
        return code, text.decode()


async def test_python_smtplib(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        port = guard.ports[0]
        first = await asyncio.to_thread(smtplib_send, port, 1044)
        second = await asyncio.to_thread(smtplib_send, port, 1044)
        code, text = await asyncio.to_thread(smtplib_send_with_reply, port, 1044)
    # send_message returns the refused recipients: none, both times.
    assert first == {} and second == {}
    assert code == 250 and "duplicate" in text and "invoice:acme:1044" in text, text
    delivered_once(upstream, "invoice:acme:1044")
    # Each attempt drew its own MIME boundary; the fingerprint ignores it, so the retry was
    # recognised as the same message rather than refused as a reused key.
    content_type = upstream.received[0].header("Content-Type")
    assert content_type is not None and content_type.startswith("multipart/mixed")


def smtplib_send_lf_bytes(port: int, invoice_id: int) -> tuple[int, str]:
    """The pitfall docs/recipes.md warns about: bytes with bare LF line ends."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as smtp:
        smtp.login(USER, PASSWORD)
        smtp.mail(SENDER)
        smtp.rcpt(CUSTOMER)
        code, text = smtp.data(invoice_message(invoice_id).as_bytes())
        return code, text.decode()


async def test_python_smtplib_bytes_need_crlf(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        code, text = await asyncio.to_thread(smtplib_send_lf_bytes, guard.ports[0], 1045)
    assert code == 550 and text.startswith("5.5.2"), text
    assert upstream.received == []


# --- Django ----------------------------------------------------------------------------------
DJANGO_SCRIPT = textwrap.dedent(
    """
    import os, sys

    import django
    from django.conf import settings

    settings.configure(
        EMAIL_BACKEND="django.core.mail.backends.smtp.EmailBackend",
        EMAIL_HOST="127.0.0.1",
        EMAIL_PORT=int(sys.argv[1]),
        EMAIL_HOST_USER="acme-app",
        EMAIL_HOST_PASSWORD=os.environ["SMTPGUARD_PASSWORD"],
        EMAIL_USE_TLS=False,  # production: True (STARTTLS on 587)
        EMAIL_TIMEOUT=30,
        DEFAULT_FROM_EMAIL="billing@acme.example",
    )
    django.setup()

    from django.core.mail import EmailMessage

    order_id = sys.argv[2]
    message = EmailMessage(
        subject=f"Order {order_id} shipped",
        body=f"Your order {order_id} is on its way.",
        to=["customer@example.com"],
        headers={"X-Event-Key": f"order-shipped:{order_id}"},
    )
    print(message.send())  # fail_silently=False: a 4xx/5xx raises
    """
)


async def test_django_smtp_backend(tmp: Path, upstream: Upstream) -> None:
    script = tmp / "django_send.py"
    script.write_text(DJANGO_SCRIPT)
    env = {"SMTPGUARD_PASSWORD": PASSWORD}
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        argv = [sys.executable, str(script), str(guard.ports[0]), "77"]
        first = await run(argv, env=env)
        second = await run(argv, env=env)
    # Django returns how many messages the backend handed over; it does not expose the reply.
    assert first[0] == 0 and first[1].strip() == "1", first
    assert second[0] == 0 and second[1].strip() == "1", second
    delivered_once(upstream, "order-shipped:77")


# --- Node.js nodemailer ----------------------------------------------------------------------
NODEMAILER_SCRIPT = textwrap.dedent(
    """
    const nodemailer = require("nodemailer");

    const [port, resetId] = process.argv.slice(2);
    const transporter = nodemailer.createTransport({
      host: "127.0.0.1",
      port: Number(port),
      secure: false,       // production: false + requireTLS: true (STARTTLS on 587)
      ignoreTLS: true,     // the test listener is loopback without TLS
      auth: { user: "acme-app", pass: process.env.SMTPGUARD_PASSWORD },
    });

    transporter
      .sendMail({
        from: "billing@acme.example",
        to: "customer@example.com",
        subject: "Reset your password",
        text: "Follow the link to reset your password.",
        html: "<p>Follow the link to reset your password.</p>",
        headers: { "X-Event-Key": `password-reset:${resetId}`, "X-Message-Class": "otp" },
      })
      .then((info) => console.log(JSON.stringify({ response: info.response, accepted: info.accepted })))
      .catch((err) => {
        console.error(err.response || err.message);
        process.exit(1);
      });
    """
)


@pytest.fixture(scope="session")
def nodemailer_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """nodemailer installed once per session into a private prefix."""
    need("node", "Node.js 20+ is needed for the nodemailer recipe")
    npm = need("npm", "npm is needed to install nodemailer for the nodemailer recipe")
    prefix = tmp_path_factory.mktemp("node")
    proc = subprocess.run(
        [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error", NODEMAILER],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(f"npm install {NODEMAILER} failed:\n{proc.stderr[-3000:]}", pytrace=False)
    (prefix / "send.js").write_text(NODEMAILER_SCRIPT)
    yield prefix


async def test_nodemailer(tmp: Path, upstream: Upstream, nodemailer_dir: Path) -> None:
    node = need("node", "Node.js 20+ is needed for the nodemailer recipe")
    argv = [node, str(nodemailer_dir / "send.js")]
    env = {"SMTPGUARD_PASSWORD": PASSWORD}
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        first = await run([*argv, str(guard.ports[0]), "r-9f2c"], env=env)
        second = await run([*argv, str(guard.ports[0]), "r-9f2c"], env=env)
    assert first[0] == 0 and second[0] == 0, (first, second)
    one, two = json.loads(first[1]), json.loads(second[1])
    assert one["response"].startswith("250 ") and "duplicate" not in one["response"]
    assert two["response"].startswith("250 ") and "duplicate" in two["response"]
    assert one["accepted"] == two["accepted"] == [CUSTOMER]
    # text + html is multipart/alternative with a fresh boundary per attempt: still one event.
    delivered_once(upstream, "password-reset:r-9f2c")


# --- msmtp (cron scripts, PHP's sendmail_path) -----------------------------------------------
MSMTPRC = """\
defaults
logfile {logfile}

account smtpguard
host 127.0.0.1
port {port}
auth plain
user acme-app
password {password}
tls off

account default : smtpguard
"""

CRON_SCRIPT = """\
set -eu
day=2031-05-04   # in the real script: day=$(date -u +%F)
msmtp -C "$MSMTPRC" -a smtpguard --read-envelope-from -t <<EOF
From: Nightly reports <reports@notify.acme.example>
To: ops@acme.example
Subject: Nightly usage report for $day
X-Event-Key: report:nightly-usage:$day

Yesterday's usage is attached to the dashboard.
EOF
"""


async def test_msmtp_cron_heredoc(tmp: Path, upstream: Upstream) -> None:
    need("msmtp", "apt-get install msmtp (scripts/test installs it)")
    sh = need("sh", "a POSIX shell is needed")
    logfile = tmp / "msmtp.log"
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        rc = tmp / "msmtprc"
        rc.write_text(MSMTPRC.format(logfile=logfile, port=guard.ports[0], password=PASSWORD))
        rc.chmod(0o600)  # msmtp refuses a config holding a password that others can read
        env = {"MSMTPRC": str(rc)}
        first = await run([sh, "-c", CRON_SCRIPT], env=env)
        second = await run([sh, "-c", CRON_SCRIPT], env=env)
    assert first[0] == 0 and second[0] == 0, (first, second)
    log = logfile.read_text().splitlines()
    assert len(log) == 2 and all("smtpstatus=250" in line for line in log), log
    assert "duplicate" not in log[0] and "duplicate" in log[1]
    delivered_once(upstream, "report:nightly-usage:2031-05-04")
    got = upstream.received[0]
    assert got.mail_from == "reports@notify.acme.example" and got.rcpt_tos == ["ops@acme.example"]


# --- swaks (checking a deployment by hand, runbook) ------------------------------------------
async def test_swaks_smoke_test(tmp: Path, upstream: Upstream) -> None:
    swaks = need("swaks", "apt-get install swaks (scripts/test installs it)")
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        argv = [
            swaks,
            "--server",
            f"127.0.0.1:{guard.ports[0]}",
            "--auth",
            "PLAIN",
            "--auth-user",
            USER,
            "--auth-password",
            PASSWORD,
            "--from",
            SENDER,
            "--to",
            CUSTOMER,
            # swaks' default Subject holds the time: a retry would then be a different message.
            "--header",
            "Subject: smtpguard smoke test",
            "--header",
            "X-Event-Key: smoke:deploy-42",
            "--body",
            "smoke test",
        ]
        first = await run(argv)
        second = await run(argv)
    assert first[0] == 0 and second[0] == 0, (first, second)
    assert "duplicate" not in first[1]
    assert any(line.startswith("<-  250 ") and "duplicate" in line for line in second[1].splitlines())
    delivered_once(upstream, "smoke:deploy-42")


# --- staging: smtpguard sink as the only provider ---------------------------------------------
def staging_config(tmp: Path, sink_port: int) -> dict[str, object]:
    """The staging.yaml of docs/recipes.md, as written, with this test's ports and paths."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text()
    section = text.split("## A staging zone that never reaches a provider", 1)[1]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    cfg = yaml.safe_load(block)
    cfg["listen"][0]["address"] = "127.0.0.1:0"
    cfg["store"]["url"] = f"sqlite:///{tmp / 'staging.db'}"
    assert cfg["providers"][0]["port"] == 2525
    cfg["providers"][0]["port"] = sink_port
    cfg["zones"]["staging"]["users"][0]["password_hash"] = password_hash(PASSWORD)
    return cfg


async def test_staging_zone_with_a_sink(tmp: Path) -> None:
    sink_port = free_port()
    maildir = tmp / "sink"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "smtpguard", "sink", "--listen", f"127.0.0.1:{sink_port}",
        "--maildir", str(maildir), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert b"listening" in await asyncio.wait_for(proc.stdout.readline(), 15)
        async with running_guard(staging_config(tmp, sink_port)) as guard:
            msg = support_message("staging:signup:1", sender="hello@acme.example")
            first = await send(guard.ports[0], msg, user="staging-app", sender="hello@acme.example")
            second = await send(guard.ports[0], msg, user="staging-app", sender="hello@acme.example")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    assert first.code == 250 and "duplicate" not in first.text
    assert second.code == 250 and "duplicate" in second.text
    (only,) = list((maildir / "new").iterdir())
    # event_key.strip is on by default: the sink gets the message without the key header.
    content = only.read_bytes()
    assert b"Subject: Invoice 1" in content and b"X-Event-Key" not in content.split(b"\r\n\r\n", 1)[0]
