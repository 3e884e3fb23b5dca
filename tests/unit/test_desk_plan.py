"""The desk's plan of replies and its memory of auctions (supplier/desk.py): how the replies
of a bid go out (prompt answers, batched offers, each alone; docs/protocol.md §4.4.2-3),
what is still due when a post goes, and what a region release reaches (§6.6). A fake
clock, no NATS: the host only performs these (supplier/replies.py).

As in test_desk.py: workers of 8 CPUs / 8 GiB, spread preset, spread_ms 4, so a worker's
offer waits (1 - score) * 4 ms; emptier workers offer first.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from bourse.wire.limits import MAX_BATCH_OFFERS
from bourse.wire.messages import Commit, Offer, Placed
from supplier.candidates import window
from supplier.desk import TOMBSTONE_TTL_S, Answer, Plan, Post
from supplier.store import Store
from supplier.worker import Worker
from tests.unit.test_desk import Bench, bid, cfg, res


def shape(plan: Plan[Worker]) -> tuple[list[tuple[str, list[str]]], list[tuple[str, list[str]]]]:
    """(answers, posts), each post as (its shape, the kind and worker of each reply)."""

    def of(posts: list[Post[Worker]]) -> list[tuple[str, list[str]]]:
        return [
            (p.shape, [f"{type(s.reply).__name__}:{s.worker.worker_id}" for s in p.sends])
            for p in posts
        ]

    return of(plan.answers), of(plan.posts)


def three(store: Store) -> Bench:
    """w2 the biggest (so the emptiest after the bid: it offers first), then w1, then w0."""
    return Bench(
        store, *(cfg(f"w{i}", cpus=8 * (i + 1), memory_mb=8192 * (i + 1)) for i in range(3))
    )


# (the bid's flags, the plan's answers and posts): three workers offer
PLANS: dict[str, tuple[dict[str, Any], Any]] = {
    "each offer alone, best first": (
        {},
        ([], [("one", ["Offer:w2"]), ("one", ["Offer:w1"]), ("one", ["Offer:w0"])]),
    ),
    "batched: one Offers at the best delay": (
        {"batch_offers": True},
        ([], [("offers", ["Offer:w2", "Offer:w1", "Offer:w0"])]),
    ),
    "prompt: one answer at once": (
        {"batch_offers": True, "prompt_offers": True},
        ([("answer", ["Offer:w2", "Offer:w1", "Offer:w0"])], []),
    ),
    "prompt without batched offers is not prompt": (
        {"prompt_offers": True},
        ([], [("one", ["Offer:w2"]), ("one", ["Offer:w1"]), ("one", ["Offer:w0"])]),
    ),
}


@pytest.mark.parametrize(("flags", "expect"), PLANS.values(), ids=PLANS.keys())
def test_how_offers_go_out(store: Store, flags: dict[str, Any], expect: Any) -> None:
    bench = three(store)
    b = bid(**flags)
    ans = bench.answer(b)
    plan = bench.desk.plan(b, "in", ans)
    assert shape(plan) == expect
    first = (plan.answers or plan.posts)[0]
    assert first.delay_s == (0.0 if plan.answers else ans.replies[0].delay_s)
    assert (first.inbox, first.auction_id) == ("in", "a-o1")


@pytest.mark.parametrize("flags", [{"batch_offers": True}, {}])
def test_a_lone_offer_goes_alone(store: Store, flags: dict[str, Any]) -> None:
    bench = Bench(store, cfg("w1"))
    b = bid(**flags)
    assert shape(bench.desk.plan(b, "in", bench.answer(b))) == ([], [("one", ["Offer:w1"])])


def test_batched_offers_go_in_messages_of_at_most_max_batch_offers(store: Store) -> None:
    workers = [cfg(f"w{i:03d}") for i in range(MAX_BATCH_OFFERS + 1)]
    bench = Bench(store, *workers, max_offers=0, quote_sample=0)  # every one offers
    b = bid(batch_offers=True)
    plan = bench.desk.plan(b, "in", bench.answer(b))
    assert [(p.shape, len(p.sends)) for p in plan.posts] == [
        ("offers", MAX_BATCH_OFFERS),
        ("offers", 1),
    ]


def test_a_prompt_bid_is_answered_even_with_nothing(store: Store) -> None:
    """Nothing fits, or only a Waiting note: the process still answers at once (empty), so
    the auction need not wait for it; a Waiting note goes alone."""
    bench = Bench(store, cfg("w1"))
    b = bid("o1", res(9, 1024), batch_offers=True, prompt_offers=True)
    assert shape(bench.desk.plan(b, "in", bench.answer(b))) == ([("answer", [])], [])
    bench.answer(bid("big", res(8, 1024)))
    b = bid("o2", batch_offers=True, prompt_offers=True, wait_ms=1000)
    plan = bench.desk.plan(b, "in", bench.answer(b))
    assert shape(plan) == ([("answer", [])], [("one", ["Waiting:w1"])])
    assert bench.desk.due(plan.answers[0]) == []  # empty, and it goes all the same


def test_late_replies_to_waiting_bids_go_first(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    bench.answer(bid("big", res(8, 1024), auction_id="run-1"))
    bench.answer(bid("o2", wait_ms=5000, batch_offers=True, prompt_offers=True), inbox="in-2")
    b = bid("big", res(8, 1024), auction_id="run-2", exclude_workers=["w1"])
    plan = bench.desk.plan(b, "in", bench.answer(b))  # the re-bid's drop answers o2 first
    assert shape(plan) == ([], [("answer", ["Offer:w1"])])
    [late] = plan.posts
    assert (late.inbox, late.delay_s, late.sends[0].delay_s > 0) == ("in-2", 0.0, True)


def test_a_posts_released_offer_is_no_longer_due(store: Store) -> None:
    bench = three(store)
    b = bid(batch_offers=True)
    [post] = bench.desk.plan(b, "in", bench.answer(b)).posts
    bench["w1"].release("o1", "a-o1")
    assert [s.worker.worker_id for s in bench.desk.due(post) or []] == ["w2", "w0"]
    for w in ("w2", "w0"):
        bench[w].release("o1", "a-o1")
    assert bench.desk.due(post) is None  # nothing goes


# -- what the desk remembers of its process's auctions -------------------------------------------


def test_a_bid_released_before_it_came_is_ignored(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    b = bid(batch_offers=True, prompt_offers=True)
    bench.desk.release("o1", "a-o1", bench.now, bench.group.workers)
    ans = bench.answer(b)
    assert ans == Answer(ignored=True)
    assert bench.desk.plan(b, "in", ans) == Plan()  # not even a prompt answer
    assert bench["w1"].ledger.holds == {}
    bench.desk.forget(bench.now + TOMBSTONE_TTL_S + 0.001)
    assert bench.answer(b).replies  # forgotten: a bid of that auction is answered again


def test_a_release_reaches_the_workers_its_auction_asked(store: Store) -> None:
    bench = Bench(store, cfg("w1"), cfg("w2", cpus=2), max_offers=1)
    bench.answer(bid("o1"))  # w1 holds (the emptier)
    bench.answer(bid("o2", exclude_workers=["w1"]))  # w2 holds all it has
    bench.answer(bid("o3", res(2, 1024), wait_ms=5000, exclude_workers=["w1"]), inbox="in-3")
    assert list(bench.desk.asked) == [("o1", "a-o1"), ("o2", "a-o2"), ("o3", "a-o3")]
    bench.desk.release("o3", "a-o3", bench.now, bench.group.workers)
    assert (len(bench["w2"].waiting), ("o3", "a-o3") in bench.desk.asked) == (0, False)
    bench.desk.release("o1", "a-o1", bench.now, bench.group.workers)
    assert (bench["w1"].ledger.holds, list(bench["w2"].ledger.holds)) == ({}, ["o2"])


def test_a_release_of_any_auction_reaches_every_worker_of_the_region(store: Store) -> None:
    bench = Bench(store, cfg("w1"), cfg("w2"), max_offers=0)
    bench.answer(bid("o1"))
    bench.desk.release("o1", "", bench.now, bench.group.workers)
    assert [w.ledger.holds for w in bench.group.workers] == [{}, {}]


def test_the_workers_asked_are_forgotten_once_no_hold_of_theirs_can_live(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    bench.answer(bid("o1"))
    bench.desk.forget(bench.now + 59.9)
    assert list(bench.desk.asked) == [("o1", "a-o1")]
    bench.desk.forget(bench.now + 60.001)  # MAX_HOLD_MS: the longest hold any bid may ask
    assert not bench.desk.asked


async def test_a_retry_is_priced_on_the_worker_that_placed_the_order(store: Store) -> None:
    """In a big group a bid is priced on a sample; the worker with the order's machine may
    be outside it: the desk remembers who placed it (Desk.placed) and prices that one too."""
    bench = Bench(store, *(cfg(f"w{i:02d}") for i in range(40)), max_offers=1, quote_sample=2)
    sampled = [w.worker_id for w in window(bench.group.workers, zlib.crc32(b"o1") >> 8, 2)]
    [send] = bench.answer(bid("o1", exclude_workers=sampled)).replies  # placed elsewhere
    owner = send.worker
    c = Commit(order_id="o1", worker_id=owner.worker_id, resources=res(), image="web")
    placed = await owner.commits.commit(c)
    assert isinstance(placed, Placed) and owner.worker_id not in sampled
    bench.desk.placed("o1", owner)
    ans = bench.answer(bid("o1", auction_id="retry"))
    existing = [r for r in ans.replies if isinstance(r.reply, Offer) and r.reply.machine_id]
    assert [r.worker.worker_id for r in existing] == [owner.worker_id]
