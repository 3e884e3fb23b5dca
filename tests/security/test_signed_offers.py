"""Signed offers: the exact bytes signed, every way a check fails, and a rogue responder
on the bus (a supplier of the same region, with real credentials) that answers bids for
another worker: without a trust file its forged machine claim wins, with one it is
ignored and the real worker's offer wins."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anyio
import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bourse.auction.auctioneer import Auctioneer
from bourse.auction.core import MACHINE_UNSHOWN, AuctionConfig
from bourse.nats.auth import new_seed
from bourse.nats.connection import flush_all
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Bid, Offer, Placed, Unfilled
from bourse.wire.signing import (
    BAD_SIGNATURE,
    UNKNOWN_WORKER,
    UNSIGNED,
    WRONG_KEY,
    OfferSigner,
    TrustError,
    TrustStore,
    offer_signing_bytes,
)
from supplier.host import SupplierHost
from supplier.store import Store
from tests.market import order, wait_until, worker
from tests.security.conftest import Secured

OFFER = Offer(
    order_id="o-1",
    auction_id="A1",
    worker_id="mad-1",
    region="mad",
    score=0.75,
    subscores={"memory_mb": 0.5, "cpus": 0.1},
    image_cached=True,
    hold_expires_at_ms=1700000000000,
)


def test_the_signed_bytes_are_exactly_the_documented_ones() -> None:
    assert offer_signing_bytes(OFFER) == (
        b'["bourse.v1.offer","o-1","A1","mad-1","mad","0.75",true,1700000000000,"",'
        b'[["cpus","0.10000000000000001"],["memory_mb","0.5"]]]'
    )


def test_a_signed_offer_survives_the_wire_and_verifies() -> None:
    signer = OfferSigner(new_seed())
    trust = TrustStore({"mad-1": signer.public_key})
    wire = decode(encode(signer.sign(OFFER)), Offer)
    assert wire.signer == signer.public_key and len(wire.sig) == 86
    assert trust.check(wire) is None


@pytest.mark.parametrize(
    "change",
    [
        {"score": 0.99},
        {"worker_id": "mad-2"},
        {"region": "fra"},
        {"order_id": "o-2"},
        {"auction_id": "A2"},  # replayed into another run of the same order
        {"machine_id": "mad-1~FAKE"},
        {"subscores": {"cpus": 1.0}},
    ],
)
def test_any_tampered_field_breaks_the_signature(change: dict[str, object]) -> None:
    signer = OfferSigner(new_seed())
    trust = TrustStore({"mad-1": signer.public_key, "mad-2": signer.public_key})
    tampered = msgspec.structs.replace(signer.sign(OFFER), **change)
    assert trust.check(tampered) == BAD_SIGNATURE


def test_unsigned_unknown_and_wrong_key_offers_are_told_apart() -> None:
    real, rogue = OfferSigner(new_seed()), OfferSigner(new_seed())
    trust = TrustStore({"mad-1": real.public_key})
    assert trust.check(OFFER) == UNSIGNED
    assert trust.check(rogue.sign(OFFER)) == WRONG_KEY
    # a rogue that writes the trusted key in `signer` still cannot make its signature
    forged = msgspec.structs.replace(rogue.sign(OFFER), signer=real.public_key)
    assert trust.check(forged) == BAD_SIGNATURE
    assert trust.check(msgspec.structs.replace(real.sign(OFFER), sig="!!")) == BAD_SIGNATURE
    stranger = msgspec.structs.replace(OFFER, worker_id="zzz")
    assert trust.check(real.sign(stranger)) == UNKNOWN_WORKER


def test_bad_trust_files_are_named(tmp_path: Path) -> None:
    f = tmp_path / "trust.json"
    with pytest.raises(TrustError, match="cannot read trust file"):
        TrustStore.load(f)
    f.write_text("{")
    with pytest.raises(TrustError, match="is not JSON"):
        TrustStore.load(f)
    f.write_text(json.dumps({"mad-1": "U"}))
    with pytest.raises(TrustError, match=re.escape('expected {"workers"')):
        TrustStore.load(f)
    good = OfferSigner(new_seed()).public_key
    f.write_text(json.dumps({"workers": {"mad-1": good[:-1] + ("A" if good[-1] != "A" else "B")}}))
    with pytest.raises(TrustError, match="checksum mismatch"):
        TrustStore.load(f)
    f.write_text(json.dumps({"workers": {"Mad 1": good}}))
    with pytest.raises(TrustError, match="invalid worker id 'Mad 1'"):
        TrustStore.load(f)


class Rogue:
    """Supplier mad-2 (real credentials, so it may hear mad's bids and answer them) gone
    bad: it answers every bid at once with three forged offers."""

    def __init__(self, nc: NATS, seed: str) -> None:
        self.nc = nc
        self.signer = OfferSigner(seed)
        self.sent = 0

    def offers(self, bid: Bid) -> list[Offer]:
        claim = Offer(
            order_id=bid.order_id,
            auction_id=bid.auction_id,
            worker_id="mad-1",
            region=bid.region,
            score=1.0,
            machine_id="mad-1~FAKE",  # "that order already runs here": no commit needed
        )
        own = self.signer.sign(msgspec.structs.replace(claim, worker_id="mad-2", machine_id=None))
        return [
            claim,  # unsigned
            self.signer.sign(claim),  # signed, but with mad-2's key
            msgspec.structs.replace(own, score=1.0, subscores={"x": 1.0}),  # altered after
        ]

    async def on_bid(self, msg: Msg) -> None:
        for offer in self.offers(decode(msg.data, Bid)):
            await self.nc.publish(msg.reply, encode(offer))
            self.sent += 1


async def test_a_rogue_responder_cannot_answer_for_another_worker(
    secured: Secured, tmp_path: Path
) -> None:
    s = secured.subjects
    rogue_nc, rogue_v = await secured.connect("supplier:mad-2")
    rogue = Rogue(rogue_nc, secured.files.seed_file("supplier:mad-2").read_text())
    await rogue_nc.subscribe(s.bid("mad"), cb=rogue.on_bid)
    await flush_all(rogue_nc)
    ex_nc, ex_v = await secured.connect("exchange")
    trust = TrustStore.load(secured.files.trust)
    # a long quiet time: the auction waits for every forged offer, however slow the machine
    cfg = AuctionConfig(quiet_ms=1000)
    trusting = Auctioneer(ex_nc, s, cfg, trust=trust)
    naive = Auctioneer(ex_nc, s, cfg)
    try:
        # 1. only the rogue answers. Without trust, its forged machine claim is not believed
        # either: mad-1 (absent; only its user may serve worker.mad-1.>) does not show it
        naive_r = await naive.run(order(region="mad", order_id="o-naive", deadline_ms=3000))
        assert not isinstance(naive_r, Placed), naive_r
        assert naive.unverified == {MACHINE_UNSHOWN: 2}  # the unsigned and mad-2-signed claims
        # with trust, every forged offer is dropped, by reason, and nothing is placed
        r = await trusting.run(order(region="mad", order_id="o-1", deadline_ms=3000))
        assert isinstance(r, Unfilled) and r.reason == "no_offers", r
        assert "3 offer(s) failed the signature check" in r.detail
        assert trusting.unverified == {UNSIGNED: 1, WRONG_KEY: 1, BAD_SIGNATURE: 1}

        # 2. the real mad-1 joins, on its own credentials, signing with its own key
        sup_nc, sup_v = await secured.connect("supplier:mad-1")
        store = Store(tmp_path / "mad-1" / "supplier.db")
        signer = OfferSigner(secured.files.seed_file("supplier:mad-1").read_text())
        host = SupplierHost(sup_nc, [worker("mad-1")], store, s, signer=signer)
        try:
            async with anyio.create_task_group() as tasks:
                await tasks.start(host.run)
                won = await trusting.run(order(region="mad", order_id="o-2", deadline_ms=3000))
                assert isinstance(won, Placed) and won.worker_id == "mad-1", won
                assert won.machine_id != "mad-1~FAKE" and not won.existing
                assert won.machine_id in host.workers["mad-1"].machines  # a real machine
                tasks.cancel_scope.cancel()  # the host stops as on SIGTERM
        finally:
            store.close()
        await wait_until(lambda: rogue.sent == 9)  # three bids, three forgeries each
        assert sup_v.none_yet() and ex_v.none_yet() and rogue_v.none_yet()
    finally:
        await trusting.close()
        await naive.close()
