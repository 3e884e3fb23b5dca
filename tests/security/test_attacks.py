"""Attacks, written from the attacker's side (issue 17): raw nats-py clients holding a
stolen or shared key (or none), against real programs on a real nats-server. Each test
asserts the attack fails and the market keeps serving. docs/security.md lists each threat
with the test here that covers it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bourse.auction.core import FOREIGN_MACHINE, MACHINE_UNSHOWN, NOT_THIS_ORDER
from bourse.client import BourseClient, ClientError
from bourse.nats.auth import tenant_of
from bourse.nats.connection import connect, flush_all
from bourse.nats.embedded import EmbeddedNats
from bourse.runtime.launcher import start_program
from bourse.wire.codec import decode, encode
from bourse.wire.messages import (
    Bid,
    Error,
    Event,
    ExplainRequest,
    MachineRequest,
    Offer,
    Placed,
    Resources,
    StatusRequest,
    WorkerStatus,
)
from bourse.wire.signing import OfferSigner, TrustStore
from bourse.wire.subjects import Subjects
from exchange.service import ExchangeService
from supplier.host import SupplierHost
from supplier.store import Store
from tests.market import order, wait_until, worker
from tests.security.conftest import Secured, Violations

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
        *("--driver", "sim", "--worker-id", "mad-1", "--region", "mad", "--cpus", "4"),
        *("--memory-mb", "4096"),
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


# -- a secured market: mad-1 and mad-2, each on its own key, and an exchange with --trust ------


@dataclass
class Mad:
    secured: Secured
    hosts: dict[str, SupplierHost]
    exchange: ExchangeService
    buyer: BourseClient
    violations: dict[str, Violations]


@contextlib.asynccontextmanager
async def mad_market(secured: Secured, tmp_path: Path) -> AsyncIterator[Mad]:
    s = secured.subjects
    hosts: dict[str, SupplierHost] = {}
    violations: dict[str, Violations] = {}
    stores: list[Store] = []
    try:
        async with anyio.create_task_group() as tasks:
            for wid in ("mad-1", "mad-2"):
                user = f"supplier:{wid}"
                nc, v = await secured.connect(user)
                store = Store(tmp_path / wid / "supplier.db")
                stores.append(store)
                signer = OfferSigner(secured.files.seed_file(user).read_text())
                hosts[wid] = SupplierHost(nc, [worker(wid)], store, s, signer=signer)
                violations[user] = v
                await tasks.start(hosts[wid].run)
            ex_nc, violations["exchange"] = await secured.connect("exchange")
            exchange = ExchangeService(
                ex_nc, s, trust=TrustStore.load(secured.files.trust), claims=False
            )
            await tasks.start(exchange.run)
            buyer_nc, violations["buyer"] = await secured.connect("buyer")
            buyer = BourseClient(buyer_nc, s)
            yield Mad(secured, hosts, exchange, buyer, violations)
            tasks.cancel_scope.cancel()  # every service stops as on SIGTERM
    finally:
        for st in stores:
            st.close()


async def place(m: Mad, order_id: str, **kw: object) -> Placed:
    o = order(region="mad", order_id=order_id, deadline_ms=3000, **kw)  # type: ignore[arg-type]  # kw: order fields
    r = await m.buyer.place(o)
    assert isinstance(r, Placed), r
    return r


async def nothing_arrived(nc: NATS, sub: Subscription) -> bool:
    """Whether ``sub`` got nothing. Sound once the publisher's later message was received
    elsewhere: the server queues a connection's messages in order, so a PING/PONG on this
    connection comes after anything published to it before."""
    await flush_all(nc)
    return sub.pending_msgs == 0


# -- the stolen supplier key: someone else's machine ---------------------------------------------


async def test_a_supplier_key_cannot_hand_out_another_workers_machine(
    secured: Secured, tmp_path: Path
) -> None:
    """With mad-1's seed, an attacker answers bids for mad-1 with correctly signed
    existing-machine offers: a machine on mad-2 (the victim's), a machine id under mad-1
    that does not exist, and a real mad-1 machine of another order. None is handed out;
    the attacker's order gets a machine of its own, and the victim keeps its machine."""
    async with mad_market(secured, tmp_path) as m:
        victim = await place(m, "victim", exclude_workers=["mad-1"])
        assert victim.worker_id == "mad-2"
        bystander = await place(m, "bystander", exclude_workers=["mad-2"])
        assert bystander.worker_id == "mad-1"

        seed = secured.files.seed_file("supplier:mad-1").read_text()
        attacker, violations = await secured.connect("supplier:mad-1")
        signer = OfferSigner(seed)
        claims = [victim.machine_id, "mad-1~01M80QESDH2NAZQ4Z9ASNWXSKR", bystander.machine_id]
        sent: list[str] = []

        async def forge(msg: Msg) -> None:
            bid = decode(msg.data, Bid)
            if not bid.order_id.startswith("attack"):
                return
            claim = claims[len(sent) % len(claims)]
            offer = Offer(
                order_id=bid.order_id,
                auction_id=bid.auction_id,
                worker_id="mad-1",
                region="mad",
                score=1.0,
                machine_id=claim,
            )
            await attacker.publish(msg.reply, encode(signer.sign(offer)))
            sent.append(claim)

        await attacker.subscribe(secured.subjects.bid("mad"), cb=forge)
        await flush_all(attacker)
        for i in range(len(claims)):
            got = await place(m, f"attack-{i}")
            assert got.machine_id not in claims and not got.existing, got
        assert sent == claims
        assert dict(m.exchange.auctioneer.unverified) == {
            FOREIGN_MACHINE: 1,
            MACHINE_UNSHOWN: 1,
            NOT_THIS_ORDER: 1,
        }
        # the victim's machine is still the victim's, and only its order gets it back
        again = await place(m, "victim", exclude_workers=["mad-1"], retry=True)
        assert (again.machine_id, again.existing) == (victim.machine_id, True)
        assert violations.none_yet()
        assert [v for h in m.hosts.values() for v in h.check_invariants()] == []


async def test_an_order_id_reused_for_another_order_does_not_return_the_first_machine(
    secured: Secured, tmp_path: Path
) -> None:
    """With the buyer's key and a victim's order id (no claims here: the server has no
    JetStream), an order for another image, aimed at the victim's worker, is refused naming
    the mismatch instead of being answered with the victim's machine; the market keeps
    serving. Aimed (the other worker excluded), as an attacker after the machine would:
    otherwise the other worker's fresh offer may be committed before the victim's worker
    answers (the thief then gets a machine of its own, never the victim's)."""
    async with mad_market(secured, tmp_path) as m:
        victim = await place(m, "victim-order", exclude_workers=["mad-2"])
        attacker, violations = await secured.connect("buyer")
        thief = BourseClient(attacker, secured.subjects)
        stolen = order(region="mad", order_id="victim-order", image="db", exclude_workers=["mad-2"])
        with pytest.raises(ClientError) as err:
            await thief.place(stolen)
        assert err.value.code == "bad_request"
        assert f"placed as machine {victim.machine_id} for a different order" in str(err.value)
        assert "image 'web', not 'db'" in str(err.value)
        assert violations.none_yet()
        await place(m, "after")


# -- the shared buyer key: replies pointed at a worker's subjects ----------------------------------


@pytest.mark.parametrize(
    ("kind", "victim_subject"),
    [
        ("status", "worker.mad-2.commit"),
        ("explain", "worker.mad-2.release"),
        ("machine.get", "worker.mad-1.machine.destroy"),
        ("order", "worker.mad-2.machine.destroy"),  # (its commit subject sees the real one)
    ],
)
async def test_a_buyer_cannot_make_a_program_publish_on_a_workers_subject(
    secured: Secured, tmp_path: Path, kind: str, victim_subject: str
) -> None:
    """With the buyer's key, a request whose reply subject is a worker's commit, release or
    destroy subject: the program that gets it drops it unanswered (counted), nothing is
    published there, and the same request with an inbox is answered as usual."""
    s = secured.subjects
    victim = f"{s.root}.{victim_subject}"
    async with mad_market(secured, tmp_path) as m:
        placed = await place(m, "victim", exclude_workers=["mad-2"])
        wid = victim_subject.split(".")[1]
        ear_nc, ear_v = await secured.connect(f"supplier:{wid}")  # the victim worker's ear
        ear = await ear_nc.subscribe(victim)
        await flush_all(ear_nc)
        attacker, violations = await secured.connect("buyer")
        subject, body = {
            "status": (s.status("mad"), encode(StatusRequest())),
            "explain": (s.explain("mad"), encode(ExplainRequest(**_order_fields()))),
            "machine.get": (s.machine("get"), encode(MachineRequest(machine_id=placed.machine_id))),
            "order": (s.order("mad"), encode(order(region="mad", order_id="o-deputy"))),
        }[kind]
        await attacker.publish(subject, body, reply=victim)
        # the same request, answered into an inbox: handled after the attack's (in order)
        answer = await attacker.request(subject, body, timeout=5)
        assert answer.data and not isinstance(_maybe_error(answer.data), Error)
        assert await nothing_arrived(ear_nc, ear)
        dropped = {name: h.responder.counts["reply_not_inbox"] for name, h in m.hosts.items()} | {
            "exchange": m.exchange.responder.counts["reply_not_inbox"]
        }
        expect = "exchange" if kind in ("machine.get", "order") else None
        if expect:
            assert dropped == {"mad-1": 0, "mad-2": 0, "exchange": 1}
        else:  # every supplier of the region got it, and each dropped it
            assert dropped == {"mad-1": 1, "mad-2": 1, "exchange": 0}
        assert violations.none_yet() and ear_v.none_yet()
        await place(m, "after")  # the market keeps serving


def _order_fields() -> dict[str, object]:
    o = order(region="mad", order_id="o-why")
    return {"order_id": o.order_id, "region": "mad", "resources": o.resources, "image": o.image}


def _maybe_error(data: bytes) -> object:
    try:
        return decode(data, Error)
    except Exception:
        return None


async def test_a_rogue_responder_cannot_publish_on_a_reply_subject_it_was_handed(
    secured: Secured,
) -> None:
    """The server half: a supplier key (stolen, in a process that skips the check) gets a
    buyer's status request whose reply subject is another worker's commit subject; the
    server refuses the publish (no allow_responses), and only an inbox reply goes through."""
    s = secured.subjects
    victim = s.commit("mad-2")
    ear_nc, _ = await secured.connect("supplier:mad-2")
    ear = await ear_nc.subscribe(victim)
    await flush_all(ear_nc)
    rogue, rogue_v = await secured.connect("supplier:mad-1")

    async def deputy(msg: Msg) -> None:
        status = WorkerStatus.__name__  # any payload: the server decides, not the content
        await rogue.publish(msg.reply, status.encode())

    await rogue.subscribe(s.status("mad"), cb=deputy)
    await flush_all(rogue)
    buyer, _ = await secured.connect("buyer")
    await buyer.publish(s.status("mad"), b"", reply=victim)
    refused = await rogue_v.next()
    assert "publish" in refused.lower() and victim in refused
    answer = await buyer.request(s.status("mad"), b"", timeout=5)  # an inbox: allowed
    assert answer.data == b"WorkerStatus"
    assert await nothing_arrived(ear_nc, ear)


# -- tenants: every buyer is no longer every other buyer -------------------------------------------


async def test_a_tenant_cannot_reach_another_tenants_machines(
    secured: Secured, tmp_path: Path
) -> None:
    """alice and bob each hold their own key (auth init --buyer). bob cannot get, stop,
    destroy or read the logs of alice's machine, does not see it in a listing, gets a
    machine of his own when he reuses her order id, and cannot speak as alice or as the
    operator (the server refuses), nor read events. alice keeps her machine and can act on
    it; the operator's shared key still sees everything."""
    s = secured.subjects
    async with mad_market(secured, tmp_path) as m:
        clients = {}
        for name in ("alice", "bob"):
            nc, _ = await secured.connect(f"buyer:{name}")
            clients[name] = BourseClient(nc, s, tenant=tenant_of(secured.creds(f"buyer:{name}")))
        alice, bob = clients["alice"], clients["bob"]
        assert (alice.tenant, bob.tenant) == ("alice", "bob")
        theirs = await alice.place(order(region="mad", order_id="a1", deadline_ms=3000))
        assert isinstance(theirs, Placed) and theirs.order_id == "a1"
        mid = theirs.machine_id

        for verb in ("get", "stop", "destroy"):
            with pytest.raises(ClientError, match=f"machine {mid} is not one of 'bob'"):
                await bob.machine(verb, mid)
        with pytest.raises(ClientError, match="is not one of 'bob'"):
            await bob.logs(mid)
        assert (await bob.machines(theirs.worker_id)).machines == []
        mine = await bob.place(order(region="mad", order_id="a1", deadline_ms=3000))
        assert isinstance(mine, Placed) and mine.machine_id != mid and not mine.existing
        assert m.exchange.responder.counts["not_owner"] == 4

        # a dry run finds each tenant's own machine for "a1", not the other's
        why = await alice.explain(order(region="mad", order_id="a1", deadline_ms=2000))
        assert mid in {v.machine_id for v in why.verdicts if v.verdict == "existing"}
        why = await bob.explain(order(region="mad", order_id="a1", deadline_ms=2000))
        assert {v.machine_id for v in why.verdicts if v.verdict == "existing"} == {mine.machine_id}

        # alice's machine is untouched, hers to act on, and listed for her alone
        shown = await alice.machine("get", mid)
        assert (shown.order_id, shown.state != "destroyed") == ("a1", True)
        assert [x.machine_id for x in (await alice.machines(theirs.worker_id)).machines] == [mid]
        assert (await alice.machine("destroy", mid)).state == "destroyed"
        # the operator's key sees every tenant's machines, scoped ids and all
        everything = await m.buyer.machines(theirs.worker_id, include_destroyed=True)
        assert {x.order_id for x in everything.machines} >= {"alice:a1"}

        # bob's key cannot speak as alice, as the operator, or listen to events
        raw, v = await secured.connect("buyer:bob")
        for subject in (s.tenant_order("alice", "mad"), s.order("mad"), s.machine("get")):
            await raw.publish(subject, b"{}")
            assert subject in await v.next()
        await raw.subscribe(s.events())
        assert "subscription" in (await v.next()).lower()
        await place(m, "after")  # the market keeps serving


async def test_a_status_flood_is_shed_and_the_market_keeps_serving(
    secured: Secured, tmp_path: Path
) -> None:
    """With the buyer's key, 5000 status requests at once (each would be answered by every
    worker): a supplier answers what it can and drops what queues behind FANOUT_BACKLOG
    (counted), and a status request and an order afterwards are answered as usual."""
    s = secured.subjects
    async with mad_market(secured, tmp_path) as m:
        flood, violations = await secured.connect("buyer")
        inbox = flood.new_inbox()
        replies = await flood.subscribe(inbox)
        body = encode(StatusRequest())
        for _ in range(5000):
            await flood.publish(s.status("mad"), body, reply=inbox)
        await flush_all(flood)
        # every flooded request was taken off the queue (answered or shed)
        await wait_until(
            lambda: all(h.responder.counts["requests"] >= 5000 for h in m.hosts.values()), 30
        )
        shed = {w: h.responder.counts["fanout_shed"] for w, h in m.hosts.items()}
        assert all(n > 0 for n in shed.values()), shed
        assert replies.delivered <= 2 * 5000 - sum(shed.values())  # shed: never answered
        answered = await m.buyer.status("mad", within_s=5)  # the flood is over: answered
        assert [st.worker_id for st in answered] == ["mad-1", "mad-2"]
        assert violations.none_yet()
        await place(m, "after")


# -- why not allow_responses ---------------------------------------------------------------------


async def test_allow_responses_would_let_a_responder_publish_on_a_subject_it_denies(
    tmp_path: Path,
) -> None:
    """The reason auth.conf grants inbox allows instead (docs/security.md): with nats-server's
    allow_responses, a responder may publish on any reply subject it is handed, even one its
    publish deny list names (the response grant is checked after the deny). If a future
    nats-server makes the deny win, this fails: the pairing could then be reconsidered."""
    conf = tmp_path / "s.conf"
    conf.write_text(
        "authorization { users = [\n"
        '  { user: r, password: r, permissions: { subscribe: { allow: ["svc"] },\n'
        '    publish: { allow: ["ok.>"], deny: ["victim.>"] },\n'
        '    allow_responses: { max: -1, expires: "1m" } } }\n'
        '  { user: q, password: q, permissions: { publish: { allow: ["svc"] },\n'
        '    subscribe: { allow: ["_INBOX.>"] } } }\n'
        '  { user: v, password: v, permissions: { subscribe: { allow: ["victim.>"] } } }\n'
        "] }\n"
    )
    with EmbeddedNats(workdir=tmp_path / "nats", config=conf, jetstream=False) as srv:
        conns = []
        try:
            for user in ("r", "q", "v"):
                url = srv.url.replace("nats://", f"nats://{user}:{user}@")
                conns.append(await connect(url, name=user, service=False))
            r, q, v = conns
            ear = await v.subscribe("victim.>")
            await flush_all(v)

            async def respond(msg: Msg) -> None:
                await r.publish(msg.reply, b"reply")

            await r.subscribe("svc", cb=respond)
            await flush_all(r)
            # The server does not always let the first response through (about 1 run in
            # 20 here, with nothing in its log): the property is that one can get through
            # at all, so a few requests are sent; a server where the deny wins stops all.
            got = None
            for _ in range(5):
                await q.publish("svc", b"", reply="victim.commit")
                with contextlib.suppress(nats.errors.TimeoutError):
                    got = await ear.next_msg(timeout=1)  # delivered despite the deny
                    break
            assert got is not None, "the deny won: no response reached victim.commit"
            assert (got.subject, got.data) == ("victim.commit", b"reply")
        finally:
            for nc in conns:
                await nc.close()
