"""Idle connections: memory of smtpguard holding many authenticated sessions open.

    .venv/bin/python -m bench.idle                 # 1,000 idle sessions, SQLite store
    .venv/bin/python -m bench.idle --connections 1500 --store redis

Starts the sink and smtpguard (limits.max_connections 2000, max_connections_per_ip 2000),
warms it with one submission, reads its RSS, opens N connections that each EHLO and AUTH
(PLAIN) and then stay idle, reads the RSS again, checks that a new connection can still
submit a message (and that the sink received it), then closes everything.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from bench.client import Session, body_for, message_bytes
from bench.common import (
    ROOT,
    Guard,
    Redis,
    Sink,
    cpu_seconds,
    free_port,
    guard_config,
    install_sigterm,
    machine_info,
    memory_mb,
    password_hash,
    raise_nofile,
    stamp,
    workdir,
    write_result,
)


async def submit_one(port: int, key: str) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    s = await asyncio.wait_for(Session.open(port, True), 30)
    try:
        code, text = await asyncio.wait_for(s.send(message_bytes(key, body_for(2000)), False), 30)
    finally:
        await s.close()
    return code, text, (time.perf_counter() - t0) * 1000


async def hold_idle(port: int, n: int, batch: int, pid: int, hold: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sessions: list[Session] = []
    failures: dict[str, int] = {}
    try:
        t0 = time.perf_counter()
        while len(sessions) < n and time.perf_counter() - t0 < 120:
            k = min(batch, n - len(sessions))
            got = await asyncio.gather(
                *(asyncio.wait_for(Session.open(port, True), 30) for _ in range(k)), return_exceptions=True
            )
            for g in got:
                if isinstance(g, Session):
                    sessions.append(g)
                else:
                    name = f"{type(g).__name__}: {g}"[:80]
                    failures[name] = failures.get(name, 0) + 1
            if failures and sum(failures.values()) > 50:
                break
        out["opened"] = len(sessions)
        out["authenticated"] = sum(s.authenticated for s in sessions)
        out["open_seconds"] = round(time.perf_counter() - t0, 2)
        out["open_failures"] = failures
        await asyncio.sleep(hold)
        rss, hwm = memory_mb([pid])
        out["rss_idle_mb"], out["hwm_idle_mb"] = round(rss, 1), round(hwm, 1)
        code, text, ms = await submit_one(port, f"idle-check:{stamp()}")
        out["new_submission"] = {"code": code, "reply": text[:120], "ms": round(ms, 2)}
        # And one of the idle sessions is still usable.
        if sessions:
            code2, text2 = await asyncio.wait_for(
                sessions[-1].send(message_bytes(f"idle-reuse:{stamp()}", body_for(2000)), False), 30
            )
            out["idle_session_submission"] = {"code": code2, "reply": text2[:120]}
        rss, hwm = memory_mb([pid])
        out["rss_after_mb"], out["hwm_after_mb"] = round(rss, 1), round(hwm, 1)
    finally:
        for i in range(0, len(sessions), 200):
            await asyncio.gather(*(s.close() for s in sessions[i : i + 200]), return_exceptions=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.idle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=100, help="connections opened at once")
    ap.add_argument("--hold", type=float, default=2.0, help="seconds idle before reading RSS")
    ap.add_argument("--store", choices=["sqlite", "redis"], default="sqlite")
    ap.add_argument("--target-mb", type=float, default=150.0)
    ap.add_argument(
        "--cold",
        action="store_true",
        help="no warm-up submission: the first --batch AUTHs arrive together on an empty password cache",
    )
    args = ap.parse_args(argv)
    install_sigterm()
    nofile = raise_nofile(max(4096, args.connections * 2 + 256))
    password_hash()
    result: dict[str, Any] = {
        "machine": machine_info(),
        "connections": args.connections,
        "store": args.store,
        "nofile": nofile,
    }
    with workdir("smtpguard-idle-") as tmp:
        sink = Sink(tmp)
        redis: Redis | None = None
        guard: Guard | None = None
        try:
            if args.store == "redis":
                redis = Redis(tmp)
            url = redis.url if redis else f"sqlite:///{Path(tmp) / 'idle.db'}"
            port = free_port()
            limits = {"max_connections": 2000, "max_connections_per_ip": 2000}
            guard = Guard(tmp, "idle", guard_config(port, sink.port, url, 8, limits))
            rss, hwm = memory_mb([guard.pid])
            result["rss_started_mb"], result["hwm_started_mb"] = round(rss, 1), round(hwm, 1)
            if args.cold:
                # No warm-up: the first batch of AUTHs all miss the verified-password cache.
                code, ms = 0, 0.0
            else:
                code, _, ms = asyncio.run(submit_one(port, f"idle-warm:{stamp()}"))
            result["warm_submission"] = {"code": code, "ms": round(ms, 2), "cold": args.cold}
            rss, hwm = memory_mb([guard.pid])
            result["rss_warm_mb"], result["hwm_warm_mb"] = round(rss, 1), round(hwm, 1)
            before = sink.settled_count(quiet=0.3)
            result.update(asyncio.run(hold_idle(port, args.connections, args.batch, guard.pid, args.hold)))
            result["sink_received_after_idle"] = sink.settled_count(quiet=0.3) - before
            result["guard_cpu_s"] = round(cpu_seconds(guard.pid), 2)
        finally:
            if guard is not None:
                guard.stop()
            if redis is not None:
                redis.stop()
            sink.stop()

    opened = result.get("opened", 0)
    per_conn = (result.get("rss_idle_mb", 0) - result["rss_warm_mb"]) * 1000 / opened if opened else 0.0
    result["kb_per_idle_connection"] = round(per_conn, 1)
    ok_new = result.get("new_submission", {}).get("code") == 250
    result["target"] = {
        "rss_idle_mb": result.get("rss_idle_mb"),
        "target_mb": args.target_mb,
        "met": bool(
            result.get("rss_idle_mb", 1e9) <= args.target_mb and opened == args.connections and ok_new
        ),
    }
    print(
        f"smtpguard ({args.store}) with {opened}/{args.connections} idle authenticated connections "
        f"(opened in {result.get('open_seconds')} s, failures {result.get('open_failures') or 0}; "
        f"nofile {nofile})"
    )
    print(
        f"  RSS started {result['rss_started_mb']} MB (HWM {result['hwm_started_mb']} MB), after one "
        f"submission {result['rss_warm_mb']} MB (HWM {result['hwm_warm_mb']} MB: the first AUTH runs an "
        f"argon2id verify, m=64 MiB)"
    )
    print(
        f"  RSS with {opened} idle: {result.get('rss_idle_mb')} MB (HWM {result.get('hwm_idle_mb')} MB) "
        f"= {per_conn:.1f} kB per idle connection"
    )
    print(f"  new submission while they idle: {result.get('new_submission')}")
    print(f"  submission on one of the idle sessions: {result.get('idle_session_submission')}")
    print(
        f"  sink received {result.get('sink_received_after_idle')} (expected 2); smtpguard CPU "
        f"{result.get('guard_cpu_s')} s in all"
    )
    print(
        f"  target RSS <= {args.target_mb:g} MB with {args.connections} idle and a new submission OK: "
        f"{'MET' if result['target']['met'] else 'NOT MET'}"
    )
    path = write_result("idle", result)
    print(f"wrote {path.relative_to(ROOT)}")
    return 0 if result["target"]["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
