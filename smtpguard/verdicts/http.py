"""What the three log-API clients share: one aiohttp session per API, with a timeout and a
connection limit; `429` honoured; a bounded retry of `5xx` and network errors; `401`/`403`
logged once an hour and counted; paging bounded in pages. Errors become smtpguard's own
(`ApiAuthRefused`, `ApiUnavailable`, `ApiMalformed`) here and nowhere else.

The API key is held by `Credential`, whose repr and str hide it, and goes only into the
headers of requests to the configured `base_url`: a paging link that points anywhere else, and
any redirect, is refused rather than followed, and no log line, exception or repr is built from the headers.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self
from urllib.parse import urlsplit

import aiohttp

from smtpguard.policy.verdicts import Attempt, LogEntry, LogKind, log_identity, matches

if TYPE_CHECKING:
    from smtpguard.verdict_config import MailgunApi, PostmarkApi, SendgridApi

log = logging.getLogger("smtpguard.verdicts")

MAX_BODY = 8 << 20
"""Bytes of one response read at most: a page of any of the three APIs is far smaller."""
AUTH_LOG_EVERY = 3600.0
"""A refused key is logged once an hour per API, not once per record asked about."""


class ApiError(Exception):
    """The API could not answer. `kind` is the label the client's error counter
    (ApiClient.errors, smtpguard_verdict_api_errors_total) counts the error under when the
    client raises it, or None: not counted. ApiError itself is the answer the client has no
    other name for: a 4xx other than 401, 403, 404 and 429."""

    kind: ClassVar[str | None] = "refused"


class ApiAuthRefused(ApiError):
    kind = "auth"


class ApiUnavailable(ApiError):
    kind = "unavailable"


class ApiNotFound(ApiError):
    """404: what was asked for is not there (yet: logs are eventually consistent)."""

    kind = None


class ApiTruncated(ApiError):
    """More pages than one call may read: what was read is not the whole range asked for."""

    kind = None


class ApiMalformed(ApiError):
    """The API answered something its documentation does not describe."""

    kind = "malformed"


class Credential:
    """A secret that never prints itself."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Credential(<hidden>)"

    __str__ = __repr__


def header_auth(header: str, value: str) -> Callable[[], Mapping[str, str]]:
    """An ApiClient's `auth` for an API whose credential is one request header: the value is
    held by a Credential, so nothing the client keeps prints it."""
    secret = Credential(value)
    return lambda: {header: secret.reveal()}


@dataclass(frozen=True, slots=True)
class Retry:
    attempts: int = 4
    """Requests per call at most, the first included."""
    backoff: float = 0.5
    """Seconds before the first retry without a Retry-After; doubled each time."""
    backoff_max: float = 30.0
    retry_after_max: float = 60.0
    """A longer Retry-After is not waited for inside one call: the API is unavailable now,
    and the verdict loop asks again at its next look."""


def retry_after(value: str | None, now: float) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP-date, RFC 9110 §10.2.3)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now)


class ApiClient:
    """One provider API. `provider` is smtpguard's name for the provider (for logs and
    counters); the credential is `key`, sent in the header `credential_header` names, or
    `auth`, the headers that carry it; `clock` is monotonic, `wall` is Unix time."""

    kind: ClassVar[str]
    """The provider kind whose log the client reads: the `kind` of its `api:`."""

    def __init__(
        self,
        *,
        provider: str,
        base_url: str,
        key: str | None = None,
        auth: Callable[[], Mapping[str, str]] | None = None,
        timeout: float = 10.0,
        max_connections: int = 4,
        retry: Retry = Retry(),
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if auth is None and key is not None:
            auth = header_auth(*self.credential_header(key))
        elif auth is None or key is not None:
            raise TypeError(f"{type(self).__name__} takes a key or an auth, not both or neither")
        self.provider = provider
        self.base_url = base_url.rstrip("/")
        self.log = log_identity(self.kind, self.base_url, self.log_domain(), key) if key is not None else None
        """The log this client reads (policy.verdicts.log_identity): it proves absent only a
        message noted as sent while its provider's api named this log. None with an `auth`."""
        self._origin = _origin(self.base_url)
        self._auth = auth
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._max_connections = max_connections
        self._retry = retry
        self._clock = clock
        self._wall = wall
        self._sleep = sleep
        self._session: aiohttp.ClientSession | None = None
        self._auth_logged_at: float | None = None
        self.errors: Counter[str] = Counter()
        """Per error kind (auth, rate_limited, server, network, malformed, unavailable)."""
        self.requests = 0

    @classmethod
    def from_config(
        cls, provider: str, api: MailgunApi | PostmarkApi | SendgridApi, key: str, **kw: Any
    ) -> Self:
        """The client a provider's `api:` sets: where its API is (the kind's public API by
        default), the timeout of a request and the connections to it."""
        if api.kind != cls.kind:
            # The key would go to another provider's API (its default base_url).
            raise ValueError(f"{cls.__name__} reads a {cls.kind} log, not {api.kind}")
        return cls(
            provider=provider,
            key=key,
            base_url=api.url(cls.kind),
            timeout=api.timeout,
            max_connections=api.max_connections,
            **cls.config_keywords(api),
            **kw,
        )

    @classmethod
    def config_keywords(cls, api: MailgunApi | PostmarkApi | SendgridApi) -> dict[str, Any]:
        """The keywords of the client's own (beyond ApiClient's) that its `api:` sets."""
        return {}

    def log_domain(self) -> str | None:
        """What of the log, beyond its API and key, names it (Mailgun's domain)."""
        return None

    def credential_header(self, key: str) -> tuple[str, str]:
        """The request header that carries the API key, and its value."""
        raise TypeError(f"{type(self).__name__} takes an auth, not a key")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(provider={self.provider!r}, base_url={self.base_url!r})"

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, headers={"Accept": "application/json"}
            )
        return self._session

    def url(self, path_or_url: str) -> str:
        """A path under base_url, or an absolute URL (a paging link) on base_url's origin."""
        if "://" not in path_or_url:
            return self.base_url + path_or_url
        if _origin(path_or_url) != self._origin:
            raise self._failed(
                ApiMalformed(f"{self.provider}: a paging link points off the API's base_url; not followed")
            )
        return path_or_url

    async def get_json(self, path_or_url: str, params: Mapping[str, str] | None = None) -> Any:
        """GET and decode JSON, honouring 429 and retrying 5xx and network errors (bounded)."""
        url = self.url(path_or_url)
        where = urlsplit(url).path
        last = "no answer"
        wait = 0.0
        for attempt in range(self._retry.attempts):
            if attempt:
                await self._sleep(wait)
            self.requests += 1
            try:
                # Never followed: a redirect to another host would carry a header credential
                # there (aiohttp drops only Authorization) and make its answer the verdict's.
                async with self._client().get(
                    url, params=params, headers=self._auth(), allow_redirects=False
                ) as resp:
                    status = resp.status
                    if status == 200:
                        return await self._json(resp, where)
                    header = resp.headers.get("Retry-After")
            except (aiohttp.ClientError, TimeoutError) as e:
                # type(e) only: aiohttp's texts name the URL, and a URL may carry a filter value
                self.errors["network"] += 1
                last = f"{type(e).__name__}"
                wait = self._backoff(attempt)
                continue
            if status in (401, 403):
                self._auth_refused(status, where)
            if status == 429:
                self.errors["rate_limited"] += 1
                told = retry_after(header, self._wall())
                last = "429 Too Many Requests"
                if told is not None and told > self._retry.retry_after_max:
                    last += f", Retry-After {told:g}s"
                    break
                wait = self._backoff(attempt) if told is None else told
                continue
            if status >= 500:
                self.errors["server"] += 1
                wait = self._backoff(attempt)
                last = f"HTTP {status}"
                continue
            if 300 <= status < 400:
                raise self._failed(
                    ApiMalformed(
                        f"{self.provider}: {where} answered a redirect (HTTP {status}); not followed"
                    )
                )
            if status == 404:
                raise self._failed(ApiNotFound(f"{self.provider}: {where} answered HTTP 404"))
            raise self._failed(ApiError(f"{self.provider}: {where} answered HTTP {status}"))
        raise self._failed(
            ApiUnavailable(f"{self.provider}: {where} unavailable after {attempt + 1} requests ({last})")
        )

    async def _json(self, resp: aiohttp.ClientResponse, where: str) -> Any:
        """The body of a 200, read no further than MAX_BODY: a broken or hostile API's
        endless body, or JSON nested past the parser's recursion, is malformed, not a crash."""
        body = bytearray()
        if resp.content_length is None or resp.content_length <= MAX_BODY:
            async for chunk in resp.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > MAX_BODY:
                    break
        if len(body) > MAX_BODY or (resp.content_length or 0) > MAX_BODY:
            raise self._failed(
                ApiMalformed(f"{self.provider}: {where} answered 200 with more than {MAX_BODY} bytes")
            )
        try:
            return json.loads(body)
        except (ValueError, RecursionError):
            raise self._failed(
                ApiMalformed(f"{self.provider}: {where} answered 200 with no usable JSON")
            ) from None

    def _backoff(self, attempt: int) -> float:
        return float(min(self._retry.backoff * (2**attempt), self._retry.backoff_max))

    def _auth_refused(self, status: int, where: str) -> None:
        now = self._clock()
        if self._auth_logged_at is None or now - self._auth_logged_at >= AUTH_LOG_EVERY:
            self._auth_logged_at = now
            log.warning(
                "provider API refused smtpguard's credentials; verdicts for it wait",
                extra={"provider": self.provider, "status": status, "path": where},
            )
        raise self._failed(
            ApiAuthRefused(f"{self.provider}: {where} answered HTTP {status} (credentials refused)")
        )

    def _failed(self, error: ApiError) -> ApiError:
        """The error to raise, counted under its kind: every error a request or a paging raises
        passes here (not those need_list, untimed and partial_look find in an answer taken)."""
        if error.kind is not None:
            self.errors[error.kind] += 1
        return error

    async def pages(
        self,
        first: tuple[str, Mapping[str, str] | None],
        following: Callable[[Any, int], tuple[str, Mapping[str, str] | None] | None],
        max_pages: int,
        whole: bool = False,
    ) -> AsyncIterator[Any]:
        """Each page's decoded body, first request first; `following(body, n)` gives the next
        request after the n-th page (1-based), or None when the last page is reached.
        `whole`: the caller needs every page (reconciliation moves its cursor past them), so
        a range with pages left after `max_pages` raises ApiTruncated instead of ending."""
        request: tuple[str, Mapping[str, str] | None] | None = first
        n = 0
        while request is not None and n < max_pages:
            body = await self.get_json(*request)
            n += 1
            yield body
            request = following(body, n)
        if whole and request is not None:
            raise self._failed(
                ApiTruncated(f"{self.provider}: more than {max_pages} pages in the range asked for")
            )

    def need_list(self, body: Any, key: str | None) -> list[Any]:
        """The documented list in a response (body[key], or the body itself), or ApiMalformed."""
        value = body if key is None else field(body, key)
        if not isinstance(value, list):
            where = f"`{key}`" if key else "a list"
            raise ApiMalformed(f"{self.provider}: the response has no {where}")
        return value

    def untimed(self) -> ApiMalformed:
        """An entry that may be the attempt's message, with a time smtpguard cannot read: no
        verdict rests on the log then, for dropping the entry could leave only another
        message's later acceptance, the proof that leads to `not accepted` and a second copy."""
        return ApiMalformed(f"{self.provider}: a log entry of the message has no time smtpguard can read")

    def partial_look(self, attempt: Attempt, entries: list[LogEntry]) -> list[LogEntry]:
        """The entries of a look that could not read all the search found (pages or details
        left unread): they settle the record only by an acceptance of its own among them. An
        entry left unread may be that acceptance, so without one the look proves neither a
        refusal (a drop of some recipients, the acceptance for another unread: `failed`, and
        the application sends it another way) nor an absence (`not accepted`, sent again)."""
        if any(e.kind is LogKind.ACCEPTED and matches(attempt, e) for e in entries):
            return entries
        raise ApiTruncated(
            f"{self.provider}: the log holds more entries that may be the message than one look reads"
        )


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


def field(obj: Any, *path: str | int) -> Any:
    """obj[path[0]][path[1]]…, or None where the shape differs: providers leave fields out."""
    for part in path:
        if isinstance(part, int):
            obj = obj[part] if isinstance(obj, list) and -len(obj) <= part < len(obj) else None
        else:
            obj = obj.get(part) if isinstance(obj, dict) else None
        if obj is None:
            return None
    return obj
