"""A fast asyncio SMTP sink, used when Postfix's smtp-sink is not installed:

    python -m bench.sink PORT

Accepts everything (PIPELINING, AUTH PLAIN with any password), discards the content and
prints smtp-sink's `-c` counters (`sess=N quit=N mesg=N` ending in CR) to stdout, at most
every 50 ms, so bench/common.py reads both sinks the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

_EHLO = (
    b"250-bench-sink\r\n250-PIPELINING\r\n250-8BITMIME\r\n250-AUTH PLAIN LOGIN\r\n"
    b"250-ENHANCEDSTATUSCODES\r\n250 SIZE 100000000\r\n"
)


class Counters:
    sess = 0
    quit = 0
    mesg = 0


class SinkProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.in_data = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        Counters.sess += 1
        transport.write(b"220 bench-sink ESMTP\r\n")

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buf += data
        out: list[bytes] = []
        while self.buf:
            if self.in_data:
                if self.buf.startswith(b".\r\n"):
                    end, skip = 0, 3
                else:
                    end = self.buf.find(b"\r\n.\r\n")
                    skip = 5
                if end < 0:
                    # keep only what could still hold the terminator
                    self.buf = self.buf[-4:]
                    break
                self.buf = self.buf[end + skip :]
                self.in_data = False
                Counters.mesg += 1
                out.append(b"250 2.0.0 Ok: queued as S%d\r\n" % Counters.mesg)
                continue
            nl = self.buf.find(b"\r\n")
            if nl < 0:
                break
            line, self.buf = self.buf[:nl], self.buf[nl + 2 :]
            verb = line[:4].upper()
            if verb == b"EHLO":
                out.append(_EHLO)
            elif verb == b"DATA":
                self.in_data = True
                out.append(b"354 End data with <CR><LF>.<CR><LF>\r\n")
            elif verb == b"AUTH":
                out.append(b"235 2.7.0 Authentication successful\r\n")
            elif verb == b"QUIT":
                Counters.quit += 1
                out.append(b"221 2.0.0 Bye\r\n")
                self.transport.write(b"".join(out))
                self.transport.close()
                return
            else:
                out.append(b"250 2.0.0 Ok\r\n")
        if out:
            self.transport.write(b"".join(out))


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(SinkProtocol, "127.0.0.1", port, reuse_address=True, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    last = None
    while not stop.is_set():
        now = (Counters.sess, Counters.quit, Counters.mesg)
        if now != last:
            sys.stdout.write(f"sess={now[0]} quit={now[1]} mesg={now[2]}\r")
            sys.stdout.flush()
            last = now
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)
    srv.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
