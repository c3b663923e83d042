"""nodemailer's pooled transport (pool: true, one connection, no message limit), as a
Node.js app sends a newsletter: 120 messages one recipient each on one connection, of which
30 in a row go to suppressed recipients (550 at RCPT, then nodemailer's RSET), and one
message BCC'd to 130 (max_recipients 100: 30 refused 452). limits.max_errors and
limits.max_junk_commands never cut it: every message to a recipient not suppressed, and
the BCC to its 100 accepted, reach the upstream."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tests.support import PASSWORD, Upstream, base_config, running_guard, suppressions_refreshed
from tests.wire.test_recipes import need, nodemailer_dir, run

__all__ = ["nodemailer_dir"]  # the fixture

SCRIPT = textwrap.dedent(
    """
    const nodemailer = require("nodemailer");
    const [port] = process.argv.slice(2);
    const transporter = nodemailer.createTransport({
      pool: true, maxConnections: 1, maxMessages: Infinity,
      host: "127.0.0.1", port: Number(port), secure: false, ignoreTLS: true,
      auth: { user: "acme-app", pass: process.env.SMTPGUARD_PASSWORD },
    });
    const send = (n, to, bcc) => transporter.sendMail({
      from: "billing@acme.example", to, bcc, subject: `News ${n}`, text: "News.",
      headers: { "X-Event-Key": `news:${n}` },
    }).then((i) => ({ n, ok: i.accepted.length, rejected: i.rejected.length }),
            (e) => ({ n, error: e.responseCode || e.code }));
    (async () => {
      const out = [];
      for (let n = 0; n < 120; n++) out.push(await send(n, `r${n}@example.com`));
      const bcc = Array.from({ length: 130 }, (_, i) => `b${i}@example.com`);
      out.push(await send("bcc", "list:;", bcc));
      transporter.close();
      console.log(JSON.stringify(out));
    })();
    """
)


async def test_a_pooled_newsletter_with_suppressed_runs_and_a_large_bcc(
    tmp: Path, upstream: Upstream, nodemailer_dir: Path
) -> None:
    node = need("node", "Node.js 20+ is needed for nodemailer")
    script = nodemailer_dir / "pool.js"
    script.write_text(SCRIPT)
    suppressed = {f"r{n}@example.com" for n in range(40, 70)}
    cfg = base_config(tmp, upstream.port, zones__acme__hourly_cap=1000)
    async with running_guard(cfg) as guard:
        assert guard.store is not None
        for address in suppressed:
            await guard.store.suppress_add("acme", address, "bounced", guard.clock())
        suppressions_refreshed(guard)
        code, out, err = await run(
            [node, str(script), str(guard.ports[0])], env={"SMTPGUARD_PASSWORD": PASSWORD}, timeout=120
        )
    assert code == 0, err
    results = {str(r["n"]): r for r in json.loads(out)}
    refused = {n for n, r in results.items() if "error" in r}
    assert refused == {str(n) for n in range(40, 70)}, results
    assert {results[n]["error"] for n in refused} == {550}
    assert results["bcc"] == {"n": "bcc", "ok": 100, "rejected": 30}, results["bcc"]
    keys = upstream.event_keys()
    assert keys == [f"news:{n}" for n in range(120) if not 40 <= n < 70] + ["news:bcc"], keys
    assert len(upstream.received[-1].rcpt_tos) == 100
