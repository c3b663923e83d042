"""The listener's fast path for plain `<local@domain>` must agree with aiosmtpd's RFC 5322
parser on every address it takes (it only skips the parser's cost)."""

from __future__ import annotations

import types

from aiosmtpd.smtp import SMTP
from hypothesis import given, settings
from hypothesis import strategies as st

from smtpguard.policy.senders import address_problem

_ATEXT = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-/=?^_`{|}~."
local_parts = st.text(alphabet=_ATEXT, min_size=1, max_size=64)
labels = st.from_regex(r"[a-z0-9](?:[a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
domains = st.lists(labels, min_size=1, max_size=4).map(".".join)


@settings(max_examples=400, deadline=None)
@given(local=local_parts, domain=domains, params=st.sampled_from(["", " SIZE=100", " BODY=8BITMIME"]))
def test_fast_path_addresses_parse_the_same(local: str, domain: str, params: str) -> None:
    raw = f"{local}@{domain}"
    if address_problem(raw) is not None:
        return  # not taken by the fast path
    parsed, rest = SMTP._getaddr(types.SimpleNamespace(local_part_limit=0), f"<{raw}>{params}")
    assert parsed is not None
    # aiosmtpd may drop dots it deems obsolete syntax; the fast path keeps what was written,
    # as the slow path in GuardSMTP does whenever the two differ.
    assert parsed.replace(".", "") == raw.replace(".", "")
    assert (rest or "").split() == params.split()
