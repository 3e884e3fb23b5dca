"""TaskSet (bourse/runtime/tasks.py): the owner of the per-message tasks. Its end lets the
tasks under way finish, cancels what is left past the bound, and never leaves one running."""

from __future__ import annotations

import asyncio

import pytest

from bourse.runtime.tasks import TaskSet


async def test_finish_lets_the_tasks_under_way_end_and_cuts_the_rest() -> None:
    tasks = TaskSet("t")
    quick_done = asyncio.Event()
    release = asyncio.Event()
    slow_cancelled = asyncio.Event()

    async def quick() -> None:
        await release.wait()
        quick_done.set()

    async def slow() -> None:
        try:
            await asyncio.Event().wait()  # never set: only cancellation ends it
        except asyncio.CancelledError:
            slow_cancelled.set()
            raise

    tasks.spawn(quick())
    tasks.spawn(slow())
    assert len(tasks) == 2
    asyncio.get_running_loop().call_soon(release.set)
    cut = await tasks.finish(0.2)
    assert cut == 1
    assert quick_done.is_set() and slow_cancelled.is_set()
    assert len(tasks) == 0


async def test_a_task_that_raises_is_counted_and_the_others_go_on() -> None:
    tasks = TaskSet("t")
    ran = asyncio.Event()

    async def boom() -> None:
        raise ValueError("bad")

    async def fine() -> None:
        ran.set()

    tasks.spawn(boom())
    tasks.spawn(fine())
    await tasks.wait()
    assert tasks.failed == 1 and ran.is_set()


async def test_wait_covers_tasks_spawned_while_waiting() -> None:
    tasks = TaskSet("t")
    order: list[str] = []
    gate = asyncio.Event()

    async def second() -> None:
        order.append("second")

    async def first() -> None:
        await gate.wait()  # opened once wait() below is waiting
        tasks.spawn(second())
        order.append("first")

    tasks.spawn(first())
    asyncio.get_running_loop().call_soon(gate.set)
    await tasks.wait()
    assert order == ["first", "second"]


async def test_cancelling_the_owner_during_finish_still_ends_every_task() -> None:
    tasks = TaskSet("t")
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    tasks.spawn(forever())
    await started.wait()
    # the owner's own bound (a stop's scope) cuts finish() short while it waits
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(tasks.finish(30.0), 0.05)
    assert len(tasks) == 0


async def test_every_waiter_is_told_when_the_tasks_end() -> None:
    tasks = TaskSet("t")
    release = asyncio.Event()

    async def held() -> None:
        await release.wait()

    tasks.spawn(held())
    waiters = [asyncio.ensure_future(tasks.wait()) for _ in range(2)]
    asyncio.get_running_loop().call_soon(release.set)  # once both wait
    done, _ = await asyncio.wait(waiters, timeout=5.0)  # a bound, not a pace
    assert len(done) == 2
