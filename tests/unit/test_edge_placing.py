"""Scale from zero by placing (edge/placing.py): which slot a request places and under
which order id (pure), and Starts placing it, starting it and routing it before the table
has its row."""

from __future__ import annotations

import msgspec
import pytest

from bourse.client.apps.slots import SlotRecord, attempt_of, order_id
from bourse.client.apps.spec import AppSpec
from bourse.client.apps.store import AppRecord
from bourse.view.db import ViewDB
from bourse.wire.messages import Machine, PlaceOrder, Resources
from bourse.wire.metadata import GEN, ROLE, SLOT
from bourse.wire.tenancy import scoped_order, tenant_of_order
from edge.placing import SlotRow, order_for, to_place
from edge.routing import AppRoute, Choice, Router, RouteTable
from edge.starts import Starts
from tests.unit.test_edge_starts import PORT, Held, machine

SPEC = AppSpec(app="web", image="srv", regions=["mad", "fra"], ports=["http"],
               resources=Resources(cpus=1, memory_mb=64), count=1, spares=1)  # fmt: skip


def record(gen: int = 2, **slots: SlotRecord) -> AppRecord:
    return AppRecord(spec=SPEC, generation=gen, slots={k.replace("_", "."): v for k, v in
                                                       slots.items()})  # fmt: skip


P = "primary"
LOST = SlotRecord(role=P, generation=2, machine_id="mad-1~gone")


@pytest.mark.parametrize(
    ("rec", "rows", "region", "want"),
    [
        # the slot's machine destroyed: the next attempt in the edge's region
        (record(mad_0=LOST), [SlotRow("web.g2.mad.0", "mad", "destroyed", 0, 2)], "mad",
         "web.g2.mad.0.r1"),
        # lost again: one past the view's highest (a tenant's scope taken off)
        (record(mad_0=LOST), [SlotRow("web.g2.mad.0", "mad", "destroyed", 0, 2),
                              SlotRow("t:web.g2.mad.0.r1", "mad", "destroyed", 0, 2)], "mad",
         "web.g2.mad.0.r2"),
        # never filled (a deploy cut off before it placed): the deploy's own id
        (record(mad_0=SlotRecord(role=P, generation=2)), [], "mad", "web.g2.mad.0"),
        # an edge of a region the app does not run in: the spec's first
        (record(mad_0=LOST), [], "ams", "web.g2.mad.0.r1"),
        (record(fra_1=SlotRecord(role=P, generation=2)), [], "fra", "web.g2.fra.1"),
        # the spare's slot is not a primary's: the primary slot
        (record(mad_0=SlotRecord(role="spare", generation=2), mad_1=LOST), [], "mad",
         "web.g2.mad.1.r1"),
        # no slot record (an older deploy): the lowest free index
        (record(), [SlotRow("web.g2.mad.1", "mad", "stopped", 1, 2, "spare")], "mad",
         "web.g2.mad.0"),
        # the region has its count: none (a stopped one is started instead)
        (record(mad_0=LOST), [SlotRow("web.g2.mad.0.r1", "mad", "stopped", 0, 2)], "mad",
         None),
        (AppRecord(spec=None), [], "mad", None),
    ],
)  # fmt: skip
def test_which_slot_a_request_places(
    rec: AppRecord, rows: list[SlotRow], region: str, want: str | None
) -> None:
    got = to_place(rec, rows, region)
    assert (got.order_id if got else None) == want


def test_the_order_is_the_slots_as_a_deploy_places_it() -> None:
    got = to_place(record(mad_0=LOST), [], "mad")
    assert got is not None
    assert (got.region, got.image, got.resources, got.ports) == ("mad", "srv", SPEC.resources,
                                                                 ["http"])  # fmt: skip
    assert {k: got.metadata[k] for k in ("app", ROLE, SLOT, GEN)} == {
        "app": "web",
        ROLE: P,
        SLOT: "0",
        GEN: "2",
    }
    assert "fields" in got.metadata  # so the next deploy keeps it in its slot


def test_a_tenants_slot_is_placed_under_the_id_its_own_deploy_would_have() -> None:
    """A tenant's app: the slot's order id under the tenant's scope, as the exchange scopes
    the tenant's own deploy's order (one order id, one machine); its rows' attempts count
    with the scope taken off."""
    rows = [SlotRow("acme:web.g2.mad.0.r1", "mad", "destroyed", 0, 2)]
    got = to_place(record(mad_0=LOST), rows, "mad", "acme")
    assert got is not None and got.order_id == "acme:web.g2.mad.0.r2"
    deploys = msgspec.structs.replace(got, order_id=order_id("web", 2, "mad", 0, 2))
    assert scoped_order("acme", deploys) == got
    assert tenant_of_order(got.order_id) == "acme" and got.metadata["app"] == "web"


def test_a_request_places_only_the_app_its_record_is_of() -> None:
    """The order for a request to an app key: a tenant's under its scope; none from a
    record that names another app than its key (a tenant cannot have an edge place an app
    it did not deploy, nor under another's name)."""
    db = ViewDB(":memory:")
    try:
        got = order_for("web.acme", record(mad_0=LOST), db.db, "mad")
        assert got is not None and got.order_id == "acme:web.g2.mad.0.r1"
        assert order_for("web", record(mad_0=LOST), db.db, "mad") is not None
        assert order_for("shop.acme", record(mad_0=LOST), db.db, "mad") is None
        assert order_for("web.acme", AppRecord(spec=None), db.db, "mad") is None
    finally:
        db.close()


def test_attempt_of() -> None:
    assert [attempt_of(o) for o in ("web.g2.mad.0", "web.g2.mad.0.r3", "a.rb")] == [0, 3, 0]


async def test_a_placed_machine_is_started_and_routed_before_its_row_comes() -> None:
    router = Router("mad")
    router.update(RouteTable({"web": AppRoute("web", ())}))  # deployed, no machine
    calls: list[str] = []
    order = PlaceOrder(order_id="web.g2.mad.0.r1", region="mad", resources=SPEC.resources,
                       image="srv")  # fmt: skip

    async def place(o: PlaceOrder) -> str:
        calls.append(f"place {o.order_id}")
        return "mad-1~new"

    async def start(mid: str) -> Machine:
        calls.append(f"start {mid}")
        return machine(mid, PORT)

    async def probe(address: tuple[str, int], timeout_s: float) -> bool:
        return True

    starts = Starts(router, start, probe=probe, place_for=lambda app: order, place=place)
    release = Held(2)
    assert starts.hold("web", release) is None and starts.hold("web", release) is None
    assert (calls, await release.all()) == (
        ["place web.g2.mad.0.r1", "start mad-1~new"],
        [None, None],
    )
    got = router.pick("web")
    assert isinstance(got, Choice) and got.backend.machine_id == "mad-1~new"
    router.update(RouteTable({"web": AppRoute("web", ())}))  # a table without it yet: kept
    assert isinstance(router.pick("web"), Choice)
    await starts.close()


async def test_a_placing_that_fails_is_said_to_the_held_request() -> None:
    router = Router("mad")
    router.update(RouteTable({"web": AppRoute("web", ())}))
    order = PlaceOrder(order_id="web.g2.mad.0.r1", region="mad", resources=SPEC.resources,
                       image="srv")  # fmt: skip

    async def place(o: PlaceOrder) -> str:
        raise RuntimeError("unfilled: no_offers")

    async def start(mid: str) -> Machine:
        raise AssertionError("nothing placed, nothing started")

    starts = Starts(router, start, place_for=lambda app: order, place=place)
    release = Held(1)
    assert starts.hold("web", release) is None
    assert await release.all() == [
        "placing a machine of app 'web' (order web.g2.mad.0.r1) failed: unfilled: no_offers"
    ]
    await starts.close()
