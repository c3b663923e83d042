"""LeaseKeeper: one task renews every relay's lease, each renewal independent of the others.
(End to end, a relay longer than its lease keeps it: test_resilience.py.)"""

from __future__ import annotations

import asyncio

from smtpguard.submission import LeaseKeeper, LeaseLost


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
    await asyncio.sleep(0.65)
    assert stuck.is_set()
    assert renewed >= 4, renewed
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
    await asyncio.sleep(0.05)
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

    keeper.hold(lost, 0.3)
    handle = keeper.hold(slow, 0.3)
    await asyncio.wait_for(started.wait(), 1)
    keeper.release(handle)
    await asyncio.wait_for(cancelled.wait(), 1)
    await asyncio.sleep(0.4)
    assert calls == 1
    await keeper.close()
