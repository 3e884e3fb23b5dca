"""Commands kept for a worker (docs/protocol.md §4.20) under the generated permissions:
only the operator and the exchange may publish on ``R.command.*`` (buyers, tenants and
suppliers are refused by the server); a tenant's queued stop acts on its own machines only
(the worker checks it when it is back)."""

from __future__ import annotations

from pathlib import Path

from bourse.client import BourseClient
from bourse.nats.auth import tenant_of
from bourse.nats.commands import command_for, command_stream_name, keep
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


async def test_a_tenants_queued_stop_reaches_its_own_machine_only(
    secured_js: Secured, tmp_path: Path
) -> None:
    s = secured_js.subjects
    async with Market(secured_js.url, s, tmp_path) as m:
        nc, _ = await secured_js.connect("exchange")
        await m.serve(ExchangeService(nc, s))

        async def mad_1() -> SupplierHost:
            sup, _ = await secured_js.connect("supplier:mad-1")
            store = Store(tmp_path / "mad-1" / "supplier.db")
            m.stores.append(store)
            host = SupplierHost(sup, [worker("mad-1")], store, s)
            await m.serve(host)
            return host

        host = await mad_1()
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

        host = await mad_1()  # back: alice's is dropped, bob's applied
        await wait_until(lambda: sum(host.commands.counts.values()) == 2, 10)
        assert host.commands.counts == {"drop": 1, "apply": 1}
        assert (await clients["bob"].machine("get", bobs.machine_id)).state == "stopped"
