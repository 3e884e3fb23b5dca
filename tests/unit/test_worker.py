"""One worker (supplier/worker.py), driven directly: no NATS, a real store. Its bids are
answered by the desk (supplier/desk.py, tested in test_desk.py), as the host does it.

The worker sells 8 CPUs / 8 GiB / 100 GB disk and has the image "web" cached; pricing is the
spread preset (f(u) = 1 - u) with image_weight 0.3: score = 0.7 * utility + 0.3 * cached.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from bourse.wire.messages import (
    Amount,
    Bid,
    Commit,
    Error,
    Event,
    Machine,
    MachineList,
    Offer,
    Placed,
    Rejected,
    Resources,
    WorkerStatus,
    worker_of_machine,
)
from bourse.wire.resources import ZERO
from supplier.candidates import BidGroup
from supplier.config import WorkerConfig
from supplier.desk import Desk
from supplier.store import Op, Store
from supplier.worker import Worker

WID = "mad-1"
FAR_FUTURE = 1e12  # a monotonic reading after every hold's TTL


DESK: Desk[Worker] = Desk()


class Recorder:
    """What the worker emitted."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def kinds(self) -> list[tuple[str, str]]:
        return [(e.kind, e.order_id) for e in self.events]


def config(**overrides: Any) -> WorkerConfig:
    kwargs: dict[str, Any] = {
        "worker_id": WID,
        "region": "mad",
        "capacity": Amount(cpus=8, memory_mb=8192, disk_mb=100_000),
        "labels": {"disk": "ssd"},
        "images": ["web"],
    }
    kwargs.update(overrides)
    return WorkerConfig(**kwargs)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "supplier.db")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


def make_worker(store: Store, rec: Recorder, **overrides: Any) -> Worker:
    w = Worker(config(**overrides), store, rec.emit)
    w.recover()
    return w


@pytest.fixture
def worker(store: Store, rec: Recorder) -> Worker:
    return make_worker(store, rec)


def res(cpus: int = 2, memory_mb: int = 2048, disk_mb: int = 0) -> Resources:
    return Resources(cpus=cpus, memory_mb=memory_mb, disk_mb=disk_mb)


def bid(order_id: str = "order-1", resources: Resources | None = None, **kw: Any) -> Bid:
    kwargs: dict[str, Any] = {
        "order_id": order_id,
        "region": "mad",
        "resources": resources or res(),
        "image": "web",
        "hold_ms": 1000,
        "auction_id": f"auc-{order_id}",
    }
    kwargs.update(kw)
    return Bid(**kwargs)


def commit(order_id: str = "order-1", resources: Resources | None = None, **kw: Any) -> Commit:
    kwargs: dict[str, Any] = {
        "order_id": order_id,
        "worker_id": WID,
        "resources": resources or res(),
        "image": "web",
        "metadata": {"team": "infra"},
    }
    kwargs.update(kw)
    return Commit(**kwargs)


def bid_on(worker: Worker, b: Bid) -> list[Offer]:
    """Answer a bid for this worker alone, as the host's desk does; the offers made."""
    ans = DESK.answer(b, "inbox", time.monotonic(), BidGroup([worker]), {})
    return [s.reply for s in ans.replies if isinstance(s.reply, Offer)]


def offer_of(offers: list[Offer]) -> Offer:
    [offer] = offers
    return offer


async def place(worker: Worker, order_id: str = "order-1", resources: Resources | None = None):
    """Bid then commit; the Placed reply."""
    offer_of(bid_on(worker, bid(order_id, resources)))
    placed = await worker.commit(commit(order_id, resources))
    assert isinstance(placed, Placed), placed
    return placed


async def run_spawned(before: set[asyncio.Task[Any]]) -> None:
    """Wait for the tasks the worker spawned since ``before`` (no sleeping)."""
    spawned = asyncio.all_tasks() - before - {asyncio.current_task()}
    assert spawned, "the worker spawned no task"
    await asyncio.gather(*spawned)


# -- commit --------------------------------------------------------------------------------------


async def test_commit_with_live_hold(worker: Worker, store: Store, rec: Recorder) -> None:
    offer = offer_of(bid_on(worker, bid()))
    placed = await worker.commit(commit())
    assert isinstance(placed, Placed)
    assert placed.order_id == "order-1"
    assert placed.worker_id == WID
    assert placed.region == "mad"
    assert worker_of_machine(placed.machine_id) == WID
    assert placed.score == offer.score == 0.825
    assert placed.subscores == offer.subscores
    assert placed.image_cached is True
    assert placed.existing is False
    assert placed.elapsed_ms >= 0
    m = worker.machines[placed.machine_id]
    assert m.state == "reserved"
    assert m.resources == res()
    assert m.metadata == {"team": "infra"}
    assert m.score == 0.825
    assert worker.by_order == {"order-1": placed.machine_id}
    assert worker.ledger.committed == (2, 2048, 0, 0)
    assert worker.ledger.held == ZERO
    assert worker.ledger.holds == {}
    assert rec.kinds() == [("placed", "order-1")]
    assert rec.events[0].machine_id == placed.machine_id
    # durable before the reply
    assert store.load_machines(WID) == [m]
    assert store.oplog(WID) == [(1, "place", "order-1", placed.machine_id, "reserved")]


async def test_commit_less_than_hold_frees_the_rest(worker: Worker) -> None:
    bid_on(worker, bid(resources=res(4, 4096)))
    placed = await worker.commit(commit(resources=res(1, 1024)))
    assert isinstance(placed, Placed)
    assert worker.ledger.committed == (1, 1024, 0, 0)
    assert worker.ledger.held == ZERO


async def test_commit_twice_returns_existing(worker: Worker, store: Store, rec: Recorder) -> None:
    first = await place(worker)
    again = await worker.commit(commit())
    assert isinstance(again, Placed)
    assert again.existing is True
    assert again.machine_id == first.machine_id
    assert again.score == first.score
    assert worker.ledger.committed == (2, 2048, 0, 0)  # counted once
    assert len(store.load_machines(WID)) == 1
    assert rec.kinds() == [("placed", "order-1")]


async def test_concurrent_commits_make_one_machine(worker: Worker, store: Store) -> None:
    bid_on(worker, bid())
    a, b = await asyncio.gather(worker.commit(commit()), worker.commit(commit()))
    assert isinstance(a, Placed)
    assert isinstance(b, Placed)
    assert a.machine_id == b.machine_id
    assert len(store.load_machines(WID)) == 1
    assert worker.ledger.committed == (2, 2048, 0, 0)


async def test_commit_without_hold(worker: Worker) -> None:
    reply = await worker.commit(commit())
    assert reply == Rejected(
        order_id="order-1",
        worker_id=WID,
        reason="no_hold",
        detail="no hold for this order on this worker",
    )
    assert worker.machines == {}


async def test_commit_after_released_hold(worker: Worker) -> None:
    bid_on(worker, bid())
    worker.release("order-1", "auc-order-1")
    reply = await worker.commit(commit())
    assert isinstance(reply, Rejected)
    assert reply.reason == "no_hold"


async def test_commit_after_expiry(worker: Worker, store: Store, rec: Recorder) -> None:
    bid_on(worker, bid())
    worker.expire_holds(now=FAR_FUTURE)
    assert worker.ledger.held == ZERO
    assert rec.kinds() == [("hold_expired", "order-1")]
    reply = await worker.commit(commit())
    assert reply == Rejected(
        order_id="order-1",
        worker_id=WID,
        reason="hold_expired",
        detail="the hold's TTL passed before the commit",
    )
    assert worker.ledger.committed == ZERO
    assert store.oplog() == []


async def test_commit_for_more_than_the_hold(worker: Worker) -> None:
    bid_on(worker, bid())
    reply = await worker.commit(commit(resources=res(2, 4096)))
    assert reply == Rejected(
        order_id="order-1",
        worker_id=WID,
        reason="insufficient",
        detail="commit asks for (2, 4096, 0, 0) but the hold is for (2, 2048, 0, 0)",
    )
    assert worker.ledger.committed == ZERO
    assert worker.ledger.held == (2, 2048, 0, 0)  # the hold stays for a correct commit


async def test_commit_while_draining(worker: Worker) -> None:
    bid_on(worker, bid())
    worker.set_draining("maintenance")
    reply = await worker.commit(commit())
    assert reply == Rejected(
        order_id="order-1", worker_id=WID, reason="draining", detail="maintenance"
    )
    assert worker.machines == {}


async def test_commit_for_another_worker(worker: Worker) -> None:
    bid_on(worker, bid())
    reply = await worker.commit(commit(worker_id="mad-2"))
    assert reply == Error(
        code="bad_request", detail="commit for worker 'mad-2' sent to worker 'mad-1'"
    )
    assert worker.machines == {}
    assert worker.ledger.held == (2, 2048, 0, 0)


async def test_failed_store_write_unpins_and_drains(store: Store, rec: Recorder) -> None:
    # A live machine for the order already in the store, unknown to this worker (it did not
    # recover): the unique index refuses the second one, which surfaces as a StoreError.
    other = Worker(config(), store, rec.emit)
    stale = Machine(
        machine_id=f"{WID}~STALE",
        order_id="order-1",
        worker_id=WID,
        region="mad",
        state="started",
        resources=res(),
        image="web",
    )
    await store.write(Op("place", stale))
    bid_on(other, bid())
    reply = await other.commit(commit())
    assert isinstance(reply, Error)
    assert reply.code == "internal"
    assert reply.detail.startswith(f"worker {WID} cannot store: write to ")
    assert "UNIQUE constraint failed" in reply.detail
    assert other.ledger.holds == {}
    assert other.ledger.committed == ZERO
    assert other.draining is True
    assert other.by_order == {}


# -- machine lifecycle ----------------------------------------------------------------------------


async def test_transitions(worker: Worker, store: Store, rec: Recorder) -> None:
    mid = (await place(worker)).machine_id
    started = await worker.transition("start", mid)
    assert isinstance(started, Machine)
    assert started.state == "started"
    assert worker.machines[mid] == started
    stopped = await worker.transition("stop", mid)
    assert isinstance(stopped, Machine)
    assert stopped.state == "stopped"
    restarted = await worker.transition("start", mid)
    assert isinstance(restarted, Machine)
    assert restarted.state == "started"
    destroyed = await worker.transition("destroy", mid)
    assert isinstance(destroyed, Machine)
    assert destroyed.state == "destroyed"
    # Each verb records its intermediate state before the driver works, then the result.
    assert [row[1:] for row in store.oplog(WID)] == [
        ("place", "order-1", mid, "reserved"),
        ("start", "order-1", mid, "starting"),
        ("start", "order-1", mid, "started"),
        ("stop", "order-1", mid, "stopping"),
        ("stop", "order-1", mid, "stopped"),
        ("start", "order-1", mid, "starting"),
        ("start", "order-1", mid, "started"),
        ("destroy", "order-1", mid, "destroyed"),
    ]
    assert rec.kinds() == [
        ("placed", "order-1"),
        ("started", "order-1"),
        ("stopped", "order-1"),
        ("started", "order-1"),
        ("destroyed", "order-1"),
    ]
    assert store.load_machines(WID) == [destroyed]


@pytest.mark.parametrize(
    ("setup", "verb", "state"),
    [
        ([], "destroy", "destroyed"),
        (["start"], "start", "started"),
        (["start", "stop"], "stop", "stopped"),
        (["destroy"], "destroy", "destroyed"),
    ],
)
async def test_transitions_are_idempotent(
    worker: Worker, store: Store, rec: Recorder, setup: list[str], verb: str, state: str
) -> None:
    mid = (await place(worker)).machine_id
    for v in setup:
        await worker.transition(v, mid)
    first = await worker.transition(verb, mid)
    log_len, events = len(store.oplog()), len(rec.events)
    again = await worker.transition(verb, mid)
    assert isinstance(again, Machine)
    assert again.state == state
    assert again == first  # unchanged, same updated_at_ms
    assert len(store.oplog()) == log_len  # nothing written
    assert len(rec.events) == events  # nothing announced


@pytest.mark.parametrize(
    ("setup", "verb", "state"),
    [
        (["destroy"], "start", "destroyed"),
        (["destroy"], "stop", "destroyed"),
        ([], "stop", "reserved"),
    ],
)
async def test_invalid_transitions(
    worker: Worker, store: Store, setup: list[str], verb: str, state: str
) -> None:
    mid = (await place(worker)).machine_id
    for v in setup:
        await worker.transition(v, mid)
    log_len = len(store.oplog())
    reply = await worker.transition(verb, mid)
    assert reply == Error(code="bad_request", detail=f"cannot {verb} machine {mid}: it is {state}")
    assert worker.machines[mid].state == state
    assert len(store.oplog()) == log_len


async def test_transition_unknown_machine(worker: Worker) -> None:
    reply = await worker.transition("start", f"{WID}~NOPE")
    assert reply == Error(code="bad_request", detail=f"no machine {WID}~NOPE on worker {WID}")


async def test_destroy_frees_committed_capacity(worker: Worker, rec: Recorder) -> None:
    mid = (await place(worker, "order-1", res(6, 6144))).machine_id
    assert bid_on(worker, bid("order-2", res(4, 1024))) == []  # 6 + 4 > 8
    await worker.transition("destroy", mid)
    assert worker.ledger.committed == ZERO
    assert worker.live_machines() == 0
    offer_of(bid_on(worker, bid("order-2", res(4, 1024))))


def test_get_and_list_machines(worker: Worker) -> None:
    assert worker.list_machines(include_destroyed=True) == MachineList(worker_id=WID, machines=[])
    assert worker.get_machine(f"{WID}~X") == Error(
        code="bad_request", detail=f"no machine {WID}~X on worker {WID}"
    )


async def test_list_machines_hides_destroyed(worker: Worker) -> None:
    a = (await place(worker, "order-a")).machine_id
    b = (await place(worker, "order-b")).machine_id
    await worker.transition("destroy", a)
    live = worker.list_machines(include_destroyed=False)
    assert [m.machine_id for m in live.machines] == [b]
    every = worker.list_machines(include_destroyed=True)
    assert sorted(m.machine_id for m in every.machines) == sorted([a, b])
    got = worker.get_machine(a)
    assert isinstance(got, Machine)
    assert got.state == "destroyed"


async def test_status(worker: Worker) -> None:
    await place(worker, "order-a", res(2, 1024, 500))
    bid_on(worker, bid("order-b", res(1, 512)))
    assert worker.status() == WorkerStatus(
        worker_id=WID,
        region="mad",
        labels={"disk": "ssd"},
        capacity=Amount(cpus=8, memory_mb=8192, disk_mb=100_000, gpus=0),
        committed=Amount(cpus=2, memory_mb=1024, disk_mb=500, gpus=0),
        held=Amount(cpus=1, memory_mb=512, disk_mb=0, gpus=0),
        images=["web"],
        machines=1,
        draining=False,
        holds=1,
    )


# -- restart and abort ----------------------------------------------------------------------------


async def test_recover_restores_machines_and_committed(store: Store, rec: Recorder) -> None:
    w1 = make_worker(store, rec)
    a = (await place(w1, "order-a", res(2, 1024))).machine_id
    b = (await place(w1, "order-b", res(3, 2048))).machine_id
    c = (await place(w1, "order-c", res(1, 512))).machine_id
    await w1.transition("start", b)
    await w1.transition("destroy", c)
    bid_on(w1, bid("order-d"))  # a hold: forgotten by the restart

    w2 = make_worker(store, rec)
    assert w2.machines == w1.machines
    assert w2.machines[b].state == "started"
    assert w2.by_order == {"order-a": a, "order-b": b, "order-c": c}
    assert w2.ledger.committed == (5, 3072, 0, 0)  # a + b; c is destroyed
    assert w2.ledger.holds == {}
    assert w2.ledger.held == ZERO
    assert w2.live_machines() == 2
    assert w2.draining is False
    # the restarted worker answers a retried commit with the machine it already has
    again = await w2.commit(commit("order-a", res(2, 1024)))
    assert isinstance(again, Placed)
    assert (again.machine_id, again.existing) == (a, True)
    # and its hold-less state rejects a commit for the forgotten hold
    lost = await w2.commit(commit("order-d"))
    assert isinstance(lost, Rejected)
    assert lost.reason == "no_hold"


async def test_recover_overcommitted_drains(store: Store, rec: Recorder) -> None:
    w1 = make_worker(store, rec)
    await place(w1, "order-a", res(6, 1024))
    w2 = make_worker(store, rec, capacity=Amount(cpus=4, memory_mb=8192))
    assert w2.draining is True
    assert w2.drain_reason == "committed (6, 1024, 0, 0) exceeds capacity (4, 8192, 0, 0)"


async def test_abort_commit_destroys_reserved_machine(
    worker: Worker, store: Store, rec: Recorder
) -> None:
    placed = await place(worker)
    mid = placed.machine_id
    async with anyio.create_task_group() as tasks:
        await tasks.start(worker.keeper.run)  # as the host runs it: the abort's owner
        before = asyncio.all_tasks()
        worker.release("order-1", "auc-order-1", abort_commit=True)
        await run_spawned(before)
        await worker.keeper.close()
    m = worker.machines[mid]
    assert m.state == "destroyed"
    assert m.aborted is True
    assert worker.by_order == {}  # the order id is free again
    assert worker.ledger.committed == ZERO
    assert worker.aborts == set()
    assert rec.kinds() == [("placed", "order-1"), ("destroyed", "order-1")]
    assert rec.events[-1].detail == "aborted"
    assert [row[1:] for row in store.oplog(WID)] == [
        ("place", "order-1", mid, "reserved"),
        ("abort", "order-1", mid, "destroyed"),
    ]
    # the order can be placed again, as a new machine (the unique index allows it)
    retry = await place(worker)
    assert retry.existing is False
    assert retry.machine_id != mid
    # and a restart keeps the order bound to the new machine, not the aborted one
    w2 = make_worker(store, rec)
    assert w2.by_order == {"order-1": retry.machine_id}
    assert w2.ledger.committed == (2, 2048, 0, 0)


async def test_abort_commit_leaves_started_machine(worker: Worker, store: Store) -> None:
    mid = (await place(worker)).machine_id
    await worker.transition("start", mid)
    before = asyncio.all_tasks()
    worker.release("order-1", "auc-order-1", abort_commit=True)
    assert asyncio.all_tasks() - before == set()  # nothing to undo
    assert worker.machines[mid].state == "started"
    assert worker.by_order == {"order-1": mid}
    assert worker.ledger.committed == (2, 2048, 0, 0)


async def test_abort_commit_without_machine_drops_hold(worker: Worker) -> None:
    bid_on(worker, bid())
    worker.release("order-1", "auc-order-1", abort_commit=True)
    assert worker.ledger.holds == {}
    assert worker.machines == {}


async def test_abort_during_commit_undoes_it(worker: Worker, store: Store, rec: Recorder) -> None:
    bid_on(worker, bid())
    seen: list[tuple[bool, bool]] = []

    def give_up() -> None:
        # Runs right after the commit task's first step, which ends awaiting the durable write.
        seen.append(("order-1" in worker.committing, worker.ledger.holds["order-1"].committing))
        worker.release("order-1", "auc-order-1", abort_commit=True)
        seen.append(("order-1" in worker.aborts, "order-1" in worker.ledger.holds))

    task = asyncio.ensure_future(worker.commit(commit()))
    asyncio.get_running_loop().call_soon(give_up)  # FIFO: after the task's first step
    placed = await task
    assert seen == [(True, True), (True, True)]  # under way and pinned: not dropped
    assert isinstance(placed, Placed)
    m = worker.machines[placed.machine_id]
    assert (m.state, m.aborted) == ("destroyed", True)
    assert worker.by_order == {}
    assert worker.ledger.committed == ZERO
    assert worker.ledger.held == ZERO
    assert [row[1] for row in store.oplog()] == ["place", "abort"]
