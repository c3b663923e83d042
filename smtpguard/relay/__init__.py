"""Relaying one reserved submission: providers, their connection pools, the route (DESIGN.md §6).

Every aiosmtplib and OS exception is translated here, in one place, into an Attempted value:
the Outcome (policy/outcome.py) plus two facts the route needs — may the next provider be
tried (only if nothing can have been accepted), and what it says about this provider's
health (for its circuit breaker). Any other exception is too, by how far the transaction
got: before DATA `unavailable` (nothing was sent), once DATA has started `unknown`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Protocol

import aiosmtplib

from smtpguard import replies
from smtpguard.config import ConfigError, MaildirProviderConfig, SmtpProviderConfig, read_secret
from smtpguard.events.tags import tagged
from smtpguard.policy.breaker import Breaker, Circuit
from smtpguard.policy.eventkey import qualified_key
from smtpguard.policy.outcome import Kind, Outcome, classify_reply, queue_id, upstream_reply
from smtpguard.policy.senders import needs_smtputf8
from smtpguard.policy.share import Candidate, shared_provider, slot
from smtpguard.policy.strip import without_headers
from smtpguard.policy.throttle import CONNECTION_WAIT, is_rate_limit, zone_route
from smtpguard.provider_gate import IDLE_HOLD, ConnectionSlots, ProviderGate
from smtpguard.replies import Reply

log = logging.getLogger("smtpguard.relay")

Health = Literal["ok", "fail", "trip"]
BeforeData = Callable[[], Awaitable[None]]
MarkSent = Callable[[str], Awaitable[None]]
"""The route's data_sent note, told which provider the DATA goes to."""


@dataclass(frozen=True, slots=True)
class Envelope:
    zone: str
    key: str | None
    attempt_id: str
    sender: str
    recipients: tuple[str, ...]
    content: bytes
    smtputf8: bool = False
    """The client declared SMTPUTF8 on MAIL (RFC 6531): its headers may be UTF-8."""

    @property
    def smtputf8_required(self) -> bool:
        """Cannot be relayed without SMTPUTF8: a non-ASCII address (it cannot be written on
        the wire otherwise), or a declared SMTPUTF8 message whose header block is not ASCII
        (RFC 6532 header fields). A declaration the message does not need is dropped for a
        provider that does not offer SMTPUTF8, as Postfix does."""
        if any(needs_smtputf8(a) for a in (self.sender, *self.recipients)):
            return True
        return self.smtputf8 and not self.content.split(b"\r\n\r\n", 1)[0].isascii()

    @property
    def smtputf8_wanted(self) -> bool:
        """Declared to a provider that offers SMTPUTF8: the client declared it, or it is required."""
        return self.smtputf8 or self.smtputf8_required


@dataclass(frozen=True, slots=True)
class Attempted:
    outcome: Outcome
    failover: bool
    """True only when the failure came before the message could have been accepted."""
    health: Health
    rate_limited: bool = False
    """The provider answered with a rate limit (policy/throttle.py): the route throttles it
    fleet-wide, and its circuit does not count it (health is "ok")."""
    busy: bool = False
    """No max_connections slot came free in time: nothing was tried."""


class Provider(Protocol):
    name: str
    idempotent: bool
    """The provider dedupes on a header we send: an unknown outcome may be retried once."""
    smtputf8: bool | None
    """Whether the provider offers SMTPUTF8, as its last EHLO said; None until it has been
    asked. The listener refuses non-ASCII addresses at MAIL/RCPT only on a known False."""

    async def send(self, env: Envelope, before_data: BeforeData) -> Attempted: ...

    async def close(self) -> None: ...


# --- SMTP upstream ---------------------------------------------------------------------------
class SmtpProvider:
    def __init__(
        self, cfg: SmtpProviderConfig, password: str | None, helo: str, event_tag: str | None = None
    ) -> None:
        self.name = cfg.name
        self.event_tag = event_tag
        """The kind of the event source reading this provider's webhooks: its custom-variable
        header carries the event key back (events/tags.py)."""
        self.cfg = cfg
        self.idempotent = cfg.idempotency_header is not None
        self.smtputf8: bool | None = None
        self._password = password
        self._previous: str | None = None
        """The secret in use before the last re-read (a retry after a 535 may need it)."""
        self._helo = cfg.helo_name or helo
        self._idle: deque[aiosmtplib.SMTP] = deque()
        self._closed = False
        self._slots = asyncio.Semaphore(min(cfg.pool_size, cfg.max_connections or cfg.pool_size))
        self._tls_context = self._make_tls_context()
        self._fleet: ConnectionSlots | None = None
        self._holders: dict[aiosmtplib.SMTP, str] = {}
        """The max_connections slot each open connection holds (DESIGN.md §16)."""
        self._idle_since: dict[aiosmtplib.SMTP, float] = {}

    def limit_connections(self, fleet: ConnectionSlots) -> None:
        """Count every connection this pool opens against the provider's fleet-wide
        max_connections; a connection idle longer than IDLE_HOLD gives its slot back."""
        self._fleet = fleet
        fleet.on_tick = self._close_idle

    def _close_idle(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._idle if now - self._idle_since.get(c, now) >= IDLE_HOLD]:
            self._idle.remove(conn)
            self._discard(conn)

    def _discard(self, conn: aiosmtplib.SMTP) -> None:
        """Close a connection and give back the slot it held."""
        conn.close()
        self._idle_since.pop(conn, None)
        holder = self._holders.pop(conn, None)
        if holder is not None and self._fleet is not None:
            self._fleet.release(holder)

    def _make_tls_context(self) -> ssl.SSLContext | None:
        if self.cfg.tls == "none":
            return None
        ctx = ssl.create_default_context(cafile=str(self.cfg.ca_file) if self.cfg.ca_file else None)
        if not self.cfg.verify_tls:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx

    async def close(self) -> None:
        self._closed = True
        while self._idle:
            conn = self._idle.popleft()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.quit(), 2)
            self._discard(conn)
        if self._fleet is not None:
            # Connections still sending (a reload replaced this pool) finish on their own
            # and give their slots back as they are discarded (_finish: the pool is closed).
            await self._fleet.close()

    def _prepare(self, env: Envelope) -> bytes:
        qualified = qualified_key(env.zone, env.key) if env.key is not None else None
        content = env.content
        if self.cfg.idempotency_header:
            # The provider deduplicates on this field: only smtpguard's ZONE:KEY may reach
            # it. A client's own copy (its key unqualified with strip off, or another
            # zone's key written by hand) would have the provider drop someone's event.
            content = without_headers(content, (self.cfg.idempotency_header,))
        content = tagged(self.event_tag, qualified, env.attempt_id, content)
        if self.cfg.idempotency_header and qualified is not None:
            return f"{self.cfg.idempotency_header}: {qualified}\r\n".encode() + content
        return content

    async def _open(self) -> aiosmtplib.SMTP | Attempted:
        """A fresh connection, authenticated, or why not. A 535 gets one more AUTH, on a
        fresh connection, when another secret is known (`_another_password`): AUTH comes
        before MAIL, so nothing of the message has been sent either way."""
        password = self._password
        retried = False
        while True:
            try:
                return await self._connect(password)
            except aiosmtplib.SMTPAuthenticationError as e:
                another = None if retried or e.code != 535 else self._another_password(password)
                if another is None:
                    return self._auth_failed(e)
                password, retried = another, True
            except aiosmtplib.SMTPResponseException as e:
                reply = upstream_reply(e.code, e.message)
                if is_rate_limit(e.code, reply.enhanced, e.message):
                    return _rate_limited(self.name, reply)
                return _unavailable(self.name, f"connect: {_describe(e)}")
            except (aiosmtplib.SMTPException, OSError, ssl.SSLError, TimeoutError) as e:
                return _unavailable(self.name, f"connect: {_describe(e)}")
            except Exception as e:
                _log_unexpected(self.name, "connecting", e)
                return _unavailable(self.name, f"connect: {_describe(e)}")

    async def _connect(self, password: str | None) -> aiosmtplib.SMTP:
        t = self.cfg.timeouts
        conn = aiosmtplib.SMTP(
            hostname=self.cfg.host,
            port=self.cfg.port,
            use_tls=self.cfg.tls == "implicit",
            start_tls=self.cfg.tls == "starttls",
            tls_context=self._tls_context,
            local_hostname=self._helo,
            timeout=t.command,
        )
        try:
            await conn.connect(timeout=t.connect)
            if conn.is_ehlo_or_helo_needed:
                # Without STARTTLS aiosmtplib would greet at the first command; the relay
                # must know what the provider offers (SMTPUTF8) before MAIL. HELO as
                # aiosmtplib falls back to it.
                try:
                    await conn.ehlo(timeout=t.command)
                except aiosmtplib.SMTPHeloError as e:
                    if e.code == 421:
                        # The provider closes the session ("too many connections"): no
                        # HELO on a closed connection; the 421 is the answer (throttle).
                        raise
                    await conn.helo(timeout=t.command)
            # This connection's last EHLO (after STARTTLS, the second): the listener's view.
            self.smtputf8 = conn.supports_extension("smtputf8")
            if self.cfg.username:
                await conn.login(self.cfg.username, password or "", timeout=t.command)
        except BaseException:
            conn.close()
            raise
        return conn

    async def send(self, env: Envelope, before_data: BeforeData) -> Attempted:
        await self._slots.acquire()
        try:
            conn: aiosmtplib.SMTP | None = None
            while self._idle and conn is None:
                candidate = self._idle.pop()
                self._idle_since.pop(candidate, None)
                if candidate.is_connected:
                    conn = candidate
                else:
                    self._discard(candidate)
            if conn is not None:
                result, keep = await self._guarded(conn, env, before_data, reused=True)
                if result is not None:
                    return self._finish(conn, keep, result)
                # The cached connection had gone away before MAIL was answered: safe to redo.
                # Closed here, so the max_connections slot it held is free for the new one.
                self._discard(conn)
            holder: str | None = None
            if self._fleet is not None:
                holder = await self._fleet.acquire()
                if holder is None:
                    return _connections_busy(self.name)
            try:
                opened = await self._open()
            except BaseException:
                if holder is not None and self._fleet is not None:
                    self._fleet.release(holder)
                raise
            if not isinstance(opened, aiosmtplib.SMTP):
                if holder is not None and self._fleet is not None:
                    self._fleet.release(holder)
                return opened
            conn = opened
            if holder is not None:
                self._holders[conn] = holder
            result, keep = await self._guarded(conn, env, before_data, reused=False)
            assert result is not None
            return self._finish(conn, keep, result)
        finally:
            self._slots.release()

    async def _guarded(
        self, conn: aiosmtplib.SMTP, env: Envelope, before_data: BeforeData, reused: bool
    ) -> tuple[Attempted | None, bool]:
        try:
            return await self._transaction(conn, env, before_data, reused)
        except BaseException:
            # Cancelled (a drain that timed out) mid-transaction: the connection is in an
            # unknown state and its max_connections slot must not stay held by nothing.
            self._discard(conn)
            raise

    def _finish(self, conn: aiosmtplib.SMTP, keep: bool, result: Attempted) -> Attempted:
        # A provider replaced by a reload is closed: its in-flight connections end here.
        if keep and conn.is_connected and not self._closed:
            self._idle.append(conn)
            self._idle_since[conn] = time.monotonic()
        else:
            self._discard(conn)
        return result

    @property
    def password(self) -> str | None:
        """The secret new connections authenticate with (the prober reads it too)."""
        return self._password

    def rotate_password(self, password: str | None) -> bool:
        """The secret as read again (SIGHUP); True if it changed. The next connection
        authenticates with it; pooled connections, authenticated already, carry on. The
        one it replaces is kept for one retry after a 535 (`_another_password`)."""
        changed = password != self._password
        if changed:
            self._previous = self._password
        self._password = password
        return changed

    def inherit(self, old: SmtpProvider) -> None:
        """A reload rebuilt this provider with the same settings: keep what `old` knew of
        the secret in use before, for the same retry after a 535."""
        if old._password != self._password:
            self._previous = old._password
        else:
            self._previous = old._previous

    def _another_password(self, used: str | None) -> str | None:
        """After a 535 to `used`: a secret to try once instead, now in use; None when
        there is none. First the `password_file` read again (the provider rotated first);
        else the secret in use now, if another coroutine has moved on already; else the
        one in use before the last re-read (the file was rotated and reloaded before the
        provider switched: until it does, the old secret is the good one). Compared with
        the one refused, not the current one, so that connections refused together each get
        their retry. A password from the environment cannot change under a running process."""
        fresh: str | None = None
        if self.cfg.password_file is not None:
            try:
                fresh = read_secret(None, self.cfg.password_file, f"provider {self.name}")
            except ConfigError as e:
                log.error(
                    "upstream refused the password and password_file cannot be read again: %s",
                    "; ".join(e.problems),
                    extra={"provider": self.name},
                )
        candidates = (
            (fresh, "password_file holds a new one"),
            (self._password, "another connection moved to a new one"),
            (self._previous, "the one in use before the last re-read"),
        )
        for candidate, why in candidates:
            if candidate is not None and candidate != used:
                log.warning(
                    "upstream refused the password; retrying once with %s",
                    why,
                    extra={"provider": self.name},
                )
                if candidate != self._password:
                    self._previous = self._password
                    self._password = candidate
                return candidate
        return None

    def _auth_failed(self, e: aiosmtplib.SMTPAuthenticationError) -> Attempted:
        reply = upstream_reply(e.code, e.message)
        if is_rate_limit(e.code, reply.enhanced, e.message):
            return _rate_limited(self.name, reply)
        if e.code != 535:
            return _unavailable(self.name, f"upstream AUTH: {e.code} {e.message[:100]}")
        # The secret is never logged; the provider's reply text is enough to act on.
        log.critical(
            "upstream refused smtpguard's credentials; circuit opened",
            extra={"provider": self.name, "code": e.code, "upstream_text": e.message[:200]},
        )
        return Attempted(
            Outcome(
                Kind.UNAVAILABLE,
                self.name,
                upstream_reply(e.code, e.message),
                detail="upstream AUTH refused",
                data_sent=False,
            ),
            failover=True,
            health="trip",
        )

    async def _mail_rcpt(
        self, conn: aiosmtplib.SMTP, env: Envelope, reused: bool
    ) -> tuple[Attempted | None, bool] | _Accepted:
        """MAIL and RCPT: the recipients taken, or the transaction's result if it ends here."""
        t = self.cfg.timeouts
        declare = env.smtputf8_wanted and conn.supports_extension("smtputf8")
        options, encoding = (["SMTPUTF8"], "utf-8") if declare else ([], "ascii")
        try:
            try:
                await conn.mail(env.sender, options=options, encoding=encoding, timeout=t.command)
            except aiosmtplib.SMTPServerDisconnected:
                if reused:
                    return None, False
                raise
            except aiosmtplib.SMTPResponseException as e:
                if reused and e.code == 421:
                    # A pooled connection the provider closed while it was idle (Postfix:
                    # "421 4.4.2 … timeout exceeded"): that 421 ended the idle session, it
                    # is no rate limit. Nothing was sent; a fresh connection asks again.
                    return None, False
                raise
            accepted: list[str] = []
            rejected: list[tuple[str, Reply]] = []
            for rcpt in env.recipients:
                try:
                    await conn.rcpt(rcpt, encoding=encoding, timeout=t.command)
                    accepted.append(rcpt)
                except aiosmtplib.SMTPRecipientRefused as e:
                    rejected.append((rcpt, upstream_reply(e.code, e.message)))
            if not accepted or any(r.temporary for _, r in rejected):
                # A recipient refused for now would silently miss the message if the rest
                # went ahead: the 250 would close the event. Only permanent refusals may
                # leave the others to be delivered; a temporary one defers the whole event
                # (nothing has been accepted yet, so another provider may take it).
                return _refused_all(self.name, rejected), await _rset(conn)
        except aiosmtplib.SMTPResponseException as e:
            return _before_dot_reply(self.name, e.code, e.message), await _rset(conn)
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as e:
            return _unavailable(self.name, f"before DATA: {_describe(e)}"), False
        except Exception as e:
            # Anything else (an address aiosmtplib cannot encode or quote, a defect): no DATA
            # has started, so nothing can have been accepted — unavailable, never unknown,
            # and the next provider may be tried. The connection answered EHLO, and the
            # fault is this message's: it must not count against the provider's circuit.
            _log_unexpected(self.name, "before DATA", e)
            return _unavailable(self.name, f"before DATA: {_describe(e)}", health="ok"), False
        return _Accepted(accepted, rejected)

    async def _transaction(
        self, conn: aiosmtplib.SMTP, env: Envelope, before_data: BeforeData, reused: bool
    ) -> tuple[Attempted | None, bool]:
        """One MAIL…DATA transaction; (None, False) asks for a fresh connection."""
        t = self.cfg.timeouts
        if env.smtputf8_required and not conn.supports_extension("smtputf8"):
            # Checked on the connection in hand (pooled or fresh), before anything is sent:
            # its EHLO is what this provider will accept. RFC 6531's 553 5.6.7, but this
            # provider's alone — nothing was sent, so the route may fail over to one that
            # offers SMTPUTF8; where none does, the event fails with the 553, as the
            # listener answers at MAIL/RCPT once it knows the route. The provider is
            # healthy and the connection clean: it is kept.
            return Attempted(
                Outcome(Kind.FAILED, self.name, replies.smtputf8_not_offered(self.name), data_sent=False),
                failover=True,
                health="ok",
            ), True
        try:
            payload = self._prepare(env)
        except Exception as e:
            _log_unexpected(self.name, "preparing the message", e)
            return _unavailable(self.name, f"before DATA: {_describe(e)}", health="ok"), True
        # The data_sent mark is written while MAIL and RCPT go out and awaited before DATA:
        # its durable write and the provider's round trips overlap instead of adding up (and
        # the pooled connection is not held idle meanwhile). A crash between the two leaves
        # the event `unknown`, held for review: conservative, never a resend.
        marker = asyncio.ensure_future(before_data())
        # Retrieved even when MAIL/RCPT end the transaction first (no "never retrieved").
        marker.add_done_callback(_retrieve)
        try:
            envelope = await self._mail_rcpt(conn, env, reused)
        except BaseException:
            # Cancelled (shutdown): the mark, if it lands, only makes the event `unknown`.
            marker.cancel()
            self._discard(conn)
            raise
        try:
            # Whatever MAIL and RCPT gave, a failed mark (lease lost, store down) is what the
            # caller must hear; nothing has been sent.
            await marker
        except BaseException:
            self._discard(conn)
            raise
        if not isinstance(envelope, _Accepted):
            return envelope
        accepted, rejected = envelope.accepted, envelope.rejected

        # From here the final dot may reach the provider: the outcome is the provider's.
        watch = _BodyWatch(conn)
        try:
            with watch:
                response = await conn.data(payload, timeout=t.data)
        except (aiosmtplib.SMTPServerDisconnected, aiosmtplib.SMTPTimeoutError, OSError, TimeoutError) as e:
            if not watch.body_written:
                # Lost while waiting for 354: not one byte of the message, let alone its
                # final dot, was written, so nothing can have been accepted (DESIGN.md §11.6).
                return _unavailable(self.name, f"at DATA, before the message: {_describe(e)}"), False
            return _unknown(self.name, e, rejected), False
        except aiosmtplib.SMTPResponseException as e:
            reply = upstream_reply(e.code, e.message)
            limited = is_rate_limit(e.code, reply.enhanced, reply.text)
            if limited and not watch.body_written:
                # The reply to the DATA command itself: not one byte of the message went.
                return _rate_limited(self.name, reply), await _rset(conn)
            # The provider's answer to the message after its final dot: that reply is the
            # outcome (a 4xx defers, DESIGN.md §4) and it is never failed over; a rate limit
            # still throttles the provider for the messages that follow.
            kind = classify_reply(e.code)
            health: Health = "ok" if limited else "fail" if e.code == 421 else "ok"
            return Attempted(
                Outcome(kind, self.name, reply, rejected=tuple(rejected), data_sent=True),
                failover=False,
                health=health,
                rate_limited=limited,
            ), await _rset(conn)
        except aiosmtplib.SMTPException as e:
            return _unknown(self.name, e, rejected), False
        except Exception as e:
            # Not an SMTP or socket error, but DATA had started: the dot may have gone out.
            _log_unexpected(self.name, "after DATA", e)
            return _unknown(self.name, e, rejected), False
        reply = upstream_reply(response.code, response.message)
        return Attempted(
            Outcome(
                Kind.DELIVERED,
                self.name,
                reply,
                upstream_id=queue_id(response.message),
                rejected=tuple(rejected),
                accepted=tuple(accepted),
                data_sent=True,
            ),
            failover=False,
            health="ok",
        ), True


class _BodyWatch:
    """Whether any byte of the message was handed to the socket during `conn.data()`.

    aiosmtplib sends the DATA command and the message in one call; a connection lost in
    between (no 354 yet) has sent nothing the provider could accept, while one lost after
    the message was written is RFC 1047's unknown window. The call writes exactly twice
    (the command line, then the message), so counting writes tells the two apart."""

    def __init__(self, conn: aiosmtplib.SMTP) -> None:
        self._protocol = conn.protocol
        self.writes = 0

    @property
    def body_written(self) -> bool:
        return self.writes > 1

    def __enter__(self) -> _BodyWatch:
        proto = self._protocol
        if proto is not None:
            original = proto.write

            def counted(data: bytes) -> None:
                self.writes += 1
                original(data)

            proto.write = counted  # type: ignore[method-assign]
        else:
            self.writes = 2  # nothing to watch: assume the worst (unknown)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._protocol is not None:
            with contextlib.suppress(AttributeError):
                del self._protocol.write


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()


@dataclass(frozen=True, slots=True)
class _Accepted:
    accepted: list[str]
    rejected: list[tuple[str, Reply]]


async def _rset(conn: aiosmtplib.SMTP) -> bool:
    """Reset after a refused transaction; keep the connection only if RSET works."""
    try:
        await conn.rset(timeout=5)
    except Exception:
        return False
    return True


def _refused_all(provider: str, rejected: list[tuple[str, Reply]]) -> Attempted:
    temp = next((r for _, r in rejected if r.temporary), None)
    if temp is not None and is_rate_limit(temp.code, temp.enhanced, temp.text):
        return _rate_limited(provider, temp)
    if temp is not None:
        return Attempted(
            Outcome(Kind.DEFERRED, provider, temp, rejected=tuple(rejected), data_sent=False),
            failover=True,
            health="fail" if temp.code == 421 else "ok",
        )
    first = rejected[0][1]
    return Attempted(
        Outcome(Kind.FAILED, provider, first, rejected=tuple(rejected), data_sent=False),
        failover=False,
        health="ok",
    )


def _before_dot_reply(provider: str, code: int, text: str) -> Attempted:
    reply = upstream_reply(code, text)
    if is_rate_limit(code, reply.enhanced, reply.text):
        return _rate_limited(provider, reply)
    if reply.temporary:
        return Attempted(
            Outcome(Kind.DEFERRED, provider, reply, data_sent=False),
            failover=True,
            health="fail" if code == 421 else "ok",
        )
    return Attempted(Outcome(Kind.FAILED, provider, reply, data_sent=False), failover=False, health="ok")


def _rate_limited(provider: str, reply: Reply) -> Attempted:
    """A rate limit before the message could have been accepted: nothing was sent, so the
    route may fail over, and the event stays retryable (unavailable, as for an open circuit:
    the client hears 451 4.4.1, never the provider's 421, which would close its session)."""
    return Attempted(
        Outcome(Kind.UNAVAILABLE, provider, reply, detail=f"rate limited: {reply}", data_sent=False),
        failover=True,
        health="ok",
        rate_limited=True,
    )


def _connections_busy(provider: str) -> Attempted:
    """Every max_connections slot of the provider is held (by this instance or others)."""
    return Attempted(
        Outcome(
            Kind.UNAVAILABLE, provider, detail="max_connections in use on every instance", data_sent=False
        ),
        failover=True,
        health="ok",
        busy=True,
    )


def _unknown(provider: str, e: BaseException, rejected: list[tuple[str, Reply]]) -> Attempted:
    """The message was written and no reply came: RFC 1047's window. The outcome is this
    provider's (never failed over) and nobody knows it."""
    return Attempted(
        Outcome(
            Kind.UNKNOWN,
            provider,
            detail=f"after DATA: {_describe(e)}",
            rejected=tuple(rejected),
            data_sent=True,
        ),
        failover=False,
        health="fail",
    )


def _unavailable(provider: str, detail: str, health: Health = "fail") -> Attempted:
    """Nothing of the message reached the provider: retryable, and the next provider may be
    tried. `health="ok"` when the fault is the message's, not the provider's."""
    return Attempted(
        Outcome(Kind.UNAVAILABLE, provider, detail=detail, data_sent=False), failover=True, health=health
    )


def _log_unexpected(provider: str, stage: str, e: Exception) -> None:
    """An exception outside aiosmtplib's and the OS's is a defect: logged at error with its
    type (and traceback); the expected ones are outcomes and are not logged here."""
    log.error(
        "unexpected %s %s",
        type(e).__name__,
        stage,
        exc_info=e,
        extra={"provider": provider, "error": _describe(e)},
    )


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:200]


# --- Maildir (demos, staging, tests) ---------------------------------------------------------
class MaildirProvider:
    idempotent = False
    smtputf8: bool | None = True
    """A file takes any bytes: UTF-8 addresses and headers are written as they came."""

    def __init__(self, cfg: MaildirProviderConfig) -> None:
        self.name = cfg.name
        self.path = cfg.path
        self._seq = 0

    async def close(self) -> None:
        return None

    async def send(self, env: Envelope, before_data: BeforeData) -> Attempted:
        try:
            data = _maildir_message(env)
        except Exception as e:
            # Before the data_sent mark and before any file: nothing can have been written.
            _log_unexpected(self.name, "preparing the message", e)
            return Attempted(
                Outcome(Kind.UNAVAILABLE, self.name, detail=f"maildir: {_describe(e)}", data_sent=False),
                failover=True,
                health="ok",
            )
        await before_data()
        self._seq += 1
        name = f"{time.time():.6f}.{os.getpid()}_{self._seq}.{socket.gethostname()}"
        try:
            await asyncio.to_thread(_maildir_store, self.path, name, data)
        except _DeliveredButUnsynced as e:
            # In new/ already: a retry would write a second copy.
            return Attempted(
                Outcome(Kind.UNKNOWN, self.name, detail=f"maildir fsync: {e.strerror}"),
                failover=False,
                health="fail",
            )
        except OSError as e:
            # Nothing is in new/ unless the rename happened, and the rename is the last step.
            return Attempted(
                Outcome(Kind.DEFERRED, self.name, Reply(451, "4.3.0", f"maildir: {e.strerror}")),
                failover=False,
                health="fail",
            )
        reply = Reply(250, "2.0.0", f"delivered to maildir as {name}")
        return Attempted(
            Outcome(Kind.DELIVERED, self.name, reply, upstream_id=name, accepted=env.recipients),
            failover=False,
            health="ok",
        )


class _DeliveredButUnsynced(OSError):
    """The message is in new/ but its directory entry may not be on disk yet."""


def _maildir_message(env: Envelope) -> bytes:
    head = f"Return-Path: <{env.sender}>\r\nX-Original-To: {', '.join(env.recipients)}\r\n"
    return head.encode() + env.content


def _maildir_write(root: Path, name: str, env: Envelope) -> None:
    _maildir_store(root, name, _maildir_message(env))


def _maildir_store(root: Path, name: str, data: bytes) -> None:
    for sub in ("tmp", "new", "cur"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    tmp = root / "tmp" / name
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, root / "new" / name)
    try:
        fd = os.open(root / "new", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise _DeliveredButUnsynced(e.errno, e.strerror) from e


# --- the route -------------------------------------------------------------------------------
class Route:
    """Primary, then standby (then more), skipping open circuits (DESIGN.md §6); a standby
    with a `share` heads the route for that share of event keys while it is ready (§12).
    A zone with its own `providers` walks those instead (§16), and the gate skips a
    provider that is throttled or out of max_rate/max_connections slots without counting
    it against its circuit."""

    def __init__(
        self,
        providers: Sequence[Provider],
        threshold: int,
        cooldown: float,
        clock: Callable[[], float] = time.time,
        observe: Callable[[str, str, float], None] | None = None,
        on_circuit: Callable[[str, Circuit], None] | None = None,
        shares: Mapping[str, float] | None = None,
        gate: ProviderGate | None = None,
        zone_routes: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.providers = list(providers)
        self.gate = gate
        self.zone_routes: dict[str, list[Provider]] = {}
        """Each zone's own route (`zones.Z.providers`), resolved to providers."""
        self.set_zone_routes(zone_routes or {})
        self.breakers = {p.name: Breaker(threshold, cooldown) for p in self.providers}
        self.shares = {name: share for name, share in (shares or {}).items() if share > 0}
        self.ready: dict[str, bool] = {}
        """Each probed provider's last probe (serve's prober writes it). A provider never
        probed is not ready: no share goes to a standby that has not answered."""
        self._clock = clock
        self._observe = observe
        self._on_circuit = on_circuit
        if on_circuit is not None:
            for name, b in self.breakers.items():
                on_circuit(name, b.circuit)

    def set_zone_routes(self, zone_routes: Mapping[str, Sequence[str]]) -> None:
        """Resolve the zones' own routes against these providers (at start, and on a reload
        that changes only `zones.Z.providers`, which keeps the pools and circuits)."""
        by_name = {p.name: p for p in self.providers}
        self.zone_routes = {
            zone: [by_name[n] for n in zone_route(list(by_name), list(names))]
            for zone, names in zone_routes.items()
        }

    def providers_for(self, zone: str) -> list[Provider]:
        """The providers a zone's mail may go to: its own route, else the top-level one."""
        own = self.zone_routes.get(zone)
        return own if own is not None else self.providers

    async def close(self) -> None:
        for p in self.providers:
            await p.close()

    def circuits(self) -> dict[str, Circuit]:
        return {name: b.circuit for name, b in self.breakers.items()}

    def any_closed(self) -> bool:
        return any(b.circuit is not Circuit.OPEN for b in self.breakers.values())

    def order(self, env: Envelope) -> list[Provider]:
        """The providers to try, in order, for this envelope. The shared standby is picked by
        zone and key (policy/share.py), so a retry of the event heads the same route; it must
        be ready and its circuit closed, else the normal route. Failover from it walks the
        rest of the route in its configured order. A zone's own route is walked as written:
        the operator chose it, so no share reorders it."""
        own = self.zone_routes.get(env.zone)
        if own is not None:
            return own
        if not self.shares or env.key is None:
            return self.providers
        candidates = [
            Candidate(
                p.name,
                self.shares[p.name],
                self.ready.get(p.name, False) and self.breakers[p.name].circuit is Circuit.CLOSED,
            )
            for p in self.providers[1:]
            if p.name in self.shares
        ]
        name = shared_provider(slot(env.zone, env.key), candidates)
        if name is None:
            return self.providers
        chosen = next(p for p in self.providers if p.name == name)
        return [chosen, *(p for p in self.providers if p is not chosen)]

    async def blocked_until(self, zone: str) -> float | None:
        """When the zone's route is usable again, if every provider on it is throttled now
        (the queue holds the zone's entries until then); None when one is usable."""
        if self.gate is None:
            return None
        return await self.gate.blocked_route(p.name for p in self.providers_for(zone))

    async def send(self, env: Envelope, before_data: MarkSent) -> Outcome:
        outcome, waits = await self._walk(env, before_data)
        if waits and outcome.kind is Kind.UNAVAILABLE:
            # Nothing was sent only because of throttling: say when to come back, so queued
            # mail waits instead of counting an attempt (DESIGN.md §16).
            return replace(outcome, wait_until=min(waits))
        return outcome

    async def _walk(self, env: Envelope, before_data: MarkSent) -> tuple[Outcome, list[float]]:
        fallback: Outcome | None = None
        unavailable = skipped = False
        waits: list[float] = []
        """When each provider skipped for throttling is usable again."""
        gate = self.gate
        for p in self.order(env):
            if gate is not None:
                until = await gate.blocked(p.name)
                if until is not None:
                    waits.append(until)
                    continue
            allowed, self.breakers[p.name] = self.breakers[p.name].allow(self._clock())
            if not allowed:
                skipped = True
                continue
            try:
                if gate is not None:
                    # A throttle learnt while this one waited for its slot holds it too.
                    until = await gate.admit(p.name) or gate.throttled_until(p.name)
                    if until is not None:
                        self.breakers[p.name] = self.breakers[p.name].release_probe()
                        waits.append(until)
                        continue
                result = await self._attempt(p, env, _noting(before_data, p.name))
                if result.rate_limited:
                    if gate is not None:
                        waits.append(await gate.throttle(p.name, result.outcome.reply))
                    else:
                        waits.append(self._clock())
                elif result.busy:
                    waits.append(self._clock() + CONNECTION_WAIT)
                self._record_health(p.name, result.health)
                if result.outcome.kind is Kind.UNKNOWN and p.idempotent:
                    # The provider dedupes on our header, so one more try on it cannot
                    # duplicate. Whatever that try comes to, the outcome stays this
                    # provider's: the first copy may be there, so never another provider.
                    log.warning(
                        "retrying unknown outcome once on idempotent provider",
                        extra={"provider": p.name, "zone": env.zone},
                    )
                    retry = await self._attempt(p, env, _noop)
                    self._record_health(p.name, retry.health)
                    # Only a 250 settles it; any other answer says nothing about the first copy.
                    delivered = retry.outcome.kind is Kind.DELIVERED
                    result = retry if delivered else replace(result, failover=False)
            except BaseException:
                self.breakers[p.name] = self.breakers[p.name].release_probe()
                raise
            if not result.failover:
                return result.outcome, waits
            if result.outcome.kind is Kind.UNAVAILABLE:
                unavailable = True
            if fallback is None or fallback.kind is Kind.UNAVAILABLE:
                fallback = result.outcome
        if fallback is None:
            detail = (
                "every provider is throttled" if waits and not skipped else "every provider circuit is open"
            )
            return Outcome(Kind.UNAVAILABLE, None, detail=detail, data_sent=False), waits
        if fallback.kind is Kind.FAILED and (unavailable or skipped or waits):
            # Refused by one provider only for what it lacks (SMTPUTF8) while another that
            # might take it could not be tried: a 5xx would end an event that can still be
            # delivered once that one is back. Nothing was sent: retryable.
            return Outcome(
                Kind.UNAVAILABLE,
                fallback.provider,
                detail=f"{fallback.reply or ''}; another provider unavailable",
                data_sent=False,
            ), waits
        return fallback, waits

    async def _attempt(self, p: Provider, env: Envelope, before_data: BeforeData) -> Attempted:
        started = time.perf_counter()
        result = await p.send(env, before_data)
        if self._observe is not None:
            o = result.outcome
            if o.kind in (Kind.UNKNOWN, Kind.UNAVAILABLE) or o.reply is None:
                reply_class = o.kind.value
            else:
                reply_class = f"{o.reply.code // 100}xx"
            self._observe(p.name, reply_class, time.perf_counter() - started)
        return result

    def _record_health(self, name: str, health: Health) -> None:
        before = self.breakers[name]
        now = self._clock()
        if health == "ok":
            after = before.success()
        elif health == "trip":
            after = before.trip(now)
        else:
            after = before.failure(now)
        self.breakers[name] = after
        if after.circuit is not before.circuit:
            if self._on_circuit is not None:
                self._on_circuit(name, after.circuit)
            level = logging.WARNING if after.circuit is Circuit.OPEN else logging.INFO
            log.log(
                level,
                "provider circuit %s",
                after.circuit.value,
                extra={"provider": name, "circuit": after.circuit.value},
            )


async def _noop() -> None:
    return None


def _noting(mark: MarkSent, provider: str) -> BeforeData:
    async def before_data() -> None:
        await mark(provider)

    return before_data


def build_providers(
    configs: Sequence[SmtpProviderConfig | MaildirProviderConfig],
    secrets: dict[str, str | None],
    helo: str,
    event_tags: dict[str, str] | None = None,
) -> list[Provider]:
    out: list[Provider] = []
    tags = event_tags or {}
    for cfg in configs:
        if isinstance(cfg, SmtpProviderConfig):
            out.append(SmtpProvider(cfg, secrets.get(cfg.name), helo, tags.get(cfg.name)))
        else:
            out.append(MaildirProvider(cfg))
    return out
