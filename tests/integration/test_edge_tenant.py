"""The edge for a tenant's apps, end to end on a market with keys (what ``bourse auth init
--buyer acme`` writes: bourse/nats/authdir.py) on a real nats-server: every service on its
own role's key, the tenant on its own, real ``edge serve`` programs on the edge's key. A
request places the tenant's missing machine and a controller heals the tenant's app, each
through the exchange as the shared buyer under the tenant's scope of the order id: the
machine is the tenant's own, one machine whoever places it. Every wait is on an event (an
answer, a row, a line), never a sleep."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from bourse.client import BourseClient
from bourse.client.apps.apply import apply, context
from bourse.client.apps.spec import AppSpec
from bourse.client.apps.store import AppRecord, AppStore
from bourse.nats.authdir import AuthFiles, SupplierSpec, write_auth_dir
from bourse.nats.connection import connect, flush_all
from bourse.nats.embedded import EmbeddedNats
from bourse.view import open_view
from bourse.wire.codec import decode
from bourse.wire.messages import EdgeActivity, ListMachines, Machine, Resources
from bourse.wire.subjects import Subjects
from tests.cli import buyer
from tests.edgekit import answered, edge
from tests.integration.test_edge_control import (
    drained,
    heal_hosts,
    healed_once,
    placed_once,
    primary_and_spare,
    process_market,
)
from tests.isolation import own_worker_id
from tests.market import Market, wait_until
from tests.security.conftest import Violations

PREFIX = "ten"
TENANT = "acme"
FLEET = "fleet"  # one supplier user for every worker of a test


class KeyedMarket(Market):
    """tests/market.py's market, each connection on its role's key: the suppliers on
    FLEET's, the exchange, the operator's set-up and the shared buyer on theirs, the tenant
    on ``buyer:acme``'s; anything else watches on the edge's (it reads every row)."""

    def __init__(self, url: str, tmp_path: Path, files: AuthFiles) -> None:
        super().__init__(url, Subjects(PREFIX), tmp_path)
        self.files = files

    def creds(self, name: str) -> str:
        user = {"supplier": f"supplier:{FLEET}", TENANT: f"buyer:{TENANT}"}.get(name, name)
        known = {u.name for u in self.files.users}
        return str(self.files.seed_file(user if user in known else "edge"))

    async def connect(self, name: str = "test", **kw: Any) -> NATS:
        nc = await connect(self.url, name=name, creds=self.creds(name), service=False, **kw)
        self.conns.append(nc)
        return nc

    async def tenant(self, **kw: Any) -> BourseClient:
        c = BourseClient(await self.connect(TENANT, **kw), self.subjects, tenant=TENANT)
        self.clients.append(c)
        return c

    def edge_args(self, *more: str) -> tuple[str, ...]:
        creds = ("--creds", self.creds("edge"))
        return ("--nats", self.url, "--prefix", PREFIX, *creds, *more)


@contextlib.asynccontextmanager
async def keyed_market(tmp_path: Path, worker_ids: list[str]) -> AsyncIterator[KeyedMarket]:
    """A nats-server with the keys' config (JetStream on) and the operator's set-up done."""
    spec = SupplierSpec(FLEET, tuple((w, "mad") for w in worker_ids))
    files = write_auth_dir(tmp_path / "auth", Subjects(PREFIX), [spec], buyers=(TENANT,))
    server = EmbeddedNats(
        workdir=tmp_path / "nats", config=files.server_conf, jetstream=True
    ).start()
    try:
        async with KeyedMarket(server.url, tmp_path, files) as market:
            await market.jetstream_init()
            yield market
    finally:
        server.stop()


async def in_view(market: KeyedMarket, machine_id: str, state: str) -> None:
    """Once the state stream holds the machine's row in ``state`` (a view of it caught up:
    an edge started after this has the row)."""
    nc = await market.connect("watch")
    async with open_view(nc, market.subjects) as view:
        sql = "SELECT state FROM machines WHERE machine_id = ?"

        def there() -> bool:
            got = view.db.db.execute(sql, (machine_id,)).fetchone()
            return got is not None and got[0] == state

        await wait_until(there, 30)


async def listed(client: BourseClient, app: str) -> list[Machine]:
    """The app's machines as ``client`` lists them (the tenant: its own, its own ids)."""
    got = await client.list_machines(["mad"], ListMachines(app=app, include_destroyed=True))
    return got.machines


async def test_a_request_places_a_tenants_missing_machine_once_and_it_is_the_tenants(
    tmp_path: Path,
) -> None:
    """The tenant deploys an app (one primary), then destroys its machine: nothing to
    start. Two edges, ten requests at each at once to ``zero.acme``: ONE machine is placed
    (both edges derive the slot's next order id under the tenant's scope, its claim gives
    both the same machine), started and serving every request. The tenant lists it as its
    own under its own id (the scope taken off), the shared buyer under the scoped one, and
    the tenant's next deploy keeps it in its slot."""
    async with keyed_market(tmp_path, [own_worker_id("edgetp")]) as market:
        shared = await process_market(market, "edgetp")
        acme = await market.tenant()
        store = await AppStore.open(acme.nc, PREFIX, tenant=TENANT, create=False)
        spec = AppSpec(app="zero", image="srv", regions=["mad"], ports=["http"],
                       env={"DELAY": "0.2"},
                       resources=Resources(cpus=1, memory_mb=256))  # fmt: skip
        done = await apply(acme, store, await context(acme, store, spec), check_wait_s=5)
        assert done.complete, done.outcomes
        [first] = [o.machine_id for o in done.outcomes]
        await acme.machine("destroy", first)
        await in_view(market, first, "destroyed")
        async with (
            edge(tmp_path, *market.edge_args()) as e1,
            edge(tmp_path, *market.edge_args()) as e2,
        ):
            new = await placed_once((e1, e2), f"zero.{TENANT}.localhost")
            assert new != first
            for e in (e1, e2):
                assert "permissions violation" not in e.log.lower(), e.log[-3000:]
        own = [(m.machine_id, m.order_id, m.state) for m in await listed(acme, "zero")]
        assert sorted(own) == sorted(
            [(first, "zero.g1.mad.0", "destroyed"), (new, "zero.g1.mad.0.r1", "started")]
        )
        # the tenant's own `buyer machines list` (from its view of the market) shows it so
        args = ("machines", "list", "--app", "zero", "--json", "--creds", market.creds(TENANT))
        code, out, err = await buyer(market, *args)
        assert code == 0, err
        shown = json.loads(out)["machines"]
        assert [(m["machine_id"], m["order_id"], m["state"]) for m in shown] == [
            (new, "zero.g1.mad.0.r1", "started")
        ], out
        assert {m.order_id for m in await listed(shared, "zero")} == {
            f"{TENANT}:zero.g1.mad.0",
            f"{TENANT}:zero.g1.mad.0.r1",
        }
        again = await apply(acme, store, await context(acme, store, spec), check_wait_s=5)
        assert [(s.action, s.machine_id) for s in again.plan.steps] == [("keep", new)]


async def test_two_controllers_heal_a_tenants_gone_primary_with_its_own_new_spare(
    tmp_path: Path,
) -> None:
    """The tenant's app: its primary on one supplier's worker, its slot's spare on
    another's, a third worker free; its record says the app's ports (http and admin). Two
    edges each run a controller. The primary's supplier stopped: the spare is started,
    the primary's stop queued, and ONE new spare is placed under the tenant's scope (shaped
    from the tenant's record: both ports) on the third worker. The tenant lists the spare
    and the new spare as its own."""
    names = [own_worker_id(f"edgeth{i}") for i in (1, 2, 3)]
    async with keyed_market(tmp_path, names) as market:
        gone_host, other = await heal_hosts(market, "edgeth", 29620)
        acme = await market.tenant()
        store = await AppStore.open(acme.nc, PREFIX, tenant=TENANT, create=False)
        spec = AppSpec(app="heal", image="web", regions=["mad"], ports=["http", "admin"],
                       resources=Resources(cpus=1, memory_mb=256), spares=1)  # fmt: skip
        await store.write("heal", AppRecord(spec=spec), 0)
        primary, spare = await primary_and_spare(acme, gone_host, other)
        args = market.edge_args("--controller", "--no-auto-start")
        async with edge(tmp_path, *args) as e1, edge(tmp_path, *args) as e2:
            await in_view(market, primary.machine_id, "started")
            await market.stop(gone_host)
            new_spare = await healed_once((e1, e2), other, primary, spare, f"{TENANT}:")
            assert sorted(new_spare.addresses) == ["admin", "http"]  # the tenant's record's
            for e in (e1, e2):
                assert "permissions violation" not in e.log.lower(), e.log[-3000:]
        own = {m.machine_id: (m.order_id, m.state) for m in await listed(acme, "heal")}
        unscoped = new_spare.order_id.removeprefix(f"{TENANT}:")
        assert own == {
            spare.machine_id: (spare.order_id, "started"),
            new_spare.machine_id: (unscoped, "reserved"),
        }, own


async def test_a_tenants_update_drains_the_old_machine_hearing_its_share(tmp_path: Path) -> None:
    """The tenant's app of one primary behind an edge: the edge publishes its share of the
    tenant's machines (§4.23), which the tenant's key hears (no permissions violation on its
    connection); the tenant's update names the old machine draining (the edge sends it
    nothing new), hears the edge's shares until it is drained, then stops and destroys it;
    the new one serves."""
    async with keyed_market(tmp_path, [own_worker_id("edgetd")]) as market:
        await process_market(market, "edgetd")
        violations = Violations()
        acme = await market.tenant(error_cb=violations.error_cb)
        store = await AppStore.open(acme.nc, PREFIX, tenant=TENANT, create=False)
        spec = AppSpec(app="roll", image="srv", regions=["mad"], ports=["http"], env={"V": "1"},
                       resources=Resources(cpus=1, memory_mb=256))  # fmt: skip
        first = await apply(acme, store, await context(acme, store, spec), check_wait_s=5)
        [old] = [o.machine_id for o in first.outcomes]
        async with edge(tmp_path, *market.edge_args()) as e:
            host = f"roll.{TENANT}.localhost"
            await answered(e.address, host, lambda a: a.headers.get("bourse-machine") == old)
            shares = await acme.nc.subscribe(acme.subjects.edge_activity_of(TENANT))
            share = decode((await shares.next_msg(timeout=30)).data, EdgeActivity)
            assert old in share.machines  # its own machine, served by the edge
            await shares.unsubscribe()
            v2 = msgspec.structs.replace(spec, env={"V": "2"})
            second = await apply(acme, store, await context(acme, store, v2), check_wait_s=5)
            assert second.complete, second.outcomes
            [new] = [o.machine_id for o in second.outcomes]
            await drained(e, acme, store, "roll", old, new)
        await flush_all(acme.nc)
        assert violations.none_yet(), violations.queue.get_nowait()
