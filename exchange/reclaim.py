"""The exchange's reclaim desk (docs/protocol.md §5.3d): the order claims' verdict on each
machine a worker asks about (keep, orphan, wait).

A verdict that changes a claim (adopting a dead auction's machine, reclaiming an unfilled
order's orphan) takes the worker's word only once the machine's region vouches for it: the
desk asks ``<root>.machines.<region>`` for the worker's reserved machines (only the
suppliers of that region hear it; under ``bourse auth init`` only they may subscribe) and
checks the machine there against the claim (``bourse.auction.verdicts.vouched``). Otherwise
the verdict is refused (wait) and logged: a supplier cannot make an order adopt a machine
it made up, nor another region's order adopt its own.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bourse.auction.claim_store import ClaimStore
from bourse.auction.claims import Claim
from bourse.auction.verdicts import vouched
from bourse.nats.responder import Responder
from bourse.nats.scatter import scatter
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.messages import (
    ListMachines,
    Machine,
    MachinePage,
    Placed,
    ReclaimCheck,
    ReclaimVerdict,
    ReclaimVerdicts,
    worker_of_machine,
)
from bourse.wire.subjects import Subjects

log = structlog.get_logger("bourse.exchange")

# How long the region's listings of one check's machines may take in all: within the
# worker's own wait for its verdicts (2 s), beside the claims' reads.
LISTING_TIMEOUT_S = 1.0


class ReclaimDesk:
    """Verdicts on a worker's reserved machines, from the order claims (``claims()``: the
    bucket, None without claims) and what the machines' regions list."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        claims: Callable[[], Awaitable[ClaimStore | None]],
        responder: Responder,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.claims = claims
        self.responder = responder  # answers the workers' checks

    async def on_reclaim(self, msg: Msg) -> None:
        """A worker asks about its reserved machines (docs/protocol.md §5.3d). Only its own:
        the subject names the worker (a supplier key may publish only its workers'), and
        every machine must be that worker's."""
        worker_id = self.subjects.tail(msg.subject, 1)[0]
        check = decode(msg.data, ReclaimCheck)
        if check.worker_id != worker_id:
            raise BadMessage(f"reclaim for worker {check.worker_id!r} sent as {worker_id!r}")
        for m in check.machines:
            if m.worker_id != worker_id or worker_of_machine(m.machine_id) != worker_id:
                raise BadMessage(f"machine {m.machine_id} is not worker {worker_id!r}'s")
        self.responder.spawn(msg, self._reclaim(msg, check))

    async def _reclaim(self, msg: Msg, check: ReclaimCheck) -> None:
        verdicts = await self.verdicts(check)
        self.responder.counts["reclaim_checks"] += 1
        await self.responder.reply(msg, verdicts)

    async def verdicts(self, check: ReclaimCheck) -> ReclaimVerdicts:
        """One verdict per machine of ``check`` (every one the asking worker's)."""
        store = await self.claims()
        if store is None:
            return ReclaimVerdicts(
                verdicts=[
                    ReclaimVerdict(machine_id=m.machine_id, verdict="keep", detail="no claims")
                    for m in check.machines
                ]
            )
        # what the regions listed of this worker, by (region, machine id); the listings of
        # one check wait LISTING_TIMEOUT_S in all, however many machines it names
        listed: dict[tuple[str, str], Machine] = {}
        until = time.monotonic() + LISTING_TIMEOUT_S

        async def vouch(claim: Claim, machine: Placed) -> str:
            key = (machine.region, machine.machine_id)
            if key not in listed and time.monotonic() < until:
                await self._gather(machine, listed, until)
            return vouched(claim, machine, listed.get(key))

        verdicts = []
        for m in check.machines:
            v = await store.judge(m, vouch)
            said = log.bind(worker_id=m.worker_id, machine_id=m.machine_id, order_id=m.order_id)
            if v.refused:
                said.warning("reclaim_refused", detail=v.detail)
            elif v.verdict != "wait":
                said.info("reclaim_verdict", verdict=v.verdict, detail=v.detail)
            verdicts.append(
                ReclaimVerdict(machine_id=m.machine_id, verdict=v.verdict, detail=v.detail)
            )
        return ReclaimVerdicts(verdicts=verdicts)

    async def _gather(
        self, machine: Placed, listed: dict[tuple[str, str], Machine], until: float
    ) -> None:
        """Ask ``machine``'s region for its worker's reserved machines and add what that
        worker lists there to ``listed``, until ``machine`` is among them or ``until``. No
        page is taken as the answer's last: any supplier of the region hears the request
        and could send one, so only the machine's turning up ends the wait early."""
        region, worker_id = machine.region, machine.worker_id
        ask = encode(ListMachines(worker_id=worker_id, states=["reserved"]))
        try:
            async with scatter(self.nc, self.subjects.machines(region), ask) as replies:
                while (region, machine.machine_id) not in listed:
                    data = await replies.next(max(0.001, until - time.monotonic()))
                    if data is None:
                        return  # nobody serves the region's machines subject
                    page = decode(data, MachinePage)
                    if page.worker_id == worker_id and page.region == region:
                        listed.update(((region, m.machine_id), m) for m in page.machines)
        except (TimeoutError, nats.errors.Error, BadMessage) as exc:
            said = log.bind(region=region, worker_id=worker_id, machine_id=machine.machine_id)
            said.info("reclaim_machine_unlisted", error=repr(exc))
