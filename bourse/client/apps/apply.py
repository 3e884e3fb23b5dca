"""The shell that converges an app to its spec: it gathers what the planner and the
rollout need (the market's regions and images, the app's machines and record), then
performs the rollout's actions and feeds back what happened. Nothing is decided here."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import msgspec
import structlog

from bourse.client.apps import rollout as ro
from bourse.client.apps.drain import DRAIN_S, drain
from bourse.client.apps.plan import Plan, plan
from bourse.client.apps.slots import machine_metadata, slot_key
from bourse.client.apps.spec import AppSpec
from bourse.client.apps.store import AppChanged, AppRecord, AppStore, next_generation
from bourse.client.client import BourseClient
from bourse.client.errors import ClientError
from bourse.client.policy import place_patiently
from bourse.client.suggest import image_hint, region_hint
from bourse.errors import BourseError
from bourse.images import BadReference, ImageError, ImageStore, Reference
from bourse.runtime.defaults import DEFAULT_CHECK_WAIT_S
from bourse.wire.messages import ListMachines, Machine, Placed, PlaceOrder, WorkerVerdict

# The reason a worker declines an image it cannot run (a dry run's verdict).
CANNOT_RUN = "image_not_runnable"

log = structlog.get_logger("bourse.apps")

# How often a new machine's health is looked at while its checks run (a worker answers
# each look with the machine as it is: the poll is the watch, not a synchronisation).
HEALTH_POLL_S = 0.25


class AppError(BourseError, ValueError):
    """A spec the market cannot run: a region no worker serves, an image that is nowhere."""


@dataclass
class Context:
    """What a plan is made from: the app's record and its KV revision (0: none), the
    generation and secrets' revision it is applied under, the image's digest ("" for a
    worker's catalog image) and machines."""

    spec: AppSpec
    previous: AppRecord | None
    revision: int
    generation: int
    digest: str
    secrets_revision: str
    image_digest: str
    machines: list[Machine]

    def plan(self) -> Plan:
        """The plan for this context (pure)."""
        records = self.previous.slots if self.previous else {}
        return plan(
            self.spec,
            self.generation,
            self.machines,
            records,
            secrets_revision=self.secrets_revision,
            image_digest=self.image_digest,
        )


async def _image_digest(client: BourseClient, spec: AppSpec) -> str:
    """The digest the spec's image names in the store; "" for an image some worker of the
    spec's regions can run without it (a catalog image: the workers are asked, as a dry
    run, holding nothing); AppError for an image nothing can run."""
    try:
        ref = Reference.parse(spec.image)
    except BadReference as exc:
        raise AppError(f"image: {exc}") from None
    try:
        store = await ImageStore.open(client.nc, client.subjects.prefix, create=False)
        if ref.digest:
            if await store.stat_blob(ref.digest) is not None:
                return ref.digest
        else:
            return await store.lookup(ref)
    except ImageError:
        pass  # not in the store (or no store): a worker's catalog image, perhaps
    for region in spec.regions:
        probe = PlaceOrder(region=region, resources=spec.resources, image=spec.image)
        dry = await client.explain(probe)
        if any(not _cannot_run(v) for v in dry.verdicts):
            return ""
    hint = await image_hint(client, spec.image, spec.regions)
    raise AppError(
        f"image {spec.image!r} is not in the image store and no worker of "
        f"{', '.join(spec.regions)} can run it{hint}: push it first (bourse image push)"
    )


def _cannot_run(v: WorkerVerdict) -> bool:
    return v.verdict == "decline" and any(r.code == CANNOT_RUN for r in v.reasons)


async def context(client: BourseClient, apps: AppStore, spec: AppSpec) -> Context:
    """Check the spec against the market (each region served, the image there) and gather
    what the plan needs. Nothing is placed or held."""
    for region in spec.regions:
        if not await client.status(region):
            hint = await region_hint(client, region)
            raise AppError(
                f"region {region!r}: no worker serves it{hint} (buyer fleet lists regions)"
            )
    image_digest = await _image_digest(client, spec)
    previous, at = await apps.read(spec.app)
    secrets = previous.secrets_now if previous else ""
    generation, digest = next_generation(previous, spec, secrets)
    machines = await _machines(client, spec, previous)
    return Context(spec, previous, at, generation, digest, secrets, image_digest, machines)


async def _machines(
    client: BourseClient, spec: AppSpec, previous: AppRecord | None
) -> list[Machine]:
    """The app's live machines in its regions and those it had (one listing, §4.17). A
    worker that did not answer: AppError (a plan without its machines would place them
    again)."""
    regions = list(
        dict.fromkeys(spec.regions + (previous.spec.regions if previous and previous.spec else []))
    )
    listing = await client.list_machines(regions, ListMachines(app=spec.app))
    if not listing.complete:
        missing = ", ".join(listing.missing) or "some workers"
        raise AppError(f"the app's machines could not all be listed ({missing} did not answer)")
    return listing.machines


@dataclass
class Applied:
    """What an apply did: the plan and each step's outcome."""

    plan: Plan
    outcomes: list[ro.Outcome]
    stopped: bool

    @property
    def complete(self) -> bool:
        return all(o.result == ro.DONE for o in self.outcomes)


def _order(ctx: Context, action: ro.Place, deadline_ms: int, min_score: float) -> PlaceOrder:
    spec, step = ctx.spec, action.step
    return PlaceOrder(
        order_id=action.order_id,
        region=step.region,
        resources=spec.resources,
        image=spec.image,
        constraints=spec.labels,
        exclude_workers=list(action.exclude_workers),
        min_score=min_score,
        deadline_ms=deadline_ms,
        metadata=machine_metadata(spec, step.role, step.slot, ctx.generation, ctx.secrets_revision),
        ports=spec.ports,
        env=spec.env,
        checks=spec.checks,
        restart=spec.restart,
    )


async def _started(client: BourseClient, machine_id: str) -> ro.Event:
    try:
        m = await client.machine("start", machine_id)
    except ClientError as exc:
        m = await client.machine("get", machine_id)  # already started (a re-run)?
        if m.state != "started":
            return ro.StartFailed(str(exc))
    if m.state != "started":
        exit_ = m.last_exit
        return ro.StartFailed(f"{m.state}" + (f": {exit_.reason} {exit_.detail}" if exit_ else ""))
    return ro.Started(machine_id)


async def _health(client: BourseClient, machine_id: str) -> ro.Event:
    await anyio.sleep(HEALTH_POLL_S)
    m = await client.machine("get", machine_id)
    if m.state not in ("started", "starting"):
        return ro.StartFailed(f"the machine is {m.state}")
    if m.health is None:
        return ro.Tick()
    return ro.Health(m.health.status, m.health.detail)


async def _perform(
    client: BourseClient, ctx: Context, action: ro.Action, deadline_ms: int, min_score: float
) -> ro.Event:
    match action:
        case ro.Place():
            order = _order(ctx, action, deadline_ms, min_score)
            result = await place_patiently(client, order)
            if isinstance(result, Placed):
                return ro.Placed(result.machine_id, result.worker_id)
            why = await client.reasons(order, result)
            return ro.Unfilled(why.reason + (f" ({why.detail})" if why.detail else ""))
        case ro.StartMachine(machine_id=mid):
            return await _started(client, mid)
        case ro.WatchHealth(machine_id=mid):
            return await _health(client, mid)
        case ro.DestroyMachine(machine_id=mid):
            await client.machine("destroy", mid)
            return ro.Destroyed(mid)
    raise AssertionError(f"unexpected action {action!r}")  # pragma: no cover


def _record(ctx: Context, p: Plan, outcomes: list[ro.Outcome]) -> AppRecord:
    """The app's record after the rollout: the plan's slots with the machines made."""
    slots = dict(p.records)
    for o in outcomes:
        key = slot_key(o.step.region, o.step.slot)
        if o.machine_id and key in slots and o.result == ro.DONE:
            slots[key] = msgspec.structs.replace(slots[key], machine_id=o.machine_id)
    return AppRecord(
        spec=ctx.spec,
        generation=ctx.generation,
        digest=ctx.digest,
        secrets_revision=ctx.secrets_revision,
        slots=slots,
        secrets=ctx.previous.secrets if ctx.previous else {},
    )


async def apply(
    client: BourseClient,
    apps: AppStore,
    ctx: Context,
    *,
    check_wait_s: float = DEFAULT_CHECK_WAIT_S,
    deadline_ms: int = 500,
    min_score: float = 0.0,
    drain_s: float = DRAIN_S,
    clock: Callable[[], float] = time.monotonic,
) -> Applied:
    """Converge the app to ``ctx.spec``: its plan, carried out step by step by the rollout.
    The record (spec, generation, slots' roles) is kept before the first step, so a run cut
    off halfway is taken up again under the same ids, and again with the machines made.
    Each write names the revision the record was read at, and each step is taken only while
    the record is still this run's: an app changed meanwhile (another deploy, a secret set)
    is :class:`AppChanged` and this run stops, so two runs never roll one app together. A
    running machine an update replaces or a scale-down destroys is drained first
    (bourse/client/apps/drain.py: named in the record, the edges' requests under way
    finished or ``drain_s`` passed, stopped)."""
    p = ctx.plan()
    app = ctx.spec.app
    revision = await apps.write(app, _record(ctx, p, []), ctx.revision, by="deploy")
    r = ro.Rollout(p, checks=bool(ctx.spec.checks), wait_ms=int(check_wait_s * 1000))
    action = r.begin(int(clock() * 1000))
    bound = log.bind(app=ctx.spec.app, generation=ctx.generation)
    while not isinstance(action, ro.Finished):
        if not isinstance(action, ro.WatchHealth):
            if (await apps.read(app))[1] != revision:
                raise AppChanged(f"app {app!r} changed while this deploy ran: run it again")
            bound.info("rollout", action=type(action).__name__, **_ids(action))
        if isinstance(action, ro.DrainMachine):
            mid = action.machine_id
            revision = await drain(client, apps, app, mid, revision, bound_s=drain_s)
            event: ro.Event = ro.Drained(mid)
        else:
            event = await _perform(client, ctx, action, deadline_ms, min_score)
        action = r.on(event, int(clock() * 1000))
    await apps.write(app, _record(ctx, p, r.outcomes), revision, by="deploy")
    return Applied(p, r.outcomes, r.stopped)


def _ids(action: ro.Action) -> dict[str, str]:
    if isinstance(action, ro.Place):
        return {"order_id": action.order_id, "region": action.step.region}
    return {"machine_id": getattr(action, "machine_id", "")}
