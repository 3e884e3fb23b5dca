"""Commands kept for a worker (docs/protocol.md §4.20) under the generated permissions:
only the operator and the exchange may publish on ``R.command.*`` (buyers, tenants and
suppliers are refused by the server); a tenant's queued stop acts on its own machines only
(the worker checks it when it is back); a supplier's key makes, fetches from and
acknowledges only its own workers' consumers, never another worker's queued command."""

from __future__ import annotations

from pathlib import Path

import nats.errors
import pytest

from bourse.client import BourseClient
from bourse.nats.auth import tenant_of
from bourse.nats.commands import (
    command_for,
    command_stream_name,
    consumer_config,
    consumer_name,
    keep,
)
from bourse.nats.connection import flush_all
from bourse.wire.codec import encode
from bourse.wire.messages import MachineCommand, Placed
from exchange.service import ExchangeService
from supplier.host import SupplierHost
from supplier.store import Store
from tests.market import Market, order, wait_until, worker
from tests.security.conftest import Secured

MID = "mad-1~01J0000000000000000000000A"


async def test_only_the_operator_and_the_exchange_may_write_commands(
    secured_js: Secured, tmp_path: Path
) -> None:
    s = secured_js.subjects
    async with Market(secured_js.url, s, tmp_path) as m:
        nc, _ = await secured_js.connect("exchange")
        await m.serve(ExchangeService(nc, s))  # makes the command stream
        body = encode(command_for("stop", MID, "operator"))
        for user in ("buyer", "buyer:alice", "supplier:mad-1"):
            raw, v = await secured_js.connect(user)
            await raw.publish(s.command("mad-1"), body)
            assert f'publish to "{s.command("mad-1")}"' in await v.next(), user
        for user in ("operator", "exchange"):
            ok, v = await secured_js.connect(user)
            await keep(ok.jetstream(), s, command_for("stop", MID, user))
            await flush_all(ok)
            assert v.none_yet(), user
        op, _ = await secured_js.connect("operator")
        info = await op.jetstream().stream_info(command_stream_name(s.prefix))
        assert info.state.messages == 2


async def mad_1(m: Market, secured: Secured, tmp_path: Path) -> SupplierHost:
    """Supplier mad-1 on its own key, its store in ``tmp_path`` (started again: the same)."""
    sup, _ = await secured.connect("supplier:mad-1")
    store = Store(tmp_path / "mad-1" / "supplier.db")
    m.stores.append(store)
    host = SupplierHost(sup, [worker("mad-1")], store, secured.subjects)
    await m.serve(host)
    return host


async def test_a_tenants_queued_stop_reaches_its_own_machine_only(
    secured_js: Secured, tmp_path: Path
) -> None:
    s = secured_js.subjects
    async with Market(secured_js.url, s, tmp_path) as m:
        nc, _ = await secured_js.connect("exchange")
        await m.serve(ExchangeService(nc, s))

        host = await mad_1(m, secured_js, tmp_path)
        clients = {}
        for name in ("alice", "bob"):
            tnc, _ = await secured_js.connect(f"buyer:{name}")
            clients[name] = BourseClient(
                tnc, s, tenant=tenant_of(secured_js.creds(f"buyer:{name}"))
            )
        bobs = await clients["bob"].place(order(region="mad", order_id="b-1", deadline_ms=3000))
        assert isinstance(bobs, Placed)
        await clients["bob"].machine("start", bobs.machine_id)
        await m.stop(host)
        await host.nc.close()

        # the worker is away: both are kept, each saying which tenant asked
        kept = {n: await c.machine_or_kept("stop", bobs.machine_id) for n, c in clients.items()}
        by = sorted(k.requested_by for k in kept.values() if isinstance(k, MachineCommand))
        assert by == ["tenant:alice", "tenant:bob"]

        host = await mad_1(m, secured_js, tmp_path)  # back: alice's is dropped, bob's applied
        await wait_until(lambda: sum(host.commands.counts.values()) == 2, 10)
        assert host.commands.counts == {"drop": 1, "apply": 1}
        assert (await clients["bob"].machine("get", bobs.machine_id)).state == "stopped"


async def test_a_supplier_key_cannot_take_another_workers_queued_command(
    secured_js: Secured, tmp_path: Path
) -> None:
    """Issue 36's attack 4: with supplier mad-2's key, bind mad-1's durable consumer and ack
    its queued stop, so that mad-1 never applies it (two primaries run). Every way in is
    refused by the server: making or changing mad-1's consumer, a consumer of mad-2's name
    filtered on mad-1's subject, one with no filter in its subject, the legacy durable
    create, fetching from mad-1's consumer, acknowledging one of its messages. The stop
    stays kept; mad-1, back, applies it."""
    s = secured_js.subjects
    stream = command_stream_name(s.prefix)
    async with Market(secured_js.url, s, tmp_path) as m:
        nc, _ = await secured_js.connect("exchange")
        await m.serve(ExchangeService(nc, s))

        host = await mad_1(m, secured_js, tmp_path)  # its consumer, cmd-mad-1, made
        buyer, _ = await secured_js.connect("buyer")
        client = BourseClient(buyer, s)
        placed = await client.place(order(region="mad", order_id="p-1", deadline_ms=3000))
        assert isinstance(placed, Placed)
        await client.machine("start", placed.machine_id)
        await m.stop(host)
        await host.nc.close()
        kept = await client.machine_or_kept("stop", placed.machine_id)
        assert isinstance(kept, MachineCommand) and kept.worker_id == "mad-1"

        attacker, violations = await secured_js.connect("supplier:mad-2")
        js = attacker.jetstream(timeout=1)
        theirs = consumer_config(s, "mad-1")
        mine_on_theirs = consumer_config(s, "mad-2")
        mine_on_theirs.filter_subject = s.command("mad-1")
        for config in (theirs, mine_on_theirs):
            with pytest.raises(nats.errors.TimeoutError):  # refused: no answer comes
                await js.add_consumer(stream, config)
        mad_1s = consumer_name("mad-1")
        attempts = [
            f"$JS.API.CONSUMER.CREATE.{stream}.{consumer_name('mad-2')}",  # no filter named
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{mad_1s}",
            f"$JS.API.CONSUMER.DELETE.{stream}.{mad_1s}",
            f"$JS.API.CONSUMER.INFO.{stream}.{mad_1s}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{mad_1s}",
            f"$JS.ACK.{stream}.{mad_1s}.1.1.1.1700000000000000000.0",
        ]
        for subject in attempts:
            await attacker.publish(subject, b'{"batch": 1}', reply=attacker.new_inbox())
        sub = await js.pull_subscribe_bind(durable=mad_1s, stream=stream)
        with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
            await sub.fetch(1, timeout=1)
        await flush_all(attacker)
        denied = violations.denied()
        assert {a.lower() for a in attempts} <= denied
        op, _ = await secured_js.connect("operator")
        assert (await op.jetstream().stream_info(stream)).state.messages == 1  # still kept

        host = await mad_1(m, secured_js, tmp_path)  # back: it applies the stop first
        await wait_until(lambda: host.commands.counts["apply"] == 1, 10)
        assert (await client.machine("get", placed.machine_id)).state == "stopped"
        assert (await op.jetstream().stream_info(stream)).state.messages == 0
