"""Client-side placement policy, in the spirit of flyctl: the market places single machines;
apps, spares, anti-affinity, region fallback and failover are decided here.

- deploy: ``count`` primaries (started) and ``spares`` spares (placed, not started) for an
  app, each on a distinct worker, regions tried in the order given. Machines carry
  ``metadata = {app, role, slot}``; a re-run first finds the app's live machines and only
  fills the slots that are missing, so deploy is idempotent.
- failover: a primary whose worker is gone is replaced by starting one of the app's spares.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bourse.client import BourseClient, ClientError
from bourse.wire.messages import Machine, Placed, PlaceOrder, Resources, Unfilled, worker_of_machine

PRIMARY = "primary"
SPARE = "spare"


@dataclass
class Slot:
    """One machine an app wants: placed (with its machine) or not (with the last Unfilled)."""

    role: str
    index: int
    machine: Machine | None = None
    placed: Placed | None = None
    unfilled: list[Unfilled] = field(default_factory=list)
    existed: bool = False

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


@dataclass
class Deployment:
    app: str
    slots: list[Slot]

    @property
    def complete(self) -> bool:
        return all(s.machine is not None for s in self.slots)


async def app_machines(client: BourseClient, app: str, regions: list[str]) -> list[Machine]:
    """The app's live machines on every worker that answers in ``regions``."""
    found: list[Machine] = []
    for region in regions:
        for status in await client.status(region):
            listed = await client.machines(status.worker_id)
            found.extend(
                m
                for m in listed.machines
                if m.metadata.get("app") == app and m.state != "destroyed"
            )
    return found


async def deploy(
    client: BourseClient,
    *,
    app: str,
    regions: list[str],
    count: int,
    spares: int,
    resources: Resources,
    image: str,
    constraints: dict[str, str] | None = None,
    deadline_ms: int = 500,
    min_score: float = 0.0,
    restart: str = "",
) -> Deployment:
    """Place ``count`` machines and ``spares`` on distinct workers (idempotent). ``restart``
    (``no``, ``on-failure``, ``always``), when given, goes in each order's ``restart``
    metadata: the process driver's restart policy for the machine."""
    if not regions:
        raise ClientError("deploy needs at least one region", "bad_request")
    existing = {
        (m.metadata.get("role"), m.metadata.get("slot")): m
        for m in await app_machines(client, app, regions)
    }
    used_workers = {m.worker_id for m in existing.values()}
    slots = [Slot(PRIMARY, i) for i in range(count)] + [Slot(SPARE, i) for i in range(spares)]
    for slot in slots:
        have = existing.get((slot.role, str(slot.index)))
        if have is not None:
            slot.machine, slot.existed = have, True
            continue
        for region in regions:
            order = PlaceOrder(
                # One id per (slot, region): a retry of this deploy is idempotent, and a
                # slot tried in two regions never shares an id across them.
                order_id=f"{app}.{slot.name}.{region}",
                region=region,
                resources=resources,
                image=image,
                constraints=constraints or {},
                exclude_workers=sorted(used_workers),  # anti-affinity
                min_score=min_score,
                deadline_ms=deadline_ms,
                metadata={"app": app, "role": slot.role, "slot": str(slot.index)}
                | ({"restart": restart} if restart else {}),
            )
            result = await client.place(order)
            if isinstance(result, Unfilled):
                slot.unfilled.append(result)
                continue
            slot.placed = result
            used_workers.add(result.worker_id)
            slot.machine = await client.machine(
                "start" if slot.role == PRIMARY else "get", result.machine_id
            )
            break
    return Deployment(app, slots)


async def failover(
    client: BourseClient, *, app: str, regions: list[str], machine_id: str, force: bool = False
) -> Machine:
    """Start one of the app's spares in place of ``machine_id``, whose worker is gone.

    Raises ClientError if the worker still answers (unless ``force``) or no spare is left.
    """
    lost_worker = worker_of_machine(machine_id)
    alive = {s.worker_id for region in regions for s in await client.status(region)}
    if lost_worker in alive and not force:
        raise ClientError(
            f"worker {lost_worker} still answers; nothing to fail over (use --force to "
            "start a spare anyway)",
            "bad_request",
        )
    spares = [
        m
        for m in await app_machines(client, app, regions)
        if m.metadata.get("role") == SPARE
        and m.state in ("reserved", "stopped")
        and m.worker_id != lost_worker
    ]
    if not spares:
        raise ClientError(f"app {app!r} has no spare left in {', '.join(regions)}", "unfilled")
    order = {r: i for i, r in enumerate(regions)}
    spares.sort(key=lambda m: (order.get(m.region, len(order)), m.metadata.get("slot", "")))
    return await client.machine("start", spares[0].machine_id)
