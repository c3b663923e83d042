"""Real parts for tests: a recording upstream, configs, an in-process smtpguard, a client.

Nothing here mocks smtpguard: the upstream is an aiosmtpd server on a free port, the
client speaks SMTP over a socket, the store is a real SQLite file or redis-server.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import aiosmtplib
import yaml
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session
from argon2 import PasswordHasher

from smtpguard.config import loads
from smtpguard.server import Server
from smtpguard.store import store_from_url
from smtpguard.suppression import REFRESH
from tests.support.eventually import eventually
from tests.support.ports import free_port

PASSWORD = "s3cret-test-pass"
OTHER_PASSWORD = "other-zone-pass"
_HASHES: dict[str, str] = {}


# Real argon2id hashes, at the cheapest parameters argon2 takes. One at smtpguard's defaults
# (64 MiB, 3 passes, 4 lanes) costs a server 0.1-0.5 s of both cores to verify, once per
# server started and once per failed AUTH: nearly every test paid it. smtpguard verifies by
# the parameters a hash carries, so the code path is the same; `smtpguard hash-password` and
# its parameters are tested on their own (tests/ops/test_ops.py).
_CHEAP = PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)


def password_hash(password: str) -> str:
    if password not in _HASHES:
        _HASHES[password] = _CHEAP.hash(password)
    return _HASHES[password]


def wait_listening(port: int, what: str, timeout: float = 10) -> None:
    """Block until something accepts connections on 127.0.0.1:port (a child just started)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"{what} did not start on port {port}")


# --- the recording upstream ------------------------------------------------------------------
@dataclass
class Received:
    mail_from: str
    rcpt_tos: list[str]
    content: bytes

    def header(self, name: str) -> str | None:
        head = self.content.split(b"\r\n\r\n", 1)[0].decode()
        for line in head.split("\r\n"):
            k, _, v = line.partition(":")
            if k.lower() == name.lower():
                return v.strip()
        return None


@dataclass
class Behaviour:
    """What the upstream does for one transaction; the default accepts."""

    mail: str | None = None
    """A reply to MAIL instead of 250, e.g. "451 4.3.0 try later"."""
    rcpt: dict[str, str] = field(default_factory=dict)
    """Per-recipient replies instead of 250."""
    data: str | None = None
    """A reply to the final dot instead of 250."""
    hang_after_dot: float = 0.0
    """Seconds to wait before answering the final dot (the message is recorded first)."""
    hold_after_dot: asyncio.Event | None = None
    """Wait for this event before answering the final dot (the message is recorded first):
    a transaction kept in flight exactly as long as the test needs, not for a guessed time."""
    accept: str = "250 2.0.0 Ok: queued as {queue_id}"
    """The reply to a final dot the upstream takes (the message is recorded); `{queue_id}` is
    filled in."""
    drop_after_dot: bool = False
    """Record the message, then close the connection without replying (RFC 1047 window)."""
    hang_at_mail: float = 0.0
    """Seconds to wait before answering MAIL (a slow provider before anything is sent)."""
    hold_at_mail: asyncio.Event | None = None
    """Wait for this event before answering MAIL (counted in `transactions` first): a
    transaction held before anything is sent exactly as long as the test needs."""
    idle_421: bool = False
    """After accepting the message, let the session time out as if idle: the next MAIL on it
    gets `421 4.4.2 … timeout exceeded` and the connection closes (the race of a pooled
    connection reused just as the provider's idle timer fired)."""


@dataclass
class RateLimit:
    """A provider's own rate limit: after `after` accepted messages, MAIL is answered with
    `reply` for `window` seconds (then it accepts again, counting afresh)."""

    after: int
    window: float
    reply: str = "421 4.7.0 rate limited, slow down"
    times: int = 0
    """How many windows it limits in all; 0: every time `after` is reached again."""


class RecordingHandler:
    def __init__(self) -> None:
        self.received: list[Received] = []
        self.script: list[Behaviour] = []
        self.default = Behaviour()
        self.transactions = 0
        self.data_commands = 0
        """Transactions that got past RCPT to DATA: what a cap unit pays for."""
        self.arrived = asyncio.Event()
        self.rate_limit: RateLimit | None = None
        self.mail_times: list[float] = []
        """time.monotonic() of every MAIL this upstream answered 250."""
        self.limited_times: list[float] = []
        """time.monotonic() of every MAIL refused by `rate_limit`."""
        self._limited_until = 0.0
        self._since_limit = 0
        self._windows = 0
        self.open_sessions = 0
        self.max_sessions = 0
        """The most connections this upstream had open at once."""

    def _rate_limited(self) -> str | None:
        rl = self.rate_limit
        if rl is None:
            return None
        now = time.monotonic()
        if now < self._limited_until:
            self.limited_times.append(now)
            return rl.reply
        if self._since_limit >= rl.after and not (rl.times and self._windows >= rl.times):
            self._windows += 1
            self._since_limit = 0
            self._limited_until = now + rl.window
            self.limited_times.append(now)
            return rl.reply
        self._since_limit += 1
        return None

    def _current(self, envelope: Envelope) -> Behaviour:
        b = getattr(envelope, "_behaviour", None)
        if b is None:
            b = self.script.pop(0) if self.script else self.default
            envelope._behaviour = b  # type: ignore[attr-defined]
        return b

    async def handle_MAIL(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        self.transactions += 1
        if getattr(session, "idle_expired", False):
            assert server.transport is not None
            asyncio.get_running_loop().call_soon(server.transport.close)
            return "421 4.4.2 upstream Error: timeout exceeded"
        envelope._behaviour = None  # type: ignore[attr-defined]
        b = self._current(envelope)
        if b.hang_at_mail:
            await asyncio.sleep(b.hang_at_mail)
        if b.hold_at_mail is not None:
            await b.hold_at_mail.wait()
        if b.mail:
            envelope._behaviour = None  # type: ignore[attr-defined]
            return b.mail
        limited = self._rate_limited()
        if limited:
            envelope._behaviour = None  # type: ignore[attr-defined]
            return limited
        self.mail_times.append(time.monotonic())
        envelope.mail_from = address
        return "250 2.1.0 OK"

    async def handle_RCPT(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        b = self._current(envelope)
        if address in b.rcpt:
            return b.rcpt[address]
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        self.data_commands += 1
        b = self._current(envelope)
        content = envelope.original_content or b""
        if b.data:
            return b.data
        self.received.append(Received(envelope.mail_from or "", list(envelope.rcpt_tos), content))
        session.served = True  # type: ignore[attr-defined]
        queue_id = f"Q{len(self.received)}"
        self.arrived.set()
        if b.drop_after_dot:
            assert server.transport is not None
            server.transport.abort()
            return "250 2.0.0 never seen"
        if b.hang_after_dot:
            await asyncio.sleep(b.hang_after_dot)
        if b.hold_after_dot is not None:
            await b.hold_after_dot.wait()
        if b.idle_421:
            session.idle_expired = True  # type: ignore[attr-defined]
        return b.accept.format(queue_id=queue_id)


class _CountingSMTP(SMTP):
    """aiosmtpd's server, counting the sessions open at once (max_connections tests)."""

    def __init__(self, handler: RecordingHandler, **kwargs: Any) -> None:
        super().__init__(handler, hostname="upstream", ident="recording-upstream", **kwargs)
        self._recording = handler

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        h = self._recording
        h.open_sessions += 1
        h.max_sessions = max(h.max_sessions, h.open_sessions)
        super().connection_made(transport)

    def connection_lost(self, error: Exception | None) -> None:
        self._recording.open_sessions -= 1
        super().connection_lost(error)


class Upstream:
    """An aiosmtpd server recording every accepted message.

    With `password`, it requires AUTH (PLAIN/LOGIN, user UPSTREAM_USER; in clear, on
    loopback) with that password, which `rotate` changes while it runs, as a provider does
    when its API key is rolled."""

    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        self.port = port or free_port()
        self.handler = RecordingHandler()
        self._server: asyncio.Server | None = None
        self.password = password
        self.auth_ok = 0
        self.auth_refused = 0
        """AUTH commands refused (a client may try PLAIN, then LOGIN, on one connection)."""
        self.refused_connections: set[int] = set()
        self._live: set[SMTP] = set()

    def _authenticate(
        self, server: SMTP, session: Session, envelope: Envelope, mechanism: str, auth_data: Any
    ) -> AuthResult:
        good = (
            isinstance(auth_data, LoginPassword)
            and auth_data.login == UPSTREAM_USER.encode()
            and self.password is not None
            and auth_data.password == self.password.encode()
        )
        if good:
            self.auth_ok += 1
            return AuthResult(success=True)
        self.auth_refused += 1
        self.refused_connections.add(id(session))
        return AuthResult(success=False, handled=False)

    def rotate(self, password: str, then: Callable[[], None] | None = None) -> None:
        """Accept only `password` from now on and close every idle authenticated connection
        (no transaction under way: closing it loses nothing), so the next message needs a
        fresh AUTH. `then` runs before any AUTH is answered again (nothing here awaits)."""
        self.password = password
        for conn in list(self._live):
            # Only between transactions of a connection that has carried one already: one
            # just past AUTH is about to send MAIL on a connection its client thinks fresh.
            idle = conn.envelope is None or conn.envelope.mail_from is None
            if conn.transport is not None and getattr(conn.session, "served", False):
                if idle:
                    conn.transport.close()
                else:
                    # Mid-transaction: that message goes through; the session ends at its
                    # next MAIL (421), so every connection meets the rotation, as when a
                    # provider revokes a key (else a busy pool could carry on for ever).
                    conn.session.idle_expired = True  # type: ignore[union-attr]
        if then is not None:
            then()

    @property
    def received(self) -> list[Received]:
        return self.handler.received

    async def wait_received(self, n: int, timeout: float = 10) -> None:
        """Until the upstream has recorded at least n messages."""
        async with asyncio.timeout(timeout):
            while len(self.received) < n:
                self.handler.arrived.clear()
                await self.handler.arrived.wait()

    def event_keys(self) -> list[str | None]:
        return [r.header("X-Event-Key") for r in self.received]

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def make() -> SMTP:
            if self.password is None:
                return _CountingSMTP(self.handler)
            conn = _TrackedSMTP(
                self.handler,
                authenticator=self._authenticate,
                auth_required=True,
                auth_require_tls=False,
            )
            conn.live = self._live
            return conn

        self._server = await loop.create_server(
            make,
            "127.0.0.1",
            self.port,
            reuse_address=True,
        )

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None


UPSTREAM_USER = "relay-user"


class _TrackedSMTP(_CountingSMTP):
    live: set[SMTP]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.live.add(self)

    def connection_lost(self, error: Exception | None) -> None:
        self.live.discard(self)
        super().connection_lost(error)


# --- configs ---------------------------------------------------------------------------------
def base_config(tmp: Path, upstream_port: int | None, **overrides: Any) -> dict[str, Any]:
    providers: list[dict[str, Any]]
    if upstream_port is None:
        providers = [{"name": "local", "kind": "maildir", "path": str(tmp / "maildir")}]
    else:
        providers = [
            {
                "name": "primary",
                "kind": "smtp",
                "host": "127.0.0.1",
                "port": upstream_port,
                "tls": "none",
                "timeouts": {"connect": "2s", "command": "5s", "data": "3s"},
                "pool_size": 8,
            }
        ]
    cfg: dict[str, Any] = {
        "listen": [{"address": "127.0.0.1:0", "tls": "none"}],
        "store": {"url": f"sqlite:///{tmp / 'state.db'}"},
        # The upstream's X-Event-Key is how tests count deliveries per event, so it travels
        # (strip: false); tests of event_key.strip turn stripping back on.
        "event_key": {"inflight_wait": "5s", "min_retry_interval": "60s", "lease": "30s", "strip": False},
        "providers": providers,
        "hostname": "guard.test",
        "log": {"format": "json", "level": "info"},
        "zones": {
            "acme": {
                "plan": "business",
                "senders": ["billing@acme.example", "@notify.acme.example"],
                "users": [{"username": "acme-app", "password_hash": password_hash(PASSWORD)}],
            },
            "globex": {
                "plan": "solo",
                "senders": ["@globex.example"],
                "users": [{"username": "globex-app", "password_hash": password_hash(OTHER_PASSWORD)}],
            },
        },
    }
    for dotted, value in overrides.items():
        node = cfg
        parts = dotted.split("__")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return cfg


def write_config(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class FakeClock:
    """The one thing tests may fake: time. Starts now; moves only when told."""

    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


@contextlib.asynccontextmanager
async def running_guard(
    cfg: dict[str, Any], clock: Callable[[], float] | None = None, config_path: Path | None = None
) -> AsyncIterator[Server]:
    """smtpguard in this process; without `clock`, on its store's clock as in production.
    With `config_path` (the file `cfg` is written to), `server.reload()` re-reads it."""
    if config_path is not None:
        write_config(config_path, cfg)
    server = Server(loads(yaml.safe_dump(cfg)), config_path=config_path, clock=clock)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def suppressions_refreshed(server: Server) -> None:
    """Moves the listener's suppression cache a refresh on (suppression.REFRESH): the wait a
    change made elsewhere (the CLI, a provider event) has in production, without waiting."""
    assert server.submitter is not None
    cache = server.submitter.suppressions
    before = cache.clock
    cache.clock = lambda: before() + REFRESH


# --- the client ------------------------------------------------------------------------------
def message(
    key: str | None = "invoice:acme:1",
    *,
    sender: str = "billing@acme.example",
    to: str = "customer@example.com",
    subject: str = "Invoice 1",
    body: str = "Your invoice.\n",
    headers: dict[str, str] | None = None,
) -> EmailMessage:
    msg = EmailMessage()
    msg["From"] = sender
    msg["To"] = to
    msg["Subject"] = subject
    if key is not None:
        msg["X-Event-Key"] = key
    for k, v in (headers or {}).items():
        msg[k] = v
    msg.set_content(body)
    return msg


@dataclass
class Reply:
    code: int
    text: str

    def __str__(self) -> str:
        return f"{self.code} {self.text}"


async def send(
    port: int,
    msg: EmailMessage | bytes,
    *,
    user: str = "acme-app",
    password: str = PASSWORD,
    sender: str = "billing@acme.example",
    recipients: list[str] | None = None,
    timeout: float = 20,
) -> Reply:
    """Submit one message; return the reply smtpguard gave (to MAIL, RCPT or DATA)."""
    rcpts = recipients or ["customer@example.com"]
    client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, start_tls=False, timeout=timeout)
    await client.connect()
    try:
        if user:
            try:
                await client.login(user, password)
            except aiosmtplib.SMTPResponseException as e:
                return Reply(e.code, e.message)
        raw = (
            msg.as_bytes().replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
            if isinstance(msg, EmailMessage)
            else msg
        )
        try:
            resp = await client.sendmail(sender, rcpts, raw)
            code, text = next(iter(resp[0].values())) if resp[0] else (250, resp[1])
            if code < 400:
                return Reply(250, resp[1])
            return Reply(code, text)
        except aiosmtplib.SMTPRecipientsRefused as e:
            first = e.recipients[0]
            return Reply(first.code, first.message)
        except aiosmtplib.SMTPResponseException as e:
            return Reply(e.code, e.message)
    finally:
        with contextlib.suppress(Exception):
            await client.quit()
        client.close()


# --- a serve process (restart, crash and multi-instance tests) -------------------------------
class GuardProcess:
    def __init__(
        self, config_path: Path, log_path: Path, prefix: tuple[str, ...] = (), src: Path | None = None
    ) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self.prefix = prefix
        """Runs serve under this command, e.g. ("faketime", "-f", "-90s") for a skewed host."""
        self.src = src
        """Runs the smtpguard package of this source tree (another release, from `git
        archive`) with this checkout's interpreter and dependencies."""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.src is not None:
            # `python -m` puts its working directory first on sys.path, ahead of the venv's
            # editable install of this checkout.
            env["PYTHONPATH"] = str(self.src)
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "smtpguard", "serve", "-c", str(self.config_path)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.src,
            # A group of its own: a prefix such as faketime forks serve as its child, and a
            # signal to the prefix alone would leave serve running after the test.
            start_new_session=True,
        )

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    async def wait_port(self, port: int, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"smtpguard exited: {self.log_path.read_text()[-2000:]}")
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                return
            except OSError:
                await asyncio.sleep(0.05)
        raise TimeoutError(f"smtpguard did not listen on {port}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        with contextlib.suppress(Exception):
            self._log.close()

    async def astop(self, timeout: float = 10) -> int:
        """stop() off the event loop, so an in-process upstream keeps answering the drain."""
        return await asyncio.to_thread(self.stop, timeout)

    def stop(self, timeout: float = 10) -> int:
        rc = -1
        if self.proc and self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                rc = self.proc.wait()
        elif self.proc:
            rc = self.proc.returncode
        with contextlib.suppress(Exception):
            self._log.close()
        return rc


# --- redis-server ----------------------------------------------------------------------------
_MEMORY = Path("/dev/shm")


def _durable_dir(tmp: Path) -> Path:
    """Where a durable redis-server keeps its append-only file: in memory where the machine
    has a tmpfs. `appendfsync always` on a disk that PostgreSQL's base backups and fsyncs
    load stalled one write past the store's 2 s deadline (451 4.3.0 in a test that never
    touched Redis' durability); the tests kill the process, never the machine, and a file
    on tmpfs outlives the process as one on disk does. The same tmp gives the same dir, so a
    restarted server finds its file."""
    if not _MEMORY.is_dir() or not os.access(_MEMORY, os.W_OK):
        return tmp
    path = _MEMORY / f"smtpguard-redis-{os.getpid()}-{abs(hash(str(tmp.resolve())))}"
    if path not in _DURABLE_DIRS:
        path.mkdir(exist_ok=True)
        _DURABLE_DIRS.append(path)
    return path


_DURABLE_DIRS: list[Path] = []
atexit.register(lambda: [shutil.rmtree(p, ignore_errors=True) for p in _DURABLE_DIRS])


class RedisServer:
    def __init__(self, tmp: Path, port: int | None = None, durable: bool = False) -> None:
        self.port = port or free_port()
        self.tmp = tmp
        self.durable = durable
        self.data_dir = _durable_dir(tmp) if durable else tmp
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (scripts/test installs it)")
        args = [
            exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--daemonize",
            "no",
            "--dir",
            str(self.data_dir),
        ]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.durable else ["--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(self.port, "redis-server")
        # Redis listens before it has loaded its append-only file and answers LOADING until
        # then: a restarted durable server is ready when PING says so, not when it accepts.
        import redis

        client = redis.Redis(port=self.port, socket_timeout=5)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    if client.ping():
                        return
                except (redis.BusyLoadingError, redis.ConnectionError):
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.01)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- Postfix's smtp-sink (fault injection) ---------------------------------------------------
SMTP_SINK = "/usr/sbin/smtp-sink"


class SmtpSink:
    """Postfix's smtp-sink with its fault flags; messages dumped to one file for counting."""

    def __init__(self, tmp: Path, *flags: str, port: int | None = None) -> None:
        self.port = port or free_port()
        # smtp-sink drops to `nobody` before it writes the dump, and pytest's tmp dirs are
        # private to root: dump into a world-writable directory of its own under /tmp.
        self.dir = Path(tempfile.mkdtemp(prefix="smtpguard-sink-"))
        self.flags = flags
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if not os.path.exists(SMTP_SINK):
            raise RuntimeError("Postfix's smtp-sink is not installed (scripts/test installs it)")
        self.dir.chmod(0o777)
        args = [SMTP_SINK, "-D", str(self.dir / "dump"), *self.flags]
        if os.geteuid() == 0:
            args[1:1] = ["-u", "nobody"]
        self.proc = subprocess.Popen(
            [*args, f"127.0.0.1:{self.port}", "64"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_listening(self.port, "smtp-sink")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def event_keys(self) -> list[str]:
        dump = self.dir / "dump"
        if not dump.exists():
            return []
        return [
            line.split(":", 1)[1].strip()
            for line in dump.read_text(errors="replace").splitlines()
            if line.lower().startswith("x-event-key:")
        ]


async def settled_records(store_url: str, zone: str, keys: list[str], timeout: float = 30) -> dict[str, Any]:
    """Wait (bounded) until the zone's store-and-forward queue has nothing due, then read
    each key's record — through the real store."""

    store = store_from_url(store_url)
    await store.open()
    try:
        await eventually(
            lambda: store.queue_entries(zone),
            lambda entries: not [e for e in entries if e.due_at is not None],
            timeout=timeout,
            interval=0.1,
        )
        return {k: await store.get(zone, k) for k in keys}
    finally:
        await store.close()


# --- a TCP fault injector in front of redis-server ------------------------------------------
class LostReplyProxy:
    """Forwards a client's connections to redis-server; can lose replies the way a network
    does: the request reaches Redis and runs, then the connection is reset before the reply
    gets back (DESIGN.md §11.4). A fault no real peer gives on demand, so it is injected
    here — on real sockets, in front of a real redis-server.

    `lose(match, times)`: the next `times` replies to requests containing `match` are lost.
    With `each_once`, every such request's reply is lost the first time and the same request
    sent again (the client's retry) gets through."""

    def __init__(self, redis_port: int) -> None:
        self.redis_port = redis_port
        self.port = free_port()
        self.lost = 0
        self._match = b""
        self._times = 0
        self._each_once = False
        self._then_down = 0.0
        self._down_until = 0.0
        self._seen: set[bytes] = set()
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def lose(self, match: bytes, times: int = 1, each_once: bool = False, then_down: float = 0.0) -> None:
        """`then_down`: after a lost reply, the store is unreachable for that many seconds
        (every connection reset, new ones refused), as while a failover is under way."""
        self._match, self._times, self._each_once = match, times, each_once
        self._then_down = then_down

    def _is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _doom(self, data: bytes) -> bool:
        if self._times <= 0 or self._match not in data:
            return False
        if self._each_once:
            if data in self._seen:
                return False
            self._seen.add(data)
        self._times -= 1
        return True

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._conns):
                w.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _client(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self._is_down():
            cw.transport.abort()
            return
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.redis_port)
        except OSError:
            cw.close()
            return
        self._conns |= {cw, uw}
        doomed = asyncio.Event()

        async def upward() -> None:
            while data := await cr.read(65536):
                if self._is_down():
                    cw.transport.abort()
                    uw.close()
                    return
                if self._doom(data):
                    doomed.set()
                uw.write(data)
                await uw.drain()
            uw.close()

        async def downward() -> None:
            while data := await ur.read(65536):
                if doomed.is_set() or self._is_down():
                    # The request ran in Redis; its reply never arrives: reset the client.
                    if doomed.is_set():
                        self.lost += 1
                        if self._then_down:
                            self._down_until = time.monotonic() + self._then_down
                    cw.transport.abort()
                    uw.close()
                    return
                cw.write(data)
                await cw.drain()
            cw.close()

        tasks = [asyncio.create_task(upward()), asyncio.create_task(downward())]
        with contextlib.suppress(Exception):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        cw.close()
        uw.close()
        self._conns -= {cw, uw}
