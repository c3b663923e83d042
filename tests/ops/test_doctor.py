"""`smtpguard doctor` (DESIGN.md §12) against a real DNS server (NSD, tests/support/dns.py)
and real upstreams: every check's ok, warning and error row, the RFC 7208 §4.6.4 limits, the
probe's certificate checks, the exit codes and JSON, and no MAIL sent to any upstream."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import os
import ssl
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session

from tests.support import RecordingHandler, Upstream, base_config, free_port, write_config
from tests.support.dns import NsdServer, nsd, txt

KEY = "MIGfMA0GCSqGSIb3DQEBAQUAA4GNADCBiQKBgQC1TaNgLlSyQMNWVLNLvyY/neDgaL2oqQE8T5illKqCgDtFHc8eHVAU"


def chain(prefix: str, n: int, last: str) -> list[str]:
    """`prefix`.test → include:prefix1.test → … → prefixN.test, whose record is `last`."""
    out = [f"{prefix} IN TXT " + txt(f"v=spf1 include:{prefix}1.test -all")]
    for i in range(1, n):
        out.append(f"{prefix}{i} IN TXT " + txt(f"v=spf1 include:{prefix}{i + 1}.test -all"))
    out.append(f"{prefix}{n} IN TXT " + txt(last))
    return out


RECORDS = [
    # the providers' own SPF records
    "_spf.primary IN TXT " + txt("v=spf1 ip4:192.0.2.0/24 -all"),
    "spf.standby IN TXT " + txt("v=spf1 ip4:198.51.100.0/24 ~all"),
    # good.test: everything in place
    "good IN TXT " + txt("v=spf1 include:_spf.primary.test include:spf.standby.test -all"),
    "good IN TXT " + txt("google-site-verification=abc"),
    "pm._domainkey.good IN TXT " + txt(f"v=DKIM1; k=rsa; p={KEY}"),
    "sb1._domainkey.good IN TXT " + txt(f"v=DKIM1; k=rsa; p={KEY}"),
    "_dmarc.good IN TXT " + txt("v=DMARC1; p=reject; rua=mailto:d@good.test"),
    "good IN MX 10 mx1.good.test.",
    "mx1.good IN A 127.0.0.1",
    # sub.good.test: SPF by redirect, DMARC inherited from good.test, no MX
    "sub.good IN TXT " + txt("v=spf1 redirect=good.test"),
    "pm._domainkey.sub.good IN TXT " + txt(f"v=DKIM1; p={KEY}"),
    "sb1._domainkey.sub.good IN TXT " + txt(f"v=DKIM1; p={KEY}"),
    "sub.good IN A 127.0.0.1",
    # soft.test: the warnings
    "soft IN TXT " + txt("v=spf1 include:_spf.primary.test include:spf.standby.test ?all"),
    "pm._domainkey.soft IN TXT " + txt(f"v=DKIM1; p={KEY}"),
    "sb1._domainkey.soft IN TXT " + txt(f"v=DKIM1; p={KEY}"),
    "_dmarc.soft IN TXT " + txt("v=DMARC1; p=none"),
    "soft IN MX 10 mx1.good.test.",
    "soft IN MX 20 old-mx.leftover.test.",
    # bad.test: the errors
    "bad IN TXT " + txt("google-site-verification=xyz"),
    "pm._domainkey.bad IN TXT " + txt("v=DKIM1; k=rsa; p="),
    "bad IN MX 0 .",
    # two.test: two SPF records, and SPF with +all that does not reach standby
    "two IN TXT " + txt("v=spf1 include:_spf.primary.test -all"),
    "two IN TXT " + txt("v=spf1 include:spf.standby.test -all"),
    "plus IN TXT " + txt("v=spf1 include:_spf.primary.test +all"),
    # the lookup limits: a chain of 11 includes, a chain of exactly 10, 3 and 2 void lookups
    *chain("c", 11, "v=spf1 include:_spf.primary.test -all"),
    *chain("d", 9, "v=spf1 include:_spf.primary.test -all"),
    "voids IN TXT "
    + txt("v=spf1 include:_spf.primary.test a:gone1.test mx:gone2.test exists:gone3.test -all"),
    "twovoids IN TXT " + txt("v=spf1 include:_spf.primary.test a:gone1.test mx:gone2.test -all"),
    "loop IN TXT " + txt("v=spf1 include:loop.test -all"),
    # a provider that authorises itself on a return-path subdomain (send.DOMAIN)
    "amazonses IN TXT " + txt("v=spf1 ip4:203.0.113.0/24 -all"),
    "send.good IN TXT " + txt("v=spf1 include:amazonses.test ~all"),
    "send.good IN MX 10 feedback-smtp.amazonses.test.",
    "resend._domainkey.good IN TXT " + txt(f"p={KEY}"),
    # a record with a lone `+` term: a permerror row, not a crash
    "plusterm IN TXT " + txt("v=spf1 + include:_spf.primary.test -all"),
    # sender-domain MX and DMARC defects
    "mixednull IN MX 0 .",
    "mixednull IN MX 10 mx1.good.test.",
    "_dmarc.mixednull IN TXT " + txt("v=DMARC1; p=reject"),
    "_dmarc.mixednull IN TXT " + txt("v=DMARC1; p=none"),
    "txtonly IN TXT " + txt("v=spf1 -all"),
    "_dmarc.txtonly IN TXT " + txt("v=DMARC1; rua=mailto:d@txtonly.test"),
    # VERP domains of the events mailbox: one in place, one that cannot take reports
    "verp.good IN TXT " + txt("v=spf1 include:_spf.primary.test -all"),
    "verp.good IN MX 10 mx1.good.test.",
    "verp.bad IN MX 0 .",
    "verp.bad IN TXT " + txt("not spf"),
]


@pytest.fixture(scope="module")
def dns_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NsdServer]:
    with nsd(tmp_path_factory.mktemp("dns"), "test", RECORDS) as server:
        yield server


def provider(name: str, port: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "smtp",
        "host": "127.0.0.1",
        "port": port,
        "tls": "none",
        "timeouts": {"connect": "2s", "command": "3s", "data": "3s"},
        **extra,
    }


def zones() -> dict[str, Any]:
    base = base_config(Path("/nonexistent"), None)["zones"]["acme"]
    return {
        "good": {**base, "senders": ["billing@good.test", "@sub.good.test"], "mx": ["mx1.good.test"]},
        "soft": {**base, "senders": ["@soft.test"], "mx": ["mx1.good.test"], "users": []},
        "bad": {**base, "senders": ["@bad.test", "@two.test", "@plus.test"], "users": []},
        "limits": {
            **base,
            "senders": ["@c.test", "@d.test", "@voids.test", "@twovoids.test", "@loop.test"],
            "users": [],
        },
    }


def doctor_config(tmp: Path, dns_server: NsdServer, providers: list[dict[str, Any]]) -> Path:
    cfg = base_config(tmp, None)
    cfg["providers"] = providers
    cfg["dns"] = {"nameservers": [dns_server.nameserver], "timeout": "2s"}
    cfg["zones"] = zones()
    return write_config(tmp / "smtpguard.yaml", cfg)


async def doctor(path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "smtpguard",
        "doctor",
        "-c",
        str(path),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def row(doc: dict[str, Any], check: str, domain: str | None, provider: str | None) -> dict[str, Any]:
    found = [
        c
        for c in doc["checks"]
        if c["check"] == check and c["domain"] == domain and c["provider"] == provider
    ]
    assert len(found) == 1, (check, domain, provider, doc["checks"])
    return found[0]


class CountingHandler(RecordingHandler):
    """The recording upstream, counting EHLOs too: proof that a probe reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.ehlos = 0

    async def handle_EHLO(
        self, server: SMTP, session: Session, envelope: Envelope, hostname: str, responses: list[str]
    ) -> list[str]:
        self.ehlos += 1
        session.host_name = hostname
        return responses


@pytest.fixture
async def counting_upstreams() -> AsyncIterator[list[Upstream]]:
    ups = []
    for _ in range(2):
        up = Upstream()
        up.handler = CountingHandler()
        await up.start()
        ups.append(up)
    yield ups
    for up in ups:
        await up.stop()


def one_zone_config(
    tmp: Path, dns_server: NsdServer, senders: list[str], providers: list[dict[str, Any]]
) -> Path:
    cfg = base_config(tmp, None)
    cfg["providers"] = providers
    cfg["dns"] = {"nameservers": [dns_server.nameserver], "timeout": "2s"}
    base = cfg["zones"]["acme"]
    cfg["zones"] = {"odd": {**base, "senders": senders}}
    return write_config(tmp / "smtpguard.yaml", cfg)


async def test_an_invalid_spf_term_is_an_error_row_not_a_crash(tmp: Path, dns_server: NsdServer) -> None:
    path = one_zone_config(
        tmp,
        dns_server,
        ["@plusterm.test"],
        [provider("primary", free_port(), spf="include:_spf.primary.test")],
    )
    code, out, err = await doctor(path, "--json", "--no-probe")
    assert code == 1, err
    detail = row(json.loads(out), "spf", "plusterm.test", "primary")
    assert detail["status"] == "error" and "invalid term '+'" in detail["detail"]


async def test_sender_domains_that_cannot_take_bounces_and_odd_dmarc(
    tmp: Path, dns_server: NsdServer
) -> None:
    path = one_zone_config(
        tmp,
        dns_server,
        ["@mixednull.test", "@txtonly.test", "@gone.test"],
        [provider("primary", free_port(), spf="include:_spf.primary.test")],
    )
    code, out, err = await doctor(path, "--json", "--no-probe")
    assert code == 1, err
    doc = json.loads(out)
    mixed = row(doc, "mx", "mixednull.test", None)
    assert mixed["status"] == "warning" and "null MX" in mixed["detail"], mixed
    txtonly = row(doc, "mx", "txtonly.test", None)
    assert txtonly["status"] == "error" and "no MX and no A/AAAA" in txtonly["detail"], txtonly
    gone = row(doc, "mx", "gone.test", None)
    assert gone["status"] == "error" and "NXDOMAIN" in gone["detail"], gone
    two = row(doc, "dmarc", "mixednull.test", None)
    assert two["status"] == "error" and "more than one" in two["detail"], two
    no_p = row(doc, "dmarc", "txtonly.test", None)
    assert no_p["status"] == "warning" and "no p= tag" in no_p["detail"], no_p


async def test_a_failure_inside_doctor_exits_2_with_one_line_and_json_stays_json(
    tmp: Path, dns_server: NsdServer
) -> None:
    """A check that breaks (here: a password file that is not UTF-8, which the probe reads)
    ends doctor with exit 2 and one line, never a traceback; --json still prints JSON."""
    secret = tmp / "password"
    secret.write_bytes(b"\xff\xfe not utf-8\n")
    path = one_zone_config(
        tmp,
        dns_server,
        ["@good.test"],
        [provider("primary", free_port(), username="u", password_file=str(secret))],
    )
    code, out, err = await doctor(path)
    assert code == 2, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("smtpguard: doctor could not finish: UnicodeDecodeError")
    code, out, err = await doctor(path, "--json")
    assert code == 2 and "Traceback" not in err, err
    doc = json.loads(out)
    assert doc["ok"] is False and "UnicodeDecodeError" in doc["error"]


# --- the DNS checks, row by row --------------------------------------------------------------
async def test_every_dns_check_ok_warning_and_error_and_no_mail_sent(
    tmp: Path, dns_server: NsdServer, counting_upstreams: list[Upstream]
) -> None:
    primary, standby = counting_upstreams
    dead = free_port()
    path = doctor_config(
        tmp,
        dns_server,
        [
            provider("primary", primary.port, spf="include:_spf.primary.test", dkim_selectors=["pm"]),
            provider("standby", standby.port, spf="include:spf.standby.test", dkim_selectors=["sb1"]),
            provider("bare", dead),
        ],
    )
    code, out, err = await doctor(path, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False, err

    def status(check: str, domain: str | None, prov: str | None) -> str:
        return str(row(doc, check, domain, prov)["status"])

    # spf: ok, warnings (?all / +all; no spf for the provider), errors
    assert status("spf", "good.test", "primary") == "ok"
    assert status("spf", "good.test", "standby") == "ok"
    assert status("spf", "sub.good.test", "standby") == "ok"  # through redirect=
    assert status("spf", "soft.test", "primary") == "warning"
    assert "?all" in row(doc, "spf", "soft.test", "primary")["detail"]
    assert status("spf", "plus.test", "primary") == "warning"
    assert "+all" in row(doc, "spf", "plus.test", "primary")["detail"]
    assert status("spf", "good.test", "bare") == "warning"
    assert "no spf configured" in row(doc, "spf", "good.test", "bare")["detail"]
    assert status("spf", "bad.test", "primary") == "error"
    assert "no v=spf1 record" in row(doc, "spf", "bad.test", "primary")["detail"]
    assert status("spf", "two.test", "primary") == "error"
    assert "2 v=spf1 records" in row(doc, "spf", "two.test", "primary")["detail"]
    assert status("spf", "plus.test", "standby") == "error"
    assert "not reached" in row(doc, "spf", "plus.test", "standby")["detail"]
    # the RFC 7208 §4.6.4 limits
    assert status("spf", "c.test", "primary") == "error"
    assert "more than 10 DNS-querying terms" in row(doc, "spf", "c.test", "primary")["detail"]
    assert status("spf", "d.test", "primary") == "ok"
    assert "10 querying terms" in row(doc, "spf", "d.test", "primary")["detail"]
    assert status("spf", "voids.test", "primary") == "error"
    assert "3 void lookups" in row(doc, "spf", "voids.test", "primary")["detail"]
    assert status("spf", "twovoids.test", "primary") == "ok"
    assert status("spf", "loop.test", "primary") == "error"

    # dkim: ok, warning (no selector configured), errors (revoked, missing)
    assert status("dkim", "good.test", "primary") == "ok"
    assert status("dkim", "good.test", "standby") == "ok"
    assert status("dkim", "good.test", "bare") == "warning"
    assert status("dkim", "bad.test", "primary") == "error"
    assert "revoked" in row(doc, "dkim", "bad.test", "primary")["detail"]
    assert status("dkim", "bad.test", "standby") == "error"
    assert "sb1: no record" in row(doc, "dkim", "bad.test", "standby")["detail"]

    # dmarc: ok (own, inherited), warnings (p=none, none at all); provider is null
    assert status("dmarc", "good.test", None) == "ok"
    assert status("dmarc", "sub.good.test", None) == "ok"
    assert "good.test" in row(doc, "dmarc", "sub.good.test", None)["detail"]
    assert status("dmarc", "soft.test", None) == "warning"
    assert "p=none" in row(doc, "dmarc", "soft.test", None)["detail"]
    assert status("dmarc", "bad.test", None) == "warning"

    # mx: ok, warning (leftover MX), error (null MX on a sender domain)
    assert status("mx", "good.test", None) == "ok"
    assert status("mx", "sub.good.test", None) == "ok"
    assert status("mx", "soft.test", None) == "warning"
    assert "old-mx.leftover.test" in row(doc, "mx", "soft.test", None)["detail"]
    assert status("mx", "bad.test", None) == "error"
    assert "null MX" in row(doc, "mx", "bad.test", None)["detail"]

    # probe: ok for the two live upstreams, error for the dead one; zone and domain null
    assert status("probe", None, "primary") == "ok"
    assert status("probe", None, "standby") == "ok"
    assert status("probe", None, "bare") == "error"
    assert row(doc, "probe", None, "bare")["detail"].startswith("connect:")

    # The probes reached both upstreams and opened no transaction: no MAIL, nothing sent.
    for up in (primary, standby):
        assert isinstance(up.handler, CountingHandler) and up.handler.ehlos >= 1
        assert up.handler.transactions == 0 and up.handler.data_commands == 0 and up.received == []

    # JSON shape: exactly §12's keys
    assert set(doc) == {"schema", "ok", "checks"} and doc["schema"] == 1
    assert all(set(c) == {"check", "zone", "domain", "provider", "status", "detail"} for c in doc["checks"])


async def test_exit_0_without_errors_and_the_table(
    tmp: Path, dns_server: NsdServer, upstream: Upstream
) -> None:
    path = doctor_config(
        tmp,
        dns_server,
        [provider("primary", upstream.port, spf="include:_spf.primary.test", dkim_selectors=["pm"])],
    )
    code, out, err = await doctor(path, "--zone", "good")
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].split() == ["check", "zone", "domain", "provider", "status", "detail"]
    assert any(line.startswith("probe") and " ok " in line for line in lines)
    assert lines[-1].endswith("0 error(s), 0 warning(s)")
    code, out, _ = await doctor(path, "--zone", "good", "--json", "--no-probe")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True
    assert {c["check"] for c in doc["checks"]} == {"spf", "dkim", "dmarc", "mx"}
    assert {c["zone"] for c in doc["checks"]} == {"good"}
    assert upstream.handler.transactions == 0


async def test_exit_2_for_a_bad_config_an_unknown_zone_or_bad_usage(tmp: Path, dns_server: NsdServer) -> None:
    path = doctor_config(tmp, dns_server, [provider("primary", free_port())])
    code, _, err = await doctor(path, "--zone", "nope")
    assert code == 2 and "unknown zone" in err
    code, _, err = await doctor(path, "--bogus")
    assert code == 2
    bad = tmp / "bad.yaml"
    bad.write_text(path.read_text().replace("timeout: 2s", "timeout: 2s\n  colour: blue"))
    code, _, err = await doctor(bad)
    assert code == 2 and "dns.colour" in err and "unknown key" in err


async def test_spf_on_the_providers_return_path_subdomain(tmp: Path, dns_server: NsdServer) -> None:
    path = doctor_config(
        tmp,
        dns_server,
        [
            provider(
                "resend",
                free_port(),
                spf="include:amazonses.test",
                spf_subdomain="send",
                dkim_selectors=["resend"],
            ),
            provider("apex", free_port(), spf="include:amazonses.test"),
        ],
    )
    code, out, _ = await doctor(path, "--json", "--zone", "good", "--no-probe")
    doc = json.loads(out)
    sub = row(doc, "spf", "good.test", "resend")
    assert sub["status"] == "ok" and sub["detail"].startswith("SPF of send.good.test:"), sub
    assert row(doc, "dkim", "good.test", "resend")["status"] == "ok"
    # Looked for in the sender domain's own record, the same mechanism is not there.
    assert row(doc, "spf", "good.test", "apex")["status"] == "error"
    assert code == 1


@pytest.mark.parametrize("domain", ["verp.good.test", "verp.bad.test"])
async def test_the_verp_domain_mx_and_spf_for_each_provider(
    domain: str, tmp: Path, dns_server: NsdServer
) -> None:
    providers = [
        provider("primary", free_port(), spf="include:_spf.primary.test"),
        provider("standby", free_port(), spf="include:spf.standby.test"),
    ]
    path = doctor_config(tmp, dns_server, providers)
    cfg = yaml.safe_load(path.read_text())
    cfg["events"] = {
        "mailbox": {
            "listen": "127.0.0.1:0",
            "address": "bounces@guard.test",
            "provider": "primary",
            "domain": domain,
            "secret_env": "SMTPGUARD_TEST_VERP_SECRET",
        }
    }
    write_config(path, cfg)
    code, out, err = await doctor(path, "--json", "--zone", "good", "--no-probe")
    doc = json.loads(out)
    primary, standby = row(doc, "spf", domain, "primary"), row(doc, "spf", domain, "standby")
    mx = row(doc, "mx", domain, None)
    assert all(r["detail"].startswith("VERP domain: ") for r in (primary, standby, mx))
    if domain == "verp.good.test":
        assert (primary["status"], standby["status"], mx["status"]) == ("ok", "error", "ok"), doc
        assert "include:spf.standby.test is not reached" in standby["detail"]
        assert "mx1.good.test" in mx["detail"]
    else:
        assert (primary["status"], standby["status"], mx["status"]) == ("error", "error", "error"), doc
        assert "null MX" in mx["detail"]
    assert code == 1, err


# --- the probe: AUTH and certificates --------------------------------------------------------
def make_ca_and_cert(
    directory: Path, not_after_days: float, not_before_days: float = -30
) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it, valid from `not_before_days`
    to `not_after_days` from now (negative: in the past)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "smtpguard test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=365))
        .not_valid_after(now + dt.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + dt.timedelta(days=not_before_days))
        .not_valid_after(now + dt.timedelta(days=not_after_days))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    ca_path, cert_path, key_path = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return ca_path, cert_path, key_path


class TlsAuthUpstream:
    """An aiosmtpd upstream with STARTTLS (the given certificate) and AUTH (one user)."""

    def __init__(self, cert: Path, key: Path, user: str = "relay", password: str = "right") -> None:
        self.handler = CountingHandler()
        self.port = free_port()
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(str(cert), str(key))
        self.user, self.password = user, password
        self._server: asyncio.Server | None = None

    def _auth(
        self, server: SMTP, session: Session, envelope: Envelope, mechanism: str, data: Any
    ) -> AuthResult:
        ok = isinstance(data, LoginPassword) and (data.login, data.password) == (
            self.user.encode(),
            self.password.encode(),
        )
        return AuthResult(success=ok, handled=False)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: SMTP(
                self.handler,
                hostname="tls-upstream",
                tls_context=self.ctx,
                require_starttls=True,
                authenticator=self._auth,
            ),
            "127.0.0.1",
            self.port,
        )

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


@pytest.mark.parametrize(
    ("not_after_days", "password", "status", "detail"),
    [
        (90, "right", "ok", "connect, EHLO, STARTTLS, AUTH, QUIT ok"),
        (7, "right", "warning", "expires in"),
        (-1, "right", "error", "certificate expired"),
        (90, "wrong", "error", "AUTH: 535"),
    ],
    ids=["valid", "expiring-within-14-days", "expired", "bad-credentials"],
)
async def test_probe_starttls_certificate_and_auth(
    tmp: Path, dns_server: NsdServer, not_after_days: float, password: str, status: str, detail: str
) -> None:
    ca, cert, key = make_ca_and_cert(tmp / "certs", not_after_days)
    up = TlsAuthUpstream(cert, key)
    await up.start()
    try:
        path = doctor_config(
            tmp,
            dns_server,
            [
                provider(
                    "primary",
                    up.port,
                    tls="starttls",
                    ca_file=str(ca),
                    username="relay",
                    password_env="DOCTOR_TEST_PASSWORD",
                )
            ],
        )
        code, out, err = await doctor(
            path, "--json", "--zone", "good", env={"DOCTOR_TEST_PASSWORD": password}
        )
        doc = json.loads(out)
        probe = row(doc, "probe", None, "primary")
        assert probe["status"] == status and detail in probe["detail"], probe
        assert code == (1 if status == "error" else 0), err
        assert up.handler.transactions == 0 and up.handler.received == []
    finally:
        await up.stop()


async def test_probe_of_an_untrusted_certificate_is_an_error(tmp: Path, dns_server: NsdServer) -> None:
    _, cert, key = make_ca_and_cert(tmp / "certs", 90)
    other_ca, _, _ = make_ca_and_cert(tmp / "other", 90)
    up = TlsAuthUpstream(cert, key)
    await up.start()
    try:
        path = doctor_config(
            tmp, dns_server, [provider("primary", up.port, tls="starttls", ca_file=str(other_ca))]
        )
        code, out, _ = await doctor(path, "--json", "--zone", "good")
        probe = row(json.loads(out), "probe", None, "primary")
        assert code == 1 and probe["status"] == "error" and "not trusted" in probe["detail"]
    finally:
        await up.stop()


async def test_probe_of_a_refused_ehlo_is_an_error_naming_the_reply(tmp: Path, dns_server: NsdServer) -> None:
    """A provider that greets, then refuses EHLO (and HELO): the probe's EHLO row."""
    commands: list[bytes] = []

    async def refusing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 refusing.test ESMTP\r\n")
        while line := await reader.readline():
            commands.append(line.split(b" ", 1)[0].strip().upper())
            if commands[-1] == b"QUIT":
                writer.write(b"221 bye\r\n")
                break
            writer.write(b"554 5.7.1 no service for you\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(refusing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        path = doctor_config(tmp, dns_server, [provider("primary", port)])
        code, out, _ = await doctor(path, "--json", "--zone", "good")
        probe = row(json.loads(out), "probe", None, "primary")
        assert code == 1 and probe["status"] == "error"
        assert probe["detail"].startswith("EHLO: 554 5.7.1"), probe
        assert b"MAIL" not in commands
    finally:
        server.close()
        await server.wait_closed()
