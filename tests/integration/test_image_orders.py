"""Orders name content (docs/protocol.md §4.3a), on a real nats-server with JetStream, a real
exchange (or a direct buyer), a real image store and real suppliers: a tag is resolved once
where the order enters, and the bid carries the digest and layers, the commit the digest;
a tag moved between two orders gives each the content it named then; a digest the store
lacks is refused at once (image_unknown), an unknown name goes out as a catalog name; the
exchange's watched copy follows a tag pushed after it started. What the bids and commits
carried is read off the wire by a listener of their subjects."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg

from bourse.client import ClientError
from bourse.images import ImageStore, RunSpec
from bourse.images.tags import TagIndex
from bourse.wire.codec import decode
from bourse.wire.messages import Bid, Commit, Event, ExplainRequest, Layer, Placed, Unfilled
from exchange.service import ExchangeService
from tests.market import Market, collect, order, wait_until, worker

RUN = RunSpec(cmd=("./serve",), architecture="amd64")
UNKNOWN = "app@sha256:" + "0" * 64


async def push(market: Market, tmp_path: Path, ref: str, body: bytes) -> tuple[str, list[Layer]]:
    """A one-layer image of a directory holding ``body``, tagged ``ref``: its digest and
    its layers as a bid lists them."""
    store = await ImageStore.open(await market.connect("pusher"), market.subjects.prefix)
    src = tmp_path / f"src-{uuid.uuid4().hex}"
    src.mkdir()
    (src / "serve").write_bytes(body)
    pushed = await store.push_directory(src, ref, RUN)
    info = await store.inspect(ref)
    return pushed.digest, [Layer(digest=x.digest, size=x.size) for x in info.layers]


async def seen_by(index: TagIndex | None, ref: str, digest: str) -> None:
    """Until ``index`` (an exchange's or a client's watched copy) names ``digest`` for
    ``ref`` (it follows the KV watch: the event, not a sleep)."""
    assert index is not None
    await index.wait_until(lambda i: i.resolve(ref) == digest)


async def serving(market: Market) -> ExchangeService:
    await market.host(worker("a"))
    return await market.exchange(batch_bids=False)


def decoded(msgs: list[Msg], kind: type[Bid] | type[Commit]) -> list[Bid] | list[Commit]:
    return [decode(m.data, kind) for m in msgs]


async def test_a_tag_is_resolved_where_the_order_enters_and_the_bid_carries_its_content(
    market: Market, tmp_path: Path
) -> None:
    svc = await serving(market)  # started before the push: its copy follows the tag
    digest, layers = await push(market, tmp_path, "acme/app:v1", b"v1" * 1000)
    await seen_by(svc.images.resolver.index, "acme/app:v1", digest)
    listener = await market.connect("listener")
    bids = await collect(listener, market.subjects.bid("mad"))
    commits = await collect(listener, market.subjects.commit("a"))
    events = await collect(listener, market.subjects.event("mad", "a", "placed"))
    client = await market.client()
    placed = await client.place(order(image="acme/app:v1"))
    assert isinstance(placed, Placed) and placed.image_digest == digest
    [bid] = [decode(m.data, Bid) for m in bids]
    assert (bid.image, bid.image_digest, bid.layers) == ("acme/app:v1", digest, layers)
    [commit] = [decode(m.data, Commit) for m in commits]
    assert (commit.image, commit.image_digest) == ("acme/app:v1", digest)
    shown = await client.machine("get", placed.machine_id)  # the worker's record
    assert (shown.image, shown.image_digest) == ("acme/app:v1", digest)
    await wait_until(lambda: bool(events))  # the worker's outbox sends it after its reply
    [placed_event] = [decode(m.data, Event) for m in events]
    assert (placed_event.kind, placed_event.image_digest) == ("placed", digest)


async def test_a_tag_moved_between_two_orders_gives_each_what_it_named_then(
    market: Market, tmp_path: Path
) -> None:
    svc = await serving(market)
    first, _ = await push(market, tmp_path, "acme/app:latest", b"one")
    await seen_by(svc.images.resolver.index, "acme/app", first)
    listener = await market.connect("listener")
    commits = await collect(listener, market.subjects.commit("a"))
    client = await market.client()
    earlier = order(image="acme/app")
    one = await client.place(earlier)
    assert isinstance(one, Placed) and one.image_digest == first
    second, _ = await push(market, tmp_path, "acme/app:latest", b"two")
    assert second != first
    await seen_by(svc.images.resolver.index, "acme/app", second)
    two = await client.place(order(image="acme/app"))
    assert isinstance(two, Placed) and two.image_digest == second
    assert [decode(m.data, Commit).image_digest for m in commits] == [first, second]
    # the first order sent again: its one machine, with the content it was placed with
    again = await client.place(msgspec.structs.replace(earlier, retry=True))
    assert isinstance(again, Placed)
    assert (again.machine_id, again.image_digest) == (one.machine_id, first)


async def test_a_digest_the_store_lacks_is_refused_at_once(market: Market) -> None:
    await serving(market)
    listener = await market.connect("listener")
    bids = await collect(listener, market.subjects.bid("mad"))
    client = await market.client()
    t0 = time.monotonic()
    with pytest.raises(ClientError) as refused:
        await client.place(order(image=UNKNOWN, deadline_ms=5000))
    assert time.monotonic() - t0 < 1.0  # an answer, not the deadline's timeout
    assert refused.value.code == "image_unknown"
    assert f"image {UNKNOWN!r}: the image store holds no sha256:{'0' * 64}" in str(refused.value)
    assert bids == []  # nothing was bid


async def test_a_malformed_digest_is_a_bad_request_naming_it(market: Market) -> None:
    await serving(market)
    client = await market.client()
    with pytest.raises(ClientError) as refused:
        await client.place(order(image="app@sha256:abc"))
    assert refused.value.code == "bad_request"
    assert "digest 'sha256:abc' is not sha256:<64 lowercase hex>" in str(refused.value)


async def test_a_name_the_store_does_not_know_goes_out_as_a_catalog_name(
    market: Market, tmp_path: Path
) -> None:
    svc = await serving(market)
    digest, _ = await push(market, tmp_path, "acme/app:v1", b"x")  # the store is not empty
    await seen_by(svc.images.resolver.index, "acme/app:v1", digest)
    listener = await market.connect("listener")
    bids = await collect(listener, market.subjects.bid("mad"))
    client = await market.client()
    for image in ("web", "acme/app:v2", "Not-A-Reference"):  # the sim driver runs any name
        assert isinstance(await client.place(order(image=image)), Placed)
    assert [(b.image, b.image_digest, b.layers) for b in decoded(bids, Bid)] == [
        ("web", "", []),
        ("acme/app:v2", "", []),
        ("Not-A-Reference", "", []),
    ]


async def test_a_name_no_store_and_no_worker_knows_is_unfilled_saying_so(
    market: Market,
) -> None:
    await market.host(worker("p1", driver="process", catalog={"web": {"command": ["true"]}}))
    await market.exchange()
    client = await market.client()
    o = order(image="nosuch")
    unfilled = await client.place(o)
    assert isinstance(unfilled, Unfilled) and unfilled.reason == "no_offers"
    told = await client.reasons(o, unfilled)
    assert "no worker serves image 'nosuch'" in told.detail, told.detail


async def test_direct_mode_resolves_the_same_way(market: Market, tmp_path: Path) -> None:
    await market.host(worker("a"))
    digest, layers = await push(market, tmp_path, "acme/app:v1", b"direct")
    listener = await market.connect("listener")
    bids = await collect(listener, market.subjects.bid("mad"))
    client = await market.client(direct=True, batch_bids=False)
    assert isinstance(await client.place(order(image="acme/app:v1")), Placed)
    [bid] = [decode(m.data, Bid) for m in bids]
    assert (bid.image_digest, bid.layers) == (digest, layers)
    with pytest.raises(ClientError) as refused:
        await client.place(order(image=UNKNOWN))
    assert refused.value.code == "image_unknown"
    moved, _ = await push(market, tmp_path, "acme/app:v1", b"moved")
    assert client._broker is not None  # direct: its watched copy follows the tag
    await seen_by(client._broker.images.index, "acme/app:v1", moved)
    assert isinstance(await client.place(order(image="acme/app:v1")), Placed)
    assert decode(bids[-1].data, Bid).image_digest == moved


async def test_a_dry_run_carries_the_content_the_order_would(
    market: Market, tmp_path: Path
) -> None:
    await serving(market)
    digest, layers = await push(market, tmp_path, "acme/app:v1", b"dry")
    listener = await market.connect("listener")
    asked = await collect(listener, market.subjects.explain("mad"))
    client = await market.client()  # through the exchange: one read of the tag
    dry = await client.explain(order(image="acme/app:v1"))
    assert dry.winner == "a"
    [req] = [decode(m.data, ExplainRequest) for m in asked]
    assert (req.image_digest, req.layers) == (digest, layers)
    with pytest.raises(ClientError) as refused:
        await client.explain(order(image=UNKNOWN))
    assert refused.value.code == "image_unknown"
