"""The exchange's adaptive cap on auctions in flight (bourse/auction/admission.py)."""

from __future__ import annotations

import asyncio
import math

import pytest

from bourse.auction.admission import ConcurrencyLimit
from tests.market import wait_until


async def test_a_fixed_cap_refuses_past_it_and_never_moves() -> None:
    cap = ConcurrencyLimit(ceiling=2, target_ms=0, floor=1)
    assert cap.try_acquire() and cap.try_acquire()
    assert not await cap.acquire(within_s=0)
    assert (cap.inflight, cap.refused) == (2, 1)
    cap.release(elapsed_ms=10_000)  # slow, but a fixed cap does not adapt
    assert cap.limit == 2 and cap.try_acquire()


async def test_a_full_cap_serves_waiters_in_order_as_slots_free() -> None:
    cap = ConcurrencyLimit(ceiling=1, target_ms=0, floor=1)
    assert cap.try_acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        if await cap.acquire(within_s=5):
            order.append(name)

    waiters = [asyncio.ensure_future(wait(n)) for n in ("a", "b")]
    await wait_until(lambda: cap.waiting == 2)  # both are in line now
    assert not cap.try_acquire()  # no jumping the line
    cap.release(None)
    await waiters[0]
    assert order == ["a"] and cap.inflight == 1
    cap.release(None)
    await waiters[1]
    assert order == ["a", "b"] and cap.refused == 0


async def test_a_waiter_is_refused_when_no_slot_frees_in_time() -> None:
    cap = ConcurrencyLimit(ceiling=1, target_ms=0, floor=1)
    assert cap.try_acquire()
    assert not await cap.acquire(within_s=0.01)
    assert (cap.refused, cap.waiting, cap.inflight) == (1, 0, 1)
    cap.release(None)
    assert cap.inflight == 0  # the refused waiter took nothing


def test_fast_auctions_open_one_slot_per_round() -> None:
    cap = ConcurrencyLimit(ceiling=100, target_ms=25, floor=4, initial=10)
    for _ in range(10):  # one round: 10 auctions within the target
        assert cap.try_acquire()
        cap.release(elapsed_ms=5)
    # each adds 1/limit: 10 x ~1/10 -> about one more slot
    assert 10.9 < cap.limit < 11.0


def test_a_slow_average_cuts_once_per_round() -> None:
    """A cut, then none until an auction admitted since the cut ends slow: those under way
    were admitted under the old limit (one cut per congestion event, however long the
    auctions of a burst take)."""
    cap = ConcurrencyLimit(ceiling=100, target_ms=25, floor=4, initial=50, decrease=0.8)
    for _ in range(8):
        cap.try_acquire()
    for _ in range(5):  # the average passes 25 ms at the 4th; the same event: one cut
        cap.release(elapsed_ms=80, now=1000.0)
    # 3 x (+1/limit) while the average was on target, then x 0.8 once
    assert cap.cuts == 1 and 40.0 < cap.limit < 40.1
    assert cap.avg_ms is not None and cap.avg_ms > 25
    before = cap.limit
    cap.release(elapsed_ms=200, now=1000.1)  # admitted before the cut: no second cut
    assert (cap.limit, cap.cuts) == (before, 1)
    cap.release(elapsed_ms=80, now=1000.1)  # admitted after it, and still slow: cut again
    assert cap.limit == pytest.approx(before * 0.8) and cap.cuts == 2


def test_a_slow_tail_does_not_cut_while_the_average_is_on_target() -> None:
    cap = ConcurrencyLimit(ceiling=100, target_ms=25, floor=4, initial=20, smoothing=0.05)
    for i in range(400):  # 1 auction in 20 takes 60 ms, the rest 10 ms: average ~12.5 ms
        cap.try_acquire()
        cap.release(elapsed_ms=60 if i % 20 == 0 else 10, now=float(i))
    assert cap.cuts == 0 and cap.avg_ms is not None and cap.avg_ms < 25
    assert cap.limit > 20


def test_outcomes_that_say_nothing_about_load_only_free_their_slot() -> None:
    cap = ConcurrencyLimit(ceiling=100, target_ms=25, floor=4, initial=10)
    cap.try_acquire()
    cap.release(None)  # e.g. no_offers after a quiet window
    assert (cap.limit, cap.inflight, cap.cuts) == (10, 0, 0)


def test_the_limit_stays_between_floor_and_ceiling() -> None:
    cap = ConcurrencyLimit(ceiling=12, target_ms=25, floor=4, initial=64, restart_s=math.inf)
    assert cap.limit == 12  # the initial value is clamped too
    for i in range(50):
        cap.try_acquire()
        cap.release(elapsed_ms=500, now=float(i))
    assert cap.limit == 4
    for _ in range(1000):
        cap.try_acquire()
        cap.release(elapsed_ms=1)
    assert cap.limit == 12


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        ({"floor": 0}, "floor"),
        ({"floor": 20, "ceiling": 10}, "floor"),
        ({"decrease": 1.0}, "decrease"),
    ],
)
def test_bad_settings_are_named(kw: dict[str, float], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ConcurrencyLimit(**kw)  # type: ignore[arg-type]  # floats for int fields on purpose: bad settings


async def test_a_standing_line_shortens_the_wait_of_new_arrivals() -> None:
    cap = ConcurrencyLimit(ceiling=1, target_ms=0, floor=1, standing_ms=30, congested_wait_ms=0)
    assert cap.try_acquire()
    first = asyncio.ensure_future(cap.acquire(within_s=5))  # a burst: waits its full share
    await wait_until(lambda: cap.waiting == 1)
    # Not a sleep for ordering: the line must stand (no slot free at once) past standing_ms.
    await asyncio.sleep(0.05)
    assert not await cap.acquire(within_s=5)  # overload: a newcomer waits 0 and is refused
    assert not first.done()
    cap.release(None)
    assert await first  # the one in line keeps its place and gets the slot


async def test_a_line_that_moves_is_a_burst_being_served_not_overload() -> None:
    """An order handed a slot within standing_ms of joining the line says the line moves:
    a newcomer past standing_ms since a slot was last free at once, but not since that
    order was served, still waits its full share (a burst whose orders a busy exchange
    reads over more than standing_ms)."""
    cap = ConcurrencyLimit(ceiling=1, target_ms=0, floor=1, standing_ms=600, congested_wait_ms=0)
    assert cap.try_acquire()
    first = asyncio.ensure_future(cap.acquire(within_s=5))
    await wait_until(lambda: cap.waiting == 1)
    # Not sleeps for ordering: time must pass, first within standing_ms of the first's place
    # in line, then past standing_ms since the slot free at once (but not since it was served)
    await asyncio.sleep(0.3)
    cap.release(None)
    assert await first  # waited ~0.3 s of the 0.6 allowed: the line moves
    await asyncio.sleep(0.4)
    newcomer = asyncio.ensure_future(cap.acquire(within_s=5))
    await wait_until(lambda: cap.waiting == 1 or newcomer.done())
    assert not newcomer.done()  # in line, not refused at once as overload
    cap.release(None)
    assert await newcomer


async def test_a_waiter_cancelled_after_being_handed_a_slot_gives_it_back() -> None:
    cap = ConcurrencyLimit(ceiling=1, target_ms=0, floor=1)
    assert cap.try_acquire()
    waiter = asyncio.ensure_future(cap.acquire(within_s=5))
    await wait_until(lambda: cap.waiting == 1)  # in line
    cap.release(None)  # hands the slot to the waiter...
    waiter.cancel()  # ...which is cancelled before it could use it
    [got] = await asyncio.gather(waiter, return_exceptions=True)
    if got is True:  # wait_for may swallow a cancel that races the result: the slot is ours
        cap.release(None)
    else:
        assert isinstance(got, asyncio.CancelledError)
    assert cap.inflight == 0 and cap.try_acquire()  # no slot was lost either way


def test_a_limit_cut_by_a_past_burst_starts_again_once_no_order_has_waited() -> None:
    """What a burst taught the limit is stale once the market is idle: the next burst
    finds the start value, not the cuts of the last one."""
    cap = ConcurrencyLimit(ceiling=100, target_ms=25, floor=4, initial=20, restart_s=0.0)
    for _ in range(20):
        assert cap.try_acquire()
    assert not cap.try_acquire()  # the burst: an order waits
    for i in range(20):  # its auctions were slow: cut once
        cap.release(elapsed_ms=200, now=10.0 + i / 1000)
    assert cap.cuts == 1 and 16.0 < cap.limit < 16.1  # one +1/limit before the average crossed
    assert cap.try_acquire()  # no order has waited for restart_s (0 here): 20 again
    assert (cap.limit, cap.avg_ms) == (20, None)


@pytest.mark.parametrize(
    ("avg_ms", "refused", "patience_ms"),
    [
        pytest.param(None, False, 475, id="idle: all but the target's time for the auction"),
        pytest.param(100.0, False, 400, id="a burst: all but an average auction's time"),
        pytest.param(450.0, False, 125, id="slow auctions: never less than a quarter"),
        pytest.param(None, True, 125, id="an order refused lately: overload, a quarter"),
    ],
)
async def test_an_order_waits_for_a_slot_while_its_deadline_leaves_time_for_an_auction(
    avg_ms: float | None, refused: bool, patience_ms: float
) -> None:
    cap = ConcurrencyLimit(ceiling=100, target_ms=25, floor=4, initial=4)
    cap.avg_ms = avg_ms
    if refused:
        while cap.try_acquire():
            pass
        assert not await cap.acquire(within_s=0)
    assert cap.patience_s(500) == pytest.approx(patience_ms / 1000)
    fixed = ConcurrencyLimit(ceiling=10, target_ms=0, floor=1)
    assert fixed.patience_s(500) == pytest.approx(0.125)  # a fixed cap: a quarter always


async def test_a_closed_limit_lets_the_orders_in_line_go_and_gives_no_slot() -> None:
    """The exchange is stopping: those in line are answered at once (not as refused for
    load), newcomers find no slot, and the auctions under way still give theirs back."""
    cap = ConcurrencyLimit(ceiling=1, target_ms=0, floor=1)
    assert cap.try_acquire()
    waiter = asyncio.ensure_future(cap.acquire(within_s=60))
    await wait_until(lambda: cap.waiting == 1)
    cap.close()
    assert await waiter is False and cap.waiting == 0
    assert not cap.try_acquire() and not await cap.acquire(within_s=60)
    assert cap.refused == 0
    cap.release(None)
    assert cap.inflight == 0
