"""What the log-API client's error counter (`ApiClient.errors`, exported as
smtpguard_verdict_api_errors_total{kind}) counts in each situation the client can end in,
and which error it raises there: one row per situation, against a local aiohttp API."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from smtpguard.verdicts import http
from smtpguard.verdicts.http import (
    ApiAuthRefused,
    ApiClient,
    ApiError,
    ApiMalformed,
    ApiNotFound,
    ApiTruncated,
    ApiUnavailable,
    Retry,
)


async def _status(request: web.Request) -> web.Response:
    status = int(request.match_info["status"])
    return web.Response(status=status, headers=dict(request.query), body=b"{}")


def _body(body: bytes) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=body)

    return answer


@pytest.fixture
async def api() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/status/{status}", _status)
    app.router.add_get("/json", _body(b'{"next": 1}'))
    app.router.add_get("/not-json", _body(b"<html>"))
    app.router.add_get("/large", _body(b'{"a": "' + b"x" * 64 + b'"}'))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def _no_wait(seconds: float) -> None:
    return None


def _client(base_url: str) -> ApiClient:
    return ApiClient(
        provider="primary", base_url=base_url, auth=dict, retry=Retry(attempts=4), sleep=_no_wait
    )


GETS: list[tuple[str, type[ApiError] | None, dict[str, int]]] = [
    ("/json", None, {}),
    ("/status/400", ApiError, {"refused": 1}),
    ("/status/405", ApiError, {"refused": 1}),
    ("/status/404", ApiNotFound, {}),
    ("/status/401", ApiAuthRefused, {"auth": 1}),
    ("/status/403", ApiAuthRefused, {"auth": 1}),
    ("/status/500", ApiUnavailable, {"server": 4, "unavailable": 1}),
    ("/status/503", ApiUnavailable, {"server": 4, "unavailable": 1}),
    ("/status/429", ApiUnavailable, {"rate_limited": 4, "unavailable": 1}),
    ("/status/429?Retry-After=0", ApiUnavailable, {"rate_limited": 4, "unavailable": 1}),
    ("/status/429?Retry-After=3600", ApiUnavailable, {"rate_limited": 1, "unavailable": 1}),
    ("/not-json", ApiMalformed, {"malformed": 1}),
    ("/large", ApiMalformed, {"malformed": 1}),
    ("http://localhost:1/elsewhere", ApiMalformed, {"malformed": 1}),
]


@pytest.mark.parametrize(("path", "raised", "counted"), GETS, ids=[row[0] for row in GETS])
async def test_each_answer_is_counted_under_its_kind(
    api: str,
    path: str,
    raised: type[ApiError] | None,
    counted: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http, "MAX_BODY", 32)
    async with _client(api) as client:
        if raised is None:
            assert await client.get_json(path) == {"next": 1}
        else:
            with pytest.raises(raised) as caught:
                await client.get_json(path)
            assert type(caught.value) is raised
    assert dict(client.errors) == counted


async def test_an_api_nobody_listens_at_counts_each_attempt_then_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    async with _client(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(ApiUnavailable):
            await client.get_json("/json")
    assert dict(client.errors) == {"network": 4, "unavailable": 1}


async def test_more_pages_than_one_call_may_read_is_truncated_and_not_counted(api: str) -> None:
    def following(body: Any, n: int) -> tuple[str, None]:
        return ("/json", None)

    async with _client(api) as client:
        assert [page async for page in client.pages(("/json", None), following, 2)] == [{"next": 1}] * 2
        with pytest.raises(ApiTruncated):
            async for _ in client.pages(("/json", None), following, 2, whole=True):
                pass
    assert dict(client.errors) == {}
    assert client.requests == 4


def test_a_malformed_response_found_after_the_request_is_not_counted() -> None:
    client = _client("http://127.0.0.1:9")
    with pytest.raises(ApiMalformed, match=r"^primary: the response has no `items`$"):
        client.need_list({"items": None}, "items")
    assert isinstance(client.untimed(), ApiMalformed)
    assert dict(client.errors) == {}
    assert client.requests == 0
