"""Immediate-or-cancel: every Unfilled reason, each caused by a scenario, within the deadline."""

from __future__ import annotations

import time
from pathlib import Path

from nats.aio.msg import Msg

from bourse.images import ImageStore, RunSpec
from bourse.nats.connection import flush_all
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Bid, Commit, Offer, Offers, Placed, Rejected, Release, Unfilled
from tests.cli import buyer
from tests.isolation import own_worker_id
from tests.market import Market, answer_commits, order, wait_until, worker

# The stalled auction's quiet window: the bid reaches the stalling supplier well within it
# however busy the machine, so it is the stall that outlasts it.
STALL_QUIET_MS = 1000.0


async def _ghost_worker(market: Market, worker_id: str, on_commit: str) -> list[Release]:
    """A stand-in supplier on the real bus that offers for everything, then either rejects
    each commit ("reject") or never answers it ("silent"). Returns the releases it gets."""
    nc = await market.connect("ghost")
    releases: list[Release] = []

    async def bid(msg: Msg) -> None:
        b = decode(msg.data, Bid)
        offer = Offer(order_id=b.order_id, worker_id=worker_id, region=b.region, score=0.9)
        await nc.publish(msg.reply, encode(offer))

    async def commit(msg: Msg) -> None:
        c = decode(msg.data, Commit)
        if on_commit == "reject":
            rej = Rejected(order_id=c.order_id, worker_id=worker_id, reason="no_hold")
            await nc.publish(msg.reply, encode(rej))

    async def release(msg: Msg) -> None:
        releases.append(decode(msg.data, Release))

    await nc.subscribe(market.subjects.bid("mad"), cb=bid)
    await nc.subscribe(market.subjects.commit(worker_id), cb=commit)
    await nc.subscribe(market.subjects.release(worker_id), cb=release)
    await flush_all(nc)
    return releases


async def test_no_workers_when_nobody_listens_in_the_region(market: Market) -> None:
    await market.host(worker("mad-1"))
    await market.exchange()
    r = await (await market.client()).place(order(region="nowhere", deadline_ms=2000))
    assert isinstance(r, Unfilled)
    assert (r.reason, r.offers, r.commits_tried) == ("no_workers", 0, 0)
    assert r.elapsed_ms < 100  # answered by the server's no-responders status, not the deadline
    assert "nowhere" in r.detail


async def test_no_offers_when_no_worker_fits(market: Market) -> None:
    await market.host(worker("mad-1", cpus=4))
    await market.exchange()
    r = await (await market.client()).place(order(cpus=64, deadline_ms=400))
    assert isinstance(r, Unfilled)
    assert (r.reason, r.offers, r.commits_tried) == ("no_offers", 0, 0)
    assert r.elapsed_ms <= 400 + 50
    assert "64 cpus" in r.detail


async def test_below_min_score_when_every_offer_is_too_cheap(market: Market) -> None:
    await market.host(worker("a"), worker("b"))
    await market.exchange()
    r = await (await market.client()).place(order(min_score=0.95))
    assert isinstance(r, Unfilled)
    assert (r.reason, r.offers, r.commits_tried) == ("below_min_score", 2, 0)


async def test_all_commits_rejected_when_the_only_worker_refuses(market: Market) -> None:
    await _ghost_worker(market, "ghost", on_commit="reject")
    await market.exchange()
    r = await (await market.client()).place(order(deadline_ms=300))
    assert isinstance(r, Unfilled)
    assert (r.reason, r.offers, r.commits_tried) == ("all_commits_rejected", 1, 1)
    assert "ghost: no_hold" in r.detail


async def test_rejected_commit_moves_on_to_the_next_best_offer(market: Market) -> None:
    await _ghost_worker(market, "ghost", on_commit="reject")  # score 0.9: tried first
    await market.host(worker("real"))
    await market.exchange()
    r = await (await market.client()).place(order())
    assert isinstance(r, Placed) and r.worker_id == "real"


async def test_deadline_when_the_commit_goes_unanswered_and_the_worker_is_told_to_undo(
    market: Market,
) -> None:
    releases = await _ghost_worker(market, "ghost", on_commit="silent")
    await market.exchange(commit_grace_ms=50)
    buyer = await market.client()
    r = await buyer.place(order(order_id="late-1", deadline_ms=200))
    assert isinstance(r, Unfilled)
    assert (r.reason, r.offers, r.commits_tried) == ("deadline", 1, 1)
    assert r.elapsed_ms < 200 + 50 + 100
    await wait_until(lambda: bool(releases))
    assert releases and releases[0].order_id == "late-1" and releases[0].abort_commit is True


async def test_no_offers_only_after_listening_the_quiet_window_not_while_the_process_stalled(
    market: Market,
) -> None:
    """The auctioneer's process stops running (a GC pause, its CPU taken) past the quiet
    window, and an offer comes in that time: the late wake reads it before it would end
    no_offers (§5.2 step 7). The stall: a raw supplier's handler blocks the process (the
    buyer's auction runs here too) before it answers."""
    nc = await market.connect("stalling-supplier")

    async def on_bid(msg: Msg) -> None:
        bid = decode(msg.data, Bid)
        time.sleep(STALL_QUIET_MS * 1.5 / 1000)  # noqa: ASYNC251  # the stall, on purpose
        o = Offer(order_id=bid.order_id, worker_id="k1", region="mad", score=0.9)
        offers = Offers(offers=[o], responder="k", auction_id=bid.auction_id)
        await nc.publish(msg.reply, encode(offers))

    await nc.subscribe(market.subjects.bid("mad"), cb=on_bid)
    await answer_commits(nc, market.subjects, "k1", score=0.9)
    await flush_all(nc)
    client = await market.client(direct=True, quiet_ms=STALL_QUIET_MS)
    placed = await client.place(order(order_id="stalled"))
    assert isinstance(placed, Placed) and placed.worker_id == "k1"


async def test_an_unfilled_order_says_the_region_or_image_it_most_likely_meant(
    market: Market, tmp_path: Path
) -> None:
    """A region no worker serves, or an image no worker runs, is answered with the nearest
    one the market has (asked only once the order is unfilled): a region whose workers
    answer, a store's tag, a worker's catalog image."""
    await market.jetstream_init()
    store = await ImageStore.open(await market.connect("images"), market.subjects.prefix)
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "server.py").write_text("print('hi')\n")
    await store.push_directory(tmp_path / "app", "hello:latest", RunSpec(cmd=("python3",)))
    catalog = {"web": {"command": ["{python}", "-c", "pass"]}}
    await market.host(
        worker(own_worker_id("mad-1"), driver="process", catalog=catalog, images=["web"])
    )
    await market.exchange()
    place = ("place", "--cpus", "1", "--memory-mb", "64")
    for args, said in [
        (("--region", "madd", "--image", "web"), "(did you mean 'mad'?)"),
        (("--region", "mad", "--image", "wbe"), "(did you mean 'web'?)"),
        (("--region", "mad", "--image", "helo"), "(did you mean 'hello'?)"),
        (("--region", "mad", "--image", "zzz"), ": no worker serves image 'zzz'"),
    ]:
        code, out, err = await buyer(market, *place, *args)
        assert (code, err) == (2, ""), out + err
        assert out.splitlines()[0].endswith(said), out
