"""A Redis store operation never outlives its deadline (_TIMEOUT, applied in store/errors.py):
with Redis hung or every client paused, each operation fails at its deadline as
StoreUnavailable, whatever it was doing when the deadline came (a command on a kept
connection, a pool checkout that reconnects a connection the server closed, a new
connection's handshake, a wait for a free connection), and an answer that arrives after the
deadline is not taken. A caller that got StoreUnavailable has given up: an operation that
went on to succeed would be a login or an AUTH tried as if uncounted, or a write nobody
waits for (tests/console/test_console_attacks.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis

from smtpguard.store import Reserved, StoreUnavailable
from smtpguard.store.redis import _MAX_CONNECTIONS, _SPARE, RedisStore
from smtpguard.store.redis.connection import _TIMEOUT
from tests.store.test_redis_kept_connections import _fill_kept, stale_after_a_restart
from tests.store.test_store_contract import fresh
from tests.support import RedisServer

_WINDOW = 300.0


def _operations(store: RedisStore, zone: str, n: int) -> list[Callable[[], Awaitable[object]]]:
    """n operations of the three shapes the store has: a ledger script through its own
    command path (kept connections), a MULTI pipeline and a plain command (redis-py's)."""
    ops: list[Callable[[], Awaitable[object]]] = []
    for i in range(n):
        if i % 3 == 0:
            ops.append(lambda i=i: store.reserve(fresh(f"{zone}{i}", zone=zone), None, None, False))
        elif i % 3 == 1:
            ops.append(lambda i=i: store.auth_failure(f"{zone}:{i}", time.time(), _WINDOW))
        else:
            ops.append(lambda i=i: store.auth_failures(f"{zone}:{i}", time.time(), _WINDOW))
    return ops


async def _timed(op: Callable[[], Awaitable[object]]) -> tuple[float, float, object]:
    """When the operation started and ended (the loop's clock), and what it returned or raised."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        outcome: object = await op()
    except Exception as e:
        outcome = e
    return start, loop.time(), outcome


async def test_a_hung_redis_fails_every_operation_at_its_deadline(tmp_path: Path) -> None:
    """Redis restarted and then hung (its process stopped: the kernel still accepts
    connections, nothing answers on them): every kept and idle connection is stale, so each
    checkout reconnects and its handshake hangs; more operations than the pool holds, so
    some open new connections and some wait for one."""
    async with stale_after_a_restart(tmp_path, "deadline") as (server, store):
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            ops = _operations(store, "deadline", _MAX_CONNECTIONS + 2 * _SPARE)
            tasks = [asyncio.create_task(_timed(op)) for op in ops]
            # 1 s past the deadline (what a loaded machine may add): an operation still under
            # way then would have waited for Redis to come back.
            _, pending = await asyncio.wait(tasks, timeout=_TIMEOUT + 1.0)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        late = [repr(outcome) for _, _, outcome in await asyncio.gather(*pending)]
        assert late == []
        answered = [repr(t.result()[2]) for t in tasks if not isinstance(t.result()[2], StoreUnavailable)]
        assert answered == []
        # And the store works again without a restart.
        assert await store.reserve(fresh("after", zone="deadline"), None, None, False) == Reserved()


async def test_an_answer_that_arrives_after_the_deadline_is_not_taken(tmp_path: Path) -> None:
    """A loaded machine: the event loop is held up across the deadline, and by the time it
    runs again the pause has ended and the answers are waiting on the sockets, next to the
    expired deadlines. The deadline wins: an operation that answers after it would be one the
    caller had already given up on (and would not have counted)."""
    server = RedisServer(tmp_path)
    server.start()
    store = RedisStore(server.url)
    await store.open()
    admin = redis.Redis(port=server.port)
    try:
        await _fill_kept(store, "stall")  # kept and idle connections, all live
        loop = asyncio.get_running_loop()
        paused = loop.time()
        # Redis ends a pause on its next cron tick (100 ms at its default hz) after it is due.
        admin.execute_command("CLIENT", "PAUSE", str(int(_TIMEOUT * 1000)), "ALL")
        stall_until = paused + _TIMEOUT + 0.6
        pong_took: list[float] = []

        def stall() -> None:
            time.sleep(max(0.0, stall_until - time.monotonic()))
            # Redis answers the commands it held, then this: at once if the pause has ended.
            asked = time.monotonic()
            admin.ping()
            pong_took.append(time.monotonic() - asked)

        # The loop blocked from just before the deadline until well after the pause ended.
        loop.call_at(paused + _TIMEOUT - 0.1, stall)
        results = await asyncio.gather(*(_timed(op) for op in _operations(store, "stall", 3 * _SPARE)))
        # The premises: every deadline came while the loop was held up, and the answers were
        # waiting when it ran again.
        assert all(start + _TIMEOUT < stall_until for start, _, _ in results)
        assert len(pong_took) == 1 and pong_took[0] < 0.1, pong_took
        past_deadline = [
            (round(end - start, 3), repr(outcome))
            for start, end, outcome in results
            if not isinstance(outcome, StoreUnavailable)
        ]
        assert past_deadline == []
        assert await store.reserve(fresh("after", zone="stall"), None, None, False) == Reserved()
    finally:
        admin.close()
        await store.close()
        server.stop()
