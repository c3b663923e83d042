"""What "the same message" means for one event key (DESIGN.md §3, last paragraph)."""

from __future__ import annotations

import email.utils
import re
from email import policy
from email.message import EmailMessage

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smtpguard.policy import fingerprint as fp_module
from smtpguard.policy.fingerprint import fingerprint
from smtpguard.policy.message import HeaderLimits, Message, parse

SENDER = "billing@acme.example"
RCPTS = ["ann@example.org", "bob@example.org"]


def raw(
    *,
    frm: str = "Billing <billing@acme.example>",
    to: str = "ann@example.org, bob@example.org",
    cc: str | None = None,
    subject: str = "Invoice 1044",
    body: bytes = b"Hello Ann,\r\nyour invoice is attached.\r\n",
    date: str = "Mon, 04 Mar 2024 10:00:00 +0000",
    message_id: str = "<1@app.acme.example>",
    extra: bytes = b"",
) -> bytes:
    head = (
        f"Received: from app (app [10.0.0.1]) by guard; {date}\r\n"
        f"From: {frm}\r\nTo: {to}\r\n" + (f"Cc: {cc}\r\n" if cc else "") + f"Subject: {subject}\r\n"
        f"Date: {date}\r\nMessage-ID: {message_id}\r\nX-Event-Key: invoice:acme:1044\r\n"
    ).encode()
    return head + extra + b"\r\n" + body


def msg(data: bytes) -> Message:
    m = parse(data, HeaderLimits())
    assert isinstance(m, Message), m
    return m


def fp(data: bytes, sender: str = SENDER, rcpts: list[str] | None = None) -> str:
    return fingerprint(sender, RCPTS if rcpts is None else rcpts, msg(data))


BASE = fp(raw())


def test_fingerprint_is_a_sha256_hex() -> None:
    assert len(BASE) == 64 and int(BASE, 16) >= 0


@pytest.mark.parametrize(
    ("data", "sender", "rcpts"),
    [
        pytest.param(
            raw(date="Tue, 05 Mar 2024 11:11:11 +0100", message_id="<2@app>"),
            SENDER,
            RCPTS,
            id="regenerated-date-and-message-id",
        ),
        pytest.param(raw(extra=b"Received: from relay2; now\r\n"), SENDER, RCPTS, id="extra-trace-header"),
        pytest.param(raw(extra=b"X-Mailer: PHPMailer 6.9\r\n"), SENDER, RCPTS, id="other-header-ignored"),
        pytest.param(raw(), SENDER, list(reversed(RCPTS)), id="recipient-order"),
        pytest.param(raw(), SENDER, [*RCPTS, RCPTS[0]], id="recipient-repeated"),
        pytest.param(raw(), "billing@ACME.Example", RCPTS, id="sender-domain-case"),
        pytest.param(raw(), f"<{SENDER}>", RCPTS, id="sender-angle-brackets"),
        pytest.param(raw(), SENDER, ["ann@EXAMPLE.org", "bob@Example.ORG"], id="recipient-domain-case"),
        pytest.param(raw(subject="Invoice\r\n 1044"), SENDER, RCPTS, id="subject-refolded"),
        pytest.param(raw(subject="Invoice   1044"), SENDER, RCPTS, id="subject-inner-whitespace"),
    ],
)
def test_same_message(data: bytes, sender: str, rcpts: list[str]) -> None:
    assert fp(data, sender, rcpts) == BASE


@pytest.mark.parametrize(
    ("data", "sender", "rcpts"),
    [
        pytest.param(raw(body=b"Hello Ann,\r\nyour invoice is attached!\r\n"), SENDER, RCPTS, id="body"),
        pytest.param(raw(body=b""), SENDER, RCPTS, id="empty-body"),
        pytest.param(raw(subject="Invoice 1045"), SENDER, RCPTS, id="subject"),
        pytest.param(raw(frm="Billing <accounts@acme.example>"), SENDER, RCPTS, id="header-from"),
        pytest.param(raw(to="ann@example.org"), SENDER, RCPTS, id="header-to"),
        pytest.param(raw(cc="boss@acme.example"), SENDER, RCPTS, id="header-cc-added"),
        pytest.param(raw(), "accounts@acme.example", RCPTS, id="envelope-sender"),
        pytest.param(raw(), "Billing@acme.example", RCPTS, id="sender-local-part-case"),
        pytest.param(raw(), SENDER, ["ann@example.org"], id="recipient-removed"),
        pytest.param(raw(), SENDER, [*RCPTS, "cat@example.org"], id="recipient-added"),
        pytest.param(raw(), SENDER, ["ann@example.org", "bob@example.net"], id="recipient-changed"),
    ],
)
def test_different_message(data: bytes, sender: str, rcpts: list[str]) -> None:
    assert fp(data, sender, rcpts) != BASE


def test_header_values_do_not_run_into_each_other() -> None:
    a = fp(raw(to="ann@example.org", subject="x"))
    b = fp(raw(to="ann@example.orgx", subject=""))
    assert a != b


# --- MIME boundaries: random per attempt in PHPMailer, nodemailer and Python's email ------------
def built(
    *,
    text: str = "Hello Ann,\nyour invoice is attached.\n",
    attachment: bytes = b"%PDF-1.4 invoice 1044\n" * 20,
    subject: str = "Invoice 1044",
    html: str | None = None,
) -> bytes:
    m = EmailMessage()
    m["From"] = "Billing <billing@acme.example>"
    m["To"] = "ann@example.org, bob@example.org"
    m["Subject"] = subject
    m["Date"] = email.utils.formatdate()
    m["Message-ID"] = email.utils.make_msgid(domain="app.acme.example")
    m["X-Event-Key"] = "invoice:acme:1044"
    m.set_content(text)
    if html is not None:
        m.add_alternative(html, subtype="html")
    m.add_attachment(attachment, maintype="application", subtype="pdf", filename="invoice-1044.pdf")
    return m.as_bytes(policy=policy.SMTP)


def boundaries(data: bytes) -> set[bytes]:
    return {line for line in data.split(b"\r\n") if line.startswith(b"--====")}


@pytest.mark.parametrize("html", [None, "<p>Hello Ann</p>"], ids=["mixed", "nested-alternative"])
def test_email_package_rebuilds_fingerprint_the_same(html: str | None) -> None:
    first, second = built(html=html), built(html=html)
    assert first != second
    assert boundaries(first).isdisjoint(boundaries(second)), "the boundaries really are random"
    assert fp(first) == fp(second)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"text": "Hello Bob,\nyour invoice is attached.\n"}, id="text-part"),
        pytest.param({"attachment": b"%PDF-1.4 invoice 1045\n" * 20}, id="attachment"),
        pytest.param({"subject": "Invoice 1045"}, id="subject"),
    ],
)
def test_email_package_different_content_differs(change: dict[str, object]) -> None:
    assert fp(built(**change)) != fp(built())  # type: ignore[arg-type]


def mime(boundary: bytes, text: bytes, quoted: bool = True) -> bytes:
    param = b'"' + boundary + b'"' if quoted else boundary
    return raw(
        extra=b"MIME-Version: 1.0\r\nContent-Type: multipart/mixed;\r\n boundary=" + param + b"\r\n",
        body=(
            b"This is a multi-part message in MIME format.\r\n"
            b"--" + boundary + b"\r\nContent-Type: text/plain\r\n\r\n" + text + b"\r\n"
            b"--" + boundary + b"--\r\n"
        ),
    )


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(b"b1_5f2a9c", b"b1_77e0d1", id="phpmailer-style"),
        pytest.param(
            b"----_NmP-0123456789abcdef-Part_1", b"----_NmP-fedcba9876543210-Part_1", id="nodemailer"
        ),
        pytest.param(b"=_abc", b"=_abcdef0123", id="different-lengths"),
    ],
)
@pytest.mark.parametrize("quoted", [True, False], ids=["quoted", "token"])
def test_hand_built_boundaries_are_neutral(a: bytes, b: bytes, quoted: bool) -> None:
    assert fp(mime(a, b"Pay 10 EUR", quoted)) == fp(mime(b, b"Pay 10 EUR", quoted))


def test_boundary_bytes_inside_content_are_content() -> None:
    # A short boundary also occurs inside the text; only its delimiter lines are neutral, so
    # "Pay 10q" and "Pay 10z" stay different messages.
    assert fp(mime(b"q", b"Pay 10q")) != fp(mime(b"z", b"Pay 10z"))


def test_boundary_parameter_in_a_plain_text_body_does_not_hide_the_text() -> None:
    a = raw(body=b"Set boundary=north then walk north\r\n")
    b = raw(body=b"Set boundary=south then walk south\r\n")
    assert fp(a) != fp(b)


# --- properties --------------------------------------------------------------------------------
ADDR = st.from_regex(r"[a-z]{1,8}@[a-z]{1,8}\.(org|example)", fullmatch=True)
TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=0, max_size=60
)


@settings(max_examples=20, deadline=None)
@given(
    sender=ADDR,
    rcpts=st.lists(ADDR, min_size=1, max_size=4, unique=True),
    subject=st.text(alphabet="abcdefghij XYZ0123", max_size=30),
    text=TEXT,
    attachment=st.binary(max_size=200),
    shuffle=st.randoms(use_true_random=False),
)
def test_equivalent_messages_fingerprint_the_same(
    sender: str,
    rcpts: list[str],
    subject: str,
    text: str,
    attachment: bytes,
    shuffle: object,
) -> None:
    first = msg(built(text=text or "-", attachment=attachment, subject=subject))
    second = msg(built(text=text or "-", attachment=attachment, subject=subject))
    other_order = list(rcpts)
    shuffle.shuffle(other_order)  # type: ignore[attr-defined]
    local, _, domain = sender.partition("@")
    assert fingerprint(sender, rcpts, first) == fingerprint(f"{local}@{domain.upper()}", other_order, second)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=200))
def test_different_bodies_differ(a: bytes, b: bytes) -> None:
    if a == b:
        return
    ma = Message((("Subject", "x"),), b"Subject: x\r\n", a)
    mb = Message((("Subject", "x"),), b"Subject: x\r\n", b)
    assert fingerprint(SENDER, RCPTS, ma) != fingerprint(SENDER, RCPTS, mb)


_v1_neutral_boundaries = fp_module._earlier_neutral_boundaries
"""The rule before it looked at where a `boundary=` stands: every one in the body was
neutral, and its value too wherever it began a line. Kept (earlier_fingerprint) to match
records it wrote, and here to show that it and the current rule hash differently only for
a `boundary=` outside any header."""


@settings(max_examples=40, deadline=None)
@given(text=TEXT, attachment=st.binary(max_size=200), html=st.none() | TEXT)
def test_mime_from_the_email_package_hashes_as_before(text: str, attachment: bytes, html: str | None) -> None:
    """Fingerprints are stored with each record: for MIME as clients build it (boundaries
    only in headers and delimiter lines), the rule hashes exactly the bytes it hashed before."""
    m = msg(built(text=text or "-", attachment=attachment, html=html))
    assert fp_module._neutral_boundaries(m.header_block, m.body) == _v1_neutral_boundaries(
        m.header_block, m.body
    )


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(
            b"Open https://x.example/?boundary=1111\r\n",
            b"Open https://x.example/?boundary=2222\r\n",
            id="plain",
        ),
        pytest.param(
            b'a BoUnDaRy = "q" word\r\n--q\r\n', b'a BoUnDaRy = "z" word\r\n--z\r\n', id="plain-with-lines"
        ),
    ],
)
def test_a_boundary_in_a_plain_body_is_text(a: bytes, b: bytes) -> None:
    assert fp(raw(body=a)) != fp(raw(body=b))


def test_a_boundary_in_a_parts_content_is_text() -> None:
    # Inside a text part, not in its header: content, so the two messages differ.
    assert fp(mime(b"b1_5f2a9c", b"see ?boundary=1111")) != fp(mime(b"b1_5f2a9c", b"see ?boundary=2222"))

    # A nested multipart declared in a part's header is neutral, as the top one is.
    def nested(outer: bytes, inner: bytes) -> bytes:
        return raw(
            extra=b'MIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary="' + outer + b'"\r\n',
            body=(
                b"--"
                + outer
                + b'\r\nContent-Type: multipart/alternative;\r\n boundary="'
                + inner
                + b'"\r\n\r\n'
                b"--" + inner + b"\r\nContent-Type: text/plain\r\n\r\nHi\r\n--" + inner + b"--\r\n"
                b"--" + outer + b"--\r\n"
            ),
        )

    assert fp(nested(b"o1", b"i1")) == fp(nested(b"o2", b"i2"))


_HAS_BOUNDARY = re.compile(rb"boundary", re.IGNORECASE)
"""The no-boundary shortcut's test before it became a search of the lower-cased bytes."""

_PIECES = st.sampled_from(
    [
        b"boundary",
        b"BoUnDaRy",
        b"bound",
        b"ary",
        b"=",
        b'"',
        b"b1",
        b"--",
        b"\r\n",
        b" ",
        b";",
        b"x",
        b"oundary=",
        "\u212a".encode(),
        "\u017f".encode(),
        "BOUNDARY\u00e9".encode(),
        b"\xc4\xb1",
        b"multipart",
    ]
)


@given(st.lists(_PIECES, max_size=30).map(b"".join), st.lists(_PIECES, max_size=30).map(b"".join))
@settings(max_examples=500, deadline=None)
def test_boundary_shortcut_is_the_regex_test_it_replaced(header_block: bytes, body: bytes) -> None:
    """Case variants and non-ASCII lookalikes (Kelvin sign, long s, dotless i, which Unicode
    case folding maps onto ASCII letters but bytes matching does not): a header block with
    no `boundary` as the IGNORECASE regex reads it leaves the body as it is."""
    if _HAS_BOUNDARY.search(header_block) is None:
        assert fp_module._neutral_boundaries(header_block, body) == body
    assert (_HAS_BOUNDARY.search(header_block) is None) == (b"boundary" not in header_block.lower())


# Fingerprints computed by the implementation before the CPU cuts (commit 8ddc36c): they are
# stored with each record, and one that changed across an upgrade would turn the retry of an
# event sent before it into a "reused key". One stored value was changed on purpose: a plain
# body's `boundary=` "q" and its `--q` line were neutral, so two messages differing only
# there shared a fingerprint (test_a_boundary_in_a_plain_body_is_text); they are text now.
_STORED = {
    "plain": ({}, "55a4c4127bbd10b96dda20dbbb25e159475030ac845c76e7e76877c75c4e24db"),
    "multipart": (
        {
            "extra": b'MIME-Version: 1.0\r\nContent-Type: multipart/alternative; boundary="=_a1b2"\r\n',
            "body": b"--=_a1b2\r\nContent-Type: text/plain\r\n\r\nHi\r\n--=_a1b2--\r\n",
        },
        "ed37c417c5baeac4031bcba1498b6ac1b95ef541d1902905e25e986897f9f052",
    ),
    "upper": (
        {
            "extra": b"Content-Type: MULTIPART/MIXED; BOUNDARY=XyZ\r\n",
            "body": b"--XyZ\r\n\r\nHi\r\n--XyZ--\r\n",
        },
        "bd869424eb4c18b64570151da2980894567c504e4df4f7064037a26b0269cc39",
    ),
    "non-ascii": (
        {"body": "boundary? \u212a\u017f Ünïcode BOUNDARY\u00e9=x\r\n--x\r\n".encode()},
        "32bc4f2f64969b7b1f895568af78ceeacc49734613e70c49d18f8606e601ef33",
    ),
    "lookalike-only": (
        {"body": "bo\u00fcndary \u212aelvin".encode()},
        "744e49c61763ab46a4fc9d1659f10b88c5354e6d80255565147fe10f033a38ed",
    ),
}


@pytest.mark.parametrize("name", sorted(_STORED))
def test_stored_fingerprints_do_not_change(name: str) -> None:
    kw, stored = _STORED[name]
    assert fp(raw(**kw)) == stored
