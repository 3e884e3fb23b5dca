"""Commands kept for this supplier's workers while they were away (docs/protocol.md §4.20):
a stop or destroy the exchange or the operator stored in the command stream because the
worker did not answer.

:func:`decide` is the pure core: a command, the worker it reached and that worker's machine
-> apply, nothing to do, or drop (with why). :class:`Commands` is the shell: one durable
consumer per worker, the commands pending at the start applied before the host resumes its
machines (I9), then each command applied as it comes (after a reconnect too: the consumer
waits for the worker), each acknowledged once its change is recorded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import anyio
import anyio.abc
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from bourse.nats.commands import command_stream_name, consumer_config
from bourse.wire.codec import BadMessage, decode
from bourse.wire.messages import (
    TENANT_REQUESTER,
    Error,
    Event,
    Machine,
    MachineCommand,
    worker_of_machine,
)
from bourse.wire.subjects import Subjects
from bourse.wire.tenancy import owns
from supplier.machines.lifecycle import SETTLED
from supplier.worker import Worker

log = structlog.get_logger("bourse.supplier.commands")

Action = Literal["apply", "nothing", "drop"]
# How long the start waits, at most, for the commands pending then (a stream that does not
# answer must not keep a worker from serving: what it holds comes later, while it runs).
CATCH_UP_S = 10.0
# One fetch of the start's catch-up, and of the loop (a long poll: returns as soon as a
# command is there).
CATCH_UP_FETCH_S = 1.0
FETCH_WAIT_S = 5.0
BATCH = 64
# After a failed fetch (the connection away, the stream gone), or a consumer that could not
# be opened (the stream not made yet): the pace of trying again.
RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class Decision:
    """What a worker does with a command, and why (its event's detail)."""

    action: Action
    detail: str


def decide(command: MachineCommand, worker_id: str, machine: Machine | None) -> Decision:
    """What ``worker_id`` does with ``command``, its machine being ``machine`` (None: it has
    none of that id). Drop: it names another worker or, for a tenant, a machine not the
    tenant's; nothing: the verb has nothing left to do; else apply."""
    owner = worker_of_machine(command.machine_id)
    if command.worker_id != worker_id or owner != worker_id:
        return Decision(
            "drop",
            f"names worker {command.worker_id}'s machine {command.machine_id}, not {worker_id}'s",
        )
    if machine is None or machine.state == "destroyed":
        return Decision("nothing", f"no live machine {command.machine_id} here")
    tenant = command.requested_by.removeprefix(TENANT_REQUESTER)
    if tenant != command.requested_by and not owns(tenant, machine.order_id):
        return Decision("drop", f"machine {command.machine_id} is not one of {tenant!r}'s")
    if machine.state in SETTLED[command.verb]:
        return Decision("nothing", f"it is {machine.state} already")
    if command.verb == "stop" and machine.state == "reserved":
        return Decision("nothing", "it is reserved: it does not run")
    return Decision("apply", f"{command.requested_by}: {command.reason}".rstrip(": "))


def detail_of(command: MachineCommand, decision: Decision) -> str:
    """The ``command`` event's detail."""
    if decision.action == "apply":
        return f"{command.verb} applied ({decision.detail})"
    if decision.action == "nothing":
        return f"{command.verb}: nothing to do ({decision.detail})"
    return f"{command.verb} dropped: {decision.detail}"


class Commands:
    """The command stream's consumers of one supplier's workers; :meth:`run` applies what
    is pending before it says started, then what comes, until cancelled."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        workers: dict[str, Worker],
        announce: Callable[[Event], None],
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.workers = workers
        self.announce = announce  # the ``command`` events: at most once
        self.counts: Counter[str] = Counter()
        self._js: JetStreamContext | None = None
        self._tasks: anyio.abc.TaskGroup | None = None  # run()'s: each worker's follower
        # a worker's follower (its end), and the workers whose followers are to end
        self._following: dict[str, anyio.Event] = {}
        self._pausing: set[str] = set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Open each worker's consumer and apply what it holds now (bounded by
        CATCH_UP_S), say started, then apply each command as it comes. A worker whose
        consumer could not be opened (the stream not made yet) opens it later, then
        applies what waits at once."""
        self._js = self.nc.jetstream()
        opened = {wid: await self._caught_up(wid) for wid in self.workers}
        task_status.started()
        try:
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                for wid, sub in opened.items():
                    self._follow_in(wid, sub)
                await anyio.sleep_forever()  # a worker's follower may end (pause): not this
        finally:
            self._tasks = None

    async def _caught_up(self, wid: str) -> JetStreamContext.PullSubscription | None:
        """The worker's consumer opened and what it holds applied (bounded by CATCH_UP_S);
        None if it could not be opened (its follower opens it later)."""
        assert self._js is not None
        got = await self._open(self._js, wid, said=False)
        if got is None:
            return None
        with anyio.move_on_after(CATCH_UP_S):
            await self._catch_up(wid, *got)
        return got[0]

    def _follow_in(self, wid: str, sub: JetStreamContext.PullSubscription | None) -> None:
        assert self._tasks is not None and self._js is not None
        js, ended = self._js, anyio.Event()
        self._following[wid] = ended

        async def follow() -> None:
            try:
                await self._follow(js, wid, sub)
            finally:
                ended.set()

        self._tasks.start_soon(follow)

    async def pause(self, wid: str) -> None:
        """The worker is stopped (§4.22): its commands wait in the stream until it starts
        (:meth:`resume`). Its follower ends after the fetch under way (at most
        FETCH_WAIT_S), applying what that fetch brings: a fetch cut short would leave its
        pull request with the server, which would deliver the next command to nobody (held
        unacknowledged for the consumer's ack wait, past the worker's start: I9)."""
        ended = self._following.pop(wid, None)
        if ended is not None:
            self._pausing.add(wid)
            try:
                await ended.wait()
            finally:
                self._pausing.discard(wid)

    async def resume(self, wid: str) -> None:
        """The worker starts again: what waits for it applied now (before its machines
        resume: I9), then each command as it comes. Nothing while :meth:`run` does not run
        (no JetStream)."""
        if self._tasks is None or wid in self._following:
            return
        self._follow_in(wid, await self._caught_up(wid))

    async def _open(
        self, js: JetStreamContext, wid: str, *, said: bool
    ) -> tuple[JetStreamContext.PullSubscription, int] | None:
        """The worker's durable consumer (made if missing) and how many commands wait;
        None when it cannot be opened (said once, as an error: ``said`` False)."""
        stream = command_stream_name(self.subjects.prefix)
        try:
            info = await js.add_consumer(stream, consumer_config(self.subjects, wid))
            sub = await js.pull_subscribe_bind(durable=info.name, stream=stream)
        except (nats.js.errors.Error, nats.errors.Error, TimeoutError) as exc:
            (log.debug if said else log.error)(
                "command_stream_unavailable",
                worker_id=wid,
                stream=stream,
                error=repr(exc),
                effect="asked again while the worker runs; its commands wait for it",
            )
            return None
        return sub, info.num_pending or 0

    async def _catch_up(
        self, wid: str, sub: JetStreamContext.PullSubscription, pending: int
    ) -> None:
        taken = 0
        while taken < pending:
            try:
                msgs = await sub.fetch(min(pending - taken, BATCH), timeout=CATCH_UP_FETCH_S)
            except (nats.errors.TimeoutError, TimeoutError):  # nats-py raises either
                return  # taken meanwhile, or not delivered yet: the loop will
            for msg in msgs:
                await self._take(wid, msg)
            taken += len(msgs)

    async def _follow(
        self, js: JetStreamContext, wid: str, sub: JetStreamContext.PullSubscription | None
    ) -> None:
        while sub is None:
            if wid in self._pausing:
                return
            await anyio.sleep(RETRY_S)  # the pace of asking again, not a wait for an event
            got = await self._open(js, wid, said=True)
            sub = got[0] if got else None
        while wid not in self._pausing:
            try:
                msgs = await sub.fetch(BATCH, timeout=FETCH_WAIT_S)
            except (nats.errors.TimeoutError, TimeoutError):  # nats-py raises either
                continue
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                log.warning("command_fetch_failed", worker_id=wid, error=repr(exc))
                await anyio.sleep(RETRY_S)  # the pace of trying again, not a wait for an event
                continue
            for msg in msgs:
                await self._take(wid, msg)

    async def _take(self, wid: str, msg: Msg) -> None:
        """Apply one command, announce it, acknowledge it; a command that could not be
        recorded is left unacknowledged (delivered again)."""
        w = self.workers[wid]
        try:
            command = decode(msg.data, MachineCommand)
        except BadMessage as exc:
            self.counts["drop"] += 1
            self._dropped(wid, f"unreadable command: {exc}")
            await msg.ack()
            return
        shown = w.get_machine(command.machine_id)
        decision = decide(command, wid, shown if isinstance(shown, Machine) else None)
        if decision.action == "apply":
            result = await w.transition(command.verb, command.machine_id)
            if isinstance(result, Error) and result.code == "internal":
                log.error("command_not_applied", worker_id=wid, error=result.detail)
                return
            if isinstance(result, Error):
                decision = Decision("nothing", result.detail)
        self.counts[decision.action] += 1
        if decision.action == "drop":
            self._dropped(wid, decision.detail, command)
        else:
            log.info(
                "command_" + ("applied" if decision.action == "apply" else "nothing_to_do"),
                worker_id=wid,
                machine_id=command.machine_id,
                verb=command.verb,
                command_id=command.command_id,
                requested_by=command.requested_by,
                detail=decision.detail,
            )
        self.announce(
            w.event("command", machine_id=command.machine_id, detail=detail_of(command, decision))
        )
        await msg.ack()

    def _dropped(self, wid: str, why: str, command: MachineCommand | None = None) -> None:
        log.warning(
            "command_dropped",
            worker_id=wid,
            machine_id=command.machine_id if command else "",
            command_id=command.command_id if command else "",
            reason=why,
        )
