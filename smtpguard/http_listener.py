"""An aiohttp listener with the side listeners' limits: the events webhooks and the console.

aiohttp parses HTTP and serves the application; this module only configures it and adds
what aiohttp has no knob for (DESIGN.md §18):

- connection caps (admission.py), checked when the connection is accepted: over a cap the
  client gets `503` and the socket is closed before anything is parsed. Under TLS the
  count starts before the handshake (the listener accepts on its own sockets, admits, then
  hands the socket to the event loop's TLS with read_timeout for the handshake): asyncio's
  TLS server would call the protocol only once a handshake is done, so handshakes that
  never finish would hold descriptors beyond every cap, and the refused get no `503`;
- `read_timeout`, a deadline from the first byte of a request to the last byte of its
  body: aiohttp has none for the request headers, so a client sending a byte a second
  would hold its connection as long as it liked;
- `idle_timeout`, for a connection that sends nothing: before its first request (our own
  timer) and between keep-alive requests (aiohttp's `keepalive_timeout`);
- the same `read_timeout` for a client to take an answer once the socket's buffers are
  full: a client that sends requests whole and in time but never reads the answers would
  otherwise be outside both deadlines and hold its connection for good.

The hooks are the handler's own protocol callbacks (connection_made, data_received,
connection_lost) and the server's `request_factory`, called once a request's headers are
in; its payload's `on_eof` tells when the body is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from smtpguard.admission import (
    WARN_EVERY,
    Admission,
    ListenerLimits,
    Timer,
    WriteDeadline,
    WriteDeadlineProtocol,
    peer_ip,
)
from smtpguard.background import keep

LINGER = 2.0
"""After a response, the unread rest of a body is read and dropped this long at most."""

_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 5\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 30\r\n\r\ntoo many connections; retry.\r\n"
)
_SLOW = (
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 43\r\n\r\nthe request did not arrive in read_timeout\r\n"
)


class BodyAborted(ConnectionResetError):
    """The connection closed (the client left, or read_timeout cut it) while a request's body
    was still arriving: what reading that body raises, in every application on a
    LimitedListener. The client's doing, so one log line, never a traceback; and nobody is
    left to answer."""


class _LimitedHandler(WriteDeadlineProtocol, RequestHandler):
    """aiohttp's protocol for one connection, admitted and timed by its listener."""

    def __init__(
        self, listener: LimitedListener, manager: web.Server, bucket: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(manager, **kwargs)
        self._listener = listener
        self._bucket: str | None = bucket
        """What the connection is counted under; given when it was admitted at accept (TLS)."""
        self._admitted = bucket is not None
        self._timer = Timer(self._loop)
        """The idle_timeout before a request, then the request's read_timeout."""
        self._reading = False
        """A request is arriving: its first byte is in, its body is not complete yet."""
        self._headers_in = False
        self._conn: asyncio.BaseTransport | None = None
        """The connection's transport, kept after aiohttp lets go of it (force_close)."""
        self._writing = WriteDeadline(self._loop, listener.limits.read_timeout, self._not_reading)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._admitted:
            bucket = self._listener.admission.admit(peer_ip(transport))
            if bucket is None:
                transport.write(_BUSY)  # type: ignore[attr-defined]
                transport.close()
                return
            self._bucket = bucket
        self._conn = transport
        super().connection_made(transport)
        self._timer.arm(self._listener.limits.idle_timeout, self._idle)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._bucket is None:
            return  # refused at connection_made: nothing of aiohttp's was started
        self._listener.admission.release(self._bucket)
        self._bucket = None
        self._writing.resumed()
        self._timer.disarm()
        if self._reading and self._headers_in:
            # A handler may be waiting on the rest of the body: aiohttp hands it this exception.
            exc = BodyAborted("the connection closed before the request body was complete")
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._bucket is None:
            return  # refused, or already gone
        if data and not self._reading:
            # The first byte of a request: from here its headers and body have read_timeout,
            # however slowly they trickle in.
            self._reading = True
            self._headers_in = False
            self._timer.arm(self._listener.limits.read_timeout, self._too_slow)
        super().data_received(data)

    def _not_reading(self) -> None:
        transport = self._conn
        logging.getLogger(self._listener.logger).info(
            "response not taken within read_timeout",
            extra={"listener": self._listener.name, "client_ip": self._listener_ip(transport)},
        )
        if transport is not None:
            # Not aiohttp's force_close, which close()s, and may have run already. (uvloop's
            # transports are no asyncio.WriteTransport by isinstance: a cast, not a check.)
            cast(asyncio.Transport, transport).abort()

    def request_read(self) -> None:
        """The request's body is complete (called through its payload's on_eof)."""
        self._reading = False
        self._timer.disarm()

    def headers_read(self) -> None:
        self._headers_in = True

    def _idle(self) -> None:
        if not self._reading:
            self.force_close()

    def _too_slow(self) -> None:
        transport = self.transport
        logging.getLogger(self._listener.logger).info(
            "request not received within read_timeout",
            extra={"listener": self._listener.name, "client_ip": self._listener_ip(transport)},
        )
        if transport is not None and not self._headers_in:
            transport.write(_SLOW)
        self.force_close()

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            # A request aiohttp's parser refused (400: a header too long, Content-Length with
            # Transfer-Encoding, a bare LF): the client's doing, one line, no traceback.
            # Anything else (a bug of ours) keeps aiohttp's traceback.
            logging.getLogger(self._listener.logger).info(
                "malformed HTTP request refused",
                extra={
                    "listener": self._listener.name,
                    "client_ip": self._listener_ip(self.transport),
                    "error": f"{type(exc).__name__}: {exc.message}"[:200],
                },
            )
            return
        super().log_exception(*args, **kw)

    @staticmethod
    def _listener_ip(transport: asyncio.BaseTransport | None) -> str:
        return peer_ip(transport) if transport is not None else "?"


class LimitedListener:
    """One aiohttp application on one address, with the side listeners' limits."""

    def __init__(self, app: web.Application, limits: ListenerLimits, name: str, logger: str) -> None:
        self.app = app
        self.limits = limits
        self.name = name
        """The listener's config section (events, console): log lines name it."""
        self.logger = logger
        self.admission = Admission(limits, name, logger)
        self.handshaking: set[asyncio.Task[None]] = set()
        """TLS handshakes in progress: admitted connections aiohttp does not know of yet."""
        self._socks: list[socket.socket] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._accept_failed = -WARN_EVERY
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._handler_args: dict[str, Any] = {
            # No access log: a webhook URL may carry a token in its query string.
            "access_log": None,
            "keepalive_timeout": limits.idle_timeout,
            "lingering_time": min(LINGER, limits.read_timeout),
        }

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self._runner = web.AppRunner(self.app, handle_signals=False, **self._handler_args)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        make_request = server.request_factory

        def request_factory(
            message: RawRequestMessage,
            payload: StreamReader,
            protocol: RequestHandler,
            writer: AbstractStreamWriter,
            task: asyncio.Task[None],
        ) -> BaseRequest:
            if isinstance(protocol, _LimitedHandler):
                protocol.headers_read()
                payload.on_eof(protocol.request_read)
            return make_request(message, payload, protocol, writer, task)

        server.request_factory = request_factory
        loop = asyncio.get_running_loop()
        if ssl_context is None:
            self._server = await loop.create_server(
                lambda: _LimitedHandler(self, server, loop=loop, **self._handler_args),
                host,
                port,
                reuse_address=True,
            )
            self.port = self._server.sockets[0].getsockname()[1] if self._server.sockets else port
            return
        # Under TLS the connection is admitted at accept, before its handshake: asyncio's
        # own TLS server calls the protocol only once a handshake is done, so handshakes
        # that never finish would hold descriptors beyond every cap.
        self._socks = _bind(host, port)
        self.port = self._socks[0].getsockname()[1]

        def handler(bucket: str) -> _LimitedHandler:
            return _LimitedHandler(self, server, bucket, loop=loop, **self._handler_args)

        self._accepting = [loop.create_task(self._accept(s, ssl_context, handler)) for s in self._socks]

    async def _accept(
        self, sock: socket.socket, tls: ssl.SSLContext, handler: Callable[[str], _LimitedHandler]
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await loop.sock_accept(sock)
            except OSError as e:
                # Out of descriptors (EMFILE) or the like: they come back as connections
                # close; meanwhile new ones wait in the kernel's queue.
                if time.monotonic() - self._accept_failed > WARN_EVERY:
                    self._accept_failed = time.monotonic()
                    logging.getLogger(self.logger).warning(
                        "accept failed", extra={"listener": self.name, "error": str(e)}
                    )
                await asyncio.sleep(0.1)
                continue
            bucket = self.admission.admit(str(address[0]))
            if bucket is None:
                conn.close()
                continue
            keep(self.handshaking, self._handshake(conn, tls, bucket, handler))

    async def _handshake(
        self, conn: socket.socket, tls: ssl.SSLContext, bucket: str, handler: Callable[[str], _LimitedHandler]
    ) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: handler(bucket), conn, ssl=tls, ssl_handshake_timeout=self.limits.read_timeout
            )
        except asyncio.CancelledError:
            conn.close()
            self.admission.release(bucket)
            raise
        except Exception:
            # No handshake within read_timeout, a bad one, or the client gone: the handler
            # never started, so the slot is given back here.
            conn.close()
            self.admission.release(bucket)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for accepting in self._accepting:
            accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await accepting
        self._accepting = []
        for sock in self._socks:
            sock.close()
        self._socks = []
        for handshake in list(self.handshaking):
            handshake.cancel()
        if self.handshaking:
            await asyncio.wait(list(self.handshaking), timeout=1)
        if self._runner is not None:
            # Closes the open connections and waits for the requests in progress.
            await self._runner.cleanup()
            self._runner = None


def _bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address of `host`, as asyncio's create_server binds them
    (SO_REUSEADDR; an IPv6 socket takes IPv6 only), for the accept loop of a TLS listener."""
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        ):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(100)
            sock.setblocking(False)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks
