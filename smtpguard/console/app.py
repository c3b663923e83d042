"""The console's HTTP side: aiohttp routes, login, sessions, CSRF and roles (§14).

Every page is server-rendered HTML that works without JavaScript; Jinja2 autoescapes
everything it renders. Every change is a POST carrying the session's CSRF token (403
without), refused to a `viewer` (403), audited as `console:USERNAME` and made through the
same code as the CLI's (smtpguard/desk.py for decisions).

Before anything else, a request must be addressed to a host this console is (421 for any
other: DNS rebinding), and its client is the TCP peer, or the address a trusted proxy names
(console/trust.py). Logins are limited per that address and per username (console/logins.py).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import jinja2
from aiohttp import web

from smtpguard import desk
from smtpguard.config import Config, ConsoleConfig, OperatorConfig
from smtpguard.console import search, trust, views
from smtpguard.console.logins import LoginLimiter
from smtpguard.console.sessions import COOKIE, LOGIN_COOKIE, Session, Sessions, fingerprint, same_token
from smtpguard.http_listener import BodyAborted, LimitedListener
from smtpguard.passwords import Verifier
from smtpguard.policy.senders import address_problem, normalize_address
from smtpguard.store import Store, StoreUnavailable

log = logging.getLogger("smtpguard.console")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SESSION = web.RequestKey("session", Session)
CLIENT = web.RequestKey("client", str)
"""The client's address as console/trust.py reads it: what limits and logs name."""
RELOADABLE = frozenset({"operators", "session_ttl", "hosts", "trusted_proxies"})
"""Console settings a reload applies; the others are bound when the listener starts."""
_PUBLIC = ("/login",)
_BACK = re.compile(r"/events/[A-Za-z0-9._%~-]+/[A-Za-z0-9._%~-]+")
"""Where a decision may send the browser back to: an event's page, URL-encoded, nothing else."""
_SECURITY_HEADERS = {
    # Pages need nothing but themselves: no scripts, no frames, forms only back to us.
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


_Page = TypeVar("_Page", bound=Callable[..., Awaitable[web.StreamResponse]])
_PAGES: list[tuple[Literal["GET", "POST"], str, str]] = []
"""(method, path, Console method) of every route, in the order the @_route lines below declare
them: Console.__init__ adds them to the router so."""


def _route(method: Literal["GET", "POST"], path: str) -> Callable[[_Page], _Page]:
    def declare(page: _Page) -> _Page:
        _PAGES.append((method, path, page.__name__))
        return page

    return declare


class Console:
    def __init__(self, config: Callable[[], Config], store: Store, console: ConsoleConfig) -> None:
        self.config = config
        self.store = store
        self.settings = console
        self.tls = console.tls is not None
        self.sessions = Sessions(console.session_ttl)
        self.verifier = Verifier()
        self.logins = LoginLimiter(store, lambda: self.config().limits)
        self._verifying = asyncio.Semaphore(4)
        """argon2 runs in the executor SMTP AUTH uses too: logins never take all of it."""
        self.templates = jinja2.Environment(
            loader=jinja2.PackageLoader("smtpguard.console", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.templates.globals.update(views.template_globals(), quote=lambda s: quote(s, safe=""))
        self.app = web.Application(middlewares=[self._guard], client_max_size=64 * 1024)
        add = {"GET": self.app.router.add_get, "POST": self.app.router.add_post}
        for method, path, page in _PAGES:
            add[method](path, getattr(self, page))
        self._listener: LimitedListener | None = None
        self.port = 0

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        ctx = None
        if self.settings.tls is not None:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(self.settings.tls.cert, self.settings.tls.key)
        # The connection caps, read_timeout and idle_timeout of console.* (http_listener.py).
        self._listener = LimitedListener(self.app, self.settings, "console", log.name)
        await self._listener.start(self.settings.host, self.settings.port, ctx)
        self.port = self._listener.port

    async def stop(self) -> None:
        if self._listener is not None:
            await self._listener.stop()
            self._listener = None

    # --- security ----------------------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await self._checked(request, handler)
        except StoreUnavailable as e:
            log.error("console: store unavailable", extra={"error": str(e)})
            response = self.page(
                "error.html", request, status=503, message="The store is unavailable; try again."
            )
        except web.HTTPException as e:
            if e.status < 400:
                raise
            response = self.page("error.html", request, status=e.status, message=e.reason)
        except BodyAborted:
            # Nothing was done: the form never arrived whole, and nobody is left to answer.
            log.info(
                "console: request body aborted", extra={"client_ip": request.remote, "path": request.path}
            )
            response = self.page(
                "error.html", request, status=400, message="The form was not received whole."
            )
        except Exception:
            log.exception("console: request failed", extra={"path": request.path})
            response = self.page(
                "error.html", request, status=500, message="Something went wrong; see the log."
            )
        response.headers.update(_SECURITY_HEADERS)
        return response

    async def _checked(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        trust.check_host(request, self.live)
        request[CLIENT] = trust.client(request, self.live)
        session = self.sessions.get(request.cookies.get(COOKIE))
        if session is not None and not self._still_valid(session):
            # Removed, given another role or another password by a reload: that login is over.
            self.sessions.drop(session.token)
            session = None
        if session is not None:
            request[SESSION] = session
        if request.path in _PUBLIC:
            return await handler(request)
        if session is None:
            if request.method == "POST":
                raise web.HTTPForbidden(reason="log in first")
            raise web.HTTPSeeOther("/login")
        if request.method == "POST":
            form = await request.post()
            csrf = form.get("csrf")
            if not session.csrf_ok(csrf if isinstance(csrf, str) else None):
                raise web.HTTPForbidden(reason="missing or wrong CSRF token; reload the page")
            if session.role != "operator" and request.path != "/logout":
                raise web.HTTPForbidden(
                    reason=f"{session.username} is a viewer: changes need the operator role"
                )
        return await handler(request)

    def page(self, name: str, request: web.Request, status: int = 200, **context: Any) -> web.Response:
        session = request.get(SESSION)
        body = self.templates.get_template(name).render(
            session=session,
            csrf=session.csrf if session else "",
            can_change=session is not None and session.role == "operator",
            **context,
        )
        return web.Response(text=body, status=status, content_type="text/html", charset="utf-8")

    @property
    def live(self) -> ConsoleConfig:
        """The console section as the running config has it (a reload changes it)."""
        return self.config().console or self.settings

    def _still_valid(self, session: Session) -> bool:
        operator = self._operator(session.username)
        return (
            operator is not None
            and operator.role == session.role
            and hmac.compare_digest(fingerprint(operator.password_hash), session.credential)
        )

    def reload(self, new: ConsoleConfig) -> list[str]:
        """Apply a reloaded console section: end the sessions it invalidates; return the
        settings that only a restart changes."""
        self.sessions.ttl = new.session_ttl
        restart = [
            f"console.{name}"
            for name in type(new).model_fields
            if name not in RELOADABLE and getattr(new, name) != getattr(self.settings, name)
        ]
        ended = self.sessions.end(lambda s: not self._still_valid(s))
        if ended:
            log.warning(
                "console: sessions ended by reload", extra={"usernames": sorted({s.username for s in ended})}
            )
        return restart

    def _actor(self, request: web.Request) -> str:
        return f"console:{request[SESSION].username}"

    def _zone(self, request: web.Request, name: str | None = None) -> str:
        zone = name if name is not None else request.match_info["zone"]
        if zone not in self.config().zones and zone != "global":
            raise web.HTTPNotFound(reason=f"no zone named {zone!r}")
        return zone

    # --- login -------------------------------------------------------------------------------
    @_route("GET", "/login")
    async def login_page(self, request: web.Request) -> web.StreamResponse:
        # No server-side session before a login succeeds: the form's CSRF token is a random
        # value in a cookie of its own, echoed by the form (double submit; the cookie is
        # SameSite=Strict). So requests for the login page cost nothing to keep, and
        # cannot crowd out the sessions of operators who are logged in.
        token = request.cookies.get(LOGIN_COOKIE)
        if not token or len(token) > 64:
            token = secrets.token_urlsafe(32)
        response = self.page("login.html", request, error=None, login_csrf=token)
        response.set_cookie(
            LOGIN_COOKIE,
            token,
            httponly=True,
            samesite="Strict",
            secure=self.tls,
            path="/login",
            max_age=3600,
        )
        return response

    @_route("POST", "/login")
    async def login(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        csrf, cookie = form.get("csrf"), request.cookies.get(LOGIN_COOKIE)
        if not isinstance(csrf, str) or not cookie or not same_token(cookie, csrf):
            raise web.HTTPForbidden(reason="missing or wrong CSRF token; reload the login page")
        ip = request[CLIENT]
        given, password = form.get("username"), form.get("password")
        username = given if isinstance(given, str) else ""
        async with self.logins.turn(ip, username), self._verifying:
            now = self.store.now()
            # Refused before anything is counted when already full; else counted, then tested.
            full = await self.logins.refused(ip, username, now)
            full = full or await self.logins.attempt(ip, username, now)
            if full is not None:
                log.warning(
                    f"console: login refused, too many failures for this {full}",
                    extra={"client_ip": ip, "username": username[:64]},
                )
                return self.page(
                    "login.html",
                    request,
                    status=429,
                    error="Too many failed logins; wait and try again.",
                    login_csrf=cookie,
                )
            operator = self._operator(username)
            ok = await self.verifier.verify(
                username,
                operator.password_hash if operator else None,
                password if isinstance(password, str) else "",
            )
            if not ok or operator is None:
                log.warning("console: login failed", extra={"client_ip": ip, "username": username[:64]})
                return self.page(
                    "login.html", request, status=401, error="Wrong username or password.", login_csrf=cookie
                )
            await self.logins.take_back(ip, username, now)
        # Never the session the browser came with (fixation), nor one left open elsewhere.
        self.sessions.drop(request.cookies.get(COOKIE))
        fresh = self.sessions.new(operator.username, operator.role, fingerprint(operator.password_hash))
        log.info(
            "console: login", extra={"username": operator.username, "client_ip": ip, "role": operator.role}
        )
        response = web.HTTPSeeOther("/")
        self._set_cookie(response, fresh)
        response.del_cookie(LOGIN_COOKIE, path="/login")
        raise response

    def _operator(self, username: str) -> OperatorConfig | None:
        """The operator as the running config has it (a reload adds, removes, demotes)."""
        console = self.config().console
        for op in console.operators if console is not None else ():
            if op.username == username:
                return op
        return None

    def _set_cookie(self, response: web.StreamResponse, session: Session) -> None:
        response.set_cookie(
            COOKIE,
            session.token,
            httponly=True,
            samesite="Strict",
            secure=self.tls,
            path="/",
            max_age=int(self.sessions.ttl),
        )

    @_route("POST", "/logout")
    async def logout(self, request: web.Request) -> web.StreamResponse:
        self.sessions.drop(request[SESSION].token)
        response = web.HTTPSeeOther("/login")
        response.del_cookie(COOKIE, path="/")
        raise response

    # --- pages -------------------------------------------------------------------------------
    @_route("GET", "/")
    async def zones(self, request: web.Request) -> web.StreamResponse:
        return self.page("zones.html", request, zones=await views.zones(self.config(), self.store))

    @_route("POST", "/zones/{zone}/{action:pause|resume}")
    async def pause(self, request: web.Request) -> web.StreamResponse:
        zone = self._zone(request)
        action = request.match_info["action"]
        await desk.set_zone_paused(self.store, zone, action == "pause", self._actor(request))
        log.warning(
            f"console: zone {action}d",
            extra={"zone": zone, "actor": self._actor(request), "client_ip": request[CLIENT]},
        )
        raise web.HTTPSeeOther("/")

    @_route("GET", "/decisions")
    async def decisions(self, request: web.Request) -> web.StreamResponse:
        return self.page(
            "decisions.html",
            request,
            rows=await views.decisions(self.config(), self.store),
            more=await views.held_counts(self.config(), self.store),
            shown=views.LIST_LIMIT,
        )

    @_route("POST", "/decide")
    async def decide(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        zone = self._zone(request, str(form.get("zone", "")))
        key, action = str(form.get("key", "")), str(form.get("action", ""))
        try:
            version = int(str(form.get("version", "")))
        except ValueError:
            raise web.HTTPBadRequest(reason="the form carries no record version; reload the page") from None
        if action not in desk.DECISIONS:
            raise web.HTTPBadRequest(reason=f"unknown decision {action!r}")
        try:
            await desk.decide(self.store, zone, key, action, self._actor(request), version)
        except desk.DeskError as e:
            heading = "Already decided" if isinstance(e, desk.AlreadyDecided) else "Not done"
            return self.page(
                "error.html", request, status=e.status, message=str(e), zone=zone, key=key, heading=heading
            )
        log.warning(
            "console: decision",
            extra={
                "zone": zone,
                "event_key": key,
                "decision": action,
                "actor": self._actor(request),
                "client_ip": request[CLIENT],
            },
        )
        back = str(form.get("back", ""))
        raise web.HTTPSeeOther(back if _BACK.fullmatch(back) else "/decisions")

    @_route("GET", "/events/{zone}/{key:.+}")
    async def history(self, request: web.Request) -> web.StreamResponse:
        zone = self._zone(request)
        found = await views.history(self.store, zone, request.match_info["key"])
        if found is None:
            raise web.HTTPNotFound(reason="no such record")
        return self.page("history.html", request, h=found, zone=zone)

    @_route("GET", "/search")
    async def search(self, request: web.Request) -> web.StreamResponse:
        q = request.query.get("q", "")
        if len(q) > search.QUERY_MAX:
            raise web.HTTPBadRequest(reason=f"the search is longer than {search.QUERY_MAX} characters")
        found = await search.search(self.config(), self.store, q)
        return self.page("search.html", request, q=q.strip(), found=found, query_max=search.QUERY_MAX)

    @_route("GET", "/records/{zone}")
    async def records(self, request: web.Request) -> web.StreamResponse:
        zone = self._zone(request)
        state = request.query.get("state") or None
        return self.page(
            "records.html",
            request,
            zone=zone,
            state=state,
            records=await views.records(self.store, zone, state),
        )

    @_route("GET", "/suppression/{zone}")
    async def suppression(self, request: web.Request) -> web.StreamResponse:
        zone = self._zone(request)
        q = request.query.get("q", "").strip().lower()
        entries = [e for e in await self.store.suppress_list(zone) if q in e.address.lower()]
        return self.page(
            "suppression.html", request, zone=zone, q=q, entries=entries[:500], total=len(entries)
        )

    @_route("POST", "/suppression/{zone}/{action:add|remove}")
    async def suppression_change(self, request: web.Request) -> web.StreamResponse:
        zone = self._zone(request)
        form = await request.post()
        address = str(form.get("address", "")).strip()
        action = request.match_info["action"]
        problem = address_problem(address) if action == "add" else None
        if problem or not address:
            raise web.HTTPBadRequest(reason=f"{address!r}: {problem or 'no address'}")
        address = normalize_address(address)
        if action == "add":
            reason = str(form.get("reason", "")).strip()[:200] or f"added by {self._actor(request)}"
            await desk.suppress_add(self.store, zone, address, reason, self._actor(request))
        else:
            await desk.suppress_remove(self.store, zone, address, self._actor(request))
        raise web.HTTPSeeOther(f"/suppression/{quote(zone)}")

    @_route("GET", "/queue")
    async def queue(self, request: web.Request) -> web.StreamResponse:
        outboxes = []
        if self.config().outbox:
            # psycopg is the `postgres` extra: only a config with an outbox needs it here.
            from smtpguard.outbox.status import outbox_status

            outboxes = await outbox_status(self.config())
        return self.page(
            "queue.html",
            request,
            lanes=await views.queue(self.store),
            outboxes=outboxes,
            now=self.store.now(),
        )
