"""The supplier's desk (supplier/desk.py): every outcome of answering a bid (docs/protocol.md
§6.2) and of holds and waiting bids (§6.3), on a fake clock, no NATS, no sleep.

The seats are real workers (a real store in a temp dir), as production runs them. Each
worker sells 8 CPUs / 8 GiB; pricing is the spread preset (f(u) = 1 - u) with image_weight
0.3 and spread_ms 4: score = 0.7 * utility + 0.3 * cached, delay = (1 - score) * 4 ms.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from bourse.wire.messages import Amount, Bid, Commit, Offer, Placed, Resources, Waiting
from supplier.candidates import BidGroup
from supplier.config import DEFAULT_MAX_HOLD_MS, WorkerConfig
from supplier.desk import OUTRANKED, Answer, Desk, Send
from supplier.feasible import (
    BLOCKED,
    CANNOT_RUN,
    COMMITTING,
    CONSTRAINT_MISMATCH,
    DRAINING,
    EXCLUDED,
    INSUFFICIENT,
    RECLAIMING,
)
from supplier.status import worker_status
from supplier.store import Store
from supplier.worker import Worker

WALL_MS = 1_700_000_000_000  # the fake wall clock, in ms


def cfg(worker_id: str, cpus: int = 8, memory_mb: int = 8192, **extra: Any) -> WorkerConfig:
    raw = {
        "worker_id": worker_id,
        "region": "mad",
        "capacity": {"cpus": cpus, "memory_mb": memory_mb},
        "labels": {"disk": "ssd"},
        **extra,
    }
    return msgspec.convert(raw, WorkerConfig)


def res(cpus: int = 2, memory_mb: int = 2048) -> Resources:
    return Resources(cpus=cpus, memory_mb=memory_mb)


def bid(order_id: str = "o1", resources: Resources | None = None, **kw: Any) -> Bid:
    kwargs: dict[str, Any] = {
        "order_id": order_id,
        "region": "mad",
        "resources": resources or res(),
        "image": "web",
        "hold_ms": 1000,
        "auction_id": f"a-{order_id}",
    }
    kwargs.update(kw)
    return Bid(**kwargs)


class Bench:
    """One supplier process's workers and desk, driven as the host drives them, on a fake
    clock; ``sent`` collects what capacity changes outside a bid sent (late replies).

    The clock starts at a real monotonic reading because a commit (real worker code)
    expires holds on the real clock; after that, only the tests move it."""

    def __init__(
        self, store: Store, *configs: WorkerConfig, max_offers: int = 3, quote_sample: int = 8
    ) -> None:
        self.t0 = self.now = time.monotonic()
        self.desk: Desk[Worker] = Desk(max_offers, quote_sample, wall_ms=lambda: WALL_MS)
        self.sent: list[Send[Worker]] = []
        self.workers = {
            c.worker_id: Worker(c, store, lambda e: None, on_freed=self._freed, on_grew=self._grew)
            for c in configs
        }
        self.group: BidGroup[Worker] = BidGroup(list(self.workers.values()))
        for w in self.group.workers:
            for image in w.images:
                self.group.image_changed(w, image, True)

    def _freed(self, w: Worker) -> None:
        self.sent += self.desk.freed(w, self.now)

    def _grew(self, w: Worker) -> None:
        self.sent += self.desk.withdraw_hopeless(w)

    def __getitem__(self, worker_id: str) -> Worker:
        return self.workers[worker_id]

    def answer(self, b: Bid, inbox: str = "in") -> Answer[Worker]:
        return self.desk.answer(b, inbox, self.now, self.group)

    async def place(self, order_id: str, resources: Resources | None = None) -> Placed:
        """Bid and commit through the real worker; the Placed."""
        ans = self.answer(bid(order_id, resources))
        [reply] = ans.replies
        w = reply.worker
        c = Commit(
            order_id=order_id, worker_id=w.worker_id, resources=resources or res(), image="web"
        )
        placed = await w.commits.commit(c)
        assert isinstance(placed, Placed)
        self.desk.placed(order_id, w)
        return placed


def offers(ans: Answer[Worker]) -> list[tuple[str, Offer]]:
    out = []
    for r in ans.replies:
        assert isinstance(r.reply, Offer)
        out.append((r.worker.worker_id, r.reply))
    return out


# -- §6.2: one worker, every outcome --------------------------------------------------------------


def test_a_fitting_worker_holds_and_offers_after_its_score_delay(store: Store) -> None:
    bench = Bench(store, cfg("w1", images=["web"]))
    ans = bench.answer(bid(hold_ms=250))
    [send] = ans.replies
    # u = 2/8 and 2048/8192 -> 0.75 each -> utility 0.75; score 0.7 * 0.75 + 0.3 = 0.825
    assert send.reply == Offer(
        order_id="o1",
        worker_id="w1",
        region="mad",
        score=0.825,
        subscores={"cpus": 0.75, "memory_mb": 0.75, "utility": 0.75, "image": 1.0},
        image_cached=True,
        hold_expires_at_ms=WALL_MS + 250,
        auction_id="a-o1",
    )
    assert (send.inbox, send.auction_id) == ("in", "a-o1")
    assert send.delay_s == pytest.approx((1 - 0.825) * 4.0 / 1000.0, abs=1e-12)
    h = bench["w1"].ledger.holds["o1"]
    assert (h.want, h.expires_at, h.auction_id, h.score) == (
        (2000, 2048, 0, 0, 0),  # CPU in millicores
        bench.t0 + 0.25,
        "a-o1",
        0.825,
    )
    assert (ans.silent, ans.late, ans.expired) == ({}, [], [])
    assert bench.desk.still_due(send)


# (the bid's hold_ms, the worker's max_hold_ms config) -> how long the hold lasts
@pytest.mark.parametrize(
    ("hold_ms", "max_hold_ms", "held_ms"),
    [
        (60_000, None, DEFAULT_MAX_HOLD_MS),  # the attack: a minute, capped at the default
        (5_001, None, 5_000),
        (5_000, None, 5_000),
        (750, None, 750),  # the auction's default ask is under the cap
        (60_000, 1_000, 1_000),  # the worker's own cap
        (999, 1_000, 999),
        (60_000, 60_000, 60_000),  # a worker may allow the protocol's maximum
    ],
)
def test_a_hold_lasts_at_most_the_workers_max_hold_ms(
    store: Store, hold_ms: int, max_hold_ms: int | None, held_ms: int
) -> None:
    extra = {} if max_hold_ms is None else {"max_hold_ms": max_hold_ms}
    bench = Bench(store, cfg("w1", **extra))
    [send] = bench.answer(bid(hold_ms=hold_ms)).replies
    assert isinstance(send.reply, Offer)
    assert send.reply.hold_expires_at_ms == WALL_MS + held_ms  # the Offer tells the cap
    assert bench["w1"].ledger.holds["o1"].expires_at == pytest.approx(bench.t0 + held_ms / 1000)
    # past the cap the capacity is free again for the next bid, whatever the bid asked
    bench.now = bench.t0 + held_ms / 1000 + 0.001
    ans = bench.answer(bid("o2", res(cpus=8, memory_mb=8192)))
    assert [w for w, _ in offers(ans)] == ["w1"]
    assert [h.order_id for _, hs in ans.expired for h in hs] == ["o1"]


def test_a_waiting_bid_answered_later_is_capped_too(store: Store) -> None:
    bench = Bench(store, cfg("w1", cpus=2, memory_mb=2048, max_hold_ms=300))
    bench.answer(bid("o1"))  # holds all of w1 (300 ms)
    ans = bench.answer(bid("o2", hold_ms=60_000, wait_ms=10_000))
    assert [type(r.reply).__name__ for r in ans.replies] == ["Waiting"]
    bench.now = bench.t0 + 0.301
    bench["w1"].expire_holds(bench.now)  # o1's hold lapses: o2 is answered
    [late] = bench.sent
    assert isinstance(late.reply, Offer) and late.reply.hold_expires_at_ms == WALL_MS + 300


def test_an_uncached_image_earns_no_image_bonus(store: Store) -> None:
    [(_, offer)] = offers(Bench(store, cfg("w1")).answer(bid()))
    assert (offer.score, offer.image_cached) == (0.525, False)  # 0.7 * 0.75


@pytest.mark.parametrize(
    ("worker", "kw", "reason"),
    [
        ({"draining": True}, {}, DRAINING),
        ({}, {"exclude_workers": ["w2", "w1"]}, EXCLUDED),
        ({}, {"constraints": {"disk": "hdd"}}, CONSTRAINT_MISMATCH),
        ({}, {"constraints": {"gpu": "a100"}}, CONSTRAINT_MISMATCH),
        ({}, {"resources": res(9, 1024)}, INSUFFICIENT),  # more than the capacity
        ({"driver": "process", "catalog": {"db": {"command": ["x"]}}}, {}, CANNOT_RUN),
        ({"driver": "process", "catalog": {"web": {}}}, {}, CANNOT_RUN),  # no command
        # a tenant's order (its id scoped) where machines are not isolated (docs/protocol.md
        # §6.8e: supplier run --tenant-images isolated, the default)
        (
            {"driver": "process", "catalog": {"web": {"command": ["x"]}}, "isolate": "off"},
            {"order_id": "alice:o1"},
            CANNOT_RUN,
        ),
    ],
)
def test_a_worker_that_cannot_take_the_bid_is_silent_with_its_reason(
    store: Store, worker: dict[str, Any], kw: dict[str, Any], reason: str
) -> None:
    bench = Bench(store, cfg("w1", **worker))
    ans = bench.answer(bid(wait_ms=1000, **kw))
    assert (ans.replies, ans.silent) == ([], {"w1": reason})
    assert bench["w1"].ledger.holds == {}
    assert len(bench["w1"].waiting) == 0


@pytest.mark.parametrize("make_it_unable", ["drain", "fill"])
async def test_an_existing_machine_is_offered_at_once_without_a_hold(
    store: Store, make_it_unable: str
) -> None:
    bench = Bench(store, cfg("w1", images=["web"]))
    placed = await bench.place("o1")
    w = bench["w1"]
    if make_it_unable == "drain":
        w.set_draining("maintenance")
    else:
        await bench.place("filler", res(6, 6144))
    ans = bench.answer(bid("o1", auction_id="retry"))
    [send] = ans.replies
    assert send.reply == Offer(
        order_id="o1",
        worker_id="w1",
        region="mad",
        score=placed.score,
        image_cached=True,
        machine_id=placed.machine_id,
        auction_id="retry",
    )
    assert (send.delay_s, send.inbox) == (0.0, "in")
    assert w.ledger.holds == {}
    assert bench.desk.still_due(send)


async def test_an_existing_machine_being_reclaimed_is_offered_to_nobody(store: Store) -> None:
    """While the worker asks whether the machine is an orphan (§5.3d) its verdict may be
    "orphan": no auction gets it, and no fresh hold is made for the order either."""
    bench = Bench(store, cfg("w1", images=["web"]))
    placed = await bench.place("o1")
    w = bench["w1"]
    m = w.machines[placed.machine_id]
    assert w.reclaims.due([m], m.created_at_ms + w.reclaims.after_ms) == [m]
    ans = bench.answer(bid("o1", auction_id="retry"))
    assert (ans.replies, ans.silent, w.ledger.holds) == ([], {"w1": RECLAIMING}, {})
    assert "o1" not in w.commits.given
    w.reclaims.done(m.machine_id)  # settled "keep": handed out again
    [send] = bench.answer(bid("o1", auction_id="retry")).replies
    assert isinstance(send.reply, Offer) and send.reply.machine_id == placed.machine_id
    assert "o1" in w.commits.given  # from now on no abort of its first auction undoes it


def test_a_rebid_replaces_the_earlier_hold(store: Store) -> None:
    bench = Bench(store, cfg("w1", images=["web"]))
    [first] = bench.answer(bid()).replies
    [second] = bench.answer(bid(resources=res(3, 1024), auction_id="a-2")).replies
    w = bench["w1"]
    assert list(w.ledger.holds) == ["o1"]
    assert (w.ledger.holds["o1"].auction_id, w.ledger.held) == ("a-2", (3000, 1024, 0, 0, 0))
    # priced against an empty worker, as the first: utility (0.625 + 0.875) / 2 = 0.75
    assert first.reply.score == second.reply.score == 0.825  # type: ignore[union-attr]  # Offers
    assert not bench.desk.still_due(first)  # due later: the first auction's offer is dropped
    assert bench.desk.still_due(second)


async def test_a_duplicates_bid_keeps_the_hold_it_took_the_place_of(store: Store) -> None:
    """Two auctions of one order (duplicates sent at once, the claim's create beside the
    bid, protocol §5.3c): the loser's bid takes the place of the winner's hold, and its
    release puts the winner's back, so the winner's commit finds it."""
    bench = Bench(store, cfg("w1", images=["web"]))
    bench.answer(bid(auction_id="winner"))
    bench.answer(bid(auction_id="loser"))
    w = bench["w1"]
    assert w.ledger.holds["o1"].auction_id == "loser"
    w.release("o1", "loser")
    assert w.ledger.holds["o1"].auction_id == "winner"
    assert w.ledger.held == (2000, 2048, 0, 0, 0)
    assert bench.sent == []  # nothing was freed: no waiting bid was told otherwise
    c = Commit(order_id="o1", worker_id="w1", resources=res(), image="web", auction_id="winner")
    assert isinstance(await w.commits.commit(c), Placed)


def test_a_bid_that_holds_elsewhere_puts_another_auctions_hold_back(store: Store) -> None:
    bench = Bench(store, cfg("w1", images=["web"]), cfg("w2"), max_offers=1)
    [first] = bench.answer(bid(auction_id="winner")).replies
    assert first.worker.worker_id == "w1"
    [second] = bench.answer(bid(auction_id="loser", exclude_workers=["w1"])).replies
    assert second.worker.worker_id == "w2"
    assert bench["w1"].ledger.holds["o1"].auction_id == "winner"  # dropped, then put back
    assert bench["w1"].ledger.held == (2000, 2048, 0, 0, 0)


def test_bids_for_different_orders_stack(store: Store) -> None:
    bench = Bench(store, cfg("w1", images=["web"]))
    bench.answer(bid("o1"))
    [(_, second)] = offers(bench.answer(bid("o2")))
    assert bench["w1"].ledger.held == (4000, 4096, 0, 0, 0)
    assert second.score == 0.65  # u = 4/8 -> utility 0.5 -> 0.35 + 0.3


def test_a_commit_under_way_keeps_the_worker_silent(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    bench.answer(bid())
    bench["w1"].ledger.holds["o1"].committing = True  # as CommitDesk.commit pins it
    ans = bench.answer(bid(auction_id="a-retry"))
    assert (ans.replies, ans.silent) == ([], {"w1": COMMITTING})
    assert bench["w1"].ledger.holds["o1"].auction_id == "a-o1"  # untouched


def test_expired_holds_are_dropped_and_returned_to_announce(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    bench.answer(bid("old", res(8, 1024), hold_ms=100))
    bench.now = bench.t0 + 0.1
    ans = bench.answer(bid("new", res(8, 1024)))
    assert [(w.worker_id, [h.order_id for h in hs]) for w, hs in ans.expired] == [("w1", ["old"])]
    assert [w for w, _ in offers(ans)] == ["w1"]
    assert list(bench["w1"].ledger.holds) == ["new"]


# -- §6.3: waiting bids ---------------------------------------------------------------------------


def test_blocked_only_by_holds_waits_then_offers_when_the_hold_goes(store: Store) -> None:
    bench = Bench(store, cfg("w1", images=["web"]))
    bench.answer(bid("big", res(8, 1024)))
    ans = bench.answer(bid("o2", res(4, 4096), wait_ms=5000), inbox="in-2")
    assert [s.reply for s in ans.replies] == [
        Waiting(order_id="o2", worker_id="w1", region="mad", wait_ms=5000)
    ]
    assert (ans.replies[0].delay_s, ans.silent) == (0.0, {})
    assert "o2" not in bench["w1"].ledger.holds
    bench.now += 0.5
    bench["w1"].release("big", "a-big")
    [late] = bench.sent
    assert (late.inbox, late.auction_id) == ("in-2", "a-o2")
    assert isinstance(late.reply, Offer)
    assert late.reply.score == 0.65  # priced after the release: u = 4/8 -> 0.35 + 0.3
    assert late.delay_s == pytest.approx(0.35 * 4.0 / 1000.0, abs=1e-12)
    assert bench["w1"].ledger.holds["o2"].expires_at == bench.t0 + 0.5 + 1.0
    assert len(bench["w1"].waiting) == 0


@pytest.mark.parametrize(
    ("kw", "inbox"),
    [({"wait_ms": 0}, "in"), ({"wait_ms": 1000}, "")],  # not allowed to wait; nobody to tell
)
def test_blocked_by_holds_without_waiting_is_silent(
    store: Store, kw: dict[str, Any], inbox: str
) -> None:
    bench = Bench(store, cfg("w1"))
    bench.answer(bid("big", res(8, 1024)))
    ans = bench.answer(bid("o2", **kw), inbox=inbox)
    assert (ans.replies, ans.silent) == ([], {"w1": BLOCKED})
    assert len(bench["w1"].waiting) == 0


def test_a_full_waiting_queue_keeps_the_bid_silent(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    bench.desk.max_waiting = 1
    bench.answer(bid("big", res(8, 1024)))
    assert bench.answer(bid("o2", wait_ms=1000)).replies
    ans = bench.answer(bid("o3", wait_ms=1000))
    assert (ans.replies, ans.silent) == ([], {"w1": BLOCKED})


def test_blocked_by_committed_machines_does_not_wait(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    bench["w1"].ledger.load_committed((7000, 0, 0, 0, 0))  # 7 CPUs, in millicores
    ans = bench.answer(bid(wait_ms=1000))
    assert (ans.replies, ans.silent) == ([], {"w1": INSUFFICIENT})


async def test_a_waiting_bid_is_withdrawn_when_committed_machines_take_the_capacity(
    store: Store,
) -> None:
    bench = Bench(store, cfg("w1"))
    bench.answer(bid("big", res(6, 1024)))
    bench.answer(bid("o2", res(4, 1024), wait_ms=5000), inbox="in-2")
    placed = await bench["w1"].commits.commit(
        Commit(order_id="big", worker_id="w1", resources=res(6, 1024), image="web")
    )
    assert isinstance(placed, Placed)
    # 8 - 6 committed < 4: the bid can never fit here, so the worker says so at once
    assert [(s.inbox, s.auction_id, s.reply, s.delay_s) for s in bench.sent] == [
        ("in-2", "a-o2", Waiting(order_id="o2", worker_id="w1", region="mad", wait_ms=0), 0.0)
    ]
    assert len(bench["w1"].waiting) == 0


def test_a_waiting_bid_is_answered_when_the_blocking_hold_expires(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    bench.answer(bid("big", res(8, 1024), hold_ms=100))
    bench.answer(bid("o2", wait_ms=30_000), inbox="in-2")
    bench.now = bench.t0 + 0.1
    bench["w1"].expire_holds(bench.now)  # the sweep
    assert [(s.inbox, type(s.reply).__name__) for s in bench.sent] == [("in-2", "Offer")]


@pytest.mark.parametrize("how", ["released", "expired", "expired on a bid"])
def test_a_waiting_bid_is_answered_when_a_bigger_replacing_hold_gives_way(
    store: Store, how: str
) -> None:
    """One order id bid twice with different resources (reused ids, no claims): the second
    auction's 8-CPU hold keeps the first's 2-CPU hold as replaced. When it goes, the first
    comes back (nothing to announce), and the 6 CPUs between them are free again."""
    bench = Bench(store, cfg("w1"))
    bench.answer(bid("o1", res(2, 1024), auction_id="first", hold_ms=1000))
    bench.answer(bid("o1", res(8, 1024), auction_id="second", hold_ms=100))
    w = bench["w1"]
    assert (w.ledger.holds["o1"].auction_id, w.ledger.held[0]) == ("second", 8000)
    [waiting] = bench.answer(bid("o2", res(4, 1024), wait_ms=30_000), inbox="in-2").replies
    assert isinstance(waiting.reply, Waiting)
    if how == "released":
        w.release("o1", "second")
    elif how == "expired":
        bench.now = bench.t0 + 0.1
        w.expire_holds(bench.now)  # the sweep
    else:  # a bid for another order expires the worker's holds before pricing it
        bench.now = bench.t0 + 0.1
        bench.sent += bench.answer(bid("o3", res(1, 512)), inbox="in-3").late
    assert (w.ledger.holds["o1"].auction_id, w.ledger.holds["o2"].want[0]) == ("first", 4000)
    assert [(s.inbox, type(s.reply).__name__) for s in bench.sent] == [("in-2", "Offer")]


def test_a_waiting_bid_past_its_wait_is_dropped_silently(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    bench.answer(bid("big", res(8, 1024)))
    bench.answer(bid("o2", wait_ms=100))
    bench.now = bench.t0 + 0.1
    bench["w1"].release("big", "a-big")
    assert bench.sent == []
    assert len(bench["w1"].waiting) == 0


def test_a_release_drops_the_waiting_bid(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    bench.answer(bid("big", res(8, 1024)))
    bench.answer(bid("o2", wait_ms=5000))
    bench["w1"].release("o2", "a-o2")
    assert len(bench["w1"].waiting) == 0
    bench["w1"].release("big", "a-big")
    assert bench.sent == []


def test_a_rebid_that_drops_its_hold_answers_a_waiting_bid_first(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    bench.answer(bid("big", res(8, 1024), auction_id="run-1"))
    bench.answer(bid("o2", wait_ms=5000), inbox="in-2")
    # a retry of "big" that excludes this worker: its old hold goes, the waiting bid takes it
    ans = bench.answer(bid("big", res(8, 1024), auction_id="run-2", exclude_workers=["w1"]))
    assert (ans.replies, ans.silent) == ([], {"w1": EXCLUDED})
    assert [(s.inbox, type(s.reply).__name__) for s in ans.late] == [("in-2", "Offer")]
    assert list(bench["w1"].ledger.holds) == ["o2"]


async def test_a_destroyed_machine_answers_a_waiting_bid(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    mid = (await bench.place("o1", res(4, 1024))).machine_id
    bench.answer(bid("hold", res(4, 1024)))
    # 8 - 4 committed < 6: it cannot wait for holds alone
    assert bench.answer(bid("o2", res(6, 1024), wait_ms=5000)).silent == {"w1": INSUFFICIENT}
    assert bench.answer(bid("o3", res(4, 1024), wait_ms=30_000), inbox="in-3").replies
    await bench["w1"].transition("destroy", mid)
    assert [(s.inbox, type(s.reply).__name__) for s in bench.sent] == [("in-3", "Offer")]


# -- across the workers of one process ----------------------------------------------------------


def test_max_offers_keeps_only_the_best(store: Store) -> None:
    # emptier workers score higher under spread: w4 (64 cpus) best, w0 (8 cpus) worst
    configs = [cfg(f"w{i}", cpus=8 + 14 * i, memory_mb=8192) for i in range(5)]
    bench = Bench(store, *configs, max_offers=2)
    ans = bench.answer(bid())
    assert [w for w, _ in offers(ans)] == ["w4", "w3"]  # best first (shorter delay)
    assert ans.replies[0].delay_s < ans.replies[1].delay_s
    assert ans.silent == {"w0": OUTRANKED, "w1": OUTRANKED, "w2": OUTRANKED}
    assert [w.worker_id for w in bench.group.workers if w.ledger.holds] == ["w3", "w4"]


def test_max_offers_0_offers_every_fitting_worker(store: Store) -> None:
    bench = Bench(store, *(cfg(f"w{i}") for i in range(5)), max_offers=0)
    assert len(bench.answer(bid()).replies) == 5


def test_nobody_waits_when_another_worker_offers_at_once(store: Store) -> None:
    bench = Bench(store, cfg("w1", cpus=2), cfg("w2", cpus=2))
    bench.answer(bid("o1", exclude_workers=["w2"]))  # holds all of w1
    ans = bench.answer(bid("o2", wait_ms=1000))
    assert [w for w, _ in offers(ans)] == ["w2"]
    assert ans.silent == {"w1": BLOCKED}
    assert len(bench["w1"].waiting) == 0


async def test_an_existing_machine_offer_goes_out_beside_the_best_quotes(store: Store) -> None:
    bench = Bench(store, cfg("w1"), cfg("w2"), max_offers=1)
    placed = await bench.place("o1")
    ans = bench.answer(bid("o1", auction_id="retry"))
    first = offers(ans)[0]
    assert (first[0], first[1].machine_id) == (placed.worker_id, placed.machine_id)
    assert len(ans.replies) == 2  # and the best fresh quote (the other worker)


def test_a_big_group_prices_a_sample(store: Store) -> None:
    configs = [cfg(f"w{i:02d}", images=["web"] if i == 37 else []) for i in range(40)]
    bench = Bench(store, *configs, max_offers=0, quote_sample=2)
    ans = bench.answer(bid())
    asked = {w for w, _ in offers(ans)} | set(ans.silent)
    assert "w37" in asked  # the only holder of the image is always priced
    assert len(asked) <= 4  # 2 image holders + 2 at random, not 40
    assert offers(ans)[0][0] == "w37"  # and it is the best


def test_a_sample_that_cannot_offer_falls_back_to_every_worker(store: Store) -> None:
    configs = [cfg(f"s{i:02d}", cpus=1) for i in range(39)] + [cfg("big", cpus=16)]
    bench = Bench(store, *configs, quote_sample=2)
    ans = bench.answer(bid(resources=res(4, 1024)))
    assert [w for w, _ in offers(ans)] == ["big"]
    assert ans.silent == {f"s{i:02d}": INSUFFICIENT for i in range(39)}


def test_a_released_hold_makes_its_delayed_offer_stale(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    [send] = bench.answer(bid()).replies
    bench["w1"].release("o1", "a-o1")
    assert not bench.desk.still_due(send)


# -- fractional CPUs -----------------------------------------------------------------------------


def half(memory_mb: int = 256) -> Resources:
    return Resources(cpus=1, cpu_millis=500, memory_mb=memory_mb)


def test_half_cpu_bids_share_one_cpu_and_a_third_stays_silent(store: Store) -> None:
    bench = Bench(store, cfg("w1", cpus=1, memory_mb=1024))
    [a] = offers(bench.answer(bid("o1", half())))
    # u_cpus = 0.5 -> 0.5, u_mem = 256/1024 -> 0.75: utility 0.625, score 0.7 * 0.625
    assert a[1].subscores == {"cpus": 0.5, "memory_mb": 0.75, "utility": 0.625, "image": 0.0}
    assert a[1].score == 0.4375
    assert offers(bench.answer(bid("o2", half())))
    assert bench["w1"].ledger.held == (1000, 512, 0, 0, 0)
    ans = bench.answer(bid("o3", half()))
    assert (ans.replies, ans.silent) == ([], {"w1": BLOCKED})  # only holds: it would wait
    assert bench["w1"].ledger.held == (1000, 512, 0, 0, 0)  # I1


async def test_half_cpu_commits_count_millicores_and_status_says_them(store: Store) -> None:
    bench = Bench(store, cfg("w1", cpus=1, memory_mb=1024))
    await bench.place("o1", half())
    status = worker_status(bench["w1"])
    assert status.committed == Amount(cpus=1, cpu_millis=500, memory_mb=256)
    assert status.capacity == Amount(cpus=1, memory_mb=1024)
    await bench.place("o2", half())
    assert bench["w1"].ledger.committed == (1000, 512, 0, 0, 0)
    assert worker_status(bench["w1"]).committed == Amount(cpus=1, memory_mb=512)  # whole: as in v1
    ans = bench.answer(bid("o3", half()))
    assert (ans.replies, ans.silent) == ([], {"w1": INSUFFICIENT})
