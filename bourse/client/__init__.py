"""The buyer's client library: place orders, read the fleet, manage machines.

Thin typed methods over NATS request-reply. ``direct=True`` runs the auction in this
process against the suppliers (no exchange instance needed), resolving each order's image
where it enters as the exchange does (a watched copy of the image store's tags, from the
first order on); otherwise orders go to the exchange queue group.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS

from bourse.errors import BourseError
from bourse.nats.commands import CommandNotKept, command_for, keep
from bourse.runtime.tasks import TaskSet
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.listing import listed
from bourse.wire.messages import (
    EXCHANGE_REQUESTER,
    IMAGE_UNKNOWN_REASON,
    OVERLOADED_REASON,
    UNRECORDED_REASON,
    Error,
    ExplainReply,
    ExplainRequest,
    Explanation,
    ListMachines,
    Machine,
    MachineCommand,
    MachineList,
    MachineLogs,
    MachinePage,
    MachineReply,
    MachineRequest,
    MachinesReply,
    OrderReply,
    Placed,
    PlaceOrder,
    Reason,
    StatusRequest,
    Unfilled,
    WorkerStatus,
    WorkerVerdict,
    worker_of_machine,
)
from bourse.wire.paging import PageSet
from bourse.wire.subjects import Subjects
from bourse.wire.tenancy import scoped_order

T = TypeVar("T")

if TYPE_CHECKING:  # and imported where used: an order through the exchange needs neither
    from bourse.auction.admission import ConcurrencyLimit
    from bourse.auction.content import ImageContent, Resolver
    from bourse.auction.driver import AuctionConfig

log = structlog.get_logger("bourse.client")

# How long past an order's own deadline the buyer waits for the exchange's answer.
REPLY_SLACK_S = 2.0
# Machine verbs may wait for a stop grace or an image pull.
MACHINE_TIMEOUT_S = 60.0
# How long a stop or destroy that may be kept waits for the machine's worker (§4.20).
QUEUE_PROBE_S = 2.0


# ClientError.code of an order the exchange (or a direct buyer's own admission control)
# refused as overloaded: nothing was bid; try again later or elsewhere. On the wire it is an
# Error "internal" (the v1 codes are fixed) with reason "overloaded".
OVERLOADED_CODE = "overloaded"
# ClientError.code of an order whose machine was placed but whose claim could not name it
# (a claims outage at that moment, §5.3c): send the order again under the same id (as a
# retry), which is answered with the order's one machine. On the wire: Error "internal",
# reason "unrecorded".
UNRECORDED_CODE = "unrecorded"
# ClientError.code of an order (or dry run) whose image names a digest the image store does
# not hold (§4.3a): nothing was bid. On the wire: Error "bad_request", reason
# "image_unknown".
IMAGE_UNKNOWN_CODE = IMAGE_UNKNOWN_REASON
# Direct mode: a market with no image store yet (nothing pushed) is asked again after this.
STORE_RETRY_S = 5.0
# Direct mode: how long the first order waits for the watched copy of the tags.
WATCH_START_S = 5.0


# How long a dry run waits for the region's status (the workers it knows, to list those
# whose supplier gives no explanation as "no answer"), within the order's deadline.
EXPLAIN_STATUS_S = 0.5
# Declines are grouped by their first reason, in the order of the desk's stages (§6.2).
DECLINE_ORDER = (
    "machine_being_reclaimed",
    "commit_under_way",
    "draining",
    "excluded",
    "constraint_mismatch",
    "image_not_runnable",
    "too_small_to_confine",
    "image_too_big",
    "insufficient",
    "blocked_by_holds",
)
# How long a machine listing waits for every worker's pages (it ends as soon as it has them).
LIST_WITHIN_S = 5.0
# A client-side note on an offer the auction would not take (PlaceOrder.min_score).
BELOW_MIN_SCORE = "below_min_score"


class Listing(msgspec.Struct, kw_only=True):
    """Every machine a listing asked for (``buyer machines list``, §4.17), sorted by
    region, worker and creation; ``complete`` when every worker the regions' status named
    sent all its pages, else ``missing`` names those that did not (all of them or the rest
    of their pages); ``regions``: those where some worker answered."""

    machines: list[Machine]
    complete: bool
    missing: list[str] = []
    regions: list[str] = []
    errors: list[str] = []  # Error replies of suppliers (e.g. a bad request)


class DryRun(msgspec.Struct, kw_only=True):
    """Where an order would go and why not elsewhere (``buyer place --dry-run``): every
    worker of the region, the would-be winner first, then other offers by score, workers
    that would wait, declines grouped by reason, and workers that gave no answer."""

    order_id: str
    region: str
    winner: str | None  # the worker the auction would pick now, if any
    verdicts: list[WorkerVerdict]
    # True when every process that answered sent its last page and every worker the status
    # scatter-gather found has a verdict (else the deadline ended the gather).
    complete: bool
    elapsed_ms: float
    errors: list[str] = []  # Error replies of suppliers (e.g. a bad request)


def rank(
    verdicts: Iterable[WorkerVerdict], min_score: float = 0.0
) -> tuple[str | None, list[WorkerVerdict]]:
    """The would-be winner and the verdicts in display order (see DryRun). The auction takes
    an existing machine at once, else the best offer scoring at least ``min_score``; an
    offer below it gets a ``below_min_score`` note."""
    vs = [_min_score_note(v, min_score) for v in verdicts]

    def key(v: WorkerVerdict) -> tuple[int, int, float, str]:
        if v.verdict == "decline":
            code = v.reasons[0].code if v.reasons else ""
            group = DECLINE_ORDER.index(code) if code in DECLINE_ORDER else len(DECLINE_ORDER)
            return (4, group, 0.0, v.worker_id)
        kind = {"existing": 0, "offer": 1, "wait": 3, "no_answer": 5}[v.verdict]
        if kind == 1 and v.score < min_score:
            kind = 2
        return (kind, 0, -v.score, v.worker_id)

    vs.sort(key=key)
    winner = next(
        (
            v.worker_id
            for v in vs
            if v.verdict == "existing" or (v.verdict == "offer" and v.score >= min_score)
        ),
        None,
    )
    return winner, vs


# How an unfilled order's region answered, per reason code: a phrase over the workers that
# gave it (``{names}``), in the desk's order (§6.2). ``image_not_runnable`` on every worker
# is said as "no worker serves image ...".
_WHY_NOT = {
    "machine_being_reclaimed": "the order's machine is being reclaimed on {names}",
    "commit_under_way": "a commit for this order is under way on {names}",
    "draining": "draining: {names}",
    "excluded": "excluded by the order: {names}",
    "constraint_mismatch": "labels do not match on {names} ({detail})",
    "insufficient": "not enough free capacity on {names} ({detail})",
    "blocked_by_holds": "capacity held by other orders on {names}",
    "image_not_runnable": "image {image!r} is not served by {names}",
    "too_small_to_confine": "too small to confine on {names} ({detail})",
    "image_too_big": "image {image!r} is bigger than the image cache of {names}",
}
# At most this many worker ids are named per reason; the rest are counted.
WHY_NOT_NAMES = 3


def why_unfilled(order: PlaceOrder, dry: DryRun) -> str | None:
    """An unfilled order's detail from what the region's workers answered an explain of it
    (``None`` when nobody answered): which workers declined for which reason (capacity,
    labels, an image no worker serves, draining, excluded, holds), named, in the desk's
    order; workers that would offer now (capacity freed since) and silent ones are said too.
    ``no worker in 'sjc' took 1 cpus + 128 MiB of image 'x': no worker serves image 'x'``."""
    if not dry.verdicts:
        return None
    by_code: dict[str, list[WorkerVerdict]] = {}
    offers: list[str] = []
    silent: list[str] = []
    for v in dry.verdicts:
        if v.verdict in ("offer", "existing"):
            offers.append(v.worker_id)
        elif v.verdict == "no_answer":
            silent.append(v.worker_id)
        elif v.verdict == "wait":
            by_code.setdefault("blocked_by_holds", []).append(v)
        for r in v.reasons if v.verdict == "decline" else ():
            by_code.setdefault(r.code, []).append(v)
    parts: list[str] = []
    for code in sorted(by_code, key=lambda c: (_decline_rank(c), c)):
        vs = by_code[code]
        if code == "image_not_runnable" and len(vs) == len(dry.verdicts):
            parts.append(f"no worker serves image {order.image!r}")
            continue
        first = next((r.detail for r in vs[0].reasons if r.code == code), "")
        if len(vs) > 1 and first:
            first = f"{vs[0].worker_id}: {first}"  # one worker's numbers, named
        phrase = _WHY_NOT.get(code, code + " on {names}")
        parts.append(phrase.format(names=_names(vs), detail=first, image=order.image))
    if offers:
        parts.append(f"{_names_of(offers)} would offer now (capacity freed since)")
    if silent:
        parts.append(f"no explanation from {_names_of(silent)}")
    from bourse.auction.core import describe

    what = f"{describe(order)} of image {order.image!r}"
    return f"no worker in {order.region!r} took {what}: " + "; ".join(parts)


def _decline_rank(code: str) -> int:
    return DECLINE_ORDER.index(code) if code in DECLINE_ORDER else len(DECLINE_ORDER)


def _names(vs: list[WorkerVerdict]) -> str:
    return _names_of([v.worker_id for v in vs])


def _names_of(ids: list[str]) -> str:
    shown = ", ".join(ids[:WHY_NOT_NAMES])
    more = len(ids) - WHY_NOT_NAMES
    return f"{shown} and {more} more" if more > 0 else shown


def _min_score_note(v: WorkerVerdict, min_score: float) -> WorkerVerdict:
    if v.verdict != "offer" or v.score >= min_score:
        return v
    note = Reason(code=BELOW_MIN_SCORE, detail=f"score {v.score:g} < min_score {min_score:g}")
    return msgspec.structs.replace(v, reasons=[*v.reasons, note])


class ClientError(BourseError, RuntimeError):
    """The request failed: an Error reply, no exchange/worker reachable, or a timeout."""

    def __init__(self, message: str, code: str = "internal") -> None:
        super().__init__(message)
        self.code = code


class BourseClient:
    def __init__(
        self,
        nc: NATS,
        subjects: Subjects | None = None,
        *,
        direct: bool = False,
        auction: AuctionConfig | None = None,
        admission: ConcurrencyLimit | None = None,
        claims: bool = True,
        tenant: str = "",
    ) -> None:
        self.nc = nc
        # A tenant's key (``auth init --buyer NAME``) orders and acts on machines under
        # R.tenant.NAME. (its only subjects): the exchange scopes them to it.
        self.tenant = tenant
        self.subjects = subjects or Subjects()
        self.direct = direct
        # Direct mode only: the exchange's admission control, run here (a load source
        # placing thousands of orders a second wants it; one CLI order does not).
        self.admission = admission
        # Direct mode: the same broker (admission + auction) the exchange runs.
        # ``claims``: order claims in JetStream KV where the server has it (§5.3c).
        self._broker = None
        if direct:
            from bourse.auction.broker import Broker
            from bourse.auction.driver import Auctioneer

            auctioneer = Auctioneer(nc, self.subjects, auction, claims=claims)
            self._broker = Broker(auctioneer, admission)
        # Direct mode: the watch of the image store's tags, started at the first order.
        self._tasks = TaskSet("client.images")
        self._watching = False
        self._opening = asyncio.Lock()  # one opening of the store at a time
        self._store_at = 0.0  # monotonic: when the image store may be opened (again)

    async def close(self) -> None:
        await self._tasks.finish(0.0)
        if self._broker is not None:
            await self._broker.close()

    async def place(self, order: PlaceOrder) -> Placed | Unfilled:
        """Run one immediate-or-cancel order; raises ClientError on an Error reply (or, in
        direct mode, the same refusal: code ``overloaded``, ``bad_request`` for an order id
        in use by another order, ``unrecorded`` for a machine placed whose claim could not
        name it (send the order again under the same id), ``internal`` when the auction
        cannot run)."""
        if self._broker is not None:
            if not self._watching:
                await self._watch_images(self._broker.images)
            from bourse.auction.broker import Refused

            outcome = await self._broker.place(order)
            if isinstance(outcome, Refused):
                raise _refusal(outcome.error())
            return outcome
        if not self.nc.is_connected:
            # Immediate-or-cancel: a request buffered while disconnected would be sent on
            # reconnect and answered long after its deadline. Fail now; retry if you like.
            raise ClientError("not connected to NATS: the order was not sent", "not_connected")
        timeout = order.deadline_ms / 1000.0 + REPLY_SLACK_S
        reply: Placed | Unfilled | Error = await self._request(
            self._order_subject(order.region), encode(order), OrderReply, timeout, "exchange"
        )
        if isinstance(reply, Error):
            raise _refusal(reply)
        return reply

    async def _watch_images(self, resolver: Resolver) -> None:
        """Direct mode: watch the image store's tags from now on, in a task this client
        owns, for ``resolver`` (once the copy is replayed, or ``WATCH_START_S``). A market
        with no image store yet is asked again ``STORE_RETRY_S`` later; meanwhile every
        image is a catalog name and a digest is refused."""
        from bourse.images.errors import ImageError
        from bourse.images.store import ImageStore

        async with self._opening:
            if self._watching or time.monotonic() < self._store_at:
                return
            try:
                store = await ImageStore.open(self.nc, self.subjects.prefix, create=False)
            except (ImageError, nats.errors.Error, TimeoutError) as exc:
                log.info("image_store_not_open", error=str(exc) or repr(exc))
                self._store_at = time.monotonic() + STORE_RETRY_S
                return
            self._watching = True
            ready = anyio.Event()

            async def watch() -> None:
                async with anyio.create_task_group() as tg:
                    await tg.start(resolver.watch, store)
                    ready.set()

            self._tasks.spawn(watch())
            with anyio.move_on_after(WATCH_START_S):
                await ready.wait()

    async def content(self, image: str) -> ImageContent:
        """What ``image`` names now (§4.3a), as the order's entry point resolves it: in
        direct mode from the watched copy, else with one read of its tag. ClientError
        ``image_unknown`` for a digest the store lacks, ``bad_request`` for a malformed one
        or one that names no image manifest."""
        from bourse.auction.content import CATALOG, Resolver
        from bourse.images.errors import BadImage, BadReference, ImageError, ImageNotFound
        from bourse.images.store import ImageStore

        try:
            if self._broker is not None:
                if not self._watching:
                    await self._watch_images(self._broker.images)
                return await self._broker.images.resolve(image)
            try:
                store = await ImageStore.open(self.nc, self.subjects.prefix, create=False)
            except ImageNotFound:
                return CATALOG  # no image store: every name is a catalog name
            return await Resolver(blobs=store, lookup=store).resolve(image)
        except ImageNotFound as exc:
            raise ClientError(str(exc), IMAGE_UNKNOWN_CODE) from None
        except (BadReference, BadImage) as exc:
            raise ClientError(str(exc), "bad_request") from None
        except (ImageError, nats.errors.Error, TimeoutError) as exc:
            raise ClientError(f"image {image!r}: the image store: {exc!r}") from None

    async def reasons(
        self, order: PlaceOrder, unfilled: Unfilled, explained: DryRun | None = None
    ) -> Unfilled:
        """An Unfilled ``no_offers`` with its detail made true: the region's workers are
        asked why not (an explain gather, §4.15, within the order's deadline) only now that
        the order has ended unfilled, so placing costs no extra message; ``explained``: an
        explain of the order already gathered (it is used instead). Any other outcome, or a
        region where nobody explains, is returned as it is."""
        if unfilled.reason != "no_offers":
            return unfilled
        detail = why_unfilled(order, explained or await self.explain(order))
        if detail is None:
            return unfilled
        return msgspec.structs.replace(unfilled, detail=detail)

    async def status(
        self, region: str | None, within_s: float = 0.5, quiet_s: float = 0.1
    ) -> list[WorkerStatus]:
        """Scatter-gather: every worker of the region (None: of every region) answers; stop
        after ``quiet_s`` silence."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        out: list[WorkerStatus] = []
        try:
            await self.nc.publish(
                self.subjects.status(region) if region is not None else self.subjects.status_every,
                encode(StatusRequest()),
                reply=inbox,
            )
            end = time.monotonic() + within_s
            while (left := end - time.monotonic()) > 0:
                try:
                    msg = await sub.next_msg(timeout=min(left, quiet_s if out else left))
                except nats.errors.TimeoutError:
                    break
                if msg.headers and msg.headers.get("Status") == "503":
                    break  # nobody in that region
                out.append(decode(msg.data, WorkerStatus))
        finally:
            await sub.unsubscribe()
        return sorted(out, key=lambda s: (s.region, s.worker_id))

    async def explain(self, order: PlaceOrder, within_s: float | None = None) -> DryRun:
        """Why not, for ``order`` without placing it: every worker of the region answers
        with the score it would offer or its reasons (docs/protocol.md §4.15); nothing is
        held. Workers the region's status lists that gave no verdict (a supplier that does
        not implement explain) are ``no_answer``. Bounded by ``within_s`` (default: the
        order's deadline); ends early once every answering process sent its last page and
        every known worker has a verdict."""
        t0 = time.monotonic()
        end = t0 + (order.deadline_ms / 1000.0 if within_s is None else within_s)
        if self.tenant:  # the workers know a tenant's machines by its scoped order id
            try:
                order = scoped_order(self.tenant, order)
            except BadMessage as exc:
                raise ClientError(str(exc), "bad_request") from None
        content = await self.content(order.image)
        req = ExplainRequest(
            order_id=order.order_id,
            region=order.region,
            resources=order.resources,
            image=order.image,
            constraints=order.constraints,
            exclude_workers=order.exclude_workers,
            image_digest=content.digest,
            layers=content.layers,
            ports=order.ports,
        )
        gather = _ExplainGather()
        await self._scatter(
            self.subjects.explain(order.region), encode(req), order.region, gather, end
        )
        winner, verdicts = rank(gather.verdicts(), order.min_score)
        return DryRun(
            order_id=order.order_id,
            region=order.region,
            winner=winner,
            verdicts=verdicts,
            complete=gather.complete(),
            elapsed_ms=round((time.monotonic() - t0) * 1000.0, 1),
            errors=gather.errors,
        )

    async def _scatter(
        self, subject: str, body: bytes, region: str | None, gather: _Gather, end: float
    ) -> None:
        """Publish ``body`` to a fan-out ``subject`` and feed every reply to ``gather``
        until it is complete or ``end`` (monotonic s) passes. Meanwhile the status of
        ``region`` (None: of every region) tells the gather which workers exist, so it
        knows when it has heard from all of them."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            async with anyio.create_task_group() as tasks:
                left = max(0.0, end - time.monotonic())
                reading = anyio.CancelScope(deadline=anyio.current_time() + left)

                async def known() -> None:
                    within = max(0.0, min(EXPLAIN_STATUS_S, end - time.monotonic()))
                    statuses = await self.status(region, within_s=within)
                    gather.known = {s.worker_id for s in statuses}
                    gather.regions.update(s.region for s in statuses)
                    if gather.complete():
                        reading.cancel()

                tasks.start_soon(known)
                await self.nc.publish(subject, body, reply=inbox)
                with reading:
                    while not gather.complete():
                        msg = await sub.next_msg(timeout=None)
                        gather.add(msg.data, bool(msg.headers and msg.headers.get("Status")))
                tasks.cancel_scope.cancel()  # the deadline passed before the status came
        finally:
            await sub.unsubscribe()

    async def list_machines(
        self,
        regions: list[str] | None = None,
        request: ListMachines | None = None,
        within_s: float = LIST_WITHIN_S,
    ) -> Listing:
        """Every machine ``request`` asks for (its filters), on every worker of ``regions``
        (None: of every region that answers), sorted by region, worker and creation
        (docs/protocol.md §4.17). Each worker answers in pages; the listing is ``complete``
        when every worker the regions' status names sent every page, else ``missing`` names
        the others. A tenant (who may not ask the suppliers directly: they would show every
        tenant's machines) lists each worker through the exchange, its own machines only."""
        req = request or ListMachines()
        end = time.monotonic() + within_s
        asked: list[str | None] = list(dict.fromkeys(regions)) if regions else [None]
        gathers: list[_MachinesGather] = []
        async with anyio.create_task_group() as tasks:
            for region in asked:
                gather = _MachinesGather()
                gathers.append(gather)
                if self.tenant:
                    tasks.start_soon(self._tenant_gather, region, req, gather)
                else:
                    subject = (
                        self.subjects.machines(region)
                        if region is not None
                        else self.subjects.machines_every
                    )
                    tasks.start_soon(self._scatter, subject, encode(req), region, gather, end)
        machines = listed(req, (m for g in gathers for m in g.machines()))
        missing = sorted({w for g in gathers for w in g.missing()})
        return Listing(
            machines=machines,
            complete=all(g.complete() for g in gathers),
            missing=missing,
            regions=sorted({r for g in gathers for r in g.regions}),
            errors=[e for g in gathers for e in g.errors],
        )

    async def _tenant_gather(
        self, region: str | None, req: ListMachines, gather: _MachinesGather
    ) -> None:
        statuses = await self.status(region)
        gather.known = {s.worker_id for s in statuses}
        for st in statuses:
            gather.regions.add(st.region)
            try:
                listing = await self.machines(st.worker_id, request=req)
            except ClientError as exc:
                gather.errors.append(f"{st.worker_id}: {exc}")
                continue
            gather.whole(st.worker_id, st.region, listing.machines)

    def _order_subject(self, region: str) -> str:
        if self.tenant:
            return self.subjects.tenant_order(self.tenant, region)
        return self.subjects.order(region)

    def _exchange_machine(self, verb: str) -> str:
        if self.tenant:
            return self.subjects.tenant_machine(self.tenant, verb)
        return self.subjects.machine(verb)

    def _machine_subject(self, verb: str, machine_id: str) -> tuple[str, str]:
        """Through the exchange, or (direct) straight to the worker named in the id."""
        if self.direct:
            return self.subjects.worker_machine(worker_of_machine(machine_id), verb), "worker"
        return self._exchange_machine(verb), "exchange"

    async def machine(self, verb: str, machine_id: str) -> Machine:
        """get / start / stop / destroy one machine; returns it as it is afterwards."""
        subject, who = self._machine_subject(verb, machine_id)
        body = encode(MachineRequest(machine_id=machine_id))
        reply = await self._request(subject, body, MachineReply, MACHINE_TIMEOUT_S, who)
        return _expect(reply, Machine)

    async def machine_or_kept(self, verb: str, machine_id: str) -> Machine | MachineCommand:
        """stop / destroy one machine, kept for its worker when the worker does not answer
        (docs/protocol.md §4.20): the machine as it is afterwards, or the MachineCommand
        the market keeps until the worker applies it (queued). Direct mode: the worker is
        asked first (briefly), and the command kept by this client's key (the exchange's)."""
        if self.direct:
            return await self._direct_or_kept(verb, machine_id)
        body = encode(MachineRequest(machine_id=machine_id, queue_if_away=True))
        subject = self._exchange_machine(verb)
        reply = await self._request(subject, body, MachineReply, MACHINE_TIMEOUT_S, "exchange")
        if isinstance(reply, MachineCommand):
            return reply
        return _expect(reply, Machine)

    async def _direct_or_kept(self, verb: str, machine_id: str) -> Machine | MachineCommand:
        worker_id = worker_of_machine(machine_id)
        body = encode(MachineRequest(machine_id=machine_id))
        try:
            await self.nc.request(
                self.subjects.worker_machine(worker_id, "get"), body, timeout=QUEUE_PROBE_S
            )
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            command = command_for(verb, machine_id, EXCHANGE_REQUESTER)
            try:
                await keep(self.nc.jetstream(), self.subjects, command)
            except CommandNotKept as exc:
                raise ClientError(f"worker {worker_id!r} does not answer, and {exc}") from None
            return command
        return await self.machine(verb, machine_id)

    async def logs(self, machine_id: str, tail: int = 100, since: int = -1) -> MachineLogs:
        """The last ``tail`` lines, or with ``since`` (a previous reply's ``end``) the lines
        printed after it."""
        subject, who = self._machine_subject("logs", machine_id)
        body = encode(MachineRequest(machine_id=machine_id, tail=tail, since=since))
        reply = await self._request(subject, body, MachineReply, MACHINE_TIMEOUT_S, who)
        return _expect(reply, MachineLogs)

    async def machines(
        self,
        worker_id: str,
        include_destroyed: bool = False,
        request: ListMachines | None = None,
    ) -> MachineList:
        """Every machine of one worker (``request``: its filters), page by page (a cursor
        per page, §4.17), so a worker of any size lists completely. A worker that predates
        paging answers the whole list at once."""
        base = request or ListMachines(include_destroyed=include_destroyed)
        subject = (
            self.subjects.worker_machine(worker_id, "list")
            if self.direct
            else self._exchange_machine("list")
        )
        cursor: str | None = ""
        out: list[Machine] = []
        while cursor is not None:
            body = msgspec.structs.replace(base, worker_id=worker_id, cursor=cursor)
            reply = await self._request(
                subject, encode(body), MachineReply, MACHINE_TIMEOUT_S, "worker"
            )
            page = _expect(reply, MachineList)
            out.extend(page.machines)
            if page.next_cursor is not None and page.next_cursor <= cursor:
                raise ClientError(f"worker {worker_id} sent a cursor that does not advance")
            cursor = page.next_cursor
        return MachineList(worker_id=worker_id, machines=listed(base, out))

    async def _request(self, subject: str, data: bytes, typ: Any, timeout: float, who: str) -> Any:
        """Request and decode as ``typ`` (a message class or a union of them: hence Any,
        until Python can type a union as a value; callers annotate what they get)."""
        try:
            msg = await self.nc.request(subject, data, timeout=timeout)
        except nats.errors.NoRespondersError:
            raise ClientError(f"no {who} is listening on {subject}") from None
        except (TimeoutError, nats.errors.TimeoutError):
            raise ClientError(f"no answer on {subject} within {timeout:.1f}s") from None
        try:
            return decode(msg.data, typ)
        except BadMessage as exc:
            raise ClientError(f"unreadable reply on {subject}: {exc}") from None


class _Gather:
    """A scatter-gather's paged answers as they arrive (bourse/wire/paging.py ``PageSet``),
    and whether it is complete: the status said which workers exist (``known``), each
    responder sent every page, and every known worker answered."""

    reply_type: Any = None  # the union a reply decodes as (set by each kind)

    def __init__(self) -> None:
        self.pages: PageSet[Any] = PageSet()
        self.known: set[str] | None = None  # from status; None until it has ended
        self.regions: set[str] = set()  # regions some worker answered in
        self.nobody = False  # no supplier subscribes to the subject (no responders)
        self.errors: list[str] = []

    def add(self, data: bytes, no_responders: bool) -> None:
        if no_responders:
            self.nobody = True
            return
        try:
            reply = decode(data, self.reply_type)
        except BadMessage as exc:
            self.errors.append(f"unreadable reply: {exc}")
            return
        if isinstance(reply, Error):
            self.errors.append(reply.detail)
            return
        self.page(reply)

    def page(self, reply: Any) -> None:
        raise NotImplementedError

    def answered(self) -> set[str]:
        """The workers that gave their whole answer."""
        raise NotImplementedError

    def complete(self) -> bool:
        if self.known is None or not self.pages.all_complete():
            return False
        return self.nobody or self.known <= self.answered()


class _ExplainGather(_Gather):
    """The pages of a dry run: one responder per supplier process, verdicts per worker."""

    reply_type = ExplainReply

    def page(self, reply: Explanation) -> None:
        self.pages.add(reply.responder, reply.page, reply.pages, reply.verdicts)

    def _by_worker(self) -> dict[str, WorkerVerdict]:
        return {v.worker_id: v for r in self.pages.responders() for v in self.pages.items(r)}

    def answered(self) -> set[str]:
        return set(self._by_worker())

    def verdicts(self) -> list[WorkerVerdict]:
        by_worker = self._by_worker()
        silent = sorted((self.known or set()) - by_worker.keys())
        return [
            *by_worker.values(),
            *(WorkerVerdict(worker_id=w, verdict="no_answer") for w in silent),
        ]


class _MachinesGather(_Gather):
    """The pages of a machine listing: one responder per worker."""

    reply_type = MachinesReply

    def page(self, reply: MachinePage) -> None:
        self.regions.add(reply.region)
        self.pages.add(reply.worker_id, reply.page, reply.pages, reply.machines)

    def whole(self, worker_id: str, region: str, machines: list[Machine]) -> None:
        """A worker's whole list, got another way (a tenant's, through the exchange)."""
        self.regions.add(region)
        self.pages.add(worker_id, 1, 1, machines)

    def answered(self) -> set[str]:
        return set(self.pages.complete())

    def machines(self) -> list[Machine]:
        return [m for w in self.pages.responders() for m in self.pages.items(w)]

    def missing(self) -> list[str]:
        """Known workers (and answering ones) that did not send every page."""
        return sorted(({*(self.known or ())} | {*self.pages.responders()}) - self.answered())


def _refusal(error: Error) -> ClientError:
    """An order's Error as a ClientError: an overload refusal (Error.reason) gets code
    ``overloaded``, an unrecorded placement ``unrecorded``, an unknown image
    ``image_unknown``, anything else its wire code."""
    if error.reason == OVERLOADED_REASON:
        return ClientError(error.detail, OVERLOADED_CODE)
    if error.reason == UNRECORDED_REASON:
        return ClientError(error.detail, UNRECORDED_CODE)
    if error.reason == IMAGE_UNKNOWN_REASON:
        return ClientError(error.detail, IMAGE_UNKNOWN_CODE)
    return ClientError(error.detail, error.code)


def _expect(reply: object, typ: type[T]) -> T:
    if isinstance(reply, Error):
        raise ClientError(reply.detail, reply.code)
    if not isinstance(reply, typ):
        raise ClientError(f"expected {typ.__name__}, got {type(reply).__name__}")
    return reply
