"""Bad input to the events listener gets the §13 status and changes nothing (DESIGN.md §13):
per provider the good signature, a tampered body, a wrong key and a stale timestamp; then
malformed JSON, an unknown source, a body over max_body, another SNS topic, and a store
that is down (503, so the provider retries — and the retry is applied)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from smtpguard.cli import main
from smtpguard.config import ConfigError, loads
from smtpguard.events import signatures
from smtpguard.server import Server
from tests.events.test_events import BOUNCE_STATUS, RCPT, events_port, sent, suppressed
from tests.support import RedisServer, Upstream, base_config, running_guard, write_config
from tests.support import events as ev
from tests.support.eventually import eventually

STALE = 400.0
"""Seconds off: beyond the default 5 m tolerance."""


def config(tmp: Path, upstream: Upstream, keys: ev.Keys, **events: Any) -> dict[str, Any]:
    return base_config(
        tmp, upstream.port, events={"address": "127.0.0.1:0", "sources": keys.sources(), **events}
    )


@pytest.fixture
async def guard(tmp: Path, upstream: Upstream, keys: ev.Keys) -> AsyncIterator[Server]:
    async with running_guard(config(tmp, upstream, keys)) as server:
        yield server


def tamper(signed: ev.Signed) -> ev.Signed:
    """The same headers over a body changed after signing (another recipient)."""
    return ev.Signed(signed.body.replace(RCPT.encode(), b"victim@example.org"), signed.headers)


Make = Callable[..., ev.Signed]


def good(kind: str, keys: ev.Keys, mid: str, q: str, **kw: Any) -> ev.Signed:
    if kind == "mailgun":
        return ev.mailgun(keys, ev.mailgun_event("failed", RCPT, mid, severity="permanent"), **kw)
    if kind == "sendgrid":
        return ev.sendgrid(keys, [ev.sendgrid_event("bounce", RCPT, mid)], **kw)
    if kind == "resend":
        return ev.svix(keys, ev.resend_event("email.bounced", RCPT, q), **kw)
    if kind == "postmark":
        return ev.postmark(keys, ev.postmark_bounce(RCPT, q), **kw)
    return ev.ses(keys, ev.ses_message("Bounce", RCPT, mid, q), **kw)


WRONG_KEY: dict[str, Callable[[], dict[str, Any]]] = {
    "mailgun": lambda: {"key": "key-not-the-one"},
    "sendgrid": lambda: {"private": ec.generate_private_key(ec.SECP256R1())},
    "resend": lambda: {"secret": "whsec_" + base64.b64encode(b"another secret, 24 bytes").decode()},
    "postmark": lambda: {"password": "not-the-password"},
    "ses": lambda: {"private": rsa.generate_private_key(public_exponent=65537, key_size=2048)},
}
KINDS = list(WRONG_KEY)


async def assert_nothing_changed(guard: Server) -> None:
    assert await suppressed(guard, "acme") == {}
    assert guard.store is not None
    assert await guard.store.provider_events("acme", "invoice:1") == []


@pytest.mark.parametrize("kind", KINDS)
async def test_good_tampered_wrong_key_and_stale(
    kind: str, guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    mid, q = await sent(guard, upstream, "invoice:1")
    port = events_port(guard)
    assert (await ev.post(port, kind, good(kind, keys, mid, q, **WRONG_KEY[kind]())))[0] == 401
    if kind != "postmark":  # Basic auth: Postmark signs no timestamp
        for off in (-STALE, STALE):
            status, doc = await ev.post(port, kind, good(kind, keys, mid, q, at=time.time() + off))
            assert status == 401 and "tolerance" in doc["error"], doc
    await assert_nothing_changed(guard)
    signed = good(kind, keys, mid, q)
    status, doc = await ev.post(port, kind, signed)
    assert (status, doc["applied"]) == (200, 1)
    if kind != "postmark":
        # Signed over the body (Mailgun: over a token that this body was the first to use).
        status, doc = await ev.post(port, kind, tamper(signed))
        assert status == 401, doc
    assert await suppressed(guard, "acme") == {RCPT: f"bounce {BOUNCE_STATUS[kind]} via {kind}"}


@pytest.mark.parametrize(
    ("kind", "drop"),
    [
        ("sendgrid", "X-Twilio-Email-Event-Webhook-Signature"),
        ("sendgrid", "X-Twilio-Email-Event-Webhook-Timestamp"),
        ("resend", "svix-signature"),
        ("resend", "svix-id"),
        ("postmark", "Authorization"),
    ],
)
async def test_a_missing_signature_header_is_401(
    kind: str, drop: str, guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    mid, q = await sent(guard, upstream, "invoice:1")
    signed = good(kind, keys, mid, q)
    headers = {k: v for k, v in signed.headers.items() if k != drop}
    status, doc = await ev.post(events_port(guard), kind, ev.Signed(signed.body, headers))
    assert status == 401 and drop in doc["error"]
    await assert_nothing_changed(guard)


@pytest.mark.parametrize("kind", ["mailgun", "ses"])
async def test_missing_signature_fields_in_the_body_are_401(
    kind: str, guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    mid, q = await sent(guard, upstream, "invoice:1")
    doc = json.loads(good(kind, keys, mid, q).body)
    doc.pop("signature" if kind == "mailgun" else "Signature")
    status, _ = await ev.post(events_port(guard), kind, ev.Signed(json.dumps(doc).encode(), {}))
    assert status == 401
    await assert_nothing_changed(guard)


async def test_sns_signature_version_2_verifies(guard: Server, upstream: Upstream, keys: ev.Keys) -> None:
    mid, q = await sent(guard, upstream, "invoice:1")
    signed = ev.ses(keys, ev.ses_message("Bounce", RCPT, mid, q), version="2")
    assert (await ev.post(events_port(guard), "ses", signed))[1]["applied"] == 1
    unknown = ev.ses(keys, ev.ses_message("Bounce", RCPT, mid, q), version="2")
    doc = json.loads(unknown.body)
    doc["SignatureVersion"] = "3"
    assert (await ev.post(events_port(guard), "ses", ev.Signed(json.dumps(doc).encode(), {})))[0] == 401


async def test_another_sns_topic_is_403(guard: Server, upstream: Upstream, keys: ev.Keys) -> None:
    mid, q = await sent(guard, upstream, "invoice:1")
    signed = ev.ses(
        keys, ev.ses_message("Bounce", RCPT, mid, q), topic="arn:aws:sns:us-east-1:999999999999:other"
    )
    status, doc = await ev.post(events_port(guard), "ses", signed)
    assert status == 403 and "TopicArn" in doc["error"]
    await assert_nothing_changed(guard)


async def test_a_subscription_confirmation_is_logged_with_its_url_and_never_fetched(
    guard: Server, keys: ev.Keys, caplog: pytest.LogCaptureFixture
) -> None:
    # The SubscribeURL points at a listener of the test's: a fetch would reach it.
    reached: list[int] = []
    """The client port of each connection, in the order the listener accepted them."""

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reached.append(writer.get_extra_info("peername")[1])
        writer.close()

    trap = await asyncio.start_server(record, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{trap.sockets[0].getsockname()[1]}/confirm?Token=abc"
    caplog.set_level(logging.WARNING, logger="smtpguard.events")
    signed = ev.ses(keys, None, kind="SubscriptionConfirmation", subscribe_url=url)
    status, body = await ev.post(events_port(guard), "ses", signed)
    assert status == 200 and body["applied"] == 0
    assert any(url in r.getMessage() for r in caplog.records)
    # A connection of the test's own, made after the reply, accepted: a fetch begun while
    # the confirmation was handled would have been accepted before it.
    _, probe = await asyncio.open_connection("127.0.0.1", trap.sockets[0].getsockname()[1])
    mine = probe.get_extra_info("sockname")[1]
    order = await eventually(lambda: list(reached), lambda r: mine in r, timeout=5, interval=0.02)
    probe.close()
    await probe.wait_closed()
    trap.close()
    assert order == [mine]


# --- malformed, unknown, too large ------------------------------------------------------------
async def test_malformed_json_is_400_and_changes_nothing(
    guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    await sent(guard, upstream, "invoice:1")
    port = events_port(guard)
    assert (await ev.post(port, "mailgun", ev.Signed(b"{not json", {})))[0] == 400
    # Signed correctly, but not what SendGrid sends: a JSON object instead of an array…
    assert (await ev.post(port, "sendgrid", ev.sendgrid(keys, {"event": "bounce"})))[0] == 400  # type: ignore[arg-type]
    # …or not JSON at all under a valid signature.
    signed = ev.svix(keys, {})
    bad = ev.svix(keys, {})
    bad_body = b"\xff\xfe not json"
    assert (await ev.post(port, "resend", ev.Signed(bad_body, signed.headers)))[
        0
    ] == 401  # signature covers the body
    assert (await ev.post(port, "postmark", ev.postmark(keys, {}), raw=b"[1, 2"))[0] == 400
    assert (await ev.post(port, "postmark", ev.postmark(keys, {"Email": RCPT})))[0] == 400  # no RecordType
    assert (await ev.post(port, "resend", bad))[0] == 400  # no type
    await assert_nothing_changed(guard)


async def test_an_unknown_source_is_404(guard: Server) -> None:
    status, doc = await ev.post(events_port(guard), "nosuch", ev.Signed(b"{}", {}))
    assert status == 404 and "nosuch" in doc["error"]


async def test_a_body_over_max_body_is_413(tmp: Path, upstream: Upstream, keys: ev.Keys) -> None:
    async with running_guard(config(tmp, upstream, keys, max_body="2KB")) as guard:
        mid, _ = await sent(guard, upstream, "invoice:1")
        events = [ev.sendgrid_event("bounce", RCPT, mid) for _ in range(20)]
        status, _ = await ev.post(events_port(guard), "sendgrid", ev.sendgrid(keys, events))
        assert status == 413
        await assert_nothing_changed(guard)
        assert (await ev.post(events_port(guard), "sendgrid", ev.sendgrid(keys, events[:1])))[0] == 200


async def test_only_post_is_served(guard: Server) -> None:
    import aiohttp

    url = f"http://127.0.0.1:{events_port(guard)}/events/mailgun"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        assert resp.status == 405


# --- the store down: 503, and the provider's retry applies it --------------------------------
async def test_store_down_is_503_and_the_retry_is_applied(
    tmp: Path, upstream: Upstream, keys: ev.Keys
) -> None:
    redis = RedisServer(tmp, durable=True)
    redis.start()
    try:
        cfg = base_config(
            tmp,
            upstream.port,
            store__url=redis.url,
            events={"address": "127.0.0.1:0", "sources": keys.sources()},
        )
        async with running_guard(cfg) as guard:
            mid, q = await sent(guard, upstream, "invoice:1")
            signed = good("sendgrid", keys, mid, q)
            redis.stop()
            status, doc = await ev.post(events_port(guard), "sendgrid", signed)
            assert status == 503 and "store" in doc["error"]
            redis.start()
            await eventually(  # the provider's retries
                lambda: ev.post(events_port(guard), "sendgrid", signed),
                lambda r: r[0] == 200,
                timeout=10,
                interval=0.2,
            )
            assert await suppressed(guard, "acme") == {RCPT: "bounce 5.0.0 via sendgrid"}
    finally:
        redis.stop()


# --- config -----------------------------------------------------------------------------------
def test_a_source_naming_an_unknown_provider_is_a_config_error(tmp: Path, keys: ev.Keys) -> None:
    cfg = base_config(
        tmp, 2525, events={"sources": {"mg": {**keys.sources()["mailgun"], "provider": "nope"}}}
    )
    with pytest.raises(ConfigError) as e:
        loads(json.dumps(cfg))
    assert "events.sources.mg.provider" in str(e.value)
    assert "provider 'nope' is not one of providers: primary" in str(e.value)


@pytest.mark.parametrize(
    ("source", "expect"),
    [
        (
            {"kind": "mailgun", "provider": "primary"},
            "give exactly one of signing_key_env or signing_key_file",
        ),
        (
            {"kind": "svix", "provider": "primary", "secret_env": "A", "secret_file": "/x"},
            "give exactly one of secret_env or secret_file",
        ),
        ({"kind": "ses", "provider": "primary", "certificate_file": "/x"}, "topic_arn"),
        ({"kind": "sparkpost", "provider": "primary"}, "mailgun"),
    ],
)
def test_source_config_errors_name_the_field_and_line(
    tmp: Path, capsys: pytest.CaptureFixture[str], source: dict[str, Any], expect: str
) -> None:
    path = write_config(tmp / "c.yaml", base_config(tmp, 2525, events={"sources": {"mg": source}}))
    assert main(["check-config", "-c", str(path)]) == 1
    err = capsys.readouterr().err
    assert "events.sources.mg" in err and expect in err and "(line " in err, err


async def test_a_missing_secret_or_a_bad_key_stops_the_start(
    tmp: Path, upstream: Upstream, keys: ev.Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("T_MAILGUN_KEY")
    with pytest.raises(
        ConfigError, match=r"events\.sources\.mailgun: environment variable T_MAILGUN_KEY is not set"
    ):
        async with running_guard(config(tmp, upstream, keys)):
            pass
    monkeypatch.setenv("T_MAILGUN_KEY", keys.mailgun)
    monkeypatch.setenv("T_SENDGRID_KEY", "bm90IGEga2V5")
    with pytest.raises(ConfigError, match=r"events\.sources\.sendgrid: not a base64 DER public key"):
        async with running_guard(config(tmp, upstream, keys)):
            pass


async def test_a_rotated_signing_key_applies_after_sighup(
    tmp: Path, upstream: Upstream, keys: ev.Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp / "smtpguard.yaml"
    cfg = config(tmp, upstream, keys)
    key_file = tmp / "mailgun.key"
    key_file.write_text(keys.mailgun + "\n")
    cfg["events"]["sources"]["mailgun"] = {
        "kind": "mailgun",
        "provider": "primary",
        "signing_key_file": str(key_file),
    }
    async with running_guard(cfg, config_path=path) as guard:
        mid, _ = await sent(guard, upstream, "invoice:1")
        old = keys.mailgun
        new = "key-rotated-" + "0" * 20
        key_file.write_text(new + "\n")
        await guard.reload()  # the same config: the key file rewritten in place is re-read
        event = ev.mailgun_event("failed", RCPT, mid, severity="permanent")
        assert (await ev.post(events_port(guard), "mailgun", ev.mailgun(keys, event, key=old)))[0] == 401
        assert (await ev.post(events_port(guard), "mailgun", ev.mailgun(keys, event, key=new)))[0] == 200


# --- the signature algorithms against their documented examples ------------------------------
def test_svix_signature_matches_the_documented_example() -> None:
    # The example of Svix's "Verifying payloads manually" page.
    assert signatures.svix(
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "1614265330",
        b'{"test": 2432232314}',
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
    )


def test_a_secret_that_is_not_base64_never_verifies() -> None:
    assert not signatures.svix("whsec_***", "id", "1", b"{}", "v1,AAAA")
    assert not signatures.basic_auth("Basic !!!", "u", "p")
    assert not signatures.basic_auth("Bearer x", "u", "p")


async def test_a_certificate_file_with_the_next_sns_certificate_verifies_both(
    tmp: Path, upstream: Upstream, keys: ev.Keys
) -> None:
    (tmp / "next").mkdir()
    rotated = ev.Keys.make(tmp / "next")
    keys.ses_cert.write_bytes(keys.ses_cert.read_bytes() + rotated.ses_cert.read_bytes())
    async with running_guard(config(tmp, upstream, keys)) as guard:
        mid, q = await sent(guard, upstream, "invoice:1")
        by_old = ev.ses(keys, ev.ses_message("Delivery", RCPT, mid, q))
        by_next = ev.ses(keys, ev.ses_message("Bounce", RCPT, mid, q), private=rotated.ses_private)
        assert (await ev.post(events_port(guard), "ses", by_old))[1]["applied"] == 1
        assert (await ev.post(events_port(guard), "ses", by_next))[1]["applied"] == 1
        stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        by_stranger = ev.ses(keys, ev.ses_message("Bounce", RCPT, mid, q), private=stranger)
        assert (await ev.post(events_port(guard), "ses", by_stranger))[0] == 401


async def test_a_mailgun_token_replayed_to_another_instance_is_refused(
    tmp: Path, upstream: Upstream, keys: ev.Keys
) -> None:
    """Two instances on one store (and a reload between): the token is remembered by the
    store, not by the process that saw it first."""
    cfg = config(tmp, upstream, keys)
    async with running_guard(cfg) as first, running_guard(cfg) as second:
        mid, q = await sent(first, upstream, "invoice:1")
        signed = good("mailgun", keys, mid, q)
        assert (await ev.post(events_port(first), "mailgun", signed))[1]["applied"] == 1
        status, doc = await ev.post(events_port(second), "mailgun", tamper(signed))
        assert status == 401 and "replay" in doc["error"]
        # The provider's own retry (same body) is a duplicate, on either instance.
        assert (await ev.post(events_port(second), "mailgun", signed))[1]["duplicate"] == 1
    assert await suppressed_in(tmp) == {RCPT}


async def suppressed_in(tmp: Path) -> set[str]:
    from smtpguard.store.sqlite import SQLiteStore

    s = SQLiteStore(f"sqlite:///{tmp / 'state.db'}")
    await s.open()
    try:
        return {e.address for e in await s.suppress_list("acme")}
    finally:
        await s.close()


async def test_header_checks_come_before_the_body_is_read(
    tmp: Path, upstream: Upstream, keys: ev.Keys
) -> None:
    async with running_guard(config(tmp, upstream, keys, max_body="2KB")) as guard:
        big = b"x" * 100_000
        wrong = ev.postmark(keys, {}, password="not-it")
        assert (await ev.post(events_port(guard), "postmark", wrong, raw=big))[0] == 401
        unsigned = ev.Signed(big, {"Content-Type": "application/json"})
        assert (await ev.post(events_port(guard), "sendgrid", unsigned))[0] == 401
        assert (await ev.post(events_port(guard), "resend", unsigned))[0] == 401
        # Signed-looking headers get the body read, and its size refused.
        fake = ev.Signed(big, ev.sendgrid(keys, []).headers)
        assert (await ev.post(events_port(guard), "sendgrid", fake))[0] == 413


async def test_a_reload_that_removes_a_source_makes_it_404_and_warns_of_restart_settings(
    tmp: Path, upstream: Upstream, keys: ev.Keys, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp / "smtpguard.yaml"
    cfg = config(tmp, upstream, keys)
    async with running_guard(cfg, config_path=path) as guard:
        mid, q = await sent(guard, upstream, "invoice:1")
        del cfg["events"]["sources"]["sendgrid"]
        cfg["events"]["max_body"] = "2MB"
        write_config(path, cfg)
        caplog.set_level(logging.WARNING, logger="smtpguard.server")
        await guard.reload()
        assert (await ev.post(events_port(guard), "sendgrid", good("sendgrid", keys, mid, q)))[0] == 404
        assert (await ev.post(events_port(guard), "mailgun", good("mailgun", keys, mid, q)))[0] == 200
        assert any(
            "events.max_body changes take effect only after a restart" in r.getMessage()
            for r in caplog.records
        )


def test_a_source_may_not_be_called_mailbox(tmp: Path, keys: ev.Keys) -> None:
    cfg = base_config(tmp, 2525, events={"sources": {"mailbox": keys.sources()["mailgun"]}})
    with pytest.raises(ConfigError, match="the events mailbox's own"):
        loads(json.dumps(cfg))
