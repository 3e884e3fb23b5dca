"""Client-side placement policy, in the spirit of flyctl: the market places single machines;
apps (bourse/client/apps: spec, plan, rollout), spares, anti-affinity and failover are
decided in the client.

- app_machines: an app's machines on the workers that answer; place_patiently: an order
  tried once more when the market was busy; restart (stop, then start) and on_each (a
  verb on several machines, each whatever became of the others).
- failover: a primary whose worker is gone (or, forced, a primary that is stopped) is
  replaced by starting one of the app's spares, and a new spare is placed as deploy would.
  A started spare fills a primary slot from then on (metadata is written once, at placing:
  the app's record keeps the slot's role), so a re-run of deploy keeps ``count`` running.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import msgspec
import nats.errors
import nats.js.errors

from bourse.client.apps.store import AppStore
from bourse.client.client import BourseClient
from bourse.client.errors import OVERLOADED_CODE, UNRECORDED_CODE, ClientError
from bourse.errors import BourseError
from bourse.wire.messages import (
    Check,
    Machine,
    MachineCommand,
    Placed,
    PlaceOrder,
    Resources,
    Unfilled,
    worker_of_machine,
)
from bourse.wire.metadata import APP, PRIMARY, RESTART, ROLE, SLOT, SPARE
from bourse.wire.tenancy import scope


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


async def app_machines(
    client: BourseClient, app: str, regions: list[str] | None, include_destroyed: bool = False
) -> list[Machine]:
    """The app's machines (live ones, or every one) on every worker that answers in
    ``regions`` (None: in every region)."""
    if regions is None:
        statuses = await client.status(None)
    else:
        statuses = [s for region in regions for s in await client.status(region)]
    found: list[Machine] = []
    for status in statuses:
        listed = await client.machines(status.worker_id, include_destroyed)
        found.extend(
            m
            for m in listed.machines
            if m.metadata.get(APP) == app and (include_destroyed or m.state != "destroyed")
        )
    return found


# The states of a machine whose run a restart stops before it starts it again.
RUNS = ("starting", "started", "stopping")


async def restart(client: BourseClient, machine_id: str) -> Machine:
    """Stop the machine, then start it (the wire has no restart verb: the worker's stop and
    start, each recorded, each an event). One that does not run is refused (ClientError):
    a restart never starts a spare or a machine stopped on purpose."""
    state = (await client.machine("get", machine_id)).state
    if state not in RUNS:
        raise ClientError(f"cannot restart machine {machine_id}: it is {state} (start starts it)")
    await client.machine("stop", machine_id)
    return await client.machine("start", machine_id)


async def on_each(
    client: BourseClient, verb: str, machine_ids: list[str]
) -> tuple[list[Machine], dict[str, str]]:
    """``verb`` (start, stop, restart, destroy) on each machine, one after the other, each
    whatever became of the others: the machines as they are after, and why each of those
    that were not done was not (machine id -> the error)."""
    done: list[Machine] = []
    failed: dict[str, str] = {}
    for machine_id in dict.fromkeys(machine_ids):
        try:
            if verb == "restart":
                done.append(await restart(client, machine_id))
            else:
                done.append(await client.machine(verb, machine_id))
        except BourseError as exc:
            failed[machine_id] = str(exc)
    return done, failed


def _slot_key(m: Machine) -> tuple[int, str]:
    slot = m.metadata.get("slot", "")
    return (int(slot) if slot.isdigit() else 1 << 30, m.machine_id)


# An order the market was too busy for, rather than unable to place, or placed but not
# recorded (its claim could not name the machine, §5.3c): tried once more under its id.
BUSY_REASONS = frozenset({"deadline"})
BUSY_CODES = frozenset({OVERLOADED_CODE, UNRECORDED_CODE})


async def place_patiently(client: BourseClient, order: PlaceOrder) -> Placed | Unfilled:
    """``order``, tried once more under the same id (as a retry: idempotent) when the
    answer says the market was busy (an ``Unfilled`` by deadline, an ``overloaded``
    refusal) rather than unable (no offers, no workers), or that a machine was placed but
    not recorded (``unrecorded``: the retry is answered with the order's one machine). A
    deploy of a few machines should not leave a slot empty because one auction met a busy
    moment."""
    try:
        result = await client.place(order)
    except ClientError as exc:
        if exc.code not in BUSY_CODES:
            raise
    else:
        if isinstance(result, Placed) or result.reason not in BUSY_REASONS:
            return result
    return await client.place(msgspec.structs.replace(order, retry=True))


async def _fill(
    client: BourseClient,
    slot: Slot,
    *,
    app: str,
    regions: list[str],
    resources: Resources,
    image: str,
    constraints: dict[str, str],
    used_workers: set[str],
    deadline_ms: int,
    min_score: float,
    fresh: bool,
    restart: str = "",
    shape: Shape | None = None,
    suffix: str | None = None,
    under: str = "",
) -> None:
    """Place ``slot`` in the first region that takes it, on a worker the app does not use
    yet; a primary is started. Order ids: ``<app>.<slot>.<region>`` on an app's first
    deploy (a retry of it is idempotent); with a random suffix once the app has had
    machines, so a refilled slot never reuses the id of a machine it replaces (an order id
    is kept for the idempotency window, §5.3c: the old id would hand back the old machine),
    or ``suffix`` when the caller derives one (controllers racing for one slot); each
    ``under`` a tenant's scope (when the shared buyer's key places for it)."""
    if suffix is None:
        suffix = "" if fresh else secrets.token_hex(4)
    tail = f".{suffix}" if suffix else ""
    for region in regions:
        order = PlaceOrder(
            # One id per (slot, region): a slot tried in two regions never shares an id.
            order_id=f"{under}{app}.{slot.name}.{region}{tail}",
            region=region,
            resources=resources,
            image=image,
            constraints=constraints,
            exclude_workers=sorted(used_workers),  # anti-affinity
            min_score=min_score,
            deadline_ms=deadline_ms,
            metadata={APP: app, ROLE: slot.role, SLOT: str(slot.index)}
            | ({RESTART: restart} if restart else {}),
            ports=list(shape.ports) if shape else [],
            env=dict(shape.env) if shape else {},
            checks=list(shape.checks) if shape else [],
            restart=restart,
        )
        result = await place_patiently(client, order)
        if isinstance(result, Unfilled):
            slot.unfilled.append(await client.reasons(order, result))
            continue
        slot.placed = result
        used_workers.add(result.worker_id)
        slot.machine = await client.machine(
            "start" if slot.role == PRIMARY else "get", result.machine_id
        )
        return


@dataclass(frozen=True)
class Shape:
    """What a machine of an app is besides its resources and image: its named ports, env
    and checks (and restart policy), as the new spare a failover places must be."""

    ports: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    checks: tuple[Check, ...] = ()
    restart: str = ""


async def app_shape(client: BourseClient, app: str, like: Machine, tenant: str = "") -> Shape:
    """The app's shape: from its applied spec in the apps bucket when there is one (the
    record of ``tenant``'s app, else of the client's own), else from ``like``, one of its
    machines (its port names are its addresses' keys; its env's values are not shown, so
    none)."""
    try:
        store = await AppStore.open(
            client.nc, client.subjects.prefix, tenant=tenant or client.tenant
        )
        record = await store.get(app)
    except (BourseError, nats.errors.Error, nats.js.errors.Error):
        record = None  # no apps bucket this key may read: the machine says what it can
    spec = record.spec if record is not None else None  # secrets set before a first deploy
    if spec is not None:
        return Shape(
            tuple(spec.ports), tuple(sorted(spec.env.items())), tuple(spec.checks), spec.restart
        )
    return Shape(tuple(sorted(like.addresses)), (), tuple(like.checks))


async def place_spare(
    client: BourseClient,
    *,
    app: str,
    regions: list[str],
    like: Machine,
    used_workers: set[str],
    constraints: dict[str, str] | None = None,
    deadline_ms: int = 500,
    suffix: str | None = None,
    tenant: str = "",
) -> Slot:
    """A new spare in place of ``like`` (a spare just started in place of a failed
    primary): its slot, resources and image, the app's shape, on a worker of none of
    ``used_workers`` (a machine does not carry its order's labels: ``constraints`` are
    deploy's --label). Its order id ends in ``suffix`` (None: a random one): the same suffix
    from any number of callers places one machine (one order id, §5.3c). ``tenant``: the
    app's tenant when the shared buyer's key places for it (an edge's controller): the
    order id under the tenant's scope (the machine is the tenant's), its record read under
    its name."""
    refill = Slot(SPARE, int(like.metadata.get(SLOT, "0") or 0))
    shape = await app_shape(client, app, like, tenant)
    await _fill(
        client,
        refill,
        app=app,
        regions=regions,
        resources=like.resources,
        image=like.image,
        constraints=constraints or {},
        used_workers=set(used_workers),
        deadline_ms=deadline_ms,
        min_score=0.0,
        fresh=False,
        restart=shape.restart,
        shape=shape,
        suffix=suffix,
        under=scope(tenant) if tenant else "",
    )
    return refill


@dataclass
class Failover:
    """What a failover did: the spare it started in place of ``replaced``, the replaced
    machine as it is after a ``--force`` stop, or stopped by a worker that answered at
    last, the stop kept for the replaced machine's worker when it is gone (``queued``, or
    why it could not be: ``queue_error``), and the new spare placed in its place
    (``refill``: placed, or its Unfilled)."""

    app: str
    replaced: str
    started: Machine
    stopped: Machine | None
    refill: Slot
    queued: MachineCommand | None = None
    queue_error: str = ""


async def failover(
    client: BourseClient,
    *,
    app: str,
    regions: list[str],
    machine_id: str,
    force: bool = False,
    constraints: dict[str, str] | None = None,
    deadline_ms: int = 500,
) -> Failover:
    """Start one of the app's spares in place of ``machine_id`` (whose worker is gone, or
    whose health check is critical, or, with ``force``, any: a machine whose worker still
    answers is stopped), then place a new spare as deploy would.

    Raises ClientError: ``bad_request`` for an app with no machine in ``regions``, a machine
    its answering worker does not have for the app, or a worker that still answers (without
    ``force``); ``unfilled`` when no spare is left.
    """
    if not regions:
        raise ClientError("failover needs at least one region", "bad_request")
    where = ", ".join(regions)
    lost_worker = worker_of_machine(machine_id)
    alive = {s.worker_id for region in regions for s in await client.status(region)}
    machines = await app_machines(client, app, regions)
    if not machines:
        raise ClientError(f"app {app!r} has no machines in {where}", "bad_request")
    replaced = next((m for m in machines if m.machine_id == machine_id), None)
    health = replaced.health if replaced is not None else None
    critical = health is not None and health.status == "critical"  # as if its worker were gone
    if lost_worker in alive:
        if replaced is None:
            raise ClientError(
                f"machine {machine_id} is not a live machine of app {app!r} (its worker "
                f"{lost_worker} answers without it)",
                "bad_request",
            )
        if not force and not critical:
            raise ClientError(
                f"worker {lost_worker} still answers; nothing to fail over (use --force to "
                "stop the machine and start a spare anyway)",
                "bad_request",
            )
    spares = [
        m
        for m in machines
        if m.metadata.get(ROLE) == SPARE
        and m.state in ("reserved", "stopped")
        and m.worker_id != lost_worker
    ]
    if not spares:
        raise ClientError(f"app {app!r} has no spare left in {where}", "unfilled")
    order = {r: i for i, r in enumerate(regions)}
    spares.sort(key=lambda m: (order.get(m.region, len(order)), _slot_key(m)))
    spare = spares[0]
    started = await client.machine("start", spare.machine_id)
    stopped: Machine | None = None
    queued: MachineCommand | None = None
    queue_error = ""
    if replaced is not None and lost_worker in alive:
        stopped = await client.machine("stop", replaced.machine_id)
    elif lost_worker not in alive:
        # Kept for its worker: when it comes back, it stops the replaced primary before it
        # would resume it (docs/protocol.md §4.20), so two primaries never run.
        try:
            outcome = await client.machine_or_kept("stop", machine_id)
        except ClientError as exc:
            queue_error = str(exc)
        else:
            queued, stopped = (
                (outcome, None) if isinstance(outcome, MachineCommand) else (None, outcome)
            )
    used = {m.worker_id for m in machines} | {lost_worker}
    refill = await place_spare(
        client,
        app=app,
        regions=regions,
        like=spare,
        used_workers=used,
        constraints=constraints or {},
        deadline_ms=deadline_ms,
    )
    return Failover(app, machine_id, started, stopped, refill, queued, queue_error)
