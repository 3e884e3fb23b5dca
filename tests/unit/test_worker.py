"""One worker's market logic (supplier/worker.py), driven directly: no NATS, a real store.

The worker sells 8 CPUs / 8 GiB / 100 GB disk and has the image "web" cached; pricing is the
spread preset (f(u) = 1 - u) with image_weight 0.3: score = 0.7 * utility + 0.3 * cached.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
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
    Waiting,
    WorkerStatus,
    worker_of_machine,
)
from supplier.config import WorkerConfig
from supplier.ledger import ZERO
from supplier.store import Op, Store
from supplier.worker import Worker

WID = "mad-1"
FAR_FUTURE = 1e12  # a monotonic reading after every hold's TTL


class Recorder:
    """What the worker emitted: events, and late answers to waiting bids."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.sent: list[tuple[str, str, Offer | Waiting, float]] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def send_offer(self, inbox: str, auction_id: str, reply: Offer | Waiting, delay: float) -> None:
        self.sent.append((inbox, auction_id, reply, delay))

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
    w.send_offer = rec.send_offer
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


def offer_of(answer: tuple[Offer | Waiting, float] | None) -> Offer:
    assert answer is not None
    reply = answer[0]
    assert isinstance(reply, Offer)
    return reply


async def place(worker: Worker, order_id: str = "order-1", resources: Resources | None = None):
    """Bid then commit; the Placed reply."""
    offer_of(worker.bid(bid(order_id, resources), time.monotonic()))
    placed = await worker.commit(commit(order_id, resources))
    assert isinstance(placed, Placed), placed
    return placed


async def run_spawned(before: set[asyncio.Task[Any]]) -> None:
    """Wait for the tasks the worker spawned since ``before`` (no sleeping)."""
    spawned = asyncio.all_tasks() - before - {asyncio.current_task()}
    assert spawned, "the worker spawned no task"
    await asyncio.gather(*spawned)


# -- bids ------------------------------------------------------------------------------------------


def test_bid_returns_priced_offer_and_holds(worker: Worker) -> None:
    answer = worker.bid(bid(), time.monotonic())
    assert answer is not None
    offer, delay = answer
    # u_cpus = 2/8 = 0.25 -> 0.75; u_mem = 2048/8192 = 0.25 -> 0.75; utility 0.75
    # score = 0.7 * 0.75 + 0.3 * 1 (image cached) = 0.825
    assert isinstance(offer, Offer)
    assert offer.score == 0.825
    assert offer.subscores == {"cpus": 0.75, "memory_mb": 0.75, "utility": 0.75, "image": 1.0}
    assert offer.image_cached is True
    assert (offer.order_id, offer.worker_id, offer.region) == ("order-1", WID, "mad")
    assert offer.machine_id is None
    assert delay == pytest.approx((1 - 0.825) * 4.0 / 1000.0, abs=1e-12)  # spread_ms = 4
    h = worker.ledger.holds["order-1"]
    assert h.want == (2, 2048, 0, 0)
    assert h.auction_id == "auc-order-1"
    assert h.score == 0.825
    assert worker.ledger.held == (2, 2048, 0, 0)
    assert worker.ledger.committed == ZERO


def test_bid_for_uncached_image(worker: Worker) -> None:
    offer = offer_of(worker.bid(bid(image="db"), time.monotonic()))
    assert offer.image_cached is False
    assert offer.score == 0.525  # 0.7 * 0.75


def test_hold_ttl(worker: Worker) -> None:
    now = 500.0
    worker.bid(bid(hold_ms=250), now)
    assert worker.ledger.holds["order-1"].expires_at == 500.25


def test_second_bid_replaces_hold(worker: Worker) -> None:
    now = time.monotonic()
    first = offer_of(worker.bid(bid(), now))
    second = offer_of(worker.bid(bid(resources=res(3, 1024), auction_id="auc-2"), now))
    assert list(worker.ledger.holds) == ["order-1"]
    assert worker.ledger.holds["order-1"].auction_id == "auc-2"
    assert worker.ledger.held == (3, 1024, 0, 0)  # not (5, 3072, ...): the first hold is gone
    # priced against an empty worker, as the first: u_cpus = 3/8, u_mem = 1024/8192
    # utility = (0.625 + 0.875) / 2 = 0.75 -> score 0.825
    assert first.score == second.score == 0.825


def test_bids_for_different_orders_stack(worker: Worker) -> None:
    now = time.monotonic()
    offer_of(worker.bid(bid("order-1"), now))
    second = offer_of(worker.bid(bid("order-2"), now))
    assert worker.ledger.held == (4, 4096, 0, 0)
    # u = 4/8 for both -> utility 0.5 -> 0.7 * 0.5 + 0.3 = 0.65
    assert second.score == 0.65


@pytest.mark.parametrize(
    "kw",
    [
        {"resources": res(9, 1024)},  # more than the capacity
        {"constraints": {"disk": "hdd"}},
        {"exclude_workers": ["mad-2", WID]},
    ],
)
def test_bid_that_does_not_fit_is_silent(worker: Worker, kw: dict[str, Any]) -> None:
    assert worker.bid(bid(**kw), time.monotonic(), "inbox") is None
    assert worker.ledger.holds == {}
    assert len(worker.waiting) == 0


def test_draining_worker_is_silent(store: Store, rec: Recorder) -> None:
    w = make_worker(store, rec, draining=True)
    assert w.bid(bid(), time.monotonic()) is None
    assert w.ledger.holds == {}


def test_bid_blocked_by_committed_does_not_wait(worker: Worker) -> None:
    worker.ledger.load_committed((7, 0, 0, 0))
    assert worker.bid(bid(wait_ms=1000), time.monotonic(), "inbox") is None
    assert len(worker.waiting) == 0


def test_bid_blocked_by_holds_without_wait_is_silent(worker: Worker) -> None:
    now = time.monotonic()
    offer_of(worker.bid(bid("big", res(8, 1024)), now))
    assert worker.bid(bid("order-2", wait_ms=0), now, "inbox") is None
    assert worker.bid(bid("order-3", wait_ms=1000), now, "") is None  # no inbox to answer
    assert len(worker.waiting) == 0


async def test_bid_blocked_by_holds_waits_then_offers(worker: Worker, rec: Recorder) -> None:
    now = time.monotonic()
    offer_of(worker.bid(bid("big", res(8, 1024), auction_id="auc-big"), now))
    answer = worker.bid(bid("order-2", res(4, 4096), wait_ms=5000, auction_id="auc-2"), now, "in-2")
    assert answer == (Waiting(order_id="order-2", worker_id=WID, region="mad", wait_ms=5000), 0.0)
    assert "order-2" not in worker.ledger.holds
    assert rec.sent == []
    worker.release("big", "auc-big")
    assert len(rec.sent) == 1
    inbox, auction_id, late, delay = rec.sent[0]
    assert (inbox, auction_id) == ("in-2", "auc-2")
    assert isinstance(late, Offer)
    # priced after the release: u = 4/8 and 4096/8192 -> utility 0.5 -> 0.35 + 0.3
    assert late.score == 0.65
    assert late.order_id == "order-2"
    assert delay == pytest.approx(0.35 * 4.0 / 1000.0, abs=1e-12)
    assert worker.ledger.holds["order-2"].want == (4, 4096, 0, 0)
    assert len(worker.waiting) == 0
    # and the late offer can be committed like any other
    placed = await worker.commit(commit("order-2", res(4, 4096)))
    assert isinstance(placed, Placed)


def test_waiting_bid_answered_when_blocking_hold_expires(worker: Worker, rec: Recorder) -> None:
    now = time.monotonic()
    worker.bid(bid("big", res(8, 1024), hold_ms=100), now)
    worker.bid(bid("order-2", wait_ms=30_000), now, "in-2")
    worker.expire_holds(now=now + 0.1)
    assert rec.kinds() == [("hold_expired", "big")]
    assert [(s[0], type(s[2]).__name__) for s in rec.sent] == [("in-2", "Offer")]


def test_release_drops_a_waiting_bid(worker: Worker, rec: Recorder) -> None:
    now = time.monotonic()
    worker.bid(bid("big", res(8, 1024), auction_id="auc-big"), now)
    worker.bid(bid("order-2", wait_ms=5000, auction_id="auc-2"), now, "in-2")
    worker.release("order-2", "auc-2")
    assert len(worker.waiting) == 0
    worker.release("big", "auc-big")
    assert rec.sent == []


async def test_waiting_bid_withdrawn_when_committed_takes_capacity(
    worker: Worker, rec: Recorder
) -> None:
    now = time.monotonic()
    worker.bid(bid("big", res(6, 1024)), now)
    worker.bid(bid("order-2", res(4, 1024), wait_ms=5000, auction_id="auc-2"), now, "in-2")
    placed = await worker.commit(commit("big", res(6, 1024)))
    assert isinstance(placed, Placed)
    # 8 - 6 committed < 4: the bid can never fit, so the worker says so at once
    assert rec.sent == [
        ("in-2", "auc-2", Waiting(order_id="order-2", worker_id=WID, region="mad", wait_ms=0), 0.0)
    ]
    assert len(worker.waiting) == 0


def test_rebid_that_drops_hold_answers_waiting_bid(worker: Worker, rec: Recorder) -> None:
    now = time.monotonic()
    worker.bid(bid("big", res(8, 1024), auction_id="run-1"), now)
    worker.bid(bid("order-2", wait_ms=5000, auction_id="auc-2"), now, "in-2")
    # A retry of "big" that excludes this worker: its old hold goes, and nothing takes it.
    retry = bid("big", res(8, 1024), auction_id="run-2", exclude_workers=[WID])
    assert worker.bid(retry, now) is None
    # The old hold is gone and the waiting bid took the capacity at once.
    assert list(worker.ledger.holds) == ["order-2"]
    assert [(s[0], type(s[2]).__name__) for s in rec.sent] == [("in-2", "Offer")]


# -- commit --------------------------------------------------------------------------------------


async def test_commit_with_live_hold(worker: Worker, store: Store, rec: Recorder) -> None:
    offer = offer_of(worker.bid(bid(), time.monotonic()))
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
    worker.bid(bid(resources=res(4, 4096)), time.monotonic())
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
    worker.bid(bid(), time.monotonic())
    a, b = await asyncio.gather(worker.commit(commit()), worker.commit(commit()))
    assert isinstance(a, Placed)
    assert isinstance(b, Placed)
    assert a.machine_id == b.machine_id
    assert len(store.load_machines(WID)) == 1
    assert worker.ledger.committed == (2, 2048, 0, 0)


async def test_bid_after_commit_reports_the_machine(worker: Worker) -> None:
    placed = await place(worker)
    answer = worker.bid(bid(auction_id="retry"), time.monotonic())
    assert answer is not None
    offer, delay = answer
    assert isinstance(offer, Offer)
    assert offer.machine_id == placed.machine_id
    assert offer.score == placed.score
    assert delay == 0.0
    assert worker.ledger.holds == {}  # nothing held for it


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
    worker.bid(bid(), time.monotonic())
    worker.release("order-1", "auc-order-1")
    reply = await worker.commit(commit())
    assert isinstance(reply, Rejected)
    assert reply.reason == "no_hold"


async def test_commit_after_expiry(worker: Worker, store: Store, rec: Recorder) -> None:
    worker.bid(bid(), time.monotonic())
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
    worker.bid(bid(), time.monotonic())
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
    worker.bid(bid(), time.monotonic())
    worker.set_draining("maintenance")
    reply = await worker.commit(commit())
    assert reply == Rejected(
        order_id="order-1", worker_id=WID, reason="draining", detail="maintenance"
    )
    assert worker.machines == {}


async def test_commit_for_another_worker(worker: Worker) -> None:
    worker.bid(bid(), time.monotonic())
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
    other.bid(bid(), time.monotonic())
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
    assert worker.bid(bid("order-2", res(4, 1024)), time.monotonic()) is None  # 6 + 4 > 8
    await worker.transition("destroy", mid)
    assert worker.ledger.committed == ZERO
    assert worker.live_machines() == 0
    offer_of(worker.bid(bid("order-2", res(4, 1024)), time.monotonic()))


async def test_destroy_answers_waiting_bid(worker: Worker, rec: Recorder) -> None:
    mid = (await place(worker, "order-1", res(4, 1024))).machine_id
    worker.bid(bid("hold", res(4, 1024)), time.monotonic())
    worker.bid(
        bid("order-2", res(6, 1024), wait_ms=5000, auction_id="a2"), time.monotonic(), "in-2"
    )
    assert len(worker.waiting) == 0  # 8 - 4 committed < 6: cannot wait for holds alone
    worker.bid(
        bid("order-3", res(4, 1024), wait_ms=30_000, auction_id="a3"), time.monotonic(), "in"
    )
    assert len(worker.waiting) == 1
    await worker.transition("destroy", mid)
    assert [(s[0], s[1], type(s[2]).__name__) for s in rec.sent] == [("in", "a3", "Offer")]


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
    worker.bid(bid("order-b", res(1, 512)), time.monotonic())
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
    w1.bid(bid("order-d"), time.monotonic())  # a hold: forgotten by the restart

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
    before = asyncio.all_tasks()
    worker.release("order-1", "auc-order-1", abort_commit=True)
    await run_spawned(before)
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
    worker.bid(bid(), time.monotonic())
    worker.release("order-1", "auc-order-1", abort_commit=True)
    assert worker.ledger.holds == {}
    assert worker.machines == {}


async def test_abort_during_commit_undoes_it(worker: Worker, store: Store, rec: Recorder) -> None:
    worker.bid(bid(), time.monotonic())
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
