"""The console in a real browser: Debian's headless Chromium driven by Playwright (no
browser is downloaded). Two operators in two browser sessions on one unknown event: one
decision, the other sees it, the stale page gets 409, the history holds one audit entry.
Every page is saved as a screenshot (build/screenshots, or $SMTPGUARD_SCREENSHOTS)."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from playwright import async_api as playwright_api

from smtpguard.server import Server
from tests.support import Upstream, message, running_guard, send
from tests.support.console import PASSWORDS, console_config, console_port, hold

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = Path(
    os.environ.get("SMTPGUARD_SCREENSHOTS", Path(__file__).resolve().parents[2] / "build" / "screenshots")
)
# As root in CI, and on a closed network: no sandbox, no background connections.
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def chromium() -> str:
    if not os.path.exists(CHROMIUM):
        pytest.fail("chromium is not installed (scripts/test installs Debian's chromium)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    return CHROMIUM


@pytest.fixture
async def browser(chromium: str) -> AsyncIterator[Any]:
    async with playwright_api.async_playwright() as p:
        b = await p.chromium.launch(executable_path=chromium, headless=True, args=ARGS)
        yield b
        await b.close()


@pytest.fixture
async def guard(tmp: Path, upstream: Upstream) -> AsyncIterator[Server]:
    async with running_guard(console_config(tmp, upstream)) as server:
        yield server


async def login(browser: Any, port: int, username: str) -> Any:
    context = await browser.new_context(viewport={"width": 1200, "height": 800})
    page = await context.new_page()
    await page.goto(f"http://127.0.0.1:{port}/login")
    await page.fill("input[name=username]", username)
    await page.fill("input[name=password]", PASSWORDS[username])
    await page.click("button[type=submit]")
    await page.wait_for_url(f"http://127.0.0.1:{port}/")
    return page


async def shot(page: Any, name: str) -> None:
    await page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


async def test_two_operators_in_two_browsers_one_decision(
    browser: Any, guard: Server, upstream: Upstream
) -> None:
    port = console_port(guard)
    for i in range(3):
        assert (await send(guard.ports[0], message(f"order:{i}"))).code == 250
    await hold(guard, upstream, "invoice:1044")
    await hold(guard, upstream, "invoice:1045", state="failed")

    anon = await (await browser.new_context()).new_page()
    await anon.goto(f"http://127.0.0.1:{port}/decisions")
    assert anon.url.endswith("/login")
    await shot(anon, "login")

    alice = await login(browser, port, "alice")
    bob = await login(browser, port, "bob")
    await shot(alice, "zones")
    # Both open the decisions page before either decides.
    for page in (alice, bob):
        await page.goto(f"http://127.0.0.1:{port}/decisions")
    item = '[data-zone="acme"][data-key="invoice:1044"]'
    assert await alice.locator(f"{item} button[name=action]").count() == 2
    await shot(alice, "decisions")

    await alice.click(f'{item} button[name=action][value="delivered"]')
    await alice.wait_for_url(f"http://127.0.0.1:{port}/decisions")
    assert "by console:alice at" in await alice.locator(item).inner_text()
    assert await alice.locator(f"{item} button").count() == 0
    await shot(alice, "decisions-after")

    # Bob's page is stale: his click is refused, naming who decided.
    response = None
    async with bob.expect_response(lambda r: r.url.endswith("/decide")) as info:
        await bob.click(f'{item} button[name=action][value="retry"]')
    response = await info.value
    assert response.status == 409
    assert "already resolved by console:alice at" in await bob.content()
    await shot(bob, "stale-409")
    await bob.goto(f"http://127.0.0.1:{port}/decisions")
    assert "by console:alice at" in await bob.locator(item).inner_text()
    assert await bob.locator(f"{item} button").count() == 0

    # The release of the failed one reaches the upstream exactly once.
    failed = '[data-zone="acme"][data-key="invoice:1045"]'
    await bob.click(f'{failed} button[name=action][value="release"]')
    await bob.wait_for_url(f"http://127.0.0.1:{port}/decisions")
    before = len(upstream.received)
    assert (await send(guard.ports[0], message("invoice:1045"))).code == 250
    again = await send(guard.ports[0], message("invoice:1045"))
    assert again.code == 250 and "duplicate" in again.text
    assert len(upstream.received) == before + 1

    await alice.goto(f"http://127.0.0.1:{port}/events/acme/invoice%3A1044")
    timeline = await alice.locator(".timeline").inner_text()
    assert timeline.count("resolve:delivered by console:alice") == 1
    await shot(alice, "history")
    assert guard.store is not None
    rec = await guard.store.get("acme", "invoice:1044")
    assert rec is not None and [e.action for e in rec.audit] == ["resolve:delivered"]

    await alice.goto(f"http://127.0.0.1:{port}/suppression/acme")
    await alice.fill("input[name=address]", "gone@example.net")
    await alice.fill("input[name=reason]", "asked by phone")
    await alice.click("form[action$='/add'] button")
    assert "gone@example.net" in await alice.locator("table").inner_text()
    await shot(alice, "suppression")
    await alice.goto(f"http://127.0.0.1:{port}/queue")
    await shot(alice, "queue")
    await alice.goto(f"http://127.0.0.1:{port}/records/acme?state=delivered")
    await shot(alice, "records")
    for name in (
        "login",
        "zones",
        "decisions",
        "decisions-after",
        "stale-409",
        "history",
        "suppression",
        "queue",
    ):
        assert (SHOTS / f"{name}.png").stat().st_size > 5000, name


async def test_a_viewer_in_the_browser_sees_no_buttons(
    browser: Any, guard: Server, upstream: Upstream
) -> None:
    await hold(guard, upstream, "invoice:1")
    page = await login(browser, console_port(guard), "victor")
    assert await page.locator("button.danger").count() == 0  # no pause
    await page.goto(f"http://127.0.0.1:{console_port(guard)}/decisions")
    assert await page.locator('[data-key="invoice:1"]').count() == 1
    assert await page.locator("button[name=action]").count() == 0
    await shot(page, "decisions-viewer")


async def test_the_search_box_in_the_header_finds_a_record_by_its_message_id(
    browser: Any, guard: Server, upstream: Upstream
) -> None:
    assert (await send(guard.ports[0], message("invoice:77"))).code == 250
    message_id = upstream.received[-1].header("Message-ID") or ""
    page = await login(browser, console_port(guard), "alice")
    await page.fill("header input[name=q]", message_id)
    await page.press("header input[name=q]", "Enter")
    await page.wait_for_url("**/search?q=*")
    row = page.locator('tr[data-key="invoice:77"]')
    assert await row.count() == 1
    assert (await row.get_attribute("data-by")) == "Message-ID"
    await shot(page, "search")
    await row.locator("a").click()
    await page.wait_for_url("**/events/acme/invoice%3A77")
    assert "invoice:77" in await page.inner_text("h1")
    assert len(upstream.received) == 1
