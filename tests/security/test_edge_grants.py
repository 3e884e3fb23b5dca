"""The ``edge`` key (``bourse auth init`` writes it: every ``edge serve`` shares it), on a
live nats-server with the generated config: it follows a view of every row of the state
stream and reads an app's record; it asks the exchange for starts, stops and orders (and
the suppliers for listings, the exchange and suppliers may answer it); it hears the
market's live events (its page); and nothing else: no bids (neither sent nor heard), no
rows of the state stream, no commands of its own, no apps' records written, no tenant's
subjects."""

from __future__ import annotations

from bourse.client.apps.store import AppStore
from bourse.nats.auth import inbox_prefix_for
from bourse.nats.connection import flush_all
from bourse.nats.jetstream import apps_bucket_name
from bourse.nats.state import StateStream, ensure_state_stream
from bourse.view import open_view
from bourse.wire.codec import encode
from bourse.wire.messages import Amount, Machine, Resources, WorkerRow
from edge.viewroutes import view_table
from tests.security.conftest import PREFIX, Secured


async def test_the_edge_key_follows_the_view_and_asks_the_exchange(secured: Secured) -> None:
    s = secured.subjects
    exchange, ex_v = await secured.connect("exchange")
    assert await ensure_state_stream(exchange.jetstream(), StateStream.of(s))  # as it starts
    operator, _ = await secured.connect("operator")
    await AppStore.open(operator, PREFIX)  # the operator's set-up makes the apps bucket

    sup, sup_v = await secured.connect("supplier:mad-1")
    js = sup.jetstream(timeout=2)
    row = WorkerRow(worker_id="mad-1", region="mad", beat="mad-1", capacity=Amount(), free=Amount())
    await js.publish(s.state_worker("mad", "mad-1"), encode(row))
    m = Machine(
        machine_id="mad-1~A1", order_id="o1", worker_id="mad-1", region="mad", state="started",
        resources=Resources(cpus=1, memory_mb=64), image="web", metadata={"app": "web"},
        addresses={"http": "127.0.0.1:8080"},
    )  # fmt: skip
    await js.publish(s.state_machine("_", "mad", "mad-1", m.machine_id), encode(m))

    edge, v = await secured.connect("edge")
    async with open_view(edge, s) as view:  # a consumer over every row, its flow control
        table = view_table(view.db.db)
        assert [b.machine_id for b in table.apps["web"].backends] == ["mad-1~A1"]
    store = await AppStore.open(edge, PREFIX, create=False)  # its info, then a key read
    assert await store.get("web") is None

    asks = [s.machine("start"), s.order("o2"), s.explain("mad"), s.machines("mad")]
    for subject in [*asks, s.machines_every]:
        await edge.publish(subject, b"{}", reply=edge.new_inbox())
    await flush_all(edge)
    assert v.none_yet(), v.queue.get_nowait()

    refused = [
        s.bid("mad"),  # it neither bids
        s.state_worker("mad", "mad-1"),  # nor writes a row
        s.command("mad-1"),  # nor keeps a command itself (the exchange does)
        s.tenant_machine("alice", "start"),  # nor acts as a tenant
        f"$KV.{apps_bucket_name(PREFIX)}.web",  # nor writes an app's record
    ]
    for subject in refused:
        await edge.publish(subject, b"{}")
        assert f'publish to "{subject.lower()}"' in (await v.next()).lower()
    await edge.subscribe(s.events())  # the page's live events
    await flush_all(edge)
    assert v.none_yet(), v.queue.get_nowait()
    await edge.subscribe(s.bid("mad"))  # but no order's bids
    assert "subscription" in (await v.next()).lower()

    # the exchange and the suppliers answer into its inbox
    key = next(u.public_key for u in secured.files.users if u.name == "edge")
    for nc, watched in ((exchange, ex_v), (sup, sup_v)):
        await nc.publish(f"{inbox_prefix_for(key)}.x", b"{}")
        await flush_all(nc)
        assert watched.none_yet(), watched.queue.get_nowait()
    # ... and not into another's (a tenant's is theirs to answer): the check bites
    await sup.publish("_INBOX.nobody.x", b"{}")
    assert "publish to" in await sup_v.next()


async def test_a_tenant_hears_each_edges_share_of_its_own_machines_only(
    secured: Secured,
) -> None:
    """An edge's whole activity report names every tenant's machines: a tenant's key may not
    hear it, nor another tenant's share; it hears the share the edge publishes of its own
    machines (§4.23), which is what its deploy's drain waits on."""
    s = secured.subjects
    alice, alice_v = await secured.connect("buyer:alice")
    shares = await alice.subscribe(s.edge_activity_of("alice"))
    await flush_all(alice)
    assert alice_v.none_yet(), alice_v.queue.get_nowait()
    for refused in (s.edge_activity(), s.edge_activity_of("bob"), s.edge_activity_of()):
        await alice.subscribe(refused)
        assert "subscription" in (await alice_v.next()).lower()

    edge, v = await secured.connect("edge")
    await edge.publish(s.edge_activity("e1"), b"{}")  # the whole report
    await edge.publish(s.edge_activity_of("alice", "e1"), b"alice's share")
    await edge.publish(s.edge_activity_of("bob", "e1"), b"bob's share")
    await flush_all(edge)
    assert v.none_yet(), v.queue.get_nowait()
    assert (await shares.next_msg(timeout=5)).data == b"alice's share"
    # one publisher's messages arrive in order: the next she gets after hers is this one,
    # so bob's share, sent between, never reached her
    await edge.publish(s.edge_activity_of("alice", "e1"), b"next")
    assert (await shares.next_msg(timeout=5)).data == b"next"
    bob, bob_v = await secured.connect("buyer:bob")
    await bob.publish(s.edge_activity_of("alice", "e2"), b"forged")  # no tenant speaks for one
    assert "publish" in (await bob_v.next()).lower()
