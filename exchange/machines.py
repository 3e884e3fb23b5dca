"""The exchange's machine relay: ``<root>.machine.<verb>`` and a tenant's
``<root>.tenant.<name>.machine.<verb>``, routed to ``<root>.worker.<id>.machine.<verb>``
by the worker id embedded in the machine id (or ``ListMachines.worker_id``), the worker's
reply relayed as it is.

``exec`` (a command run inside a machine, its session relayed by this instance) is
exchange/execs.py's, owner-checked here for a tenant.

A ``queue_if_away`` stop or destroy (a buyer's or a tenant's) whose worker does not answer
is kept for it in the command stream (``bourse.nats.commands.probe_or_keep``, §4.20) and
answered with the MachineCommand kept; a tenant's is checked against its machines by the
worker. A tenant's verbs reach only its own machines (the worker is asked for the machine
first), and its listings show only them (bourse/wire/tenancy.py).
"""

from __future__ import annotations

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bourse.nats.commands import CommandNotKept, probe_or_keep
from bourse.nats.responder import Responder
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.messages import (
    COMMAND_VERBS,
    EXCHANGE_REQUESTER,
    EXEC_VERB,
    MACHINE_VERBS,
    TENANT_REQUESTER,
    Error,
    ListMachines,
    Machine,
    MachineList,
    MachineRequest,
    worker_of_machine,
)
from bourse.wire.subjects import Subjects
from bourse.wire.tenancy import own_machines, owns, unscoped
from exchange.execs import ExecRelay

log = structlog.get_logger("bourse.exchange")

MACHINE_TIMEOUT_S = 55.0  # a stop may wait its grace, a start an image pull


class MachineRelay:
    """Relays machine requests to their workers for one exchange instance."""

    def __init__(self, nc: NATS, subjects: Subjects, responder: Responder) -> None:
        self.nc = nc
        self.subjects = subjects
        self.responder = responder
        self.execs = ExecRelay(nc, subjects, responder, self._owned)

    async def on_machine(self, msg: Msg) -> None:
        verb = self.subjects.tail(msg.subject, 1)[0]
        if verb == EXEC_VERB:
            self.execs.on_exec(msg)
            return
        if not await self._known_verb(msg, verb):
            return
        if verb == "list":
            self.responder.spawn(msg, self._relay(msg, _list_worker(msg), verb))
            return
        req = decode(msg.data, MachineRequest)
        self.responder.spawn(msg, self._machine_verb(msg, req, verb))

    async def _machine_verb(self, msg: Msg, req: MachineRequest, verb: str) -> None:
        """Relay to the machine's worker; a ``queue_if_away`` stop or destroy is kept for a
        worker that does not answer."""
        if _keeps(req, verb) and await self._or_keep(msg, req, verb, EXCHANGE_REQUESTER) is None:
            return
        await self._relay(msg, worker_of_machine(req.machine_id), verb)

    async def _or_keep(
        self, msg: Msg, req: MachineRequest, verb: str, requester: str
    ) -> bytes | None:
        """The worker's answer to a ``get`` of the machine when it answers in time; else
        None once the command is kept for the worker in the command stream and ``msg``
        answered with it (or with why it could not be kept, §4.20)."""
        try:
            shown = await probe_or_keep(self.nc, self.subjects, verb, req.machine_id, requester)
        except CommandNotKept as exc:
            await self.responder.error(msg, "internal", str(exc))
            return None
        if isinstance(shown, bytes):
            return shown
        self.responder.counts["command_kept"] += 1
        log.info(
            "command_kept",
            worker_id=shown.worker_id,
            machine_id=req.machine_id,
            verb=verb,
            command_id=shown.command_id,
            requested_by=requester,
        )
        await self.responder.reply(msg, shown)
        return None

    async def _known_verb(self, msg: Msg, verb: str) -> bool:
        """A machine verb the workers serve; else the request is answered with why not."""
        if verb in MACHINE_VERBS:
            return True
        await self.responder.error(
            msg,
            "unknown_subject",
            f"unknown machine verb {verb!r}: use one of {', '.join(MACHINE_VERBS)}",
        )
        return False

    async def _relay(self, msg: Msg, worker_id: str, verb: str) -> None:
        data = await self._ask(msg, worker_id, verb, msg.data)
        if data is not None:
            await self.responder.forward(msg, data)

    async def _ask(self, msg: Msg, worker_id: str, verb: str, data: bytes) -> bytes | None:
        """The worker's reply to ``verb``, or None once ``msg`` was answered with why not."""
        subject = self.subjects.worker_machine(worker_id, verb)
        try:
            reply = await self.nc.request(subject, data, timeout=MACHINE_TIMEOUT_S)
        except nats.errors.NoRespondersError:
            await self.responder.error(
                msg, "bad_request", f"worker {worker_id!r} is not reachable: no supplier serves it"
            )
            return None
        except nats.errors.TimeoutError:
            await self.responder.error(
                msg, "internal", f"worker {worker_id!r} did not answer {verb} in time"
            )
            return None
        return reply.data

    async def on_tenant_machine(self, msg: Msg) -> None:
        """A tenant's machine request: only its own machines, whatever it names."""
        tenant, _, verb = self.subjects.tail(msg.subject, 1)
        if verb == EXEC_VERB:
            self.execs.on_exec(msg, tenant)
            return
        if not await self._known_verb(msg, verb):
            return
        if verb == "list":
            self.responder.spawn(msg, self._tenant_list(msg, tenant, _list_worker(msg)))
            return
        machine_id = decode(msg.data, MachineRequest).machine_id
        self.responder.spawn(msg, self._tenant_verb(msg, tenant, machine_id, verb))

    async def _tenant_list(self, msg: Msg, tenant: str, worker_id: str) -> None:
        data = await self._ask(msg, worker_id, "list", msg.data)
        if data is None:
            return
        reply: MachineList | Error = decode(data, MachineList | Error)
        if isinstance(reply, MachineList):
            reply = own_machines(tenant, reply)
        await self.responder.reply(msg, reply)

    async def _tenant_verb(self, msg: Msg, tenant: str, machine_id: str, verb: str) -> None:
        """Ask the worker for the machine first; act only if it is the tenant's."""
        worker_id = worker_of_machine(machine_id)
        if _keeps(req := decode(msg.data, MachineRequest), verb):  # else the worker checks
            shown = await self._or_keep(msg, req, verb, TENANT_REQUESTER + tenant)
        else:
            shown = await self._ask(
                msg, worker_id, "get", encode(MachineRequest(machine_id=machine_id))
            )
        if shown is None:
            return
        machine = await self._owned_of(msg, tenant, machine_id, verb, shown)
        if machine is None:
            return
        if verb == "get":
            await self.responder.reply(msg, unscoped(tenant, machine))
            return
        data = await self._ask(msg, worker_id, verb, msg.data)
        if data is None:
            return
        try:
            await self.responder.reply(msg, unscoped(tenant, decode(data, Machine)))
        except BadMessage:  # logs, or an Error: as the worker sent it
            await self.responder.forward(msg, data)

    async def _owned(self, msg: Msg, tenant: str, machine_id: str) -> bool:
        """Whether the machine is the tenant's (its worker asked); else ``msg`` was answered
        with why not (an exec's check, exchange/execs.py)."""
        worker_id = worker_of_machine(machine_id)
        get = encode(MachineRequest(machine_id=machine_id))
        shown = await self._ask(msg, worker_id, "get", get)
        return shown is not None and (
            await self._owned_of(msg, tenant, machine_id, EXEC_VERB, shown) is not None
        )

    async def _owned_of(
        self, msg: Msg, tenant: str, machine_id: str, verb: str, shown: bytes
    ) -> Machine | None:
        """The machine its worker showed when it is the tenant's; else None once ``msg``
        was answered with why not (the worker's Error, or not the tenant's)."""
        machine: Machine | Error = decode(shown, Machine | Error)
        if isinstance(machine, Error):
            await self.responder.forward(msg, shown)
            return None
        if not owns(tenant, machine.order_id):
            self.responder.counts["not_owner"] += 1
            log.warning(
                "machine_request_not_owner", tenant=tenant, machine_id=machine_id, verb=verb
            )
            await self.responder.error(
                msg, "bad_request", f"machine {machine_id} is not one of {tenant!r}'s machines"
            )
            return None
        return machine


def _keeps(req: MachineRequest, verb: str) -> bool:
    """Whether the request is kept as a command when its worker does not answer."""
    return req.queue_if_away and verb in COMMAND_VERBS


def _list_worker(msg: Msg) -> str:
    """The worker a machine.list through the exchange names (it must name one)."""
    worker_id = decode(msg.data, ListMachines).worker_id
    if not worker_id:
        raise BadMessage("machine.list through the exchange needs worker_id")
    return worker_id
