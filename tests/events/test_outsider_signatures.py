"""Signed webhooks forged the way an outsider holding one genuine request would try: its
signature kept, the signed fields re-split where the scheme concatenates them, the
signature itself re-encoded, another AWS customer's SNS notification. Each either fails to
verify or carries exactly the genuine events, which are applied once. Counted at the
upstream: the victim recipient's next message still goes out, and only the fresh 250s
arrived."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import io
import json
import secrets
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature

from smtpguard.cli import main
from smtpguard.events.sources.base import Rejected
from smtpguard.events.sources.mailgun import Mailgun
from smtpguard.events.sources.ses import sns_canonical
from smtpguard.server import Server
from tests.events.test_events import RCPT, events_config, events_port, sent
from tests.support import Upstream, message, running_guard, send, suppressions_refreshed
from tests.support import events as ev

_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


async def _history_events(tmp: Path, key: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = await asyncio.to_thread(
            main, ["history", "acme", key, "--json", "-c", str(tmp / "smtpguard.yaml")]
        )
    assert code == 0
    return [e["type"] for e in json.loads(out.getvalue())["events"]]


async def _still_sends(guard: Server, upstream: Upstream, key: str) -> None:
    suppressions_refreshed(guard)
    before = len(upstream.received)
    reply = await send(guard.ports[0], message(key, to=RCPT), recipients=[RCPT])
    assert reply.code == 250, reply
    assert len(upstream.received) == before + 1


async def test_a_svix_signature_resplit_between_id_timestamp_and_body_is_401(
    tmp: Path, upstream: Upstream, keys: ev.Keys
) -> None:
    """HMAC over `id.timestamp.body`: moving the timestamp into the id and the body's text up
    to its first dot into the timestamp keeps the signed bytes, but that timestamp is no
    number. A delivered event's signature cannot carry a bounce."""
    cfg = events_config(tmp, upstream, keys, {}, only="resend")
    async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as guard:
        _, queue_id = await sent(guard, upstream, "svix:1")
        genuine = ev.svix(keys, ev.resend_event("email.delivered", RCPT, queue_id))
        h = genuine.headers
        head, _, rest = genuine.body.partition(b".")
        forged = {
            **h,
            "svix-id": f"{h['svix-id']}.{h['svix-timestamp']}",
            "svix-timestamp": head.decode(),
        }
        status, doc = await ev.post(events_port(guard), "resend", ev.Signed(rest, forged))
        assert status == 401, doc
        # The timestamp alone moved into the id (or the id into the timestamp): no match.
        for bad_id, bad_ts in (
            (f"{h['svix-id']}.{h['svix-timestamp'][:4]}", h["svix-timestamp"][4:]),
            (h["svix-id"][:-2], h["svix-id"][-2:] + h["svix-timestamp"]),
        ):
            headers = {**h, "svix-id": bad_id, "svix-timestamp": bad_ts}
            status, _ = await ev.post(events_port(guard), "resend", ev.Signed(genuine.body, headers))
            assert status == 401
        status, doc = await ev.post(events_port(guard), "resend", genuine)
        assert status == 200 and doc["applied"] == 1, doc
        again, doc = await ev.post(events_port(guard), "resend", genuine)
        assert again == 200 and doc["applied"] == 0, doc
        await _still_sends(guard, upstream, "svix:2")
        assert await _history_events(tmp, "svix:1") == ["delivered"]
    assert upstream.event_keys() == ["svix:1", "svix:2"]


async def test_a_sendgrid_signature_resplit_or_malleated_carries_only_the_genuine_events(
    tmp: Path, upstream: Upstream, keys: ev.Keys
) -> None:
    """ECDSA over `timestamp + body`. A body's leading whitespace lent to the timestamp
    (float() would ignore it) never arrives as signed: HTTP trims a header value. (r, n - s)
    is a second valid signature of the same bytes: it carries the genuine events only,
    which their event id makes a duplicate. Anything else moved between timestamp and body
    does not verify."""
    cfg = events_config(tmp, upstream, keys, {}, only="sendgrid")
    async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as guard:
        message_id, _ = await sent(guard, upstream, "sg:1")
        genuine = ev.sendgrid(keys, [ev.sendgrid_event("delivered", RCPT, message_id)])
        ts = genuine.headers["X-Twilio-Email-Event-Webhook-Timestamp"]
        sig_header = "X-Twilio-Email-Event-Webhook-Signature"
        # A genuine body with leading whitespace, signed as SendGrid would sign it.
        spaced = ev.sendgrid(keys, [ev.sendgrid_event("delivered", RCPT, message_id)])
        private = keys.sendgrid_private
        body = b" " + spaced.body
        stamp = spaced.headers["X-Twilio-Email-Event-Webhook-Timestamp"]
        signature = private.sign(stamp.encode() + body, ec.ECDSA(hashes.SHA256()))
        spaced = ev.Signed(body, {**spaced.headers, sig_header: base64.b64encode(signature).decode()})
        status, doc = await ev.post(events_port(guard), "sendgrid", spaced)
        assert status == 200 and doc["applied"] == 1, doc
        lent = {**spaced.headers, "X-Twilio-Email-Event-Webhook-Timestamp": stamp + " "}
        status, doc = await ev.post(events_port(guard), "sendgrid", ev.Signed(body[1:], lent))
        # HTTP trims a header value's trailing whitespace, so what arrives no longer verifies.
        assert status == 401, doc
        # The signature's other valid form, over the genuine request.
        r, s = decode_dss_signature(base64.b64decode(genuine.headers[sig_header]))
        other = base64.b64encode(encode_dss_signature(r, _P256_ORDER - s)).decode()
        status, doc = await ev.post(events_port(guard), "sendgrid", genuine)
        assert status == 200 and doc["applied"] == 1, doc
        status, doc = await ev.post(
            events_port(guard), "sendgrid", ev.Signed(genuine.body, {**genuine.headers, sig_header: other})
        )
        assert status == 200 and doc["applied"] == 0, doc
        # The body's first byte lent to the timestamp, or a digit of the timestamp to the body.
        for bad_ts, bad_body in ((ts + "[", genuine.body[1:]), (ts[:-1], ts[-1:].encode() + genuine.body)):
            headers = {**genuine.headers, "X-Twilio-Email-Event-Webhook-Timestamp": bad_ts}
            status, _ = await ev.post(events_port(guard), "sendgrid", ev.Signed(bad_body, headers))
            assert status in (400, 401)
        await _still_sends(guard, upstream, "sg:2")
        assert await _history_events(tmp, "sg:1") == ["delivered", "delivered"]
    assert upstream.event_keys() == ["sg:1", "sg:2"]


async def test_another_topics_sns_notification_naming_the_victims_topic_is_refused(
    tmp: Path, upstream: Upstream, keys: ev.Keys
) -> None:
    """SNS signs every customer's notifications with the same certificate, so an attacker's
    own topic gets genuine signatures over a Message and Subject of their choosing. Their
    notification is 403 as it is; with the victim's TopicArn written over theirs, or spelt
    into the Subject and the canonical string re-split around it, it does not verify."""
    cfg = events_config(tmp, upstream, keys, {}, only="ses")
    attacker = "arn:aws:sns:eu-west-1:999999999999:attacker"
    async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as guard:
        message_id, queue_id = await sent(guard, upstream, "ses:1")
        bounce = ev.ses_message("Bounce", RCPT, message_id, queue_id)
        theirs = ev.ses(keys, bounce, topic=attacker)
        status, _ = await ev.post(events_port(guard), "ses", theirs)
        assert status == 403
        envelope = json.loads(theirs.body)
        overwritten = {**envelope, "TopicArn": keys.topic}
        status, _ = await ev.post(events_port(guard), "ses", ev.Signed(json.dumps(overwritten).encode(), {}))
        assert status == 401
        # The attacker's Subject spells the victim's fields; the forgery drops the Subject
        # and moves what followed it into the fields it names.
        injected = f"x\nTimestamp\n{envelope['Timestamp']}\nTopicArn\n{keys.topic}\nType\nNotification"
        signed = json.loads(ev.ses(keys, bounce, topic=attacker).body)
        signed.pop("Signature")
        signed["Subject"] = injected
        signature = keys.ses_private.sign(sns_canonical(signed), padding.PKCS1v15(), hashes.SHA1())
        signed["Signature"] = base64.b64encode(signature).decode()
        status, _ = await ev.post(events_port(guard), "ses", ev.Signed(json.dumps(signed).encode(), {}))
        assert status == 403
        resplit = {**signed, "TopicArn": keys.topic}
        resplit.pop("Subject")
        status, _ = await ev.post(events_port(guard), "ses", ev.Signed(json.dumps(resplit).encode(), {}))
        assert status == 401
        await _still_sends(guard, upstream, "ses:2")
        assert await _history_events(tmp, "ses:1") == []
    assert upstream.event_keys() == ["ses:1", "ses:2"]


def _mailgun_signed(key: str, timestamp: str, token: str, data: dict[str, object]) -> dict[str, object]:
    mac = hmac.new(key.encode(), (timestamp + token).encode(), hashlib.sha256).hexdigest()
    return {"signature": {"timestamp": timestamp, "token": token, "signature": mac}, "event-data": data}


async def test_a_mailgun_signature_resplit_at_e0_carries_no_body_of_its_own(
    tmp: Path, upstream: Upstream, keys: ev.Keys
) -> None:
    """HMAC over timestamp + token, no separator: a token that starts with `e0` can lend
    those two characters to the timestamp (`…e0` is the same moment to float()), giving a
    new token (so no replay seen) and the same signed bytes over any body. The timestamp
    is read as digits only, so the forged bounce is 401 and the victim still gets mail."""
    cfg = events_config(tmp, upstream, keys, {}, only="mailgun")
    async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as guard:
        message_id, _ = await sent(guard, upstream, "mg:1")
        ts, token = str(int(time.time())), "e0" + secrets.token_hex(24)
        genuine = _mailgun_signed(keys.mailgun, ts, token, ev.mailgun_event("delivered", RCPT, message_id))
        signature = genuine["signature"]
        assert isinstance(signature, dict)
        forged = {
            "signature": {**signature, "timestamp": ts + "e0", "token": token[2:]},
            "event-data": ev.mailgun_event("failed", RCPT, message_id, severity="permanent"),
        }
        status, doc = await ev.post(events_port(guard), "mailgun", ev.Signed(json.dumps(forged).encode(), {}))
        assert status == 401 and "signature.timestamp is not a Unix time" in str(doc), doc
        status, doc = await ev.post(
            events_port(guard), "mailgun", ev.Signed(json.dumps(genuine).encode(), {})
        )
        assert status == 200 and doc["applied"] == 1, doc
        await _still_sends(guard, upstream, "mg:2")
        assert await _history_events(tmp, "mg:1") == ["delivered"]
    assert upstream.event_keys() == ["mg:1", "mg:2"]


@pytest.mark.parametrize(
    "timestamp",
    ["{now}e0", "{now}.0", "{now}_0", " {now}", "{now} ", "+{now}", "0x{now}", "9" * 13, ""],
)
def test_a_signed_timestamp_is_ascii_digits_only(timestamp: str) -> None:
    """The signature verifies over exactly these bytes: only the reading of the timestamp
    can refuse them."""
    now = int(time.time())
    text = timestamp.format(now=now)
    source = Mailgun("mailgun", "primary", 300.0, "key-" + "k" * 32)
    body = json.dumps(_mailgun_signed(source.signing_key, text, "t" * 50, {"event": "delivered"})).encode()
    with pytest.raises(Rejected) as refused:
        source.verify(body, {}, float(now))
    assert refused.value.status == 401
    assert refused.value.reason == "signature.timestamp is not a Unix time in whole seconds"
