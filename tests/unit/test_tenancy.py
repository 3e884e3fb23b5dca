"""Buyers as tenants, the pure part (bourse/wire/tenancy.py): order ids scoped per tenant,
ownership read back from a machine's order id, replies unscoped, listings cut."""

from __future__ import annotations

import pytest

from bourse.wire.codec import BadMessage
from bourse.wire.messages import Machine, MachineList, Placed, PlaceOrder, Resources
from bourse.wire.tenancy import (
    SHARED_OWNER,
    own_machines,
    owner_token,
    owns,
    scoped_order,
    tenant_of_order,
    unscoped,
)

ORDER = PlaceOrder(
    order_id="a1", region="mad", resources=Resources(cpus=1, memory_mb=64), image="web"
)


def machine(order_id: str, n: int = 1) -> Machine:
    return Machine(
        machine_id=f"mad-1~M{n}",
        order_id=order_id,
        worker_id="mad-1",
        region="mad",
        state="started",
        resources=ORDER.resources,
        image="web",
    )


def test_a_tenants_order_id_is_scoped_and_the_rest_kept() -> None:
    scoped = scoped_order("alice", ORDER)
    assert scoped.order_id == "alice:a1"
    assert (scoped.region, scoped.resources, scoped.image) == ("mad", ORDER.resources, "web")


def test_a_tenant_cannot_reach_into_another_scope_by_naming_it() -> None:
    # bob's "alice:a1" is bob's: scoped again, never alice's
    assert scoped_order("bob", PlaceOrder(**{**_fields(), "order_id": "alice:a1"})).order_id == (
        "bob:alice:a1"
    )


def _fields() -> dict[str, object]:
    return {"region": "mad", "resources": ORDER.resources, "image": "web"}


def test_an_order_id_too_long_once_scoped_is_refused_naming_the_limit() -> None:
    long = PlaceOrder(**{**_fields(), "order_id": "x" * 128})
    with pytest.raises(BadMessage, match="too long for tenant 'alice': at most 122 characters"):
        scoped_order("alice", long)


@pytest.mark.parametrize(
    ("tenant", "order_id", "mine"),
    [
        ("alice", "alice:a1", True),
        ("alice", "alice:bob:a1", True),
        ("bob", "alice:bob:a1", False),
        ("alice", "alice", False),  # an operator's order named like a tenant
        ("alice", "alicex:a1", False),  # a tenant whose name starts with another's
        ("alice", "a1", False),  # an operator's order
    ],
)
def test_a_machine_is_its_tenants_by_its_scoped_order_id(
    tenant: str, order_id: str, mine: bool
) -> None:
    assert owns(tenant, order_id) is mine


def test_replies_and_listings_are_the_tenants_own() -> None:
    placed = Placed(
        order_id="alice:a1",
        machine_id="mad-1~M1",
        worker_id="mad-1",
        region="mad",
        score=0.5,
        image_cached=False,
        elapsed_ms=1.0,
    )
    assert unscoped("alice", placed).order_id == "a1"
    listing = MachineList(
        worker_id="mad-1",
        machines=[machine("alice:a1", 1), machine("bob:a1", 2), machine("a1", 3)],
    )
    mine = own_machines("alice", listing)
    assert [(m.machine_id, m.order_id) for m in mine.machines] == [("mad-1~M1", "a1")]


@pytest.mark.parametrize(
    ("order_id", "tenant"),
    [
        ("alice:a1", "alice"),  # a tenant's, as the exchange scopes it
        ("a1", ""),  # the shared buyer key's
        ("Alice:a1", ""),  # no tenant name before the colon: the shared key's own id
        ("app.g1.mad.0", ""),
        ("bob:shop.g2.mad.1", "bob"),
    ],
)
def test_a_machines_tenant_and_owner_token_come_from_its_order_id(
    order_id: str, tenant: str
) -> None:
    """The state stream's owner token (§4.21): the tenant whose grant reaches the row, or
    the shared token, which no tenant name can be."""
    assert tenant_of_order(order_id) == tenant
    assert owner_token(order_id) == (tenant or SHARED_OWNER)
    assert owns(tenant, order_id) if tenant else True
