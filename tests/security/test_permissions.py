"""Least privilege, enforced by a real nats-server running the config `bourse auth init`
writes: every denial is observed as the server's permissions violation (through error_cb,
awaited) or as a refused connection, and each has a positive twin that shows the same
client may do what its role allows."""

from __future__ import annotations

from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bourse.nats.auth import inbox_prefix_for, new_seed, public_key_of, read_seed_file
from bourse.nats.connection import connect, flush_all
from bourse.nats.embedded import EmbeddedNats
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Commit, Event, ReclaimCheck, ReclaimVerdicts, Resources
from tests.security.conftest import Secured


async def test_unauthenticated_client_cannot_connect(secured_server: EmbeddedNats) -> None:
    nc = NATS()
    try:
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nc.connect(secured_server.url, allow_reconnect=False, connect_timeout=2)
    finally:
        await nc.close()
    assert not nc.is_connected


async def test_unknown_nkey_cannot_connect(secured_server: EmbeddedNats, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger.nk"
    stranger.write_text(new_seed() + "\n")
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await connect(
            secured_server.url,
            name="stranger",
            creds=str(stranger),
            service=False,
            allow_reconnect=False,
        )


async def test_buyer_cannot_publish_a_commit_to_a_worker(secured: Secured) -> None:
    s = secured.subjects
    sup, sup_v = await secured.connect("supplier:mad-1")
    commits = await sup.subscribe(s.commit("mad-1"))
    await flush_all(sup)
    buyer, v = await secured.connect("buyer")
    commit = Commit(
        order_id="o-1", worker_id="mad-1", resources=Resources(cpus=1, memory_mb=1), image="web"
    )
    await buyer.publish(s.commit("mad-1"), encode(commit))
    assert f'publish to "{s.commit("mad-1")}"' in await v.next()
    # and the worker never saw it: a round trip on its own connection comes back first
    await flush_all(sup)
    assert commits.pending_msgs == 0
    assert sup_v.none_yet()


async def test_buyer_cannot_listen_on_a_bid_subject(secured: Secured) -> None:
    s = secured.subjects
    buyer, v = await secured.connect("buyer")
    await buyer.subscribe(s.bid("mad"))
    assert f'subscription to "{s.bid("mad")}"' in await v.next()
    await buyer.subscribe(f"{s.bid('mad')}.3")  # nor a shard of it
    assert f'subscription to "{s.bid("mad")}.3"' in await v.next()


async def test_buyer_may_order_but_not_release_holds(secured: Secured) -> None:
    s = secured.subjects
    buyer, v = await secured.connect("buyer")
    # an order reaches nobody (no exchange), but the publish itself is allowed
    with pytest.raises(nats.errors.NoRespondersError):
        await buyer.request(s.order("mad"), b"{}", timeout=2)
    assert v.none_yet()
    await buyer.publish(s.release("mad-1"), b"{}")
    assert f'publish to "{s.release("mad-1")}"' in await v.next()


async def test_supplier_cannot_subscribe_to_another_workers_commits(secured: Secured) -> None:
    s = secured.subjects
    sup, v = await secured.connect("supplier:mad-1")
    await sup.subscribe(s.commit("mad-1"))  # its own: fine
    await flush_all(sup)
    assert v.none_yet()
    await sup.subscribe(s.commit("mad-2"))
    assert f'subscription to "{s.commit("mad-2")}"' in await v.next()
    await sup.subscribe(s.worker_all("*"))  # nor every worker's at once
    assert "subscription to" in await v.next()


async def test_supplier_cannot_publish_events_under_another_workers_id(secured: Secured) -> None:
    s = secured.subjects
    watcher, _ = await secured.connect("buyer")
    events = await watcher.subscribe(s.events())
    await flush_all(watcher)
    sup, v = await secured.connect("supplier:mad-1")
    forged = Event(kind="placed", region="mad", worker_id="mad-2", at_ms=1)
    await sup.publish(s.event("mad", "mad-2", "placed"), encode(forged))
    assert f'publish to "{s.event("mad", "mad-2", "placed")}"' in await v.next()
    await sup.publish(s.event("fra", "mad-1", "placed"), b"{}")  # nor in another region
    assert f'publish to "{s.event("fra", "mad-1", "placed")}"' in await v.next()
    # its own events go through, and are the only ones the watcher (a buyer) got
    await sup.publish(s.event("mad", "mad-1", "started"), b"{}")
    msg = await events.next_msg(timeout=5)
    assert msg.subject == s.event("mad", "mad-1", "started")
    assert events.pending_msgs == 0


async def test_supplier_cannot_listen_to_another_regions_bids(secured: Secured) -> None:
    s = secured.subjects
    sup, v = await secured.connect("supplier:mad-1")
    await sup.subscribe(s.bid("mad"))
    await sup.subscribe(s.bid_shard("mad", 4))
    await sup.subscribe(s.region_release("mad"))
    await sup.subscribe(s.status("mad"))
    await flush_all(sup)
    assert v.none_yet()
    await sup.subscribe(s.bid("fra"))
    assert f'subscription to "{s.bid("fra")}"' in await v.next()


async def test_fleet_user_covers_exactly_its_workers(secured: Secured) -> None:
    s = secured.subjects
    fleet, v = await secured.connect("supplier:fleet-fra")
    for wid in ("fra-1", "fra-2"):
        await fleet.subscribe(s.worker_all(wid))
        await fleet.publish(s.event("fra", wid, "placed"), b"{}")
    await fleet.subscribe(s.bid("fra"))
    await flush_all(fleet)
    assert v.none_yet()
    await fleet.subscribe(s.worker_all("mad-1"))
    assert f'subscription to "{s.worker_all("mad-1")}"' in await v.next()
    await fleet.subscribe(s.bid("mad"))
    assert f'subscription to "{s.bid("mad")}"' in await v.next()


async def test_supplier_cannot_bid_commit_or_order(secured: Secured) -> None:
    s = secured.subjects
    sup, v = await secured.connect("supplier:mad-1")
    for subject in (s.bid("mad"), s.commit("mad-2"), s.order("mad"), s.region_release("mad")):
        await sup.publish(subject, b"{}")
        assert f'publish to "{subject}"' in await v.next()


async def test_no_user_can_read_another_users_replies(secured: Secured) -> None:
    buyer, v = await secured.connect("buyer")
    # its connection uses its own inbox prefix, the only one it may subscribe to
    own = inbox_prefix_for(public_key_of(read_seed_file(secured.creds("buyer"))))
    assert buyer.new_inbox().startswith(own + ".")
    await buyer.subscribe(f"{own}.x")
    await flush_all(buyer)
    assert v.none_yet()
    await buyer.subscribe("_INBOX.>")
    # (nats-py lowercases the server's error text)
    assert 'subscription to "_inbox.>"' in await v.next()
    exchange_key = public_key_of(read_seed_file(secured.creds("exchange")))
    await buyer.subscribe(f"{inbox_prefix_for(exchange_key)}.>")
    assert "subscription to" in await v.next()


async def test_exchange_serves_orders_only_in_its_queue_group(secured: Secured) -> None:
    s = secured.subjects
    ex, v = await secured.connect("exchange")
    await ex.subscribe(s.order_all, queue="exchange")
    await ex.subscribe(s.machine_all, queue="exchange")
    await flush_all(ex)
    assert v.none_yet()
    await ex.subscribe(s.order_all)  # a plain subscription would see every order
    assert f'subscription to "{s.order_all}"' in await v.next()
    await ex.subscribe(s.events())  # and it has no business reading events
    assert "subscription to" in await v.next()


async def test_exchange_publishes_unfilled_outcomes_and_nothing_else_on_events(
    secured: Secured,
) -> None:
    s = secured.subjects
    watcher, _ = await secured.connect("buyer")
    events = await watcher.subscribe(s.events())
    await flush_all(watcher)
    ex, v = await secured.connect("exchange")
    await ex.publish(s.event("mad", "exchange", "unfilled"), b"{}")
    msg = await events.next_msg(timeout=5)
    assert msg.subject == s.event("mad", "exchange", "unfilled")
    await ex.publish(s.event("mad", "mad-1", "placed"), b"{}")  # no worker's event
    assert f'publish to "{s.event("mad", "mad-1", "placed")}"' in await v.next()
    await ex.publish(s.event("mad", "exchange", "placed"), b"{}")  # no other kind
    assert f'publish to "{s.event("mad", "exchange", "placed")}"' in await v.next()


async def test_every_region_status_buyer_asks_supplier_answers(secured: Secured) -> None:
    s = secured.subjects
    sup, sv = await secured.connect("supplier:mad-1")
    await sup.subscribe(s.status_every)
    await flush_all(sup)
    assert sv.none_yet()
    buyer, bv = await secured.connect("buyer")
    await buyer.publish(s.status_every, b"")
    await flush_all(buyer)
    assert bv.none_yet()


async def test_a_supplier_asks_about_its_own_reserved_machines_only(secured: Secured) -> None:
    """Reclaim checks (protocol §5.3d): a supplier may ask the exchange about its own
    workers' machines, never as another worker; the exchange answers into its inbox."""
    s = secured.subjects
    ex, ex_v = await secured.connect("exchange")

    async def answer(msg: Msg) -> None:
        await ex.publish(msg.reply, encode(ReclaimVerdicts(verdicts=[])))

    await ex.subscribe(s.reclaim_all, queue="exchange", cb=answer)
    await flush_all(ex)
    sup, v = await secured.connect("supplier:mad-1")
    check = ReclaimCheck(worker_id="mad-1", machines=[])
    reply = await sup.request(s.reclaim("mad-1"), encode(check), timeout=5)
    assert decode(reply.data, ReclaimVerdicts) == ReclaimVerdicts(verdicts=[])
    assert v.none_yet() and ex_v.none_yet()  # the answer into the supplier's inbox is allowed
    await sup.publish(s.reclaim("mad-2"), encode(check))
    assert f'publish to "{s.reclaim("mad-2")}"' in await v.next()
