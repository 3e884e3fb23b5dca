"""Fleet-wide listings under the generated permissions (docs/protocol.md §2.1, §4.17): the
operator's buyer key lists every machine on ``R.machines[.<region>]``; a tenant may not
publish there (it would see every tenant's machines) and lists through the exchange, which
keeps its own machines only."""

from __future__ import annotations

from pathlib import Path

from bourse.client import BourseClient
from bourse.nats.auth import tenant_of
from bourse.wire.messages import ListMachines, Placed
from tests.market import order
from tests.security.conftest import Secured
from tests.security.test_attacks import mad_market


async def test_tenants_list_only_their_machines_and_cannot_ask_the_suppliers(
    secured: Secured, tmp_path: Path
) -> None:
    s = secured.subjects
    async with mad_market(secured, tmp_path) as m:
        clients = {}
        for name in ("alice", "bob"):
            nc, _ = await secured.connect(f"buyer:{name}")
            clients[name] = BourseClient(nc, s, tenant=tenant_of(secured.creds(f"buyer:{name}")))
        placed = {}
        for name, c in clients.items():
            r = await c.place(
                order(region="mad", order_id=f"{name}-1", metadata={"app": name}, deadline_ms=3000)
            )
            assert isinstance(r, Placed), r
            placed[name] = r

        # the operator's key: every machine, scoped order ids, through the suppliers
        every = await m.buyer.list_machines()
        assert every.complete and every.regions == ["mad"]
        assert sorted(x.order_id for x in every.machines) == ["alice:alice-1", "bob:bob-1"]

        # a tenant: its own machines only (its own order ids), complete, filters work
        for name, c in clients.items():
            mine = await c.list_machines()
            assert mine.complete and mine.missing == [], mine
            assert [(x.machine_id, x.order_id) for x in mine.machines] == [
                (placed[name].machine_id, f"{name}-1")
            ]
            other = "bob" if name == "alice" else "alice"
            assert (await c.list_machines(request=ListMachines(app=other))).machines == []

        # a tenant's key cannot publish the listing subjects: the server refuses
        raw, v = await secured.connect("buyer:bob")
        for subject in (s.machines("mad"), s.machines_every):
            await raw.publish(subject, b"{}", reply=raw.new_inbox())
            assert subject in await v.next()
        assert all(vs.none_yet() for vs in m.violations.values())
