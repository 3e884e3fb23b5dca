"""The commit desk (supplier/commits.py): every commit outcome of docs/protocol.md §6.5 and
every abort of §6.6, through a real worker on a real temp SQLite store, no NATS.

Ordering between a commit and what happens "while it is written" never sleeps: a commit
task's first step always ends awaiting the store's writer thread, so a callback scheduled
with ``call_soon`` right after the task is created runs exactly while the write is under way.

The worker sells 8 CPUs / 8 GiB / 100 GB disk and has the image "web" cached; pricing is the
spread preset (f(u) = 1 - u) with image_weight 0.3: score = 0.7 * utility + 0.3 * cached.
A hold of 2 CPUs / 2 GiB on the empty worker: u = 2/8, utility 0.75, score 0.825.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import pytest

from bourse.wire.messages import (
    Amount,
    Bid,
    Commit,
    CommitReply,
    Error,
    Event,
    Machine,
    Offer,
    Placed,
    Rejected,
    Resources,
    worker_of_machine,
)
from bourse.wire.resources import ZERO, Vec
from supplier.candidates import BidGroup
from supplier.config import WorkerConfig
from supplier.desk import Desk
from supplier.feasible import UNDOING
from supplier.oplog import Op
from supplier.store import Store
from supplier.worker import Worker

WID = "mad-1"
FAR_FUTURE = 1e12  # a monotonic reading after every hold's TTL
DESK: Desk[Worker] = Desk()
SUBSCORES = {"cpus": 0.75, "memory_mb": 0.75, "utility": 0.75, "image": 1.0}


class Recorder:
    """The events the worker emitted."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
def worker(store: Store, rec: Recorder) -> Worker:
    w = Worker(
        WorkerConfig(
            worker_id=WID,
            region="mad",
            capacity=Amount(cpus=8, memory_mb=8192, disk_mb=100_000),
            images=["web"],
        ),
        store,
        rec.emit,
    )
    w.recover()
    return w


def res(cpus: int = 2, memory_mb: int = 2048) -> Resources:
    return Resources(cpus=cpus, memory_mb=memory_mb)


def commit(resources: Resources | None = None, **kw: Any) -> Commit:
    kwargs: dict[str, Any] = {
        "order_id": "order-1",
        "worker_id": WID,
        "resources": resources or res(),
        "image": "web",
        "metadata": {"team": "infra"},
    }
    kwargs.update(kw)
    return Commit(**kwargs)


def hold(w: Worker, resources: Resources | None = None) -> None:
    """A bid answered with an offer: the worker holds ``resources`` for order-1."""
    b = Bid(
        order_id="order-1",
        region="mad",
        resources=resources or res(),
        image="web",
        hold_ms=1000,
        auction_id="auc-1",
    )
    ans = DESK.answer(b, "inbox", time.monotonic(), BidGroup([w]))
    assert len(ans.replies) == 1, ans


def placed(existing: bool = False) -> Placed:
    """The Placed expected for order-1's hold (machine id and elapsed time blanked)."""
    return Placed(
        order_id="order-1",
        machine_id="",
        worker_id=WID,
        region="mad",
        score=0.825,
        image_cached=True,
        elapsed_ms=0.0,
        subscores={} if existing else SUBSCORES,
        existing=existing,
        simulated=True,  # a sim worker's machine: it says so
    )


def rejected(reason: Any, detail: str) -> Rejected:
    return Rejected(order_id="order-1", worker_id=WID, reason=reason, detail=detail)


def blank(reply: CommitReply) -> CommitReply:
    """A Placed without what differs run to run (its new machine id, its elapsed time)."""
    if isinstance(reply, Placed):
        assert worker_of_machine(reply.machine_id) == WID
        assert reply.elapsed_ms >= 0
        return msgspec.structs.replace(reply, machine_id="", elapsed_ms=0.0)
    return reply


async def nothing(w: Worker) -> None:
    pass


async def held(w: Worker) -> None:
    hold(w)


async def held_then_placed(w: Worker) -> None:
    hold(w)
    assert isinstance(await w.commits.commit(commit()), Placed)


async def held_then_released(w: Worker) -> None:
    hold(w)
    w.release("order-1", "auc-1")


async def held_then_expired(w: Worker) -> None:
    hold(w)
    w.expire_holds(now=FAR_FUTURE)


async def held_then_draining(w: Worker) -> None:
    hold(w)
    w.set_draining("maintenance")


async def held_big(w: Worker) -> None:
    hold(w, res(4, 4096))


async def held_store_refuses(w: Worker) -> None:
    # A live machine for the order in the store, unknown to this worker (written behind its
    # back): the unique index refuses the commit's machine, which surfaces as a StoreError.
    stale = Machine(
        machine_id=f"{WID}~STALE",
        order_id="order-1",
        worker_id=WID,
        region="mad",
        state="started",
        resources=res(),
        image="web",
    )
    await w.store.write(Op("place", stale))
    hold(w)


@dataclass(frozen=True)
class Case:
    """One row of §6.5: the worker's state before, the commit, and what must follow."""

    setup: Callable[[Worker], Awaitable[None]]
    commit: Commit
    reply: CommitReply
    committed: Vec  # after the commit
    held: Vec
    machines: int  # orders mapped to a machine
    events: list[str]
    draining: bool = False


CASES = {
    # 1: the commit names another worker; nothing changes, the hold stays
    "another worker": Case(
        held,
        commit(worker_id="mad-2"),
        Error(code="bad_request", detail="commit for worker 'mad-2' sent to worker 'mad-1'"),
        ZERO,
        (2000, 2048, 0, 0, 0),
        0,
        [],
    ),
    # 2: a machine exists for the order: the same one again, counted once, nothing written
    "existing machine": Case(
        held_then_placed,
        commit(),
        placed(existing=True),
        (2000, 2048, 0, 0, 0),
        ZERO,
        1,
        ["placed"],
    ),
    # 4: draining: rejected with the drain's reason, even with a live hold
    "draining": Case(
        held_then_draining,
        commit(),
        rejected("draining", "maintenance"),
        ZERO,
        (2000, 2048, 0, 0, 0),
        0,
        [],
        draining=True,
    ),
    # 5: no hold at all
    "no hold": Case(
        nothing,
        commit(),
        rejected("no_hold", "no hold for this order on this worker"),
        ZERO,
        ZERO,
        0,
        [],
    ),
    # 5: the hold was released (the auction moved on): as if there never was one
    "hold released": Case(
        held_then_released,
        commit(),
        rejected("no_hold", "no hold for this order on this worker"),
        ZERO,
        ZERO,
        0,
        [],
    ),
    # 5: the hold's TTL passed: said so (the worker remembers recent expiries)
    "hold expired": Case(
        held_then_expired,
        commit(),
        rejected("hold_expired", "the hold's TTL passed before the commit"),
        ZERO,
        ZERO,
        0,
        ["hold_expired"],
    ),
    # 6: the commit asks for more than was held: rejected, the hold stays for a right one
    "insufficient": Case(
        held,
        commit(res(2, 4096)),
        rejected(
            "insufficient",
            "commit asks for cpus=2 memory_mb=4096 disk_mb=0 gpus=0 but the hold is for "
            "cpus=2 memory_mb=2048 disk_mb=0 gpus=0",
        ),
        ZERO,
        (2000, 2048, 0, 0, 0),
        0,
        [],
    ),
    # 7: a live hold: a new reserved machine, durable, with the hold's score and subscores
    "live hold": Case(
        held,
        commit(),
        placed(),
        (2000, 2048, 0, 0, 0),
        ZERO,
        1,
        ["placed"],
    ),
    # 7: less than the hold: the rest goes back to the market (score is the hold's: 4/8)
    "less than the hold": Case(
        held_big,
        commit(),
        msgspec.structs.replace(
            placed(),
            score=0.65,
            subscores={"cpus": 0.5, "memory_mb": 0.5, "utility": 0.5, "image": 1.0},
        ),
        (2000, 2048, 0, 0, 0),
        ZERO,
        1,
        ["placed"],
    ),
    # 7: the store refuses the write: Error internal, the hold is dropped, the worker drains
    "store failure": Case(
        held_store_refuses,
        commit(),
        Error(
            code="internal",
            detail=f"worker {WID} cannot store: write to {{path}} failed: "
            "UNIQUE constraint failed: machines.worker_id, machines.order_id",
        ),
        ZERO,
        ZERO,
        0,
        [],
        draining=True,
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
async def test_commit_outcomes(case: Case, worker: Worker, store: Store, rec: Recorder) -> None:
    await case.setup(worker)
    reply = await worker.commits.commit(case.commit)
    expect = case.reply
    if isinstance(expect, Error):
        expect = msgspec.structs.replace(expect, detail=expect.detail.format(path=store.path))
    assert blank(reply) == expect
    assert worker.ledger.committed == case.committed
    assert worker.ledger.held == case.held
    assert len(worker.by_order) == case.machines
    assert rec.kinds() == case.events
    assert worker.draining is case.draining
    assert worker.commits.writing == {}
    assert worker.commits.aborts == set()


async def test_a_placed_machine_is_durable_before_the_reply(
    worker: Worker, store: Store, rec: Recorder
) -> None:
    hold(worker)
    reply = await worker.commits.commit(commit())
    assert isinstance(reply, Placed)
    m = worker.machines[reply.machine_id]
    assert (m.state, m.resources, m.metadata, m.score) == (
        "reserved",
        res(),
        {"team": "infra"},
        0.825,
    )
    assert store.load_machines(WID) == [m]
    assert store.oplog(WID) == [(1, "place", "order-1", reply.machine_id, "reserved")]
    assert rec.events[0].machine_id == reply.machine_id
    # an existing machine is reported with its own score, and nothing is written again
    again = await worker.commits.commit(commit())
    assert isinstance(again, Placed)
    assert (again.machine_id, again.score, again.existing) == (reply.machine_id, 0.825, True)
    assert len(store.oplog(WID)) == 1


# -- 3: a duplicate while the first commit is written --------------------------------------------


async def test_a_duplicate_while_writing_gets_the_same_placed(worker: Worker, store: Store) -> None:
    hold(worker)
    first, second = await asyncio.gather(
        worker.commits.commit(commit()), worker.commits.commit(commit())
    )
    assert isinstance(first, Placed)
    assert second is first  # the very reply of the write it waited for, not a second machine
    assert len(store.load_machines(WID)) == 1
    assert worker.ledger.committed == (2000, 2048, 0, 0, 0)


async def test_a_duplicate_while_writing_gets_the_same_error(worker: Worker) -> None:
    await held_store_refuses(worker)
    first, second = await asyncio.gather(
        worker.commits.commit(commit()), worker.commits.commit(commit())
    )
    assert isinstance(first, Error)
    assert second is first
    assert worker.draining is True


async def test_a_duplicate_of_a_cancelled_write_is_cancelled_not_left_waiting(
    worker: Worker, store: Store
) -> None:
    hold(worker)
    first = asyncio.ensure_future(worker.commits.commit(commit()))
    second = asyncio.ensure_future(worker.commits.commit(commit()))
    asyncio.get_running_loop().call_soon(first.cancel)  # while the write is under way
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert [type(r) for r in results] == [asyncio.CancelledError, asyncio.CancelledError]
    assert worker.commits.writing == {}
    # The writer thread still finishes the cancelled write (shutdown's business, not the
    # desk's); a later write on the FIFO writer returns only after it has been answered.
    later = Machine(
        machine_id=f"{WID}~LATER",
        order_id="order-2",
        worker_id=WID,
        region="mad",
        state="reserved",
        resources=res(),
        image="web",
    )
    await store.write(Op("place", later))


# -- abort_commit before, during and after the write (§6.6) ----------------------------------------


@dataclass(frozen=True)
class Abort:
    """When the auction gives up on the commit, and what the worker is left with."""

    reply: type[CommitReply]  # the commit's own reply (the auction no longer reads it)
    state: str | None  # the order's machine's last state (None: no machine ever)
    ops: list[str]  # the op log
    events: list[str]
    committed: Vec


ABORTS = {
    # no commit yet: a plain release (the hold goes), so the late commit finds no hold
    "before": Abort(Rejected, None, [], [], ZERO),
    # while written: the machine is destroyed as soon as it is durable
    "during": Abort(Placed, "destroyed", ["place", "abort"], ["placed", "destroyed"], ZERO),
    # written and still reserved: destroyed now
    "after": Abort(Placed, "destroyed", ["place", "abort"], ["placed", "destroyed"], ZERO),
    # written and already started: too late to undo, the machine stays
    "after start": Abort(
        Placed, "started", ["place", "start", "start"], ["placed", "started"], (2000, 2048, 0, 0, 0)
    ),
}


async def commit_and_abort(w: Worker, when: str) -> CommitReply:
    """Commit order-1 with the auction's abort_commit arriving ``when``; the commit's reply.
    The worker's lifecycle runs as the host runs it (``Machines.run`` owns the undo)."""
    async with anyio.create_task_group() as tasks:
        await tasks.start(w.keeper.run)
        try:
            return await _commit_and_abort(w, when)
        finally:
            await w.keeper.close()  # waits for the undo under way, then ends run()


async def _commit_and_abort(w: Worker, when: str) -> CommitReply:
    give_up = lambda: w.release("order-1", "auc-1", abort_commit=True)  # noqa: E731
    if when == "before":
        give_up()
        return await w.commits.commit(commit())
    if when == "during":
        task = asyncio.ensure_future(w.commits.commit(commit()))
        asyncio.get_running_loop().call_soon(give_up)  # FIFO: after the task's first step
        return await task
    reply = await w.commits.commit(commit())
    assert isinstance(reply, Placed)
    if when == "after start":
        await w.transition("start", reply.machine_id)
    give_up()
    # the undo runs in the background, owned by the worker's lifecycle
    assert len(w.keeper._work) == (1 if when == "after" else 0)
    return reply


@pytest.mark.parametrize("when", ABORTS.keys())
async def test_abort_commit(when: str, worker: Worker, store: Store, rec: Recorder) -> None:
    expect = ABORTS[when]
    hold(worker)
    reply = await commit_and_abort(worker, when)
    assert type(reply) is expect.reply
    states = [m.state for m in worker.machines.values()]
    assert states == ([] if expect.state is None else [expect.state])
    assert [row[1] for row in store.oplog(WID)] == expect.ops
    assert rec.kinds() == expect.events
    assert worker.ledger.committed == expect.committed
    assert worker.ledger.held == ZERO
    assert worker.commits.aborts == set()
    if expect.state == "destroyed":
        [m] = worker.machines.values()
        assert m.aborted is True
        assert rec.events[-1].detail == "aborted"
        assert worker.by_order == {}  # the order id is free again: a retry may place anew


async def test_abort_during_a_failed_write_undoes_nothing_and_forgets_the_abort(
    worker: Worker, store: Store
) -> None:
    await held_store_refuses(worker)
    task = asyncio.ensure_future(worker.commits.commit(commit()))
    asyncio.get_running_loop().call_soon(
        lambda: worker.release("order-1", "auc-1", abort_commit=True)
    )
    reply = await task
    assert isinstance(reply, Error)
    assert worker.commits.aborts == set()
    assert [row[1] for row in store.oplog(WID)] == ["place"]  # only the stale machine's


async def test_an_aborted_order_can_be_placed_again(
    worker: Worker, store: Store, rec: Recorder
) -> None:
    hold(worker)
    first = await commit_and_abort(worker, "after")
    assert isinstance(first, Placed)
    hold(worker)
    retry = await worker.commits.commit(commit())
    assert isinstance(retry, Placed)
    assert (retry.existing, retry.machine_id != first.machine_id) == (False, True)
    assert worker.by_order == {"order-1": retry.machine_id}
    assert worker.ledger.committed == (2000, 2048, 0, 0, 0)
    # a restart keeps the order bound to the new machine, not the aborted one
    again = Worker(worker.cfg, store, rec.emit)
    again.recover()
    assert again.by_order == {"order-1": retry.machine_id}
    assert again.ledger.committed == (2000, 2048, 0, 0, 0)


# -- a Placed is never taken back (§6.6): each interleaving, forced step by step -----------------


async def _with_lifecycle(w: Worker, body: Callable[[], Awaitable[CommitReply]]) -> CommitReply:
    async with anyio.create_task_group() as tasks:
        await tasks.start(w.keeper.run)
        try:
            return await body()
        finally:
            await w.keeper.close()  # waits for any undo under way


async def test_an_abort_during_a_write_a_duplicate_joined_undoes_nothing(
    worker: Worker, store: Store
) -> None:
    """Commit A is being written; a duplicate commit B joins it (it will be told Placed);
    then A's auction gives up: the machine B's buyer holds stays."""
    hold(worker)

    async def body() -> CommitReply:
        first = asyncio.ensure_future(worker.commits.commit(commit()))
        await asyncio.sleep(0)  # A's first step: the write is under way (FIFO loop order)
        second = asyncio.ensure_future(worker.commits.commit(commit()))
        await asyncio.sleep(0)  # B joined the write
        worker.release("order-1", "auc-1", abort_commit=True)
        a, b = await asyncio.gather(first, second)
        assert b is a
        return a

    reply = await _with_lifecycle(worker, body)
    assert isinstance(reply, Placed)
    assert [m.state for m in worker.machines.values()] == ["reserved"]
    assert worker.by_order == {"order-1": reply.machine_id}
    assert [row[1] for row in store.oplog(WID)] == ["place"]


@pytest.mark.parametrize("handed", ["duplicate commit", "existing-machine offer"])
async def test_an_abort_after_the_machine_was_handed_on_undoes_nothing(
    handed: str, worker: Worker, store: Store
) -> None:
    """Another auction got the written machine (a duplicate commit answered
    Placed{existing}, or the host sent it as the order's existing-machine offer): its buyer
    holds a Placed, so the first auction's abort leaves the machine."""
    hold(worker)

    async def body() -> CommitReply:
        first = await worker.commits.commit(commit())
        if handed == "duplicate commit":
            again = await worker.commits.commit(commit())
            assert isinstance(again, Placed) and again.existing
        else:  # a retry's bid: the desk offers it the machine
            b = Bid(order_id="order-1", region="mad", resources=res(), image="web", hold_ms=1000)
            [send] = DESK.answer(b, "inbox", time.monotonic(), BidGroup([worker])).replies
            assert isinstance(send.reply, Offer) and send.reply.machine_id == first.machine_id
        worker.release("order-1", "auc-1", abort_commit=True)
        return first

    reply = await _with_lifecycle(worker, body)
    assert isinstance(reply, Placed)
    assert [m.state for m in worker.machines.values()] == ["reserved"]
    assert [row[1] for row in store.oplog(WID)] == ["place"]
    assert worker.ledger.held == ZERO  # the abort released nothing it should not have


async def test_a_machine_being_reclaimed_is_not_handed_to_a_commit(worker: Worker) -> None:
    """While a worker asks whether its reserved machine is an orphan (docs/protocol.md
    §5.3d), a duplicate commit for its order is refused instead of answered with it: the
    verdict may be "orphan", and a Placed for a machine about to be destroyed is a lie."""
    await held_then_placed(worker)
    [m] = worker.machines.values()
    assert worker.reclaims.due([m], m.created_at_ms + worker.reclaims.after_ms) == [m]
    assert blank(await worker.commits.commit(commit())) == rejected(
        "no_hold", "the order's machine here is being reclaimed"
    )
    worker.reclaims.done(m.machine_id)  # settled "keep": handed out again
    assert blank(await worker.commits.commit(commit())) == placed(existing=True)


@pytest.mark.parametrize("when", ["during", "after"])
async def test_a_machine_being_aborted_is_handed_to_nobody(
    when: str, worker: Worker, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once an abort is decided (the committing auction gave up, nobody else had the
    machine), a retry's bid and commit that come before the destroy is durable get
    nothing of the machine: a Placed for it would name a machine destroyed a moment later
    (the duplicate storm's dup-155, told Placed with a machine its first auction's abort
    then destroyed). Asked at the last moment: as the destroy's write begins."""
    hold(worker)
    asked: list[tuple[int, dict[str, str], CommitReply]] = []  # offers, silences, reply
    undo = worker.keeper.abort

    async def asked_meanwhile(m: Machine) -> None:
        b = Bid(order_id="order-1", region="mad", resources=res(), image="web", hold_ms=1000)
        ans = DESK.answer(b, "inbox", time.monotonic(), BidGroup([worker]))
        reply = blank(await worker.commits.commit(commit()))
        asked.append((len(ans.replies), dict(ans.silent), reply))
        await undo(m)

    monkeypatch.setattr(worker.keeper, "abort", asked_meanwhile)
    reply = await commit_and_abort(worker, when)
    assert isinstance(reply, Placed)
    assert asked == [
        (
            0,
            {WID: UNDOING},
            rejected(
                "no_hold", "the order's machine here is being destroyed: its commit was aborted"
            ),
        )
    ]
    [m] = worker.machines.values()
    assert (m.state, m.aborted, worker.by_order, worker.undoing) == ("destroyed", True, {}, set())
    assert [row[1] for row in store.oplog(WID)] == ["place", "abort"]
