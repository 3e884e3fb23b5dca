"""One worker (supplier/worker.py), driven directly: no NATS, a real store. Its bids are
answered by the desk (supplier/desk.py, tested in test_desk.py), as the host does it; its
commits by its commit desk (supplier/commits.py, tested in test_commits.py).

The worker sells 8 CPUs / 8 GiB / 100 GB disk and has the image "web" cached; pricing is the
spread preset (f(u) = 1 - u) with image_weight 0.3: score = 0.7 * utility + 0.3 * cached.
"""

from __future__ import annotations

import time
from typing import Any

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
)
from bourse.wire.resources import ZERO
from supplier.candidates import BidGroup
from supplier.config import WorkerConfig
from supplier.desk import Desk
from supplier.status import worker_status
from supplier.store import Store
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
    ans = DESK.answer(b, "inbox", time.monotonic(), BidGroup([worker]))
    return [s.reply for s in ans.replies if isinstance(s.reply, Offer)]


def offer_of(offers: list[Offer]) -> Offer:
    [offer] = offers
    return offer


async def place(worker: Worker, order_id: str = "order-1", resources: Resources | None = None):
    """Bid then commit; the Placed reply."""
    offer_of(bid_on(worker, bid(order_id, resources)))
    placed = await worker.commits.commit(commit(order_id, resources))
    assert isinstance(placed, Placed), placed
    return placed


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
    assert worker_status(worker) == WorkerStatus(
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
        confinement="none",  # the sim driver runs nothing to confine
        isolation="none",  # nor to isolate
        driver="sim",
        runtime="simulated",
        cache_bytes=200 * 1024 * 1024,  # the sim's model of its cache: web's default size
        cache_budget_bytes=20_000 * 1024 * 1024,  # a fifth of its disk
    )


# -- restart ----------------------------------------------------------------------------


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
    assert w2.ledger.committed == (5000, 3072, 0, 0, 0)  # a + b; c is destroyed (CPU in millis)
    assert w2.ledger.holds == {}
    assert w2.ledger.held == ZERO
    assert w2.live_machines() == 2
    assert w2.draining is False
    # the restarted worker answers a retried commit with the machine it already has
    again = await w2.commits.commit(commit("order-a", res(2, 1024)))
    assert isinstance(again, Placed)
    assert (again.machine_id, again.existing) == (a, True)
    # and its hold-less state rejects a commit for the forgotten hold
    lost = await w2.commits.commit(commit("order-d"))
    assert isinstance(lost, Rejected)
    assert lost.reason == "no_hold"


async def test_recover_overcommitted_drains(store: Store, rec: Recorder) -> None:
    w1 = make_worker(store, rec)
    await place(w1, "order-a", res(6, 1024))
    w2 = make_worker(store, rec, capacity=Amount(cpus=4, memory_mb=8192))
    assert w2.draining is True
    assert w2.drain_reason == (
        "committed cpus=6 memory_mb=1024 disk_mb=0 gpus=0 exceeds capacity "
        "cpus=4 memory_mb=8192 disk_mb=0 gpus=0"
    )
