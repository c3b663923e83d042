"""The RCPT cost of DNS at RCPT: the recipient-domain check (`recipient_domains: check`,
DESIGN.md §12) and the receiver lookup (`receivers:`, §21). The same RCPT load through
`python -m smtpguard serve` with both off, the check on with every domain already cached
and with every RCPT a domain not seen before (one DNS lookup to a local NSD each), and the
receiver lookup on (check off), cached and uncached, side by side in one run, with each
row's ratio to `off`.

    .venv/bin/python -m bench.rcpt                   # 10 sessions, 3 s per scenario
    .venv/bin/python -m bench.rcpt --quick           # 1 s per scenario
    .venv/bin/python -m bench.rcpt --repeat 3        # 3 interleaved rounds, median round per row

Each session authenticates once, then loops MAIL, `--rcpts` RCPTs, RSET: no DATA, so no
upstream and no store write is involved — only what RCPT costs. The DNS server is NSD
(Debian's `nsd`), authoritative for a bench zone on a free loopback port, with a wildcard
MX so that every `d<N>.fresh.bench.test` is a distinct, existing, mail-receiving domain.
Columns: RCPTs/s, p50/p99 per RCPT (command written → reply read), smtpguard's CPU time
per RCPT (`/proc/PID/stat`, the number that moves least when the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import dns.exception
import dns.resolver

from bench.client import Session
from bench.common import (
    Guard,
    Proc,
    cpu_seconds,
    free_port,
    guard_config,
    install_sigterm,
    machine_info,
    workdir,
    write_result,
)

NSD = "/usr/sbin/nsd"
ORIGIN = "bench.test"
ZONE_FILE = f"""$ORIGIN {ORIGIN}.
$TTL 300
@ IN SOA ns.{ORIGIN}. hostmaster.{ORIGIN}. 1 3600 600 86400 300
@ IN NS ns.{ORIGIN}.
ns IN A 127.0.0.1
cached IN MX 10 mx.{ORIGIN}.
*.fresh IN MX 10 mx.{ORIGIN}.
mx IN A 127.0.0.1
"""
SCENARIOS = ("off", "on-cached", "on-uncached", "receivers-cached", "receivers-uncached")


def start_nsd(tmp: Path) -> tuple[Proc, int]:
    port = free_port()
    (tmp / "bench.zone").write_text(ZONE_FILE)
    (tmp / "nsd.conf").write_text(
        f"""server:
  ip-address: 127.0.0.1
  port: {port}
  username: ""
  chroot: ""
  zonesdir: "{tmp}"
  database: ""
  pidfile: "{tmp}/nsd.pid"
  xfrdfile: "{tmp}/xfrd.state"
  zonelistfile: "{tmp}/zone.list"
  server-count: 1
  hide-version: yes
  # NSD limits answers to 200/s per /24 by default (response rate limiting): off on loopback
  rrl-ratelimit: 0
  rrl-whitelist-ratelimit: 0
remote-control:
  control-enable: no
zone:
  name: "{ORIGIN}"
  zonefile: "{tmp}/bench.zone"
"""
    )
    proc = Proc("nsd", [NSD, "-d", "-c", str(tmp / "nsd.conf")], tmp / "nsd.log")
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = ["127.0.0.1"]
    resolver.port = port
    resolver.lifetime = 0.5
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(dns.exception.DNSException):
            resolver.resolve(f"cached.{ORIGIN}", "MX")
            return proc, port
        time.sleep(0.1)
    proc.stop()
    raise RuntimeError(f"nsd did not answer: {proc.tail()}")


async def measure(port: int, pid: int, scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    counter = itertools.count()
    latencies: list[float] = []
    state = {"measuring": False, "stop": False, "refused": 0}

    def address() -> bytes:
        n = next(counter)
        if scenario.endswith("-cached"):
            return f"RCPT TO:<u{n}@cached.{ORIGIN}>\r\n".encode()
        return f"RCPT TO:<u@d{n}.fresh.{ORIGIN}>\r\n".encode()

    async def one() -> None:
        s = await Session.open(port, auth=True)
        try:
            while not state["stop"]:
                code, text = await s.command(b"MAIL FROM:<billing@bench.example>\r\n")
                if code != 250:
                    raise RuntimeError(f"MAIL {code} {text}")
                for _ in range(args.rcpts):
                    started = time.perf_counter()
                    code, _ = await s.command(address())
                    took = time.perf_counter() - started
                    if code != 250:
                        state["refused"] += 1
                    if state["measuring"]:
                        latencies.append(took)
                await s.command(b"RSET\r\n")
        finally:
            await s.close()

    tasks = [asyncio.create_task(one()) for _ in range(args.sessions)]
    await asyncio.sleep(args.warmup)
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    state["measuring"] = True
    await asyncio.sleep(args.duration)
    state["measuring"] = False
    cpu1, t1 = cpu_seconds(pid), time.perf_counter()
    state["stop"] = True
    await asyncio.gather(*tasks)
    n = len(latencies)
    q = statistics.quantiles(latencies, n=100) if n >= 100 else [0.0] * 99
    return {
        "scenario": scenario,
        "rcpts": n,
        "rcpt_s": n / (t1 - t0),
        "p50_ms": q[49] * 1000,
        "p99_ms": q[98] * 1000,
        "cpu_us_per_rcpt": (cpu1 - cpu0) / n * 1e6 if n else 0.0,
        "refused": state["refused"],
    }


def config(port: int, dns_port: int, scenario: str, store_url: str) -> dict[str, Any]:
    # No DATA is sent: the provider's port is never connected to.
    # Its MAIL, RCPT…, RSET loop never delivers: without room for its RSETs the junk
    # command limit would end the session (smtp_session.py).
    limits = {"max_recipients": 1000, "max_junk_commands": 1_000_000}
    cfg = guard_config(port, free_port(), store_url, pool_size=1, limits=limits)
    cfg["dns"] = {"nameservers": [f"127.0.0.1:{dns_port}"], "timeout": "2s"}
    zone = next(iter(cfg["zones"].values()))
    zone["recipient_domains"] = "check" if scenario.startswith("on-") else "off"
    if scenario.startswith("receivers-"):
        # The built-in receivers, and a max_rate no RCPT reaches: the whole decision is made.
        cfg["receivers"] = {}
        zone["receivers"] = {"gmail": {"max_rate": "1000000/s"}}
    return cfg


def run_scenario(
    tmp: Path, dns_port: int, scenario: str, round_: int, args: argparse.Namespace
) -> dict[str, Any]:
    port = free_port()
    cfg = config(port, dns_port, scenario, f"sqlite:///{tmp / f'{scenario}-{round_}.db'}")
    guard = Guard(tmp, f"{scenario}-{round_}", cfg)
    try:
        return asyncio.run(measure(guard.port, guard.pid, scenario, args))
    finally:
        guard.stop()


def micro(dns_port: int, tmp: Path, n: int = 20000) -> dict[str, float]:
    """The check's own cost, in this process, without the SMTP session around it: the test
    the listener makes when the check is off, `RecipientDomains.refusal` and the receiver
    lookup (`ReceiverLookup.receiver`) on a cached domain and on fresh ones — CPU numbers
    that the machine's other load moves far less than a served run."""
    from smtpguard.config import DnsConfig, ZoneConfig
    from smtpguard.readiness.dns import DnsClient
    from smtpguard.recipient_domains import RecipientDomains

    zone = ZoneConfig()
    checker = RecipientDomains(DnsClient(DnsConfig(nameservers=[f"127.0.0.1:{dns_port}"])))

    def off_test() -> bool:
        # The listener's test, as written in Handler.handle_RCPT.
        return zone is not None and zone.recipient_domains == "check" and checker is not None

    started = time.process_time()
    for _ in range(n):
        off_test()
    off_ns = (time.process_time() - started) / n * 1e9

    from smtpguard.receivers.lookup import ReceiverLookup

    lookup = ReceiverLookup(checker.dns, config_receivers())

    async def per_call(ask: Callable[[str], Awaitable[object]], fresh: str) -> tuple[float, float]:
        """µs of CPU per call: to one cached domain (after one warm-up), and to domains
        never seen before (one MX lookup each)."""
        await ask(f"warm@cached.{ORIGIN}")
        started = time.process_time()
        for i in range(n):
            await ask(f"u{i}@cached.{ORIGIN}")
        cached = (time.process_time() - started) / n * 1e6
        m = 300
        started = time.process_time()
        for i in range(m):
            await ask(f"u@{fresh}{i}.fresh.{ORIGIN}")
        return cached, (time.process_time() - started) / m * 1e6

    check = asyncio.run(per_call(checker.refusal, "m"))
    receiver = asyncio.run(per_call(lookup.receiver, "r"))
    shaped = asyncio.run(shaping(lookup, tmp, n))
    return {
        "off_test_ns": off_ns,
        "cached_us": check[0],
        "uncached_us": check[1],
        "receivers_cached_us": receiver[0],
        "receivers_uncached_us": receiver[1],
        "receivers_rcpt_us": shaped,
    }


async def shaping(lookup: Any, tmp: Path, n: int) -> float:
    """µs of CPU for RCPT's whole receiver step on a cached domain: the lookup, then the
    pause and max_rate decision (a SQLite store's controls, read at most every 0.5 s)."""
    from smtpguard.class_pauses import ClassPauses
    from smtpguard.receivers.gate import ReceiverGate
    from smtpguard.store import store_from_url

    store = store_from_url(f"sqlite:///{tmp / 'micro.db'}")
    await store.open()
    try:
        gate = ReceiverGate(store, ClassPauses(store), lambda: {}, time.time)
        await gate.rcpt_refusal("acme", await lookup.receiver(f"warm@cached.{ORIGIN}"))
        started = time.process_time()
        for i in range(n):
            await gate.rcpt_refusal("acme", await lookup.receiver(f"u{i}@cached.{ORIGIN}"))
        return (time.process_time() - started) / n * 1e6
    finally:
        await store.close()


def config_receivers() -> dict[str, tuple[str, ...]]:
    from smtpguard.policy.receivers import table

    return table(None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--rcpts", type=int, default=10, help="RCPTs per MAIL")
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="0.3 s warm-up, 1 s per scenario")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = p.parse_args()
    if args.quick:
        args.duration, args.warmup = 1.0, 0.3
    install_sigterm()
    scenarios = [s for s in args.scenarios.split(",") if s]
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in scenarios}
    with workdir("smtpguard-bench-rcpt-") as tmp:
        nsd, dns_port = start_nsd(tmp)
        try:
            costs = micro(dns_port, tmp)
            for r in range(args.repeat):
                for s in scenarios:  # interleaved: a slow moment of the machine hits every row
                    rounds[s].append(run_scenario(tmp, dns_port, s, r, args))
        finally:
            nsd.stop()
    rows = {s: sorted(rs, key=lambda x: x["rcpt_s"])[len(rs) // 2] for s, rs in rounds.items()}
    base = rows.get("off")
    print(f"{args.sessions} sessions, {args.rcpts} RCPTs per MAIL, {args.duration:g} s per scenario")
    print(
        f"{'scenario':18} {'RCPT/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'cpu µs/RCPT':>12} {'refused':>8}"
        f" {'x off RCPT/s':>13} {'x off cpu':>10}"
    )
    for s in scenarios:
        r = rows[s]
        ratio = r["rcpt_s"] / base["rcpt_s"] if base else float("nan")
        cpu_ratio = r["cpu_us_per_rcpt"] / base["cpu_us_per_rcpt"] if base else float("nan")
        r["ratios"] = {"rcpt_s_vs_off": ratio, "cpu_vs_off": cpu_ratio}
        print(
            f"{s:18} {r['rcpt_s']:>9.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}"
            f" {r['cpu_us_per_rcpt']:>12.0f}"
            f" {r['refused']:>8} {ratio:>13.2f} {cpu_ratio:>10.2f}"
        )
    off_cpu = base["cpu_us_per_rcpt"] if base else float("nan")
    print(
        f"in-process CPU per RCPT: check off {costs['off_test_ns']:.0f} ns "
        f"({costs['off_test_ns'] / 1000 / off_cpu * 100:.3f}% of a served RCPT's {off_cpu:.0f} µs); "
        f"on, cached {costs['cached_us']:.1f} µs; on, uncached {costs['uncached_us']:.0f} µs "
        "(one MX lookup to NSD through dnspython)"
    )
    print(
        f"in-process CPU per RCPT, receiver lookup: cached {costs['receivers_cached_us']:.1f} µs; "
        f"uncached {costs['receivers_uncached_us']:.0f} µs; "
        f"lookup and shaping decision, cached {costs['receivers_rcpt_us']:.1f} µs"
    )
    path = write_result(
        "rcpt",
        {"machine": machine_info(), "args": vars(args), "rows": rows, "rounds": rounds, "micro": costs},
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
