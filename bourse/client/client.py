"""BourseClient: place orders, read the fleet, manage machines.

Thin typed methods over NATS request-reply. ``direct=True`` runs the auction in this
process against the suppliers (no exchange instance needed), resolving each order's image
where it enters as the exchange does (a watched copy of the image store's tags, from the
first order on); otherwise orders go to the exchange queue group.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS

from bourse.client.entry import Images
from bourse.client.errors import ClientError, expect, refusal
from bourse.client.gathers import ExplainGather, Gather, Listing, MachinesGather
from bourse.client.ranking import DryRun, rank, served_nowhere, why_unfilled
from bourse.nats.commands import CommandNotKept, probe_or_keep
from bourse.nats.scatter import scatter
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.listing import listed
from bourse.wire.messages import (
    EXCHANGE_REQUESTER,
    EXEC_VERB,
    ControlReply,
    Error,
    ExecRequest,
    ExplainRequest,
    ListMachines,
    Machine,
    MachineCommand,
    MachineList,
    MachineLogs,
    MachineReply,
    MachineRequest,
    OrderReply,
    Placed,
    PlaceOrder,
    StatusRequest,
    Unfilled,
    WorkerAction,
    WorkerControl,
    WorkerState,
    WorkerStatus,
    worker_of_machine,
)
from bourse.wire.subjects import Subjects
from bourse.wire.tenancy import scoped_order

if TYPE_CHECKING:  # and imported where used: an order through the exchange needs neither
    from anyio.streams.memory import MemoryObjectReceiveStream

    from bourse.auction.admission import ConcurrencyLimit
    from bourse.auction.broker import Broker
    from bourse.auction.content import ImageContent
    from bourse.auction.core import AuctionConfig
    from bourse.client.execs import Ended, Input, Output

log = structlog.get_logger("bourse.client")

# How long past an order's own deadline the buyer waits for the exchange's answer.
REPLY_SLACK_S = 2.0
# Machine verbs may wait for a stop grace or an image pull.
MACHINE_TIMEOUT_S = 60.0
# A worker's stop waits for its machines to stop (each its stop grace), its start for them
# to start again.
CONTROL_TIMEOUT_S = 120.0
# How long a dry run waits for the region's status (the workers it knows, to list those
# whose supplier gives no explanation as "no answer"), within the order's deadline.
EXPLAIN_STATUS_S = 0.5
# How long a machine listing waits for every worker's pages (it ends as soon as it has them).
LIST_WITHIN_S = 5.0


class BourseClient:
    """A buyer's (or a service's) way into the market, on one NATS connection."""

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
        self._broker: Broker | None = None
        if direct:
            from bourse.auction.auctioneer import Auctioneer
            from bourse.auction.broker import Broker

            self._broker = Broker(Auctioneer(nc, self.subjects, auction, claims=claims), admission)
        self._images = Images(nc, self.subjects)

    async def close(self) -> None:
        await self._images.close()
        if self._broker is not None:
            await self._broker.close()

    async def place(self, order: PlaceOrder) -> Placed | Unfilled:
        """Run one immediate-or-cancel order; raises ClientError on an Error reply (or, in
        direct mode, the same refusal: code ``overloaded``, ``bad_request`` for an order id
        in use by another order, ``unrecorded`` for a machine placed whose claim could not
        name it (send the order again under the same id), ``internal`` when the auction
        cannot run)."""
        if self._broker is not None:
            await self._images.watch(self._broker.images)
            from bourse.auction.broker import Refused

            outcome = await self._broker.place(order)
            if isinstance(outcome, Refused):
                raise refusal(outcome.error())
            return outcome
        if not self.nc.is_connected:
            # Immediate-or-cancel: a request buffered while disconnected would be sent on
            # reconnect and answered long after its deadline. Fail now; retry if you like.
            raise ClientError("not connected to NATS: the order was not sent", "not_connected")
        timeout = order.deadline_ms / 1000.0 + REPLY_SLACK_S
        reply: Placed | Unfilled | Error = await ask(
            self.nc,
            self._order_subject(order.region),
            encode(order),
            OrderReply,
            timeout,
            "exchange",
        )
        if isinstance(reply, Error):
            raise refusal(reply)
        return reply

    async def content(self, image: str) -> ImageContent:
        """What ``image`` names now (§4.3a), as the order's entry point resolves it: in
        direct mode from the watched copy, else with one read of its tag. ClientError
        ``image_unknown`` for a digest the store lacks, ``bad_request`` for a malformed one
        or one that names no image manifest."""
        return await self._images.content(self._broker.images if self._broker else None, image)

    async def reasons(
        self, order: PlaceOrder, unfilled: Unfilled, explained: DryRun | None = None
    ) -> Unfilled:
        """An Unfilled ``no_offers`` with its detail made true: the region's workers are
        asked why not (an explain gather, §4.15, within the order's deadline) only now that
        the order has ended unfilled, so placing costs no extra message; ``explained``: an
        explain of the order already gathered (it is used instead). A region no worker
        serves, or an image none runs, gets the nearest one the market has ("did you
        mean"). Any other outcome, or a region where nobody explains, is returned as it is."""
        from bourse.client.suggest import image_hint, region_hint

        if unfilled.reason == "no_workers":
            hint = await region_hint(self, order.region)
            return msgspec.structs.replace(unfilled, detail=unfilled.detail + hint)
        if unfilled.reason != "no_offers":
            return unfilled
        dry = explained or await self.explain(order)
        detail = why_unfilled(order, dry)
        if detail is None:
            return unfilled
        if served_nowhere(dry):
            detail += await image_hint(self, order.image, [order.region])
        return msgspec.structs.replace(unfilled, detail=detail)

    async def status(
        self, region: str | None, within_s: float = 0.5, quiet_s: float = 0.1
    ) -> list[WorkerStatus]:
        """Scatter-gather: every worker of the region (None: of every region) answers; stop
        after ``quiet_s`` silence."""
        subject = self.subjects.status(region) if region is not None else self.subjects.status_every
        out: list[WorkerStatus] = []
        async with scatter(self.nc, subject, encode(StatusRequest())) as replies:
            end = time.monotonic() + within_s
            while (left := end - time.monotonic()) > 0:
                try:
                    data = await replies.next(min(left, quiet_s if out else left))
                except nats.errors.TimeoutError:
                    break
                if data is None:
                    break  # nobody in that region
                out.append(decode(data, WorkerStatus))
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
        gather = ExplainGather()
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
        self, subject: str, body: bytes, region: str | None, gather: Gather, end: float
    ) -> None:
        """Publish ``body`` to a fan-out ``subject`` and feed every reply to ``gather``
        until it is complete or ``end`` (monotonic s) passes. Meanwhile the status of
        ``region`` (None: of every region) tells the gather which workers exist, so it
        knows when it has heard from all of them."""
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
            async with scatter(self.nc, subject, body) as replies:
                with reading:
                    while not gather.complete():
                        gather.add(await replies.next())
            tasks.cancel_scope.cancel()  # the deadline passed before the status came

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
        gathers: list[MachinesGather] = []
        async with anyio.create_task_group() as tasks:
            for region in asked:
                gather = MachinesGather()
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
        self, region: str | None, req: ListMachines, gather: MachinesGather
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
        reply = await ask(self.nc, subject, body, MachineReply, MACHINE_TIMEOUT_S, who)
        return expect(reply, Machine)

    async def machine_or_kept(self, verb: str, machine_id: str) -> Machine | MachineCommand:
        """stop / destroy one machine, kept for its worker when the worker does not answer
        (docs/protocol.md §4.20): the machine as it is afterwards, or the MachineCommand
        the market keeps until the worker applies it (queued). Direct mode: the worker is
        asked first (briefly), and the command kept by this client's key (the exchange's)."""
        if self.direct:
            return await self._direct_or_kept(verb, machine_id)
        body = encode(MachineRequest(machine_id=machine_id, queue_if_away=True))
        subject = self._exchange_machine(verb)
        reply = await ask(self.nc, subject, body, MachineReply, MACHINE_TIMEOUT_S, "exchange")
        if isinstance(reply, MachineCommand):
            return reply
        return expect(reply, Machine)

    async def _direct_or_kept(self, verb: str, machine_id: str) -> Machine | MachineCommand:
        try:
            shown = await probe_or_keep(
                self.nc, self.subjects, verb, machine_id, EXCHANGE_REQUESTER
            )
        except CommandNotKept as exc:
            raise ClientError(str(exc)) from None
        if isinstance(shown, MachineCommand):
            return shown
        return await self.machine(verb, machine_id)

    async def control(self, worker_id: str, action: WorkerAction) -> WorkerState:
        """The operator's verb on one worker (drain, stop, start: docs/protocol.md §4.22),
        answered by its supplier; the worker as it is after. No supplier hosts it (or the
        key may not ask): ClientError."""
        body = encode(WorkerControl(worker_id=worker_id, action=action))
        subject = self.subjects.control(worker_id)
        reply = await ask(self.nc, subject, body, ControlReply, CONTROL_TIMEOUT_S, "supplier")
        return expect(reply, WorkerState)

    async def logs(self, machine_id: str, tail: int = 100, since: int = -1) -> MachineLogs:
        """The last ``tail`` lines, or with ``since`` (a previous reply's ``end``) the lines
        printed after it."""
        subject, who = self._machine_subject("logs", machine_id)
        body = encode(MachineRequest(machine_id=machine_id, tail=tail, since=since))
        reply = await ask(self.nc, subject, body, MachineReply, MACHINE_TIMEOUT_S, who)
        return expect(reply, MachineLogs)

    async def exec(
        self,
        req: ExecRequest,
        output: Output,
        read_input: Input | None = None,
        sizes: MemoryObjectReceiveStream[tuple[int, int]] | None = None,
    ) -> Ended:
        """Run a command inside a started machine (docs/protocol.md §4.24): its output to
        ``output`` as it comes, its input from ``read_input`` (``req.stdin``), the
        terminal's ``sizes`` as they change (``req.tty``); how it ended. Through the
        exchange (a tenant's: its own machines only), or in direct mode to the worker."""
        from bourse.client import execs

        subject = self._exchange_machine(EXEC_VERB)
        if self.direct:
            req = execs.direct_request(req)
            subject = self.subjects.worker_machine(worker_of_machine(req.machine_id), EXEC_VERB)
        return await execs.run(self.nc, subject, req, output, read_input, sizes)

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
            reply = await ask(
                self.nc, subject, encode(body), MachineReply, MACHINE_TIMEOUT_S, "worker"
            )
            page = expect(reply, MachineList)
            out.extend(page.machines)
            if page.next_cursor is not None and page.next_cursor <= cursor:
                raise ClientError(f"worker {worker_id} sent a cursor that does not advance")
            cursor = page.next_cursor
        return MachineList(worker_id=worker_id, machines=listed(base, out))


async def ask(nc: NATS, subject: str, data: bytes, typ: Any, timeout: float, who: str) -> Any:
    """One request on ``nc``, its reply decoded as ``typ`` (a message class or a union of
    them: hence Any, until Python can type a union as a value; callers annotate what they
    get). No responder (``who``: the kind expected there), no answer in time or an
    unreadable one: ClientError."""
    try:
        msg = await nc.request(subject, data, timeout=timeout)
    except nats.errors.NoRespondersError:
        raise ClientError(f"no {who} is listening on {subject}") from None
    except (TimeoutError, nats.errors.TimeoutError):
        raise ClientError(f"no answer on {subject} within {timeout:.1f}s") from None
    try:
        return decode(msg.data, typ)
    except BadMessage as exc:
        raise ClientError(f"unreadable reply on {subject}: {exc}") from None
