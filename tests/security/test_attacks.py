"""Attacks, written from the attacker's side (issue 17): raw nats-py clients holding a
stolen or shared key (or none), against real programs on a real nats-server. Each test
asserts the attack fails and the market keeps serving. docs/security.md lists each threat
with the test here that covers it."""

from __future__ import annotations

import time
from pathlib import Path

from bourse.nats.connection import connect
from bourse.nats.embedded import EmbeddedNats
from bourse.runtime.launcher import start_program
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Bid, Event, Offer, Resources
from bourse.wire.subjects import Subjects

# The supplier's hold cap in the unauthenticated attack (its --max-hold-ms); the default is
# 5000 ms (supplier/config.py DEFAULT_MAX_HOLD_MS).
CAP_MS = 400
SLACK_MS = 1000  # clock reading and message latency between the test and the supplier


async def test_an_unauthenticated_bid_cannot_hold_capacity_for_a_minute(
    nats_server: EmbeddedNats, subjects: Subjects, tmp_path: Path
) -> None:
    """No key at all (a market without authorization): a raw Bid{hold_ms: 60000} for the
    whole worker gets an Offer whose hold lapses at the supplier's cap, the capacity comes
    back (hold_expired), and a real bid is offered the whole worker again."""
    prefix = subjects.prefix
    supplier = await start_program(
        "supplier",
        "run",
        *("--worker-id", "mad-1", "--region", "mad", "--cpus", "4", "--memory-mb", "4096"),
        *("--max-hold-ms", str(CAP_MS), "--data-dir", str(tmp_path / "mad-1")),
        *("--nats", nats_server.url, "--prefix", prefix),
        log_path=tmp_path / "supplier.log",
        ready="supplier ready",
    )
    try:
        nc = await connect(nats_server.url, name="attacker", service=False)
        expired = await nc.subscribe(subjects.events("mad", "mad-1", "hold_expired"))
        everything = Resources(cpus=4, memory_mb=4096)

        def bid(order_id: str, hold_ms: int) -> bytes:
            return encode(
                Bid(
                    order_id=order_id,
                    region="mad",
                    resources=everything,
                    image="web",
                    hold_ms=hold_ms,
                    auction_id=f"a-{order_id}",
                )
            )

        inbox = nc.new_inbox()
        offers = await nc.subscribe(inbox)
        sent_ms = int(time.time() * 1000)
        await nc.publish(subjects.bid("mad"), bid("squat", 60_000), reply=inbox)
        offer = decode((await offers.next_msg(timeout=5)).data, Offer)
        assert offer.worker_id == "mad-1" and offer.order_id == "squat"
        held_ms = offer.hold_expires_at_ms - sent_ms
        assert held_ms <= CAP_MS + SLACK_MS, f"held {held_ms} ms for a 60000 ms ask"

        # the hold lapses at the cap (the event, not a sleep) and the capacity is back
        ev = decode((await expired.next_msg(timeout=CAP_MS / 1000 + 5)).data, Event)
        assert ev.order_id == "squat"
        await nc.publish(subjects.bid("mad"), bid("honest", 750), reply=inbox)
        again = decode((await offers.next_msg(timeout=5)).data, Offer)
        assert again.order_id == "honest" and again.worker_id == "mad-1"
        await nc.close()
    finally:
        await supplier.stop()
