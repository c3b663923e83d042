"""An upgrade on one SQLite store: the release before this session's changes (40cb517, its
tree from `git archive`) keeps serving while this one serves too. Each event is offered to
one and retried at the other, the retry with what its client redraws (Date, Message-ID,
MIME boundaries, a forwarded mail's boundaries) and the recipients it names twice: every
retry is a duplicate and each event reaches the upstream once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from email.message import EmailMessage
from pathlib import Path

import pytest

from tests.support import Upstream, base_config, message, running_guard, send
from tests.support.releases import extract_release, release_serving
from tests.wire.test_outsider_session_review_fingerprint import forwarded

BEFORE = "40cb517"


@pytest.fixture
def before(tmp: Path) -> Iterator[Path]:
    yield extract_release(BEFORE, tmp / "before")


def multipart(key: str | None) -> EmailMessage:
    m = message(key, body="Your invoice.\n")
    m.add_alternative("<p>Your invoice.</p>\n", subtype="html")
    m.add_attachment(b"%PDF-1.4 invoice", maintype="application", subtype="pdf", filename="inv.pdf")
    return m


EVENTS: dict[str, tuple[Callable[[str | None], EmailMessage], list[str]]] = {
    "plain": (lambda k: message(k), ["customer@example.com"]),
    "twice-named": (
        lambda k: message(k, subject="Invoice 2"),
        ["customer@example.com", "customer@EXAMPLE.com"],
    ),
    "multipart": (multipart, ["customer@example.com"]),
    "forwarded": (forwarded, ["customer@example.com"]),
}
KEYED_ONLY: dict[str, tuple[Callable[[str | None], EmailMessage], list[str]]] = {
    # A plain body with `boundary=` in its text: the earlier release hashed it neutralised,
    # this one as written. A keyed retry matches the earlier fingerprint; a derived key is
    # the fingerprint itself, so the earlier release's record is not found (documented).
    "link-boundary": (
        lambda k: message(k, subject="Invoice 3", body="Pay at https://pay.example/?boundary=77\n"),
        ["customer@example.com"],
    ),
}


@pytest.mark.parametrize("derive", [False, True], ids=["keyed", "derived"])
async def test_a_retry_across_the_two_releases_is_one_delivery(
    tmp: Path, upstream: Upstream, before: Path, derive: bool
) -> None:
    cfg = base_config(tmp, upstream.port, instance="new")
    if derive:
        cfg["zones"]["acme"]["missing_key"] = "derive"
    old_cfg = base_config(tmp, upstream.port, instance="old")
    old_cfg["zones"] = cfg["zones"]
    async with release_serving(before, old_cfg, tmp) as old_port, running_guard(cfg) as guard:
        new_port = guard.ports[0]
        answers: dict[str, list[tuple[int, str]]] = {}
        events = EVENTS if derive else {**EVENTS, **KEYED_ONLY}
        for i, (name, (build, rcpts)) in enumerate(sorted(events.items())):
            key = None if derive else f"two:{name}"
            # Half start at the old release, half at the new one.
            # A KEYED_ONLY event starts at the earlier release: the other way, that
            # release cannot know the fingerprint this one wrote (it answers 550 reused).
            starts_old = i % 2 == 0 or name in KEYED_ONLY
            ports = (old_port, new_port) if starts_old else (new_port, old_port)
            answers[name] = [
                ((r := await send(port, build(key), recipients=rcpts)).code, r.text) for port in ports
            ]
    print("across releases:", answers, "upstream:", len(upstream.received))
    for name, (first, retry) in answers.items():
        assert first[0] == 250 and retry[0] == 250 and "duplicate" in retry[1], (name, first, retry)
    assert len(upstream.received) == len(answers)
