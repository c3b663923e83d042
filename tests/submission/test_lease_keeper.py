"""LeaseKeeper: one task renews every relay's lease, each renewal independent of the others.
(End to end, a relay longer than its lease keeps it: test_resilience.py.)"""

from __future__ import annotations

import asyncio

from smtpguard.submission import LeaseKeeper, LeaseLost
from tests.support.eventually import eventually


async def test_a_stuck_renewal_delays_no_other_relay() -> None:
    keeper = LeaseKeeper()
    stuck = asyncio.Event()
    renewed = 0

    async def never_returns() -> None:
        stuck.set()
        await asyncio.Event().wait()

    async def quick() -> None:
        nonlocal renewed
        renewed += 1

    a = keeper.hold(never_returns, 0.3)  # renewed every 0.1 s, looked at every 0.05 s
    b = keeper.hold(quick, 0.3)
    # The other relay is renewed again and again while the stuck renewal never returns.
    assert await eventually(lambda: renewed, lambda n: n >= 4, timeout=5, interval=0.02) >= 4, renewed
    assert stuck.is_set()
    keeper.release(a)
    keeper.release(b)
    await asyncio.wait_for(keeper.close(), 1)


async def test_a_shorter_lease_is_looked_at_sooner() -> None:
    """After a reload lowers the lease, a new relay's lease is renewed on its own schedule,
    not after the sleep computed for the old, longer one."""
    keeper = LeaseKeeper()
    renewed = asyncio.Event()

    async def nothing() -> None:
        return None

    async def mark() -> None:
        renewed.set()

    long = keeper.hold(nothing, 30)
    # The keeper is in the wait computed for the long lease (a sixth of it) before the short
    # one comes: else the short one's schedule would be the first one computed.
    tick = await eventually(lambda: keeper._tick, lambda t: t == 5.0, timeout=5, interval=0.01)
    assert tick == 5.0
    short = keeper.hold(mark, 0.3)
    await asyncio.wait_for(renewed.wait(), 1)
    keeper.release(long)
    keeper.release(short)
    await keeper.close()


async def test_lease_lost_ends_the_renewals_and_release_cancels_one_in_progress() -> None:
    keeper = LeaseKeeper()
    calls = 0
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def lost() -> None:
        nonlocal calls
        calls += 1
        raise LeaseLost

    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    others = 0

    async def other() -> None:
        nonlocal others
        others += 1

    keeper.hold(lost, 0.3)
    handle = keeper.hold(slow, 0.3)
    await asyncio.wait_for(started.wait(), 1)
    keeper.release(handle)
    await asyncio.wait_for(cancelled.wait(), 1)
    # A relay held with the same lease after them is renewed three times: the keeper has
    # looked at every lease since, when the lost one would have been renewed again.
    keeper.hold(other, 0.3)
    assert await eventually(lambda: others, lambda n: n >= 3, timeout=5, interval=0.02) >= 3
    assert calls == 1
    await keeper.close()
