"""The auction's pure core (bourse/auction/core.py): events in with a fake clock, the exact
decisions out. Every outcome of docs/protocol.md §5: the steps of §5.2, each row of the
step 6 commit table, §5.3 (existing machines, retries), §5.3a (sampled bidding) and the
§5.4 reasons and details. No NATS, no sleep."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

import msgspec
import pytest

from bourse.auction.content import ImageContent
from bourse.auction.core import (
    DEADLINE_BEFORE_COMMIT,
    FOLDED_MARGIN_S,
    FOREIGN_MACHINE,
    MACHINE_UNSHOWN,
    NOT_THIS_ORDER,
    Auction,
    AuctionConfig,
    AuctionStateError,
    BroadcastBid,
    CommitAnswered,
    CommitNoResponders,
    CommitOutcome,
    CommitTimedOut,
    CommitUndecodable,
    Decision,
    Finish,
    FoldedAuctions,
    Log,
    PublishAbort,
    Refuse,
    SendBid,
    SendCommit,
    VerifyMachine,
    WakeAt,
    describe,
    late_releases,
)
from bourse.wire.codec import encode
from bourse.wire.messages import (
    Bid,
    Commit,
    Error,
    Layer,
    Machine,
    Offer,
    Offers,
    Placed,
    PlaceOrder,
    Rejected,
    Release,
    Resources,
    Unfilled,
    Waiting,
)
from bourse.wire.subjects import Subjects, sampled_shards

S = Subjects("t")
T0 = 1000.0  # the fake monotonic clock at the auction's start, in seconds
AID = "01AUCTION"
ORDER = PlaceOrder(
    order_id="o1", region="mad", resources=Resources(cpus=2, memory_mb=512), image="web"
)
QUIET = 0.1  # AuctionConfig().quiet_ms, in seconds
GRACE = 0.1  # AuctionConfig().commit_grace_ms, in seconds


def ms(t: float) -> float:
    """Milliseconds since T0, as elapsed_ms is reported."""
    return round((t - T0) * 1000.0, 3)


def start(
    order: PlaceOrder = ORDER,
    config: AuctionConfig | None = None,
    *,
    trust: Any = None,
    spent_ms: float = 0.0,
) -> Auction:
    """An auction whose bid went out at T0."""
    a = Auction(
        order, config or AuctionConfig(), AID, T0, subjects=S, trust=trust, spent_ms=spent_ms
    )
    [send] = a.start()
    assert isinstance(send, SendBid)
    a.bid_published(T0)
    return a


def offer(worker: str, score: float = 0.9, **kw: Any) -> Offer:
    fields: dict[str, Any] = {"order_id": "o1", "region": "mad", **kw}
    return Offer(worker_id=worker, score=score, **fields)


def feed(a: Auction, *replies: msgspec.Struct | bytes, at: float = T0 + 0.001) -> list[Decision]:
    out: list[Decision] = []
    for r in replies:
        out += a.bid_reply(r if isinstance(r, bytes) else encode(r), at)
    return out


def result(decisions: list[Decision]) -> Placed | Unfilled:
    last = decisions[-1]
    assert isinstance(last, Finish)
    return last.result


def unfilled_log(u: Unfilled) -> Log:
    fields = {
        "reason": u.reason,
        "offers": u.offers,
        "commits_tried": u.commits_tried,
        "elapsed_ms": u.elapsed_ms,
    }
    return Log("info", "order_unfilled", fields)


def commit_of(
    worker: str, at: float, order: PlaceOrder = ORDER, *, alone: bool = False
) -> SendCommit:
    """The SendCommit for ``worker`` decided at ``at`` (default deadline 500 ms);
    ``alone``: every offer came from its process, which drops the others itself."""
    commit = Commit(
        order_id=order.order_id,
        worker_id=worker,
        resources=order.resources,
        image=order.image,
        metadata=order.metadata,
        auction_id=AID,
        release_others=alone,
    )
    timeout = T0 + order.deadline_ms / 1000 - at + GRACE
    return SendCommit(worker, S.commit(worker), commit, pytest.approx(timeout))  # type: ignore[arg-type]  # approx compares equal to the float


def worker_placed(worker: str = "w1", **kw: Any) -> Placed:
    """A worker's commit reply."""
    fields: dict[str, Any] = {
        "order_id": "o1",
        "machine_id": f"{worker}~01M80QESDH2NAZQ4Z9ASNWXSKR",
        "worker_id": worker,
        "region": "mad",
        "score": 0.9,
        "image_cached": False,
        "elapsed_ms": 1.5,
        **kw,
    }
    return Placed(**fields)


# -- §5.2 step 3: the bid -------------------------------------------------------------------


def test_the_bid_goes_to_the_region_with_derived_hold_and_wait() -> None:
    a = Auction(ORDER, AuctionConfig(), AID, T0, subjects=S)
    bid = Bid(
        order_id="o1",
        region="mad",
        resources=ORDER.resources,
        image="web",
        hold_ms=500 + 100 + 150,  # deadline + commit grace + hold margin
        auction_id=AID,
        wait_ms=400,  # 0.8 x deadline
        batch_offers=True,  # one Offers message per supplier process is welcome (§4.4.2)
        prompt_offers=True,  # answered at once, ranked by the auction (§4.4.3)
    )
    assert a.start() == [SendBid((S.bid("mad"),), bid)]
    single = Auction(ORDER, AuctionConfig(batch_offers=False), AID, T0, subjects=S)
    assert single.start() == [
        SendBid(
            (S.bid("mad"),), msgspec.structs.replace(bid, batch_offers=False, prompt_offers=False)
        )
    ]


# What the order's image resolved to where it entered (§4.3a): a digest and its layers.
DIGEST = "sha256:" + "ab" * 32
LAYERS = [
    Layer(digest="sha256:" + "01" * 32, size=1000),
    Layer(digest="sha256:" + "02" * 32, size=5),
]
CONTENT = ImageContent(DIGEST, LAYERS)


def test_the_bid_and_the_commit_carry_the_content_the_image_resolved_to() -> None:
    a = Auction(ORDER, AuctionConfig(), AID, T0, subjects=S, content=CONTENT)
    [send] = a.start()
    assert isinstance(send, SendBid)
    assert (send.bid.image, send.bid.image_digest, send.bid.layers) == ("web", DIGEST, LAYERS)
    a.bid_published(T0)
    feed(a, offer("w1"), at=T0 + 0.002)
    [commit] = a.poll(T0 + 0.002)
    assert isinstance(commit, SendCommit)
    assert (commit.commit.image, commit.commit.image_digest) == ("web", DIGEST)
    reply = worker_placed("w1", image_digest=DIGEST)
    assert result(a.commit_outcome(CommitAnswered(reply), T0 + 0.003)).image_digest == DIGEST


def test_a_catalog_image_travels_without_content() -> None:
    a = start()
    assert (a.bid.image_digest, a.bid.layers) == ("", [])
    feed(a, offer("w1"), at=T0 + 0.002)
    [commit] = a.poll(T0 + 0.002)
    assert isinstance(commit, SendCommit) and commit.commit.image_digest == ""


def test_an_existing_machine_answers_with_the_digest_it_was_placed_with() -> None:
    """The tag may have moved since: the order's machine runs what it was placed with."""
    a = Auction(ORDER, AuctionConfig(), AID, T0, subjects=S, content=CONTENT)
    a.start()
    a.bid_published(T0)
    feed(a, offer("w1", machine_id="w1~M1"), at=T0 + 0.001)
    before = "sha256:" + "cd" * 32
    placed = result(a.machine_shown(machine(image_digest=before), T0 + 0.002))
    assert isinstance(placed, Placed) and (placed.existing, placed.image_digest) == (True, before)


def test_a_sampled_bid_goes_to_the_shards_drawn_from_the_order_id() -> None:
    cfg = AuctionConfig(bid_shards=8, bid_sample=2)
    [send] = Auction(ORDER, cfg, AID, T0, subjects=S).start()
    shards = sampled_shards("o1", "web", 8, 2)
    assert isinstance(send, SendBid)
    assert send.subjects == tuple(S.bid_shard("mad", k) for k in shards)


def test_sampling_every_shard_is_a_broadcast() -> None:
    [send] = Auction(ORDER, AuctionConfig(bid_shards=2, bid_sample=2), AID, T0, subjects=S).start()
    assert isinstance(send, SendBid) and send.subjects == (S.bid("mad"),)


# -- §5.2 step 4: collecting ------------------------------------------------------------------


def test_503_from_the_region_is_no_workers_at_once() -> None:
    a = start()
    d = a.bid_reply(b"", T0 + 0.002, no_responders=True)
    u = Unfilled(
        order_id="o1",
        region="mad",
        reason="no_workers",
        offers=0,
        commits_tried=0,
        elapsed_ms=2.0,
        detail="no worker listens in 'mad'",
    )
    assert d == [unfilled_log(u), Finish(u)]


def test_503_from_every_sampled_shard_broadcasts_then_a_503_there_is_no_workers() -> None:
    a = start(config=AuctionConfig(bid_shards=8, bid_sample=2))
    assert a.bid_reply(b"", T0 + 0.001, no_responders=True) == []  # one shard of two
    assert a.bid_reply(b"", T0 + 0.001, no_responders=True) == [BroadcastBid(S.bid("mad"), a.bid)]
    a.bid_published(T0 + 0.001)
    assert a.tally.fallbacks == 1
    u = result(a.bid_reply(b"", T0 + 0.002, no_responders=True))
    assert isinstance(u, Unfilled) and u.reason == "no_workers"


def test_sampled_shards_that_stay_silent_broadcast_before_unfilled() -> None:
    a = start(config=AuctionConfig(bid_shards=8, bid_sample=2))
    assert a.poll(T0) == [WakeAt(T0 + QUIET)]
    assert a.timer(T0 + QUIET) == [BroadcastBid(S.bid("mad"), a.bid)]
    a.bid_published(T0 + QUIET)
    assert a.poll(T0 + QUIET) == [WakeAt(T0 + 2 * QUIET)]  # a new quiet window
    u = result(a.timer(T0 + 2 * QUIET))
    assert isinstance(u, Unfilled) and (u.reason, a.tally.fallbacks) == ("no_offers", 1)


def test_sampled_shards_with_offers_do_not_broadcast() -> None:
    a = start(ORDER, AuctionConfig(bid_shards=8, bid_sample=2), spent_ms=0)
    feed(a, offer("w1", 0.1), at=T0 + 0.01)  # an offer, below nothing: taken
    assert isinstance(a.poll(T0 + 0.01)[0], SendCommit)


@pytest.mark.parametrize(
    ("reply", "event", "fields"),
    [
        (
            b"{not json",
            "bad_offer",
            {"error": "malformed JSON: JSON is malformed: object keys must be strings (byte 1)"},
        ),
        (
            offer("w1", order_id="o2"),
            "foreign_offer",
            {"worker_id": "w1", "offer_region": "mad", "offer_order": "o2"},
        ),
        (
            offer("w1", region="lis"),  # I5: never taken
            "foreign_offer",
            {"worker_id": "w1", "offer_region": "lis", "offer_order": "o1"},
        ),
        (
            Waiting(order_id="o1", worker_id="w1", region="lis", wait_ms=100),
            "foreign_offer",
            {"worker_id": "w1", "offer_region": "lis", "offer_order": "o1"},
        ),
    ],
)
def test_unusable_replies_are_logged_and_ignored(
    reply: msgspec.Struct | bytes, event: str, fields: dict[str, object]
) -> None:
    a = start()
    assert feed(a, reply) == [Log("warning", event, fields)]
    assert a.tally.offers == 0
    assert a.poll(T0 + 0.001) == [WakeAt(T0 + QUIET)]  # no extension of the quiet window


def test_unverified_offers_are_dropped_counted_by_reason_and_explained() -> None:
    a = start(trust=lambda o: None if o.worker_id == "good" else "unsigned")
    d = feed(a, offer("bad", signer="UX"), offer("bad", machine_id="bad~M1"))
    assert d == [
        Log(
            "warning",
            "offer_unverified",
            {"worker_id": "bad", "reason": "unsigned", "signer": "UX"},
        ),
        Log(
            "warning",
            "offer_unverified",
            {"worker_id": "bad", "reason": "unsigned", "signer": "", "machine_id": "bad~M1"},
        ),
    ]  # not even a machine_id claim is taken
    assert a.tally.unverified == {"unsigned": 2}
    u = result(a.timer(T0 + QUIET))
    assert isinstance(u, Unfilled)
    assert (u.reason, u.offers) == ("no_offers", 0)
    assert u.detail == (
        "no worker in 'mad' can take 2 cpus + 512 MiB: 2 offer(s) failed the signature check"
    )
    trusted = start(trust=lambda o: None if o.worker_id == "good" else "unsigned")
    assert feed(trusted, offer("good")) == [] and trusted.tally.offers == 1


@pytest.mark.parametrize(
    "order",
    [
        ORDER,
        msgspec.structs.replace(ORDER, exclude_workers=["w1"]),  # I3 outranks the exclusion
        msgspec.structs.replace(ORDER, min_score=0.99),  # and min_score
        msgspec.structs.replace(ORDER, retry=True),  # and the retry's gathering
    ],
)
def test_an_existing_machine_offer_is_the_answer_once_its_worker_shows_it(
    order: PlaceOrder,
) -> None:
    a = start(order)
    existing = offer("w1", 0.4, machine_id="w1~M1", image_cached=True)
    d = feed(a, offer("w2", 0.95), existing, at=T0 + 0.003)
    # the worker is asked to show the machine (only its own user serves worker.w1.>)
    assert d == [verify(order, T0 + 0.003)]
    placed = Placed(
        order_id="o1",
        machine_id="w1~M1",
        worker_id="w1",
        region="mad",
        score=0.4,
        image_cached=True,
        elapsed_ms=4.0,
        existing=True,
    )
    assert a.machine_shown(machine(order), T0 + 0.004) == [Finish(placed)]  # no commit


def verify(order: PlaceOrder, at: float) -> VerifyMachine:
    """The ask to show w1~M1: within the order's deadline, at most verify_timeout_ms."""
    timeout = min(1.0, T0 + order.deadline_ms / 1000 - at)
    return VerifyMachine("w1", S.worker_machine("w1", "get"), "w1~M1", pytest.approx(timeout))  # type: ignore[arg-type]  # approx compares equal to the float


def machine(order: PlaceOrder = ORDER, **kw: Any) -> Machine:
    """The record worker w1 shows for machine w1~M1, placed for ``order``."""
    fields: dict[str, Any] = {
        "machine_id": "w1~M1",
        "order_id": order.order_id,
        "worker_id": "w1",
        "region": order.region,
        "state": "started",
        "resources": order.resources,
        "image": order.image,
        "metadata": order.metadata,
        **kw,
    }
    return Machine(**fields)


# (claimed machine id, the record the worker shows) -> the reason the offer is dropped
@pytest.mark.parametrize(
    ("machine_id", "shown", "reason"),
    [
        # another worker's machine: dropped at once, nothing asked
        ("w2~M1", None, FOREIGN_MACHINE),
        ("w2~01M80QESDH2NAZQ4Z9ASNWXSKR", None, FOREIGN_MACHINE),
        ("w10~M1", None, FOREIGN_MACHINE),  # a prefix of the id is not the worker
        # its own worker's id, but the worker shows nothing (Error, timeout, gone)
        ("w1~M1", "none", MACHINE_UNSHOWN),
        # ... or another machine than the one claimed
        ("w1~M1", {"machine_id": "w1~M2"}, MACHINE_UNSHOWN),
        # ... or a machine of another order
        ("w1~M1", {"order_id": "victim"}, NOT_THIS_ORDER),
    ],
)
def test_an_existing_machine_offer_not_its_workers_or_not_this_orders_is_dropped(
    machine_id: str, shown: Any, reason: str
) -> None:
    a = start()
    claim = offer("w1", 0.99, machine_id=machine_id)
    d = feed(a, claim)
    if shown is not None:
        assert d == [verify(ORDER, T0 + 0.001)]
        record = None if shown == "none" else machine(**shown)
        d = a.machine_shown(record, T0 + 0.002)
    fields = {"worker_id": "w1", "reason": reason, "signer": "", "machine_id": machine_id}
    assert d == [Log("warning", "offer_unverified", fields)]
    assert a.tally.unverified == {reason: 1} and a.tally.offers == 0
    # the auction goes on: an honest offer is committed
    assert feed(a, offer("w3", 0.5)) == [] and a.tally.offers == 1
    [commit] = a.poll(T0 + 0.003)
    assert isinstance(commit, SendCommit) and commit.worker_id == "w3"
    # alone, the dropped claim leaves the order unfilled, and the detail says why
    lone = start()
    feed(lone, claim)
    if shown is not None:
        lone.machine_shown(None if shown == "none" else machine(**shown), T0 + 0.002)
    unfilled = result(lone.timer(T0 + QUIET))
    assert isinstance(unfilled, Unfilled) and unfilled.reason == "no_offers"
    assert unfilled.detail == (
        "no worker in 'mad' can take 2 cpus + 512 MiB: 1 offer(s) failed the ownership check "
        "(1 claimed a machine not theirs)"
    )


# what the reused order id asks for -> the mismatch the refusal names
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"image": "db"}, "image 'web', not 'db'"),
        ({"resources": Resources(cpus=4, memory_mb=512)}, "2 cpus + 512 MiB, not 4 cpus + 512 MiB"),
        ({"metadata": {"team": "x"}}, "other metadata"),
        (
            {"resources": Resources(cpus=1, cpu_millis=500, memory_mb=512)},
            "2 cpus + 512 MiB, not 0.5 cpus + 512 MiB",
        ),
        (
            {"image": "db", "resources": Resources(cpus=2, memory_mb=512, gpus=1)},
            "2 cpus + 512 MiB, not 2 cpus + 512 MiB + 1 gpus; image 'web', not 'db'",
        ),
    ],
)
def test_an_order_id_reused_for_a_different_order_is_refused_naming_the_mismatch(
    change: dict[str, Any], named: str
) -> None:
    reused = msgspec.structs.replace(ORDER, **change)
    a = start(reused)
    feed(a, offer("w1", 0.4, machine_id="w1~M1"))
    d = a.machine_shown(machine(ORDER), T0 + 0.002)  # the machine the first order placed
    assert d == [
        Log("warning", "order_id_reused", {"machine_id": "w1~M1"}),
        Refuse(
            f"order id 'o1' was placed as machine w1~M1 for a different order ({named}): an "
            "order id names one order (use a new id for a new order)"
        ),
    ]


def test_how_an_order_is_auctioned_may_change_between_attempts() -> None:
    first = msgspec.structs.replace(ORDER, constraints={"zone": "a"})
    again = msgspec.structs.replace(
        first, deadline_ms=900, min_score=0.5, exclude_workers=["w1"], retry=True
    )
    a = start(again)
    feed(a, offer("w1", 0.4, machine_id="w1~M1"))
    [fin] = a.machine_shown(machine(first), T0 + 0.002)
    assert isinstance(fin, Finish) and isinstance(fin.result, Placed)
    assert fin.result.existing and fin.result.machine_id == "w1~M1"


@pytest.mark.parametrize(
    "forged",
    [
        {"worker_id": "w2"},  # names another worker
        {"machine_id": "w2~01M80QESDH2NAZQ4Z9ASNWXSKR"},  # hands out another worker's machine
    ],
)
def test_a_commit_reply_naming_another_workers_machine_is_not_believed(
    forged: dict[str, Any],
) -> None:
    a = start()
    feed(a, offer("w1"))
    [commit] = a.poll(T0 + 0.001)
    assert isinstance(commit, SendCommit)
    d = a.commit_outcome(CommitAnswered(worker_placed("w1", **forged)), T0 + 0.002)
    assert d == [] and a.tally.rejections == ["w1: placed a machine not its own"]


def test_machine_shown_without_a_verification_is_a_driver_bug() -> None:
    with pytest.raises(AuctionStateError, match="no machine is being verified"):
        start().machine_shown(None, T0 + 0.001)


def test_offers_from_excluded_workers_are_ignored() -> None:
    a = start(msgspec.structs.replace(ORDER, exclude_workers=["w1"]))
    waiting = Waiting(order_id="o1", worker_id="w1", region="mad", wait_ms=300)
    assert feed(a, offer("w1"), waiting) == []
    assert (a.tally.offers, a.tally.waited) == (0, 0)
    assert a.poll(T0 + 0.001) == [WakeAt(T0 + QUIET)]


def test_a_waiting_worker_extends_the_window_until_it_offers_or_withdraws() -> None:
    a = start()
    feed(a, Waiting(order_id="o1", worker_id="w1", region="mad", wait_ms=300), at=T0 + 0.01)
    assert a.poll(T0 + 0.01) == [WakeAt(T0 + 0.31)]
    feed(a, Waiting(order_id="o1", worker_id="w2", region="mad", wait_ms=900), at=T0 + 0.02)
    assert a.poll(T0 + 0.02) == [WakeAt(T0 + 0.5)]  # never past the deadline
    feed(a, Waiting(order_id="o1", worker_id="w2", region="mad", wait_ms=0), at=T0 + 0.03)
    assert a.poll(T0 + 0.03) == [WakeAt(T0 + 0.31)]  # w2 withdrew
    u = result(a.timer(T0 + 0.31))
    assert isinstance(u, Unfilled) and u.reason == "no_offers"
    assert u.detail == (
        "no worker in 'mad' could take 2 cpus + 512 MiB in time: "
        "2 waited for capacity held by other orders"
    )


def test_an_offer_ends_its_workers_wait() -> None:
    a = start(msgspec.structs.replace(ORDER, min_score=0.5))
    feed(a, Waiting(order_id="o1", worker_id="w1", region="mad", wait_ms=300), at=T0 + 0.01)
    feed(a, offer("w1", 0.2), at=T0 + 0.02)  # below min: not taken, does not extend
    assert a.poll(T0 + 0.02) == [WakeAt(T0 + QUIET)]


def test_offers_below_min_score_are_counted_not_taken_nor_extend_the_window() -> None:
    a = start(msgspec.structs.replace(ORDER, min_score=0.95))
    assert feed(a, offer("w1", 0.9), offer("w2", 0.5), at=T0 + 0.05) == []
    assert a.poll(T0 + 0.05) == [WakeAt(T0 + QUIET)]
    u = result(a.timer(T0 + QUIET))
    assert isinstance(u, Unfilled)
    assert (u.reason, u.offers, u.commits_tried) == ("below_min_score", 2, 0)
    assert u.detail == "2 offer(s), all below min_score 0.95"


def test_an_acceptable_offer_restarts_the_quiet_window() -> None:
    a = start()
    a.poll(T0)
    assert a.last_offer == T0
    feed(a, offer("w1"), at=T0 + 0.07)
    assert a.last_offer == T0 + 0.07


# -- §5.2 steps 5-6: commit ------------------------------------------------------------------


def test_the_best_offer_received_so_far_is_committed() -> None:
    a = start()
    feed(a, offer("w1", 0.5), offer("w2", 0.9), offer("w3", 0.7), at=T0 + 0.004)
    assert a.poll(T0 + 0.004) == [commit_of("w2", T0 + 0.004)]
    assert a.tally.commits == 1


# One supplier process's offers in one Offers message (§4.4.2) decide exactly as the same
# offers sent one by one, in order: each is checked on its own. Rows: (order, trust, the
# offers, the decisions feeding them returns, what poll decides next).
def _trusted(o: Offer) -> str | None:
    return None if o.worker_id != "bad" else "unsigned"


BATCHES: list[tuple[PlaceOrder, Any, list[Offer], list[Decision], list[Decision]]] = [
    (  # the best of the batch is committed, whatever its place in it
        ORDER,
        None,
        [offer("w1", 0.5), offer("w2", 0.9), offer("w3", 0.7)],
        [],
        [commit_of("w2", T0 + 0.004)],
    ),
    (  # a foreign offer inside is dropped alone (I5); the others stand
        ORDER,
        None,
        [offer("w1", 0.9, region="lis"), offer("w2", 0.6)],
        [
            Log(
                "warning",
                "foreign_offer",
                {"worker_id": "w1", "offer_region": "lis", "offer_order": "o1"},
            )
        ],
        [commit_of("w2", T0 + 0.004)],
    ),
    (  # each offer's signature is checked on its own
        ORDER,
        _trusted,
        [offer("bad", 0.99, signer="UX"), offer("w2", 0.6)],
        [
            Log(
                "warning",
                "offer_unverified",
                {"worker_id": "bad", "reason": "unsigned", "signer": "UX"},
            )
        ],
        [commit_of("w2", T0 + 0.004)],
    ),
    (  # excluded workers and offers below min_score are not taken
        msgspec.structs.replace(ORDER, exclude_workers=["w1"], min_score=0.5),
        None,
        [offer("w1", 0.9), offer("w2", 0.4), offer("w3", 0.55)],
        [],
        [commit_of("w3", T0 + 0.004)],
    ),
    (  # nothing acceptable in the batch: the quiet window goes on from the bid
        msgspec.structs.replace(ORDER, min_score=0.5),
        None,
        [offer("w2", 0.4), offer("w3", 0.3)],
        [],
        [WakeAt(T0 + QUIET)],
    ),
    (  # an existing machine in the batch is verified first (I3), the rest kept meanwhile
        ORDER,
        None,
        [offer("w2", 0.95), offer("w1", 0.4, machine_id="w1~M1")],
        [verify(ORDER, T0 + 0.004)],
        [],  # (not polled while verifying: see below)
    ),
]


@pytest.mark.parametrize(("order", "trust", "offers", "fed", "then"), BATCHES)
def test_an_offers_message_decides_as_its_offers_one_by_one(
    order: PlaceOrder, trust: Any, offers: list[Offer], fed: list[Decision], then: list[Decision]
) -> None:
    one_by_one, batched = start(order, trust=trust), start(order, trust=trust)
    assert feed(one_by_one, *offers, at=T0 + 0.004) == fed
    assert feed(batched, Offers(offers=offers), at=T0 + 0.004) == fed
    # (fed one by one, they count as unnamed answers: a prompt supplier names itself)
    assert replace(batched.tally, anonymous=0) == replace(one_by_one.tally, anonymous=0)
    if not any(isinstance(d, VerifyMachine) for d in fed):
        assert batched.poll(T0 + 0.004) == one_by_one.poll(T0 + 0.004) == then
    else:  # the existing machine is not shown: the best other offer is committed
        for a in (batched, one_by_one):
            shown = a.machine_shown(None, T0 + 0.005)[0]
            assert isinstance(shown, Log) and shown.event == "offer_unverified"
            assert a.poll(T0 + 0.005) == [commit_of("w2", T0 + 0.005, order)]


@pytest.mark.parametrize(
    "body",
    [
        {"type": "Offers", "offers": [], "responder": "x" * 65},  # a name of at most 64
        {"type": "Offers", "offers": [msgspec.to_builtins(offer("w1"))] * 65},  # at most 64
        {"type": "Offers"},
    ],
)
def test_a_malformed_offers_message_is_logged_and_ignored(body: dict[str, Any]) -> None:
    import json

    a = start()
    [d] = a.bid_reply(json.dumps(body).encode(), T0 + 0.001)
    assert isinstance(d, Log) and d.event == "bad_offer"
    assert a.tally.offers == 0


def test_a_placed_reply_answers_with_the_workers_machine_and_the_offers_score() -> None:
    a = start()
    won = offer("w1", 0.82, image_cached=True, subscores={"cpus": 0.75, "image": 1.0})
    feed(a, won, at=T0 + 0.004)
    a.poll(T0 + 0.004)
    reply = worker_placed("w1", score=0.5, image_cached=False, existing=True)
    d = a.commit_outcome(CommitAnswered(reply), T0 + 0.006)
    placed = Placed(
        order_id="o1",
        machine_id=reply.machine_id,
        worker_id="w1",
        region="mad",
        score=0.82,
        image_cached=True,
        elapsed_ms=6.0,
        subscores={"cpus": 0.75, "image": 1.0},
        existing=True,  # the worker's word
    )
    fields = {
        "worker_id": "w1",
        "machine_id": reply.machine_id,
        "score": 0.82,
        "offers": 1,
        "elapsed_ms": 6.0,
    }
    assert d == [Log("info", "order_placed", fields), Finish(placed)]


# The step 6 table: every commit outcome that lets the auction go on, and what it records.
GO_ON: list[tuple[CommitOutcome, str, list[Decision]]] = [
    (
        CommitAnswered(worker_placed("w2", region="lis")),
        "w2: placed in the wrong region/order",
        [],
    ),
    (
        CommitAnswered(worker_placed("w2", order_id="o9")),
        "w2: placed in the wrong region/order",
        [],
    ),
    (
        CommitAnswered(Rejected(order_id="o1", worker_id="w2", reason="no_hold")),
        "w2: no_hold",
        [Log("info", "commit_rejected", {"worker_id": "w2", "reason": "no_hold"})],
    ),
    (
        CommitAnswered(Error(code="internal", detail="disk full")),
        "w2: error internal",
        [Log("info", "commit_rejected", {"worker_id": "w2", "reason": "error internal"})],
    ),
    (CommitNoResponders(), "w2: gone", []),
    (CommitUndecodable("malformed JSON: x"), "w2: bad reply (malformed JSON: x)", []),
]


@pytest.mark.parametrize(("outcome", "recorded", "decisions"), GO_ON)
def test_a_failed_commit_moves_on_to_the_next_best_offer(
    outcome: CommitOutcome, recorded: str, decisions: list[Decision]
) -> None:
    a = start()
    feed(a, offer("w2", 0.9), offer("w3", 0.8), at=T0 + 0.004)
    assert a.poll(T0 + 0.004) == [commit_of("w2", T0 + 0.004)]
    assert a.commit_outcome(outcome, T0 + 0.01) == decisions
    assert a.tally.rejections == [recorded]
    assert a.poll(T0 + 0.01) == [commit_of("w3", T0 + 0.01)]


@pytest.mark.parametrize(("outcome", "recorded", "decisions"), GO_ON)
def test_when_every_commit_fails_the_order_is_all_commits_rejected(
    outcome: CommitOutcome, recorded: str, decisions: list[Decision]
) -> None:
    a = start()
    feed(a, offer("w2"), at=T0 + 0.004)
    a.poll(T0 + 0.004)
    a.commit_outcome(outcome, T0 + 0.01)
    assert a.poll(T0 + 0.01) == [WakeAt(T0 + 0.004 + QUIET)]
    u = result(a.timer(T0 + 0.104))
    assert isinstance(u, Unfilled)
    assert (u.reason, u.offers, u.commits_tried) == ("all_commits_rejected", 1, 1)
    assert u.detail == f"commits rejected: {recorded}"


def test_rejections_are_listed_in_order() -> None:
    a = start()
    feed(a, offer("w1", 0.9), offer("w2", 0.8), at=T0 + 0.004)
    a.poll(T0 + 0.004)
    a.commit_outcome(CommitNoResponders(), T0 + 0.005)
    a.poll(T0 + 0.005)
    rejected = Rejected(order_id="o1", worker_id="w2", reason="hold_expired")
    a.commit_outcome(CommitAnswered(rejected), T0 + 0.006)
    u = result(a.timer(T0 + 0.2))
    assert isinstance(u, Unfilled) and u.detail == "commits rejected: w1: gone, w2: hold_expired"


def test_an_unanswered_commit_is_aborted_and_the_order_unfilled() -> None:
    a = start()
    feed(a, offer("w1"), offer("w2", 0.5), at=T0 + 0.004)
    a.poll(T0 + 0.004)
    d = a.commit_outcome(CommitTimedOut(), T0 + 0.6)
    u = Unfilled(
        order_id="o1",
        region="mad",
        reason="deadline",
        offers=2,
        commits_tried=1,
        elapsed_ms=600.0,
        detail="worker w1 did not answer the commit in time; it was told to undo it",
    )
    abort = Release(order_id="o1", worker_id="w1", abort_commit=True)
    assert d == [
        PublishAbort(S.release("w1"), abort),
        Log("warning", "commit_unanswered", {"worker_id": "w1"}),
        unfilled_log(u),
        Finish(u),
    ]  # the next offer (w2) is NOT tried: the first may have gone through


def test_the_deadline_passing_before_a_commit_could_start_is_unfilled() -> None:
    a = start()
    feed(a, offer("w1"), at=T0 + 0.5)
    u = result(a.poll(T0 + 0.5))
    assert isinstance(u, Unfilled)
    assert (u.reason, u.offers, u.commits_tried, u.detail) == (
        "deadline",
        1,
        0,
        DEADLINE_BEFORE_COMMIT,
    )


def test_time_spent_in_admission_comes_off_the_deadline() -> None:
    a = start(spent_ms=450)
    assert a.deadline == T0 + 0.05
    assert a.poll(T0) == [WakeAt(T0 + 0.05)]  # not the 100 ms quiet window
    feed(a, offer("w1"), at=T0 + 0.01)
    assert a.poll(T0 + 0.01) == [commit_of("w1", T0 + 0.01 + 0.45)]  # 40 ms + grace
    b = start(spent_ms=10_000)
    assert b.deadline == T0 + 0.001  # at least 1 ms


# -- §5.3: retries gather before committing a new machine -----------------------------------


def test_a_retry_gathers_offers_before_committing() -> None:
    a = start(msgspec.structs.replace(ORDER, retry=True))
    feed(a, offer("w1", 0.6), at=T0 + 0.001)
    assert a.poll(T0 + 0.001) == [WakeAt(T0 + QUIET)]  # min(quiet 100, deadline/2 250)
    feed(a, offer("w2", 0.8), at=T0 + 0.03)
    assert a.poll(T0 + 0.03) == [WakeAt(T0 + QUIET)]
    assert a.timer(T0 + QUIET) == [commit_of("w2", T0 + QUIET)]


def test_a_short_retry_gathers_half_its_deadline() -> None:
    a = start(msgspec.structs.replace(ORDER, retry=True, deadline_ms=60))
    feed(a, offer("w1"), at=T0 + 0.001)
    assert a.poll(T0 + 0.001) == [WakeAt(T0 + 0.03)]


def test_a_retry_whose_deadline_ends_while_gathering_is_unfilled_deadline() -> None:
    a = start(msgspec.structs.replace(ORDER, retry=True), spent_ms=450)
    feed(a, offer("w1"), at=T0 + 0.001)
    assert a.poll(T0 + 0.001) == [WakeAt(T0 + 0.05)]  # the deadline comes first
    u = result(a.timer(T0 + 0.05))
    assert isinstance(u, Unfilled)
    assert (u.reason, u.offers, u.commits_tried, u.detail) == (
        "deadline",
        1,
        0,
        "the deadline passed",
    )


def test_an_early_timer_only_asks_to_wake_again() -> None:
    a = start(msgspec.structs.replace(ORDER, retry=True))
    feed(a, offer("w1"), at=T0 + 0.001)
    assert a.timer(T0 + 0.0999) == [WakeAt(T0 + QUIET)]


# -- §5.4: reasons and details ----------------------------------------------------------------


def test_no_offers_when_nobody_answers_in_the_quiet_window() -> None:
    a = start(msgspec.structs.replace(ORDER, constraints={"disk": "ssd"}))
    assert a.poll(T0) == [WakeAt(T0 + QUIET)]
    d = a.timer(T0 + QUIET)
    u = result(d)
    assert isinstance(u, Unfilled)
    assert (u.reason, u.offers, u.commits_tried, u.elapsed_ms) == ("no_offers", 0, 0, 100.0)
    assert u.detail == (
        "no worker in 'mad' offered 2 cpus + 512 MiB + constraints disk=ssd of image 'web'"
    )
    assert d == [unfilled_log(u), Finish(u)]


def test_describe_names_every_resource_asked_for() -> None:
    o = msgspec.structs.replace(
        ORDER,
        resources=Resources(cpus=4, memory_mb=1024, disk_mb=2048, gpus=1),
        constraints={"zone": "a", "disk": "ssd"},
    )
    assert describe(o) == "4 cpus + 1024 MiB + 2048 MiB disk + 1 gpus + constraints zone=a,disk=ssd"


# -- state -----------------------------------------------------------------------------------


def test_events_out_of_turn_are_named_errors() -> None:
    a = Auction(ORDER, AuctionConfig(), AID, T0, subjects=S)
    with pytest.raises(AuctionStateError, match="is new, not collecting"):
        a.poll(T0)
    a.start()
    with pytest.raises(AuctionStateError, match="not committing"):
        a.commit_outcome(CommitTimedOut(), T0)
    feed(a, offer("w1"))
    a.poll(T0 + 0.001)
    with pytest.raises(AuctionStateError, match="is committing, not collecting"):
        a.bid_reply(encode(offer("w2")), T0 + 0.002)
    a.commit_outcome(CommitAnswered(worker_placed("w1")), T0 + 0.003)
    with pytest.raises(AuctionStateError, match="is done"):
        a.timer(T0 + 1)


# -- Placed, built in one home ----------------------------------------------------------------


def test_placed_of_machine_is_the_workers_reply() -> None:
    m = Machine(
        machine_id="w1~01M80QESDH2NAZQ4Z9ASNWXSKR",
        order_id="o1",
        worker_id="w1",
        region="mad",
        state="reserved",
        resources=ORDER.resources,
        image="web",
        score=0.7,
    )
    p = Placed.of_machine(m, image_cached=True, elapsed_ms=1.2, subscores={"cpus": 0.5})
    assert p == Placed(
        order_id="o1",
        machine_id=m.machine_id,
        worker_id="w1",
        region="mad",
        score=0.7,
        image_cached=True,
        elapsed_ms=1.2,
        subscores={"cpus": 0.5},
    )
    again = Placed.of_machine(m, image_cached=False, elapsed_ms=0.1, existing=True)
    assert again.existing and again.subscores == {}


def test_placed_of_offer_needs_a_machine() -> None:
    with pytest.raises(ValueError, match="names no machine"):
        Placed.of_offer(offer("w1"), elapsed_ms=1.0)


def test_the_same_cpus_with_or_without_cpu_millis_is_the_same_order() -> None:
    from bourse.auction.core import order_mismatch

    said = msgspec.structs.replace(
        ORDER, resources=Resources(cpus=2, cpu_millis=2000, memory_mb=512)
    )
    assert order_mismatch(said, machine(ORDER)) == ""


@pytest.mark.parametrize(
    ("recorded", "asked", "mismatch"),
    [
        ({"disk": "ssd"}, {"disk": "ssd"}, ""),
        ({"disk": "ssd"}, {"gpu": "a100"}, "constraints disk=ssd, not gpu=a100"),
        ({"disk": "ssd"}, {}, "constraints disk=ssd, not none"),
        (None, {"gpu": "a100"}, ""),  # a worker that does not record them: not compared
    ],
)
def test_a_machine_recorded_for_other_constraints_is_another_order(
    recorded: dict[str, str] | None, asked: dict[str, str], mismatch: str
) -> None:
    from bourse.auction.core import order_mismatch

    said = msgspec.structs.replace(ORDER, constraints=asked)
    assert order_mismatch(said, machine(ORDER, constraints=recorded)) == mismatch


# -- §4.4.3 prompt answers: the auction ranks, and commits once every process answered --------


def prompt(worker: str, score: float, delay_ms: float) -> Offer:
    """An offer as a prompt supplier sends it: with the delay it would have waited."""
    return offer(worker, score, delay_ms=delay_ms)


MS = 0.001


def known(n: int) -> frozenset[str]:
    """The names of ``n`` supplier processes the driver expects: p1 ... pn."""
    return frozenset(f"p{i}" for i in range(1, n + 1))


# (case, how many processes the driver expects (p1...pn), answers as (responder, offers)
# fed at T0 + 1 ms in order, then poll at T0 + 1 ms: the decision)
PROMPT = [
    (
        "all known processes answered: the best offer now, whatever its delay",
        2,
        [("p1", [prompt("w1", 0.6, 1.6)]), ("p2", [prompt("w2", 0.9, 0.4)])],
        "commit w2",
    ),
    (
        "one of two answered: its best offer when its delay has passed",
        2,
        [("p1", [prompt("w1", 0.6, 1.6), prompt("w3", 0.5, 2.0)])],
        "wake at 2.6",
    ),
    (
        "processes unknown (0): as if the suppliers had waited their delays",
        0,
        [("p1", [prompt("w1", 0.6, 1.6)]), ("p2", [prompt("w2", 0.9, 0.4)])],
        "wake at 1.4",
    ),
    (
        "an empty answer counts as answered",
        2,
        [("p1", [prompt("w1", 0.5, 2.0)]), ("p2", [])],
        "commit w1 alone",  # the only process that offered drops the other holds itself
    ),
    (
        "the one known process answered: its best at once",
        1,
        [("p1", [prompt("w1", 0.7, 1.2), prompt("w2", 0.8, 0.8)])],
        "commit w2 alone",
    ),
    (
        "the same process twice counts once",
        2,
        [("p1", [prompt("w1", 0.7, 1.2)]), ("p1", [prompt("w2", 0.8, 0.8)])],
        "wake at 1.8",
    ),
    (
        "an unknown process answered, a known one did not: it does not stand in for it",
        2,
        [("p1", [prompt("w1", 0.6, 1.6)]), ("p9", [])],
        "wake at 2.6",
    ),
    (
        "every known process answered, and one not known yet: at once, not alone",
        1,
        [("p1", [prompt("w1", 0.6, 1.6)]), ("p9", [prompt("w2", 0.5, 2.0)])],
        "commit w1",
    ),
    (
        "an offer without a delay (an older supplier waited it out) is ready at once",
        2,
        [("p1", [prompt("w1", 0.7, 1.2)]), ("", [offer("w2", 0.4)])],
        "commit w1",
    ),
]


def _poll_then(a: Auction, at: float, then: str) -> None:
    """Poll at ``at`` and check the decision: "commit W" (or "commit W alone": the commit
    asks W's process to drop the other holds), or "wake at X" (ms since T0)."""
    verb, arg = then.split(" ", 1)
    if verb == "commit":
        worker, _, alone = arg.partition(" ")
        assert a.poll(at) == [commit_of(worker, at, alone=alone == "alone")]
    else:
        [wake] = a.poll(at)
        wake_ms = float(arg.removeprefix("at "))
        assert isinstance(wake, WakeAt) and wake.at == pytest.approx(T0 + wake_ms * MS)


@pytest.mark.parametrize(
    ("case", "expected", "answers", "then"), PROMPT, ids=[row[0] for row in PROMPT]
)
def test_prompt_answers_are_ranked_by_the_auction(
    case: str, expected: int, answers: list[tuple[str, list[Offer]]], then: str
) -> None:
    a = Auction(ORDER, AuctionConfig(), AID, T0, subjects=S, responders=known(expected))
    a.start()
    a.bid_published(T0)
    at = T0 + 1 * MS
    for responder, offers in answers:
        assert feed(a, Offers(offers=offers, responder=responder), at=at) == []
    _poll_then(a, at, then)


def test_a_prompt_offer_is_committed_when_its_delay_has_passed() -> None:
    a = Auction(ORDER, AuctionConfig(), AID, T0, subjects=S, responders=known(2))
    a.start()
    feed(a, Offers(offers=[prompt("w1", 0.6, 1.6)], responder="p1"), at=T0 + MS)
    [wake] = a.poll(T0 + MS)
    assert isinstance(wake, WakeAt)
    assert a.timer(wake.at) == [commit_of("w1", wake.at)]


def test_a_rejected_commit_goes_to_the_next_best_at_once_when_all_answered() -> None:
    a = Auction(ORDER, AuctionConfig(), AID, T0, subjects=S, responders=known(1))
    a.start()
    offers = [prompt("w1", 0.9, 0.4), prompt("w2", 0.8, 0.8)]
    feed(a, Offers(offers=offers, responder="p1"), at=T0 + MS)
    assert a.poll(T0 + MS) == [commit_of("w1", T0 + MS, alone=True)]
    gone = a.commit_outcome(CommitNoResponders(), T0 + 2 * MS)
    assert gone == []
    assert a.poll(T0 + 2 * MS) == [commit_of("w2", T0 + 2 * MS, alone=True)]


def test_a_retry_still_gathers_when_every_process_answered() -> None:
    order = msgspec.structs.replace(ORDER, retry=True)
    a = Auction(order, AuctionConfig(), AID, T0, subjects=S, responders=known(1))
    a.start()
    feed(a, Offers(offers=[prompt("w1", 0.9, 0.4)], responder="p1"), at=T0 + MS)
    [wake] = a.poll(T0 + MS)
    assert isinstance(wake, WakeAt) and wake.at == pytest.approx(a.gather_until)


def test_sampled_bids_rank_by_delay_only() -> None:
    cfg = AuctionConfig(bid_shards=8, bid_sample=2)
    a = Auction(ORDER, cfg, AID, T0, subjects=S, responders=known(1))
    a.start()
    feed(a, Offers(offers=[prompt("w1", 0.6, 1.6)], responder="p1"), at=T0 + MS)
    [wake] = a.poll(T0 + MS)
    assert isinstance(wake, WakeAt) and wake.at == pytest.approx(T0 + 2.6 * MS)


SAMPLED = AuctionConfig(bid_shards=8, bid_sample=2)


def _sampled(
    shard_responders: Mapping[int, Collection[str]], responders: Collection[str] = ()
) -> Auction:
    """ORDER's auction, sampled (2 of 8 shards), with the processes known per shard."""
    return Auction(
        ORDER,
        SAMPLED,
        AID,
        T0,
        subjects=S,
        responders=responders,
        shard_responders=shard_responders,
    )


K1, K2 = sampled_shards("o1", "web", 8, 2)
# (case, processes known per shard, answers as (shard or None: the region's reply subject,
# responder, offers) fed at T0 + 1 ms in order, then poll at T0 + 1 ms: the decision)
SHARD_QUORUM = [
    (
        "every known process of both shards answered: the best offer now",
        {K1: {"p1"}, K2: {"p2"}},
        [(K1, "p1", [prompt("w1", 0.6, 1.6)]), (K2, "p2", [prompt("w2", 0.5, 2.0)])],
        "commit w1",
    ),
    (
        "only p1 offered, p2 answered empty: p1 drops the other holds itself",
        {K1: {"p1"}, K2: {"p2"}},
        [(K1, "p1", [prompt("w1", 0.6, 1.6), prompt("w3", 0.4, 2.4)]), (K2, "p2", [])],
        "commit w1 alone",
    ),
    (
        "a shard's processes are not known: the delay is waited out",
        {K1: {"p1"}},
        [(K1, "p1", [prompt("w1", 0.6, 1.6)])],
        "wake at 2.6",
    ),
    (
        "one of a shard's two known processes has not answered",
        {K1: {"p1"}, K2: {"p2", "p3"}},
        [(K1, "p1", [prompt("w1", 0.6, 1.6)]), (K2, "p2", [])],
        "wake at 2.6",
    ),
    (
        "an answer on the region's reply subject does not count for a shard",
        {K1: {"p1"}, K2: {"p2"}},
        [(K1, "p1", [prompt("w1", 0.6, 1.6)]), (None, "p2", [])],
        "wake at 2.6",
    ),
    (
        "another process answered in place of a shard's known one",
        {K1: {"p1"}, K2: {"p2"}},
        [(K1, "p1", [prompt("w1", 0.6, 1.6)]), (K2, "p3", [])],
        "wake at 2.6",
    ),
    (
        "a process of both shards answers each: it counts in both",
        {K1: {"p1"}, K2: {"p1"}},
        [(K1, "p1", [prompt("w1", 0.6, 1.6)]), (K2, "p1", [prompt("w2", 0.5, 2.0)])],
        "commit w1 alone",
    ),
]


@pytest.mark.parametrize(
    ("case", "names", "answers", "then"), SHARD_QUORUM, ids=[row[0] for row in SHARD_QUORUM]
)
def test_sampled_bids_commit_once_every_known_process_of_the_shards_answered(
    case: str,
    names: dict[int, set[str]],
    answers: list[tuple[int | None, str, list[Offer]]],
    then: str,
) -> None:
    a = _sampled(names)
    [send] = a.start()
    assert isinstance(send, SendBid) and send.shards == (K1, K2) == a.shards
    a.bid_published(T0)
    at = T0 + 1 * MS
    for shard, responder, offers in answers:
        body = encode(Offers(offers=offers, responder=responder))
        assert a.bid_reply(body, at, shard=shard) == []
    _poll_then(a, at, then)
    named = {s: {r for k, r, _ in answers if k == s} for s, _, _ in answers if s is not None}
    assert a.tally.shard_responders == named


@pytest.mark.parametrize(
    ("names", "waiting", "then"),
    [
        ({K1: {"p1"}, K2: {"p2"}}, False, "broadcast"),  # at once, not after the quiet window
        ({K1: {"p1"}}, False, "wake"),  # K2's processes are not known
        ({K1: {"p1"}, K2: {"p2"}}, True, "wake"),  # a worker of the shards waits for capacity
    ],
)
def test_sampled_shards_that_all_answered_empty_broadcast_at_once(
    names: dict[int, set[str]], waiting: bool, then: str
) -> None:
    a = _sampled(names)
    a.start()
    a.bid_published(T0)
    at = T0 + 1 * MS
    if waiting:
        note = Waiting(order_id="o1", worker_id="w9", region="mad", wait_ms=50)
        a.bid_reply(encode(note), at, shard=K1)
    a.bid_reply(encode(Offers(offers=[], responder="p1")), at, shard=K1)
    a.bid_reply(encode(Offers(offers=[], responder="p2")), at, shard=K2)
    if then == "broadcast":
        assert a.poll(at) == [BroadcastBid(S.bid("mad"), a.bid)]
    else:
        [wake] = a.poll(at)
        assert isinstance(wake, WakeAt) and wake.at > at


def test_after_a_fallback_broadcast_only_answers_to_it_make_the_region_quorum() -> None:
    a = _sampled({K1: {"p1"}, K2: {"p2"}}, responders=known(2))
    a.start()
    a.bid_published(T0)
    at = T0 + 1 * MS
    a.bid_reply(encode(Offers(offers=[], responder="p1")), at, shard=K1)
    a.bid_reply(encode(Offers(offers=[], responder="p2")), at, shard=K2)
    assert a.poll(at) == [BroadcastBid(S.bid("mad"), a.bid)]
    a.bid_published(at)
    a.bid_reply(encode(Offers(offers=[prompt("w5", 0.6, 1.6)], responder="p1")), at + MS)
    [wake] = a.poll(at + MS)  # p2 has not answered the broadcast: the delay is waited out
    assert isinstance(wake, WakeAt) and wake.at == pytest.approx(at + 2.6 * MS)
    a.bid_reply(encode(Offers(offers=[], responder="p2")), at + MS)
    [commit] = a.poll(at + MS)  # both did: at once, and never folded after a fallback
    assert isinstance(commit, SendCommit) and not commit.commit.release_others


@pytest.mark.parametrize(
    ("config", "replies", "responders", "anonymous"),
    [
        (AuctionConfig(), [Offers(offers=[offer("w1")], responder="p1")], {"p1"}, 0),
        (AuctionConfig(), [Offers(offers=[offer("w1")])], set(), 1),
        (AuctionConfig(), [offer("w1"), offer("w2")], set(), 2),
        (AuctionConfig(prompt_offers=False), [offer("w1"), Offers(offers=[offer("w2")])], set(), 0),
    ],
)
def test_the_tally_names_who_answered_a_prompt_bid(
    config: AuctionConfig, replies: list[msgspec.Struct], responders: set[str], anonymous: int
) -> None:
    a = Auction(ORDER, config, AID, T0, subjects=S, responders=known(3))
    a.start()
    feed(a, *replies)
    assert (a.tally.responders, a.tally.anonymous) == (responders, anonymous)
    assert a.responders == (known(3) if config.prompt_offers else ())


def _placed_reply(worker: str) -> CommitAnswered:
    return CommitAnswered(
        Placed(
            order_id="o1",
            machine_id=f"{worker}~M1",
            worker_id=worker,
            region="mad",
            score=0.9,
            image_cached=False,
            elapsed_ms=1.0,
        )
    )


@pytest.mark.parametrize(
    ("case", "expected", "answers", "waiting", "needed"),
    [
        ("one known process offered alone", 1, [("p1", ["w1", "w2"])], False, False),
        ("the other known process answered empty", 2, [("p1", ["w1"]), ("p2", [])], False, False),
        ("two processes offered", 2, [("p1", ["w1"]), ("p2", ["w2"])], False, True),
        ("a known process has not answered", 2, [("p1", ["w1"])], False, True),
        ("an unknown process stands in for it", 2, [("p1", ["w1"]), ("p9", [])], False, True),
        ("processes unknown", 0, [("p1", ["w1"])], False, True),
        ("a worker waits", 1, [("p1", ["w1"])], True, True),
        ("an unnamed answer", 1, [("p1", ["w1"]), ("", ["w2"])], False, True),
    ],
)
def test_the_region_release_is_folded_into_the_commit_only_when_one_process_offered(
    case: str,
    expected: int,
    answers: list[tuple[str, list[str]]],
    waiting: bool,
    needed: bool,
) -> None:
    a = Auction(ORDER, AuctionConfig(), AID, T0, subjects=S, responders=known(expected))
    a.start()
    for responder, workers in answers:
        offers = [prompt(w, 0.9 - 0.1 * i, 0.1) for i, w in enumerate(workers)]
        feed(a, Offers(offers=offers, responder=responder), at=T0 + MS)
    if waiting:
        feed(a, Waiting(order_id="o1", worker_id="w9", region="mad", wait_ms=50), at=T0 + MS)
    [commit] = a.poll(T0 + 2 * MS)
    assert isinstance(commit, SendCommit)
    assert commit.commit.release_others is not needed
    decisions = a.commit_outcome(_placed_reply(commit.worker_id), T0 + 3 * MS)
    assert isinstance(decisions[-1], Finish)
    assert a.release_needed is needed


def test_an_unfilled_auction_always_releases() -> None:
    a = Auction(ORDER, AuctionConfig(), AID, T0, subjects=S, responders=known(1))
    a.start()
    feed(a, Offers(offers=[prompt("w1", 0.9, 0.1)], responder="p1"), at=T0 + MS)
    [commit] = a.poll(T0 + 2 * MS)
    assert isinstance(commit, SendCommit) and commit.commit.release_others
    a.commit_outcome(CommitNoResponders(), T0 + 3 * MS)
    a.timer(T0 + 1.0)  # the deadline: unfilled
    assert a.release_needed


def _wait(worker: str, order_id: str = "o1") -> Waiting:
    return Waiting(order_id=order_id, worker_id=worker, region="mad", wait_ms=50)


# (case, a reply that came after the auction folded its release, as sent, or as an Offers
# out of an Answers message: the workers told to drop what they hold for it, in order)
LATE_REPLIES: list[tuple[str, bytes | Offers, list[str]]] = [
    ("one offer", encode(offer("w7")), ["w7"]),
    (
        "a process's offers",
        encode(Offers(offers=[offer("w7"), offer("w8")], responder="p9")),
        ["w7", "w8"],
    ),
    ("out of an Answers message", Offers(offers=[offer("w7")], auction_id=AID), ["w7"]),
    ("a waiting worker", encode(_wait("w7")), ["w7"]),
    ("one worker named twice", encode(Offers(offers=[offer("w7"), offer("w7")])), ["w7"]),
    ("an empty answer", encode(Offers(offers=[], responder="p9")), []),
    ("the order's existing machine (no hold)", encode(offer("w7", machine_id="w7~m1")), []),
    ("another order's offer", encode(offer("w7", order_id="o2")), []),
    ("another order's waiting worker", encode(_wait("w7", "o2")), []),
    ("undecodable", b"{not json", []),
    ("no responders (a 503 has no body)", b"", []),
]


@pytest.mark.parametrize(
    ("case", "reply", "workers"), LATE_REPLIES, ids=[c[0] for c in LATE_REPLIES]
)
def test_a_late_reply_to_a_folded_auction_releases_what_it_holds(
    case: str, reply: bytes | Offers, workers: list[str]
) -> None:
    assert late_releases(reply, "o1", AID) == [
        Release(order_id="o1", worker_id=w, auction_id=AID) for w in workers
    ]


# (what was folded: auction, order, hold_ms, at), (asked: auction, at), the answer
FOLDS: list[tuple[str, list[tuple[str, str, int, float]], tuple[str, float], str | None]] = [
    ("just folded", [("a1", "o1", 2000, 0.0)], ("a1", 0.0), "o1"),
    (
        "at the last instant a hold may live: hold_ms + the margin",
        [("a1", "o1", 2000, 0.0)],
        ("a1", 2.0 + FOLDED_MARGIN_S),
        "o1",
    ),
    ("past it", [("a1", "o1", 2000, 0.0)], ("a1", 2.0 + FOLDED_MARGIN_S + 0.001), None),
    ("a longer hold is remembered longer", [("a1", "o1", 9000, 0.0)], ("a1", 13.0), "o1"),
    ("an auction never folded", [("a1", "o1", 2000, 0.0)], ("a2", 0.0), None),
    (
        "a later fold keeps an earlier auction that is still live",
        [("a1", "o1", 1000, 0.0), ("a2", "o2", 1000, 0.5), ("a3", "o3", 1000, 6.2)],
        ("a2", 6.2),
        "o2",
    ),
    (
        "each auction answers for its own order",
        [("a1", "o1", 2000, 0.0), ("a2", "o2", 2000, 0.1)],
        ("a2", 1.0),
        "o2",
    ),
]


@pytest.mark.parametrize(("case", "folds", "asked", "order"), FOLDS, ids=[c[0] for c in FOLDS])
def test_a_folded_auction_is_remembered_while_a_hold_of_its_bid_may_live(
    case: str,
    folds: list[tuple[str, str, int, float]],
    asked: tuple[str, float],
    order: str | None,
) -> None:
    folded = FoldedAuctions()
    for auction_id, order_id, hold_ms, at in folds:
        folded.fold(auction_id, order_id, hold_ms, at)
    assert folded.order_of(*asked) == order


def test_folding_forgets_the_expired_auctions_so_memory_stays_bounded() -> None:
    folded = FoldedAuctions()
    for i in range(1000):  # 1,000 auctions, one every 10 ms, each holding for 1 s
        folded.fold(f"a{i}", f"o{i}", 1000, i / 100)
    # alive at 9.99 s: those folded at or after 9.99 - 1 - FOLDED_MARGIN_S = 3.99 s
    assert len(folded) == 1000 - 399
    assert folded.order_of("a398", 9.99) is None
    assert folded.order_of("a399", 9.99) == "o399"


class _LookupsOnly(dict[int, set[str]]):
    """Shard processes that may only be looked up, as the driver's lazy mapping should be
    (its len() and iteration walk every process of the region)."""

    def __len__(self) -> int:
        raise AssertionError("len() of the shard processes")

    def __iter__(self) -> Any:
        raise AssertionError("iteration over the shard processes")

    def __bool__(self) -> bool:
        raise AssertionError("bool() of the shard processes")


def test_the_core_only_looks_up_the_shards_it_asks() -> None:
    a = _sampled(_LookupsOnly({K1: {"p1", "p2"}, K2: {"p3"}}))
    a.start()
    a.bid_published(T0)
    for shard, responder in ((K1, "p1"), (K1, "p2"), (K2, "p3")):
        a.bid_reply(encode(Offers(offers=[], responder=responder)), T0 + MS, shard=shard)
    assert a.poll(T0 + MS) == [BroadcastBid(S.bid("mad"), a.bid)]  # all three answered
