"""The buyer's client library: place orders, read the fleet, manage machines.

Thin typed methods over NATS request-reply. ``direct=True`` runs the auction in this
process against the suppliers (no exchange instance needed); otherwise orders go to the
exchange queue group.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

import nats.errors
from nats.aio.client import Client as NATS

from bourse.auction.admission import ConcurrencyLimit
from bourse.auction.broker import Broker, Refused
from bourse.auction.driver import AuctionConfig, Auctioneer
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.messages import (
    OVERLOADED_REASON,
    Error,
    ListMachines,
    Machine,
    MachineList,
    MachineLogs,
    MachineReply,
    MachineRequest,
    OrderReply,
    Placed,
    PlaceOrder,
    StatusRequest,
    Unfilled,
    WorkerStatus,
    worker_of_machine,
)
from bourse.wire.subjects import Subjects

T = TypeVar("T")

# How long past an order's own deadline the buyer waits for the exchange's answer.
REPLY_SLACK_S = 2.0
# Machine verbs may wait for a stop grace or an image pull.
MACHINE_TIMEOUT_S = 60.0


# ClientError.code of an order the exchange (or a direct buyer's own admission control)
# refused as overloaded: nothing was bid; try again later or elsewhere. On the wire it is an
# Error "internal" (the v1 codes are fixed) with reason "overloaded".
OVERLOADED_CODE = "overloaded"


class ClientError(RuntimeError):
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
    ) -> None:
        self.nc = nc
        self.subjects = subjects or Subjects()
        self.direct = direct
        # Direct mode only: the exchange's admission control, run here (a load source
        # placing thousands of orders a second wants it; one CLI order does not).
        self.admission = admission
        # Direct mode: the same broker (admission + auction) the exchange runs.
        self._broker = Broker(Auctioneer(nc, self.subjects, auction), admission) if direct else None

    async def close(self) -> None:
        if self._broker is not None:
            await self._broker.close()

    async def place(self, order: PlaceOrder) -> Placed | Unfilled:
        """Run one immediate-or-cancel order; raises ClientError on an Error reply (or, in
        direct mode, the same refusal: code ``overloaded``, ``bad_request`` for an order id
        in use by another order, ``internal`` when the auction cannot run)."""
        if self._broker is not None:
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
            self.subjects.order(order.region), encode(order), OrderReply, timeout, "exchange"
        )
        if isinstance(reply, Error):
            raise _refusal(reply)
        return reply

    async def status(
        self, region: str, within_s: float = 0.5, quiet_s: float = 0.1
    ) -> list[WorkerStatus]:
        """Scatter-gather: every worker of the region answers; stop after ``quiet_s`` silence."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        out: list[WorkerStatus] = []
        try:
            await self.nc.publish(
                self.subjects.status(region), encode(StatusRequest()), reply=inbox
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
        return sorted(out, key=lambda s: s.worker_id)

    def _machine_subject(self, verb: str, machine_id: str) -> tuple[str, str]:
        """Through the exchange, or (direct) straight to the worker named in the id."""
        if self.direct:
            return self.subjects.worker_machine(worker_of_machine(machine_id), verb), "worker"
        return self.subjects.machine(verb), "exchange"

    async def machine(self, verb: str, machine_id: str) -> Machine:
        """get / start / stop / destroy one machine; returns it as it is afterwards."""
        subject, who = self._machine_subject(verb, machine_id)
        body = encode(MachineRequest(machine_id=machine_id))
        reply = await self._request(subject, body, MachineReply, MACHINE_TIMEOUT_S, who)
        return _expect(reply, Machine)

    async def logs(self, machine_id: str, tail: int = 100) -> MachineLogs:
        subject, who = self._machine_subject("logs", machine_id)
        body = encode(MachineRequest(machine_id=machine_id, tail=tail))
        reply = await self._request(subject, body, MachineReply, MACHINE_TIMEOUT_S, who)
        return _expect(reply, MachineLogs)

    async def machines(self, worker_id: str, include_destroyed: bool = False) -> MachineList:
        body = ListMachines(worker_id=worker_id, include_destroyed=include_destroyed)
        subject = (
            self.subjects.worker_machine(worker_id, "list")
            if self.direct
            else self.subjects.machine("list")
        )
        reply = await self._request(
            subject, encode(body), MachineReply, MACHINE_TIMEOUT_S, "worker"
        )
        return _expect(reply, MachineList)

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


def _refusal(error: Error) -> ClientError:
    """An order's Error as a ClientError: an overload refusal (Error.reason) gets code
    ``overloaded``, anything else keeps its wire code."""
    if error.reason == OVERLOADED_REASON:
        return ClientError(error.detail, OVERLOADED_CODE)
    return ClientError(error.detail, error.code)


def _expect(reply: object, typ: type[T]) -> T:
    if isinstance(reply, Error):
        raise ClientError(reply.detail, reply.code)
    if not isinstance(reply, typ):
        raise ClientError(f"expected {typ.__name__}, got {type(reply).__name__}")
    return reply
