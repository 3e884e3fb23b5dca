"""Scale from zero by placing (issue 38 item 3): an app with no machine to start, whose
spec wants more primaries in a region than it has there, gets the missing slot's machine
placed through the market for a request, then started (edge/starts.py holds the request).

:func:`to_place` is the decision, pure: in, the app's record (its spec, generation and
slots, as the last deploy wrote them) and the app's machines as the view has them (every
state, destroyed ones included: they say which attempts of a slot were used); out, the
order for the first primary slot of the region without a live machine, or None. Every
edge decides from the same record and rows, so every edge and every request places under
the same order id (``<app>.g<generation>.<region>.<slot>.r<attempt>``, the slot's id as a
deploy derives it, bourse/client/apps/slots.py): the order's claim (§5.3c, I3) gives them
ONE machine. The attempt is one past the highest the slot has used in this generation (the
record's, the view's machines'), so a slot lost again gets a new machine, not the claim of
the destroyed one. The next deploy finds the machine in its slot and keeps it.

A tenant's app is placed the same way, under the tenant's scope of that id
(``<tenant>:<app>.g…``, bourse/wire/tenancy.py): the order id the exchange gives the
tenant's own deploy of the slot, so whoever places it (the tenant's deploy, an edge, on the
shared buyer's subject, which takes a scoped id as it is) gets ONE machine, and the
machine is the tenant's (its order id says whose). The edge places only the slots of an
app record the tenant wrote (its key ``<tenant>.<app>``), of the app that record names.

The market prices the order as any other: a worker with the image cached offers first
(its image term), so the new machine lands where its start is quickest.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bourse.client.apps.slots import attempt_of, machine_metadata, order_id
from bourse.wire.messages import PlaceOrder
from bourse.wire.metadata import PRIMARY
from bourse.wire.tenancy import scope
from edge.routing import split_key

if TYPE_CHECKING:
    from bourse.client.apps.store import AppRecord

DEAD = frozenset({"destroyed"})
DEADLINE_MS = 2000

_ROWS = """
SELECT order_id, region, state, coalesce(slot, -1), coalesce(generation, 0), coalesce(role, '')
FROM machines WHERE tenant = ? AND app = ?
"""


@dataclass(frozen=True, slots=True)
class SlotRow:
    """One machine of the app as the view has it (any state)."""

    order_id: str
    region: str
    state: str
    slot: int = -1
    generation: int = 0
    role: str = PRIMARY

    @property
    def live(self) -> bool:
        return self.state not in DEAD


def slot_rows(db: sqlite3.Connection, app: str, tenant: str = "") -> list[SlotRow]:
    """The view's rows of ``tenant``'s ``app`` ("": of no tenant), destroyed ones
    included."""
    return [SlotRow(*r) for r in db.execute(_ROWS, (tenant, app))]


def region_for(regions: list[str], region: str) -> str:
    """Where the edge places: its own region when the spec runs there, else the spec's
    first."""
    return region if region in regions else regions[0]


def order_for(
    key: str, record: AppRecord, db: sqlite3.Connection, region: str
) -> PlaceOrder | None:
    """The order a request to app ``key`` (``web``, a tenant's ``web.acme``) places at an
    edge of ``region``, from the app's record (its key in the apps bucket, which only the
    tenant's key and the shared buyer's write) and the view's rows; None when it wants none
    here, or when the record names another app than its key (a tenant's record places only
    the app it is of, under the tenant's own scope)."""
    app, tenant = split_key(key)
    if record.spec is None or record.spec.app != app:
        return None
    return to_place(record, slot_rows(db, app, tenant), region, tenant)


def to_place(
    record: AppRecord, rows: list[SlotRow], region: str, tenant: str = ""
) -> PlaceOrder | None:
    """The order of the app's next machine for a request at an edge of ``region`` (see the
    module doc), None when the spec wants no more there; ``tenant``'s app ("": of no
    tenant): the order id under its scope."""
    spec = record.spec
    if spec is None or not spec.regions:
        return None
    where = region_for(spec.regions, region)
    here = [r for r in rows if r.region == where]
    if sum(1 for r in here if r.live and r.role != "spare") >= spec.count:
        return None
    taken = {r.slot for r in here if r.live}
    recorded = sorted(
        int(tail)
        for key, rec in record.slots.items()
        for r, _, tail in [key.rpartition(".")]
        if r == where and tail.isdigit() and rec.role == PRIMARY
    )
    free = [i for i in recorded if i not in taken]
    if not free:  # no slot record for it (placed by an older deploy): the lowest free index
        free = [next(i for i in range(len(taken) + 1) if i not in taken)]
    slot = free[0]
    gen = record.generation
    rec = record.slots.get(f"{where}.{slot}")
    used = [
        attempt_of(r.order_id.rpartition(":")[2])
        for r in here
        if r.slot == slot and r.generation == gen
    ]
    if rec is not None and rec.generation == gen:
        used.append(rec.attempt)
    # a slot filled before in this generation: the next attempt (its claim is the lost
    # machine's); never filled: the deploy's own id (a cut-off deploy's machine handed back)
    filled = bool(rec and rec.machine_id) or any(
        r.slot == slot and r.generation == gen for r in here
    )
    attempt = max(used, default=0) + (1 if filled else 0)
    oid = order_id(spec.app, gen, where, slot, attempt)
    return PlaceOrder(
        order_id=scope(tenant) + oid if tenant else oid,
        region=where,
        resources=spec.resources,
        image=spec.image,
        constraints=spec.labels,
        deadline_ms=DEADLINE_MS,
        metadata=machine_metadata(spec, PRIMARY, slot, gen, record.secrets_revision),
        ports=spec.ports,
        env=spec.env,
        checks=spec.checks,
        restart=spec.restart,
    )
