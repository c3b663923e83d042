"""The SMTP upstream: one provider's connection pool and its MAIL…DATA transaction
(DESIGN.md §6, §11.6, §16).

Every aiosmtplib and OS exception is translated here, in one place, into an Attempted value
(policy/failover.py decides what each answer means). Any other exception is too, by how far
the transaction got: before DATA `unavailable` (nothing was sent), once DATA has started
`unknown`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import ssl
import time
from collections import deque
from dataclasses import dataclass

import aiosmtplib

from smtpguard.config import ConfigError, SmtpProviderConfig, read_secret
from smtpguard.config.secrets import log_of
from smtpguard.policy.eventkey import qualified_key
from smtpguard.policy.events import tag_value
from smtpguard.policy.failover import (
    Attempted,
    auth_refused,
    before_dot_reply,
    connections_busy,
    data_reply,
    eightbitmime_missing,
    lost_at_data,
    rate_limited,
    refused_all,
    smtputf8_missing,
    unavailable,
    unknown,
)
from smtpguard.policy.outcome import Kind, Outcome, queue_id, upstream_reply
from smtpguard.policy.strip import without_headers
from smtpguard.policy.tags import tagged
from smtpguard.policy.throttle import is_rate_limit
from smtpguard.provider_gate import IDLE_HOLD, ConnectionSlots
from smtpguard.relay.base import BeforeData, Envelope, describe, log_unexpected
from smtpguard.relay.wire import Answer, Session, command, data_block
from smtpguard.replies import Reply

log = logging.getLogger("smtpguard.relay")
_MAX_FIELD_LINE = 998
"""RFC 5322 §2.1.1: a line of a message holds at most 998 octets before its CRLF."""
_DIGEST_TAG = "~sha256:"


class SmtpProvider:
    def __init__(
        self,
        cfg: SmtpProviderConfig,
        password: str | None,
        helo: str,
        event_tag: str | None = None,
        log: str | None = None,
    ) -> None:
        self.name = cfg.name
        self.event_tag = event_tag
        """The kind of the event source reading this provider's webhooks: its custom-variable
        header carries the event key back (policy/tags.py)."""
        self.log = log
        """The log its `api` names, read with its password (at start or a reload); None once
        a 535 moved it to another secret while its key names another log (`_check_log`)."""
        self.cfg = cfg
        self.idempotent = cfg.idempotency_header is not None
        self.smtputf8: bool | None = None
        self._password = password
        self._previous: str | None = None
        """The secret in use before the last re-read (a retry after a 535 may need it)."""
        self._helo = cfg.helo_name or helo
        self._idle: deque[Session] = deque()
        self._closed = False
        self._slots = asyncio.Semaphore(min(cfg.pool_size, cfg.max_connections or cfg.pool_size))
        self._tls_context = self._make_tls_context()
        self._fleet: ConnectionSlots | None = None
        self._holders: dict[Session, str] = {}
        """The max_connections slot each open connection holds (DESIGN.md §16)."""
        self._idle_since: dict[Session, float] = {}

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

    def _discard(self, conn: Session) -> None:
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
            return _idempotency_field(self.cfg.idempotency_header, qualified) + content
        return content

    async def _open(self) -> Session | Attempted:
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
                    return rate_limited(self.name, reply)
                return unavailable(self.name, f"connect: {describe(e)}")
            except (aiosmtplib.SMTPException, OSError, ssl.SSLError, TimeoutError) as e:
                return unavailable(self.name, f"connect: {describe(e)}")
            except Exception as e:
                log_unexpected(self.name, "connecting", e)
                return unavailable(self.name, f"connect: {describe(e)}")

    async def _connect(self, password: str | None) -> Session:
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
            return Session.take_over(conn)
        except BaseException:
            conn.close()
            raise

    async def send(self, env: Envelope, before_data: BeforeData) -> Attempted:
        # A pooled connection gone before the message is asked again on a fresh one: the
        # attempt's data_sent mark, written once, covers both (a second write of it is a
        # second ledger transition for one attempt, and a failed one abandons the first).
        before_data = _once(before_data)
        await self._slots.acquire()
        try:
            conn: Session | None = None
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
                # The cached connection had gone away before DATA: safe to redo, once.
                # Closed here, so the max_connections slot it held is free for the new one.
                self._discard(conn)
            holder: str | None = None
            if self._fleet is not None:
                holder = await self._fleet.acquire()
                if holder is None:
                    return connections_busy(self.name)
            try:
                opened = await self._open()
            except BaseException:
                if holder is not None and self._fleet is not None:
                    self._fleet.release(holder)
                raise
            if not isinstance(opened, Session):
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
        self, conn: Session, env: Envelope, before_data: BeforeData, reused: bool
    ) -> tuple[Attempted | None, bool]:
        try:
            return await self._transaction(conn, env, before_data, reused)
        except BaseException:
            # Cancelled (a drain that timed out) mid-transaction: the connection is in an
            # unknown state and its max_connections slot must not stay held by nothing.
            self._discard(conn)
            raise

    def _finish(self, conn: Session, keep: bool, result: Attempted) -> Attempted:
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
                self._check_log()
                return candidate
        return None

    def _check_log(self) -> None:
        """After a 535 moved it to a secret no reload gave it: SendGrid's and Postmark's SMTP
        password is also their api's key, often from one file. A key that now names another
        log (or cannot be read) may be another account's, whose messages the log noted so far
        never holds: none is noted until a reload reads both again. An unchanged key keeps it."""
        api = self.cfg.api
        if self.log is not None and (api is None or log_of(api, f"provider {self.name} api") != self.log):
            self.log = None

    def _auth_failed(self, e: aiosmtplib.SMTPAuthenticationError) -> Attempted:
        result = auth_refused(self.name, e.code, e.message)
        if result.health == "trip":
            # The secret is never logged; the provider's reply text is enough to act on.
            log.critical(
                "upstream refused smtpguard's credentials; circuit opened",
                extra={"provider": self.name, "code": e.code, "upstream_text": e.message[:200]},
            )
        return result

    async def _mail_rcpt(
        self, conn: Session, env: Envelope, reused: bool, eight_bit: bool
    ) -> tuple[Attempted | None, bool] | _Accepted:
        """MAIL and RCPT: the recipients taken, or the transaction's result if it ends here.
        To a provider offering PIPELINING (RFC 2920) they go out in one write and their
        replies are read in order; DATA is never in the group, so nothing of the message
        leaves before every RCPT is answered (and the data_sent mark is durable)."""
        t = self.cfg.timeouts
        declare = env.smtputf8_wanted and conn.smtputf8
        options, encoding = (b" SMTPUTF8", "utf-8") if declare else (b"", "ascii")
        if conn.eightbitmime and eight_bit:
            # RFC 6152 §3: an 8-bit message says so; undeclared, the server may take it as 7BIT.
            options += b" BODY=8BITMIME"
        try:
            # Every line is made before any is written: an address that cannot be written
            # stops the transaction with nothing sent.
            lines = [command(b"MAIL FROM:", env.sender, encoding, options)]
            lines += [command(b"RCPT TO:", rcpt, encoding) for rcpt in env.recipients]
            group = conn.send(b"".join(lines), len(lines)) if conn.pipelining else None

            async def answer(i: int) -> Answer:
                future = group[i] if group is not None else conn.send(lines[i])[0]
                code, text = await conn.reply(future, t.command)
                if code // 100 == 3:
                    # A 354 to MAIL or RCPT answers no command of ours: out of step.
                    raise _out_of_step(conn, code, text)
                return code, text

            code, text = await answer(0)
            if code != 250:
                if code == 421:
                    # The provider ends the session (RFC 5321 §3.8): no RSET on it.
                    conn.close()
                    if reused:
                        # A pooled connection the provider closed while it was idle (Postfix:
                        # "421 4.4.2 … timeout exceeded"): that 421 ended the idle session,
                        # it is no rate limit. Nothing was sent; a fresh connection asks again.
                        return None, False
                elif group is not None:
                    # The refused MAIL's RCPTs were answered too (503): read before RSET.
                    for i in range(1, len(lines)):
                        await answer(i)
                return before_dot_reply(self.name, code, text), await _rset(conn)
            accepted: list[str] = []
            rejected: list[tuple[str, Reply]] = []
            for i, rcpt in enumerate(env.recipients, 1):
                code, text = await answer(i)
                if code in (250, 251):
                    accepted.append(rcpt)
                    continue
                if code == 421:
                    conn.close()
                    if reused:
                        # The pooled session ended under this transaction (RFC 5321 §3.8),
                        # as a 421 to its MAIL would have: a fresh connection asks again.
                        return None, False
                rejected.append((rcpt, upstream_reply(code, text)))
            if not accepted or any(r.temporary for _, r in rejected):
                # A recipient refused for now would silently miss the message if the rest
                # went ahead: the 250 would close the event. Only permanent refusals may
                # leave the others to be delivered; a temporary one defers the whole event
                # (nothing has been accepted yet, so another provider may take it).
                return refused_all(self.name, rejected), await _rset(conn)
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as e:
            if reused and isinstance(e, ConnectionError):
                # A pooled connection gone before DATA (the provider's idle timer, a load
                # balancer, a restart), at MAIL or at any RCPT: nothing of the message was
                # sent, and a lost session says nothing of this message or of the provider.
                # Asked again once, on a fresh connection (send); a fresh one that drops
                # is the provider's answer, below.
                conn.close()
                return None, False
            # A reply that is not SMTP (malformed, too long, out of step) is no refusal of the
            # message, and the session is closed: unavailable, as a lost connection (§11.6).
            return unavailable(self.name, f"before DATA: {describe(e)}"), False
        except Exception as e:
            # Anything else (an address that cannot be encoded or quoted, a defect): no DATA
            # has started, so nothing can have been accepted — unavailable, never unknown,
            # and the next provider may be tried. The connection answered EHLO, and the
            # fault is this message's: it must not count against the provider's circuit.
            log_unexpected(self.name, "before DATA", e)
            return unavailable(self.name, f"before DATA: {describe(e)}", health="ok"), False
        return _Accepted(accepted, rejected)

    async def _transaction(
        self, conn: Session, env: Envelope, before_data: BeforeData, reused: bool
    ) -> tuple[Attempted | None, bool]:
        """One MAIL…DATA transaction; (None, False) asks for a fresh connection."""
        t = self.cfg.timeouts
        if env.smtputf8_required and not conn.smtputf8:
            # Checked on the connection in hand (pooled or fresh), before anything is sent:
            # its EHLO is what this provider will accept. RFC 6531's 553 5.6.7, but this
            # provider's alone — nothing was sent, so the route may fail over to one that
            # offers SMTPUTF8; where none does, the event fails with the 553, as the
            # listener answers at MAIL/RCPT once it knows the route. The provider is
            # healthy and the connection clean: it is kept.
            return smtputf8_missing(self.name), True
        try:
            block = data_block(self._prepare(env))
        except Exception as e:
            log_unexpected(self.name, "preparing the message", e)
            return unavailable(self.name, f"before DATA: {describe(e)}", health="ok"), True
        # Judged on the bytes as written (with the headers smtpguard adds): octets above 127.
        eight_bit = not block.isascii()
        if eight_bit and not conn.eightbitmime and not (env.smtputf8_wanted and conn.smtputf8):
            # RFC 6152 §3: 8-bit data must not reach a server that offers neither 8BITMIME
            # nor SMTPUTF8 (RFC 6531 §3.1: that takes 8-bit data), and smtpguard never
            # rewrites a message to 7 bits. Refused on the connection in hand before MAIL, as
            # for SMTPUTF8 above: nothing sent, the connection clean and kept, and the route
            # may fail over to a provider that offers it.
            return eightbitmime_missing(self.name), True
        # The data_sent mark is written while MAIL and RCPT go out and awaited before DATA:
        # its durable write and the provider's round trips overlap instead of adding up (and
        # the pooled connection is not held idle meanwhile). A crash between the two leaves
        # the event `unknown`, held for review: conservative, never a resend.
        marker = asyncio.ensure_future(before_data())
        # Retrieved even when MAIL/RCPT end the transaction first (no "never retrieved").
        marker.add_done_callback(_retrieve)
        try:
            envelope = await self._mail_rcpt(conn, env, reused, eight_bit)
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
        # Lock-step: the message is written only after the 354, so a failure before it
        # has sent nothing the provider could accept (body_written False).
        body_written = delivered = False
        try:
            code, text = await conn.command(b"DATA\r\n", t.data)
            if code == 354:
                # send() raises, writing nothing, on a session already closed.
                future = conn.send(block)[0]
                body_written = True
                code, text = await conn.reply(future, t.data)
            if code // 100 == 3 or (code < 400 and not body_written):
                # A 2xx to DATA itself (no byte of the message written), or a 3xx to the
                # message: neither is its outcome, and the session is out of step.
                raise _out_of_step(conn, code, text)
            delivered = code == 250
        except (aiosmtplib.SMTPServerDisconnected, aiosmtplib.SMTPTimeoutError, OSError, TimeoutError) as e:
            if reused and not body_written and isinstance(e, ConnectionError):
                # A pooled connection gone while DATA waited for its 354: not one byte of
                # the message was written, so as at RCPT (_mail_rcpt), a fresh one asks again.
                conn.close()
                return None, False
            return lost_at_data(self.name, describe(e), rejected, body_written), False
        except aiosmtplib.SMTPResponseException as e:
            # Not an SMTP reply (malformed, too long, out of step): the session was closed.
            # Before the message, nothing can have been accepted; after it, nobody knows.
            return lost_at_data(self.name, describe(e), rejected, body_written), False
        except aiosmtplib.SMTPException as e:
            return unknown(self.name, describe(e), rejected), False
        except Exception as e:
            # Not an SMTP or socket error, but DATA had started: the dot may have gone out.
            log_unexpected(self.name, "after DATA", e)
            return unknown(self.name, describe(e), rejected), False
        if not delivered:
            if reused and not body_written and code == 421:
                # The pooled session ended at the DATA command, before the message: as above.
                conn.close()
                return None, False
            # To the DATA command itself, or to the message after its final dot.
            taken = data_reply(self.name, code, text, rejected, body_written, tuple(accepted))
            return taken, await _rset(conn)
        return Attempted(
            Outcome(
                Kind.DELIVERED,
                self.name,
                upstream_reply(code, text),
                upstream_id=queue_id(text),
                rejected=tuple(rejected),
                accepted=tuple(accepted),
                data_sent=True,
            ),
            failover=False,
            health="ok",
        ), True


def _idempotency_field(name: str, qualified: str) -> bytes:
    """The provider's idempotency header for a zone-qualified key, always ASCII and within
    one RFC 5322 line (998 octets). Written as every tag is (tag_value): the key itself, or
    encoded when ASCII cannot carry it. Raw UTF-8 in a header needs SMTPUTF8 (RFC 6532),
    which the provider may not offer, and would make a 7-bit message 8-bit. A key whose
    encoding would not fit the line (up to 200 characters of four UTF-8 octets each) is
    written as its SHA-256 instead. Either way the value depends on the key alone, never on
    what a connection offered: the provider dedupes on equal values."""
    value = tag_value(qualified)
    if len(name) + 2 + len(value) > _MAX_FIELD_LINE:
        value = _DIGEST_TAG + hashlib.sha256(qualified.encode("utf-8", "surrogateescape")).hexdigest()
    return f"{name}: {value}\r\n".encode("ascii")


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()


@dataclass(frozen=True, slots=True)
class _Accepted:
    accepted: list[str]
    rejected: list[tuple[str, Reply]]


def _out_of_step(conn: Session, code: int, text: str) -> aiosmtplib.SMTPResponseException:
    """A reply no command of ours asked for: the session is closed, never pooled."""
    conn.close()
    return aiosmtplib.SMTPResponseException(code, f"reply out of step: {code} {text}")


async def _rset(conn: Session) -> bool:
    """Reset after a refused transaction; keep the connection only if RSET works."""
    try:
        code, _ = await conn.command(b"RSET\r\n", 5)
    except Exception:
        return False
    return code == 250


def _once(before_data: BeforeData) -> BeforeData:
    """`before_data` run on the first call; later calls wait for that one's result."""
    first: asyncio.Task[None] | None = None

    async def once() -> None:
        nonlocal first
        if first is None:
            first = asyncio.ensure_future(before_data())
        await first

    return once
