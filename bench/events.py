"""Provider events per second beside relay throughput, in one run (DESIGN.md §13).

    .venv/bin/python -m bench.events            # 2000 messages, then 2000 events per source
    .venv/bin/python -m bench.events --n 500    # shorter

One `smtpguard serve` (SQLite store) in front of the sink. First N messages are relayed
through it (10 sessions): msgs/s. Then, against the same process, N signed webhooks per
source, each a `delivered` event naming one of those messages by its Message-ID, so every
request pays the whole path — signature check, record lookup, one store write (10
concurrent HTTP clients; requests are signed before the clock starts). Then the same N
again: every one a duplicate. Printed: rates, the guard's CPU per item, and each rate as a
ratio of the relay's.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import secrets
import time
from typing import Any

import aiohttp
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bench.client import RECIPIENT, deliver_keys
from bench.common import ZONE, Guard, Sink, cpu_seconds, free_port, guard_config, workdir
from smtpguard.policy.eventkey import message_id_for

HOSTNAME = "bench-guard.invalid"


def signed_sendgrid(private: ec.EllipticCurvePrivateKey, message_id: str) -> tuple[bytes, dict[str, str]]:
    timestamp = str(int(time.time()))
    event = {
        "email": RECIPIENT,
        "timestamp": int(time.time()),
        "smtp-id": message_id,
        "event": "delivered",
        "sg_event_id": secrets.token_urlsafe(16),
        "sg_message_id": secrets.token_urlsafe(12) + ".filterdrecv-0",
        "response": "250 OK",
    }
    body = json.dumps([event]).encode()
    signature = private.sign(timestamp.encode() + body, ec.ECDSA(hashes.SHA256()))
    return body, {
        "Content-Type": "application/json",
        "X-Twilio-Email-Event-Webhook-Signature": base64.b64encode(signature).decode(),
        "X-Twilio-Email-Event-Webhook-Timestamp": timestamp,
    }


def signed_mailgun(key: str, message_id: str) -> tuple[bytes, dict[str, str]]:
    timestamp, token = str(int(time.time())), secrets.token_hex(25)
    signature = hmac.new(key.encode(), (timestamp + token).encode(), hashlib.sha256).hexdigest()
    data = {
        "id": secrets.token_urlsafe(16),
        "timestamp": time.time(),
        "event": "delivered",
        "recipient": RECIPIENT,
        "message": {"headers": {"message-id": message_id.strip("<>")}},
    }
    body = json.dumps(
        {"signature": {"timestamp": timestamp, "token": token, "signature": signature}, "event-data": data}
    )
    return body.encode(), {"Content-Type": "application/json"}


async def post_all(
    port: int, source: str, requests: list[tuple[bytes, dict[str, str]]], clients: int
) -> tuple[float, dict[int, int]]:
    statuses: dict[int, int] = {}
    pending = list(reversed(requests))
    url = f"http://127.0.0.1:{port}/events/{source}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:

        async def worker() -> None:
            while pending:
                body, headers = pending.pop()
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return time.perf_counter() - start, statuses


def run(n: int, clients: int) -> dict[str, Any]:
    with workdir("sg-bench-events-") as tmp:
        sink = Sink(tmp)
        private = ec.generate_private_key(ec.SECP256R1())
        public = private.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        (tmp / "sendgrid.key").write_text(base64.b64encode(public).decode())
        mailgun_key = "key-" + secrets.token_hex(16)
        (tmp / "mailgun.key").write_text(mailgun_key)
        port, events_port = free_port(), free_port()
        cfg = guard_config(port, sink.port, f"sqlite:///{tmp / 'state.db'}", 8)
        cfg["hostname"] = HOSTNAME
        cfg["events"] = {
            "address": f"127.0.0.1:{events_port}",
            "sources": {
                "sendgrid": {
                    "kind": "sendgrid",
                    "provider": "sink",
                    "public_key_file": str(tmp / "sendgrid.key"),
                },
                "mailgun": {
                    "kind": "mailgun",
                    "provider": "sink",
                    "signing_key_file": str(tmp / "mailgun.key"),
                },
            },
        }
        guard = Guard(tmp, "guard", cfg)
        try:
            keys = [f"bench:{i}" for i in range(n)]
            cpu0, t0 = cpu_seconds(guard.pid), time.perf_counter()
            relay = asyncio.run(deliver_keys(port, keys, 10, True))
            relay_s, relay_cpu = time.perf_counter() - t0, cpu_seconds(guard.pid) - cpu0
            rows: dict[str, Any] = {
                "relay": {
                    "n": relay.new_accepted,
                    "per_s": relay.new_accepted / relay_s,
                    "cpu_ms": 1000 * relay_cpu / n,
                }
            }
            mids = [message_id_for(ZONE, k, HOSTNAME) for k in keys]
            batches = {
                "sendgrid (ECDSA P-256)": ("sendgrid", [signed_sendgrid(private, m) for m in mids]),
                "mailgun (HMAC-SHA256)": ("mailgun", [signed_mailgun(mailgun_key, m) for m in mids]),
            }
            for label, (source, requests) in batches.items():
                for phase in ("applied", "duplicate"):
                    cpu0 = cpu_seconds(guard.pid)
                    elapsed, statuses = asyncio.run(post_all(events_port, source, requests, clients))
                    cpu = cpu_seconds(guard.pid) - cpu0
                    rows[f"{label}, {phase}"] = {
                        "n": statuses.get(200, 0),
                        "per_s": len(requests) / elapsed,
                        "cpu_ms": 1000 * cpu / len(requests),
                        "statuses": statuses,
                    }
        finally:
            guard.stop()
            sink.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=10)
    args = ap.parse_args(argv)
    rows = run(args.n, args.clients)
    relay = rows["relay"]["per_s"]
    print(f"{'scenario':<36} {'ok':>6} {'per s':>8} {'CPU ms/item':>12} {'x relay':>8}")
    for name, r in rows.items():
        print(f"{name:<36} {r['n']:>6} {r['per_s']:>8.0f} {r['cpu_ms']:>12.2f} {r['per_s'] / relay:>8.2f}")
    bad = {k: r["statuses"] for k, r in rows.items() if "statuses" in r and set(r["statuses"]) != {200}}
    if bad:
        print(f"non-200 answers: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
