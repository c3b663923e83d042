"""aiosmtpd handler: session hooks gather inputs, ask policy/ (through submission.py), reply.

The SMTP protocol itself, narrowed where smtpguard's contract is stricter, is protocol.py.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Concatenate, ParamSpec

from aiosmtpd.smtp import SMTP, AuthResult, Envelope, Session, TLSSetupException

from smtpguard import replies
from smtpguard.background import keep
from smtpguard.config import Config, plan_send_as
from smtpguard.connection_table import Connections
from smtpguard.listener.protocol import GuardSMTP
from smtpguard.passwords import Verifier
from smtpguard.policy.decisions import Decision
from smtpguard.policy.envelope import recipient_refusal, sender_refusal
from smtpguard.policy.http_trust import limit_unit
from smtpguard.policy.senders import normalize_address, route_offers_smtputf8
from smtpguard.policy.unrecorded import UnrecordedFailures
from smtpguard.receivers import Receivers
from smtpguard.recipient_domains import RecipientDomains
from smtpguard.replies import Reply
from smtpguard.store import Store, StoreUnavailable
from smtpguard.submission import Principal, Result, Submitter
from smtpguard.turns import Turns

log = logging.getLogger("smtpguard.listener")
_P = ParamSpec("_P")


def _signed_in(
    hook: Callable[Concatenate[Handler, Principal, Envelope, _P], Awaitable[str]],
) -> Callable[Concatenate[Handler, SMTP, Session, Envelope, _P], Awaitable[str]]:
    """An envelope hook (MAIL, RCPT, DATA) as aiosmtpd calls it, for authenticated sessions
    only: before AUTH it answers 530 5.7.0 itself, after AUTH the hook gets the session's
    Principal in place of aiosmtpd's server and session."""

    async def signed_in(
        self: Handler,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        /,
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> str:
        principal = session.auth_data
        if not isinstance(principal, Principal):
            return str(replies.AUTH_REQUIRED)
        if not self.entitled(principal):
            return self._revoke(server, principal)
        return await hook(self, principal, envelope, *args, **kwargs)

    return signed_in


class Handler:
    """aiosmtpd handler: AUTH, MAIL, RCPT, DATA hooks for one smtpguard instance."""

    def __init__(
        self,
        submitter: Submitter,
        store: Store,
        verifier: Verifier,
        on_result: Callable[[Principal | None, Result, float], None],
        clock: Callable[[], float] = time.time,
        recipient_domains: RecipientDomains | None = None,
        observe: Callable[[str], None] | None = None,
        receivers: Receivers | None = None,
    ) -> None:
        self.submitter = submitter
        self.receivers = receivers
        """Receiving providers (DESIGN.md §21): RCPT holds a paused or over-rate one's
        recipients; relayed recipients are counted per receiver."""
        self.recipient_domains = recipient_domains
        """The RCPT domain check of zones with `recipient_domains: check` (DESIGN.md §12)."""
        self.store = store
        self.verifier = verifier
        self.connections = Connections()
        self.on_result = on_result
        self.clock = clock
        self.observe = observe or (lambda event: None)
        """Events for metrics: auth_failure, auth_lockout, store_error:<where>."""
        self.active = 0
        """Submissions between end of DATA and their reply (graceful stop waits for them)."""
        self.idle = asyncio.Event()
        self.idle.set()
        self.draining = False
        self._submissions: set[asyncio.Task[str]] = set()
        self._held: weakref.WeakKeyDictionary[Envelope, list[str]] = weakref.WeakKeyDictionary()
        """The recipients of each open transaction a receiver held at RCPT (DESIGN.md §21):
        owed by its event, whose retry of them alone the ledger knows (policy/ledger.py)."""
        self._auth_turns = Turns()
        self._unrecorded = UnrecordedFailures()
        self._credentials_of: tuple[Config, dict[str, tuple[str, frozenset[str]]]] | None = None

    @property
    def config(self) -> Config:
        return self.submitter.config

    def admit(self, ip: str) -> bool:
        """A new connection from `ip`, counted per IPv4 address and per IPv6 /64 (as every
        other listener counts): one client holds a whole /64, so per address it would have
        `max_connections_per_ip` connections 2^64 times over."""
        limits = self.config.limits
        return not self.draining and self.connections.admit(
            limit_unit(ip), limits.max_connections, limits.max_connections_per_ip
        )

    def release(self, ip: str) -> None:
        self.connections.release(limit_unit(ip))

    def entitled(self, principal: Principal) -> bool:
        """Whether the configuration now running still grants what the session's AUTH
        proved: the user exists, in the same zone, and still holds the hash its password
        matched. A reload that removes or moves the user, or ends a rotation, must not leave
        a session open with the rights it no longer has (checked at MAIL, RCPT and the
        final dot, so nothing is sent or recorded for it)."""
        held = self._credentials(self.config).get(principal.username)
        return held is not None and held[0] == principal.zone and principal.credential in held[1]

    def _credentials(self, config: Config) -> dict[str, tuple[str, frozenset[str]]]:
        """Each user's zone and hashes, built once per configuration (a reload swaps it)."""
        if self._credentials_of is None or self._credentials_of[0] is not config:
            index = {
                user.username: (zname, frozenset(user.hashes))
                for zname, zone in config.zones.items()
                for user in zone.users
            }
            self._credentials_of = (config, index)
        return self._credentials_of[1]

    def _revoke(self, server: SMTP, principal: Principal) -> str:
        log.warning(
            "session closed: its credentials were changed by a reload",
            extra={"zone": principal.zone, "client_ip": principal.client_ip, "session": principal.session},
        )
        if isinstance(server, GuardSMTP):
            server.hang_up(replies.CREDENTIALS_CHANGED)
        elif server.transport is not None:
            server.transport.close()
        return str(replies.CREDENTIALS_CHANGED)

    # --- AUTH --------------------------------------------------------------------------------
    async def auth_PLAIN(self, server: SMTP, args: list[str]) -> AuthResult:
        blob = await _first_response(server, args, "")
        if blob is None:
            return AuthResult(success=False, handled=True)
        parts = blob.split(b"\x00")
        if len(parts) != 3:
            await server.push(str(replies.AUTH_BAD_PLAIN))
            return AuthResult(success=False, handled=True)
        authzid, login, password = parts
        # RFC 4616 §2: the authenticated user must be allowed to act as the authzid. No
        # smtpguard user may act as another, so one naming anyone else fails as a bad
        # password does (verified and counted the same, so its reply tells nothing).
        return await self._authenticate(server, login, password, acts_as_self=authzid in (b"", login))

    async def auth_LOGIN(self, server: SMTP, args: list[str]) -> AuthResult:
        login = await _first_response(server, args, "Username:")
        if login is None:
            return AuthResult(success=False, handled=True)
        password = await _challenge(server, "Password:")
        if password is None:
            return AuthResult(success=False, handled=True)
        return await self._authenticate(server, login, password)

    async def _authenticate(
        self, server: SMTP, login: bytes, password: bytes, acts_as_self: bool = True
    ) -> AuthResult:
        ip = _peer_ip(server.session)
        # Failures are counted per IPv4 address and per IPv6 /64, as the console counts
        # them: a client holding a /64 must not get a fresh count from each address in it.
        unit = limit_unit(ip)
        # One verification at a time per client: N parallel connections must not each pass
        # the failure check before any of them has recorded its failure.
        async with self._auth_turns.turn(unit):
            if isinstance(server, GuardSMTP):
                async with server.working():
                    return await self._authenticate_one(server, ip, unit, login, password, acts_as_self)
            return await self._authenticate_one(server, ip, unit, login, password, acts_as_self)

    async def _authenticate_one(
        self, server: SMTP, ip: str, unit: str, login: bytes, password: bytes, acts_as_self: bool
    ) -> AuthResult:
        limits = self.config.limits
        try:
            now = self.clock()
            window = limits.auth_failure_window
            counted = await self.store.auth_failures(unit, now, window)
            if counted + self._unrecorded.count(unit, now, window) >= limits.auth_failures:
                return await self._lock_out(server, ip)
            username = login.decode("utf-8", "replace")
            found = self.config.user_zone(username)
            try:
                secret: str | None = password.decode("utf-8")
            except UnicodeDecodeError:
                # No hash-password output can match bytes that are not UTF-8; still pay the
                # full verification so the reply time says nothing.
                secret = None
            matched = await self.verifier.verify_any(
                username,
                found[1].hashes if found and secret is not None else (),
                secret or "",
                pad_to=_most_hashes(self.config),
            )
            if matched is not None and found and secret is not None and acts_as_self:
                principal = Principal(found[0], username, ip, _session_id(server.session), matched)
                return AuthResult(success=True, auth_data=principal)
            try:
                failures = await self.store.auth_failure(unit, self.clock(), window)
            except StoreUnavailable:
                # The failure could not be counted in the store: count it here, so a store
                # that reads but cannot write never allows unlimited guesses (module doc).
                self._unrecorded.add(unit, self.clock())
                raise
            failures += self._unrecorded.count(unit, self.clock(), window)
        except StoreUnavailable:
            self.observe("store_error:auth")
            return AuthResult(success=False, handled=False, message=str(replies.STORE_UNAVAILABLE))
        self.observe("auth_failure")
        log.info(
            "authentication failed",
            extra={"client_ip": ip, "session": _session_id(server.session), "failures": failures},
        )
        if failures >= limits.auth_failures:
            return await self._lock_out(server, ip)
        return AuthResult(success=False, handled=False, message=str(replies.AUTH_INVALID))

    async def _lock_out(self, server: SMTP, ip: str) -> AuthResult:
        self.observe("auth_lockout")
        log.warning("AUTH locked out", extra={"client_ip": ip, "session": _session_id(server.session)})
        if isinstance(server, GuardSMTP):
            server.hang_up(replies.AUTH_LOCKED)
        else:
            await server.push(str(replies.AUTH_LOCKED))
            if server.transport is not None:
                server.transport.close()
        return AuthResult(success=False, handled=True)

    async def handle_exception(self, error: Exception) -> str:
        """aiosmtpd's fallback would log a traceback and echo the exception text to the
        client; only a real bug deserves the first, and nobody the second."""
        if isinstance(error, TLSSetupException):
            # aiosmtpd closes the connection without sending this.
            log.info("TLS handshake failed", extra={"error": type(error.__cause__).__name__})
            return str(replies.TLS_FAILED)
        log.error("unexpected error in an SMTP session", exc_info=error)
        return str(replies.INTERNAL_ERROR)

    # --- envelope ----------------------------------------------------------------------------
    @_signed_in
    async def handle_MAIL(
        self, principal: Principal, envelope: Envelope, address: str, mail_options: list[str]
    ) -> str:
        zone = self.config.zones.get(principal.zone)
        # aiosmtpd has moved SMTPUTF8 from the parameters to envelope.smtp_utf8 already.
        refusal = sender_refusal(
            address,
            principal.zone,
            zone is not None and plan_send_as(zone),
            zone.senders if zone is not None else (),
            envelope.smtp_utf8,
            self._route_smtputf8(principal.zone),
        )
        if refusal is not None:
            return self._refuse(principal, refusal.reply)
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return str(replies.OK_SENDER)

    @_signed_in
    async def handle_RCPT(
        self, principal: Principal, envelope: Envelope, address: str, rcpt_options: list[str]
    ) -> str:
        if normalize_address(address) in envelope.rcpt_tos:
            # Named again: accepted already, and relayed once (policy/envelope.py).
            return str(replies.OK_RECIPIENT)
        refusal = recipient_refusal(
            address,
            len(envelope.rcpt_tos),
            self.config.limits.max_recipients,
            envelope.smtp_utf8,
            self._route_smtputf8(principal.zone),
        )
        if refusal is not None:
            return self._refuse(principal, refusal.reply) if refusal.counted else str(refusal.reply)
        try:
            listed = await self.submitter.suppressions.find(principal.zone, address)
        except StoreUnavailable:
            self.observe("store_error:rcpt")
            return str(replies.STORE_UNAVAILABLE)
        if listed:
            return self._refuse(principal, replies.suppressed(address, listed))
        zone = self.config.zones.get(principal.zone)
        if zone is not None and self.receivers is not None:
            # Under way while the domain check waits on DNS: RCPT waits for DNS once, not
            # once per lookup (dns.timeout is the bound).
            self.receivers.lookup.start(address)
        if zone is not None and zone.recipient_domains == "check" and self.recipient_domains is not None:
            unroutable = await self.recipient_domains.refusal(address)
            if unroutable is not None:
                return self._refuse(principal, unroutable)
        if zone is not None and self.receivers is not None:
            held = await self.receivers.rcpt_refusal(principal.zone, address, zone.delivery == "queue")
            if held is not None:
                self._held.setdefault(envelope, []).append(normalize_address(address))
                return str(held)  # a hold, not a refusal of the address: not counted as one
        envelope.rcpt_tos.append(normalize_address(address))
        envelope.rcpt_options.extend(rcpt_options)
        return str(replies.OK_RECIPIENT)

    def _route_smtputf8(self, zone: str) -> bool | None:
        """What the last EHLOs of the zone's route (its own `providers`, else the top-level
        one) said about SMTPUTF8 (read per command: a reload replaces the route, and a
        relay may just have learnt a provider's answer)."""
        return route_offers_smtputf8(p.smtputf8 for p in self.submitter.route.providers_for(zone))

    def _refuse(self, principal: Principal, reply: Reply) -> str:
        self.on_result(principal, Result(reply, "rejected:envelope"), 0.0)
        return str(reply)

    # --- DATA --------------------------------------------------------------------------------
    @_signed_in
    async def handle_DATA(self, principal: Principal, envelope: Envelope) -> str:
        assert envelope.mail_from is not None  # aiosmtpd answers DATA before MAIL itself (503)
        if self.draining:
            return str(replies.SHUTTING_DOWN)
        self.active += 1
        self.idle.clear()
        task = keep(
            self._submissions,
            self._submit(
                principal,
                envelope.mail_from,
                list(envelope.rcpt_tos),
                envelope.original_content or b"",
                bool(envelope.smtp_utf8),
                self._held.pop(envelope, []),
            ),
        )
        # A client that hangs up after its final dot must not abandon a relay half done: the
        # submission runs to its recorded outcome, whoever is left to hear the reply.
        reply = await asyncio.shield(task)
        return reply

    async def _submit(
        self,
        principal: Principal,
        mail_from: str,
        rcpt_tos: list[str],
        raw: bytes,
        smtputf8: bool,
        held: list[str],
    ) -> str:
        started = time.perf_counter()
        try:
            result = await self.submitter.submit(principal, mail_from, rcpt_tos, raw, smtputf8, held)
        except Exception:
            log.exception(
                "internal error while handling a submission",
                extra={
                    "zone": principal.zone,
                    "client_ip": principal.client_ip,
                    "session": principal.session,
                },
            )
            result = Result(replies.INTERNAL_ERROR, "internal_error")
        finally:
            self.active -= 1
            if not self.active:
                self.idle.set()
        self.on_result(principal, result, time.perf_counter() - started)
        if self.receivers is not None and result.decision == Decision.RELAYED:
            self.receivers.sent(principal.zone, [r for r in rcpt_tos if r not in result.refused])
        return str(result.reply)


async def _challenge(server: SMTP, prompt: str) -> bytes | None:
    """One AUTH challenge; None when the client aborted or sent no usable answer (replied).
    An over-long answer reaches challenge_auth as GuardSMTP's stand-in line: not base64."""
    blob = await server.challenge_auth(prompt)
    return blob if isinstance(blob, bytes) else None


async def _first_response(server: SMTP, args: list[str], prompt: str) -> bytes | None:
    """The first answer of an AUTH exchange: the initial response given with the command
    (RFC 4954 §4), else the answer to a first challenge of `prompt`."""
    if len(args) == 1:
        return await _challenge(server, prompt)
    return await _initial_response(server, args[1])


async def _initial_response(server: SMTP, arg: str) -> bytes | None:
    try:
        return base64.b64decode(arg.encode(), validate=True)
    except (binascii.Error, ValueError):
        await server.push(str(replies.AUTH_BAD_BASE64))
        return None


def _session_id(session: Session | None) -> str | None:
    sid = getattr(session, "id", None)
    return sid if isinstance(sid, str) else None


def _peer_ip(session: Session | None) -> str:
    peer = getattr(session, "peer", None)
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return "?"


def _most_hashes(config: Config) -> int:
    """The most password hashes any user holds (2 during a rotation): every failed AUTH
    costs that many verifications, so its time does not tell which usernames exist."""
    return max((len(u.hashes) for z in config.zones.values() for u in z.users), default=1)
