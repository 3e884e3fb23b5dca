"""The exchange's exec relay (docs/protocol.md §4.24): an ExecRequest on ``machine.exec`` (a
tenant's on ``tenant.<name>.machine.exec``, its own machines only) is given a session id
and forwarded to ``worker.<id>.machine.exec``; this instance then relays the session: the
worker's messages (on an inbox of its own) to the client's inbox, the client's (on
``exec.<session>``, a tenant's ``tenant.<name>.exec.<session>``) to the worker's input, each
checked, until ExecExit, an Error, a silence of EXEC_SILENCE_S on either side, or the
session's time limit. Clients never publish on a worker's subject.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bourse.nats.responder import Responder
from bourse.nats.scatter import no_responders
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.limits import EXEC_SILENCE_S
from bourse.wire.messages import (
    EXCHANGE_REQUESTER,
    EXEC_VERB,
    TENANT_REQUESTER,
    Error,
    ExecCancel,
    ExecExit,
    ExecFeed,
    ExecReply,
    ExecRequest,
    ExecStarted,
    worker_of_machine,
)
from bourse.wire.subjects import Subjects

log = structlog.get_logger("bourse.exchange")

# How long a worker may take to start the command (a runtime's exec, a terminal).
START_TIMEOUT_S = 10.0
# A session outlives its time limit by at most this (the worker's ExecExit on its way).
GRACE_S = float(EXEC_SILENCE_S)
# Owned: whether a tenant's machine is its own (else the request was answered with why not).
Owned = Callable[[Msg, str, str], Awaitable[bool]]


def new_session() -> str:
    return secrets.token_hex(16)


class ExecRelay:
    """The exec sessions one exchange instance relays."""

    def __init__(self, nc: NATS, subjects: Subjects, responder: Responder, owned: Owned) -> None:
        self.nc = nc
        self.subjects = subjects
        self.responder = responder
        self.owned = owned

    def on_exec(self, msg: Msg, tenant: str = "") -> None:
        req = decode(msg.data, ExecRequest)
        if not msg.reply:
            raise BadMessage("machine.exec needs a reply subject: its session goes there")
        self.responder.spawn(msg, self._session(msg, req, tenant))

    async def _session(self, msg: Msg, req: ExecRequest, tenant: str) -> None:
        if tenant and not await self.owned(msg, tenant, req.machine_id):
            return
        session = new_session()
        requester = TENANT_REQUESTER + tenant if tenant else EXCHANGE_REQUESTER
        req = msgspec.structs.replace(req, session=session, requester=requester)
        inbox = self.nc.new_inbox()
        from_worker = await self.nc.subscribe(inbox)
        try:
            worker_id = worker_of_machine(req.machine_id)
            subject = self.subjects.worker_machine(worker_id, EXEC_VERB)
            await self.nc.publish(subject, encode(req), reply=inbox)
            started = await self._started(msg, from_worker, worker_id)
            if started is None:
                return
            relay = Relay(self, msg.reply, started, req, tenant)
            await relay.run(from_worker)
        finally:
            with anyio.CancelScope(shield=True):
                await from_worker.unsubscribe()

    async def _started(
        self, msg: Msg, from_worker: Subscription, worker_id: str
    ) -> ExecStarted | None:
        """The worker's ExecStarted; else None once the client was told why not."""
        try:
            first = await from_worker.next_msg(timeout=START_TIMEOUT_S)
        except nats.errors.TimeoutError:
            await self.responder.error(
                msg, "internal", f"worker {worker_id!r} did not answer exec in time"
            )
            return None
        if no_responders(first):
            await self.responder.error(
                msg, "bad_request", f"worker {worker_id!r} is not reachable: no supplier serves it"
            )
            return None
        reply: ExecReply = decode(first.data, ExecReply)
        if not isinstance(reply, ExecStarted):
            await self.responder.forward(msg, first.data)  # its Error, as the worker said it
            return None
        return reply


class Relay:
    """One session, relayed both ways (see the module doc)."""

    def __init__(
        self, relay: ExecRelay, client: str, started: ExecStarted, req: ExecRequest, tenant: str
    ) -> None:
        self.nc = relay.nc
        self.client = client  # the client's inbox
        self.worker = started.input  # the worker's input inbox
        self.session = started.session
        self.started = started
        self.input = relay.subjects.exec_input(started.session, tenant)
        self.limit_s = req.timeout_s + GRACE_S
        now = time.monotonic()
        self.heard = {"worker": now, "client": now}
        self.ended = False
        self.log = log.bind(session=started.session, machine_id=req.machine_id, tenant=tenant)

    async def run(self, from_worker: Subscription) -> None:
        from_client = await self.nc.subscribe(self.input)
        try:
            shown = msgspec.structs.replace(self.started, input=self.input)
            await self.nc.publish(self.client, encode(shown))
            self.log.info("exec_relayed")
            with anyio.move_on_after(self.limit_s):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._forward, from_client, ExecFeed, "client", self.worker)
                    tg.start_soon(self._silence, tg.cancel_scope)
                    await self._forward(from_worker, ExecReply, "worker", self.client)
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await from_client.unsubscribe()
                if not self.ended:
                    await self._abandon("the exchange ended the session")

    async def _forward(self, sub: Subscription, typ: Any, side: str, to: str) -> None:
        """Each message on ``sub`` that is a ``typ`` of this session (``side``: whose) on to
        ``to``, as it is; the worker's ExecExit or Error is the last."""
        async for msg in sub.messages:
            try:
                got = decode(msg.data, typ)
            except BadMessage as exc:
                self.log.warning("exec_message_refused", side=side, detail=str(exc))
                continue
            if getattr(got, "session", self.session) != self.session:
                continue
            self.heard[side] = time.monotonic()
            await self.nc.publish(to, msg.data)
            if isinstance(got, ExecExit | Error):
                self.ended = True
                return

    async def _silence(self, scope: anyio.CancelScope) -> None:
        """A side silent for EXEC_SILENCE_S ends the relay: the client is told, or the
        worker asked to end the command (its ExecExit still comes through)."""
        cancelled = False
        while True:
            now = time.monotonic()
            if now - self.heard["worker"] >= EXEC_SILENCE_S:
                await self._abandon(f"the worker stopped answering for {EXEC_SILENCE_S} s")
                self.ended = True
                scope.cancel()
                return
            if not cancelled and now - self.heard["client"] >= EXEC_SILENCE_S:
                await self.nc.publish(self.worker, encode(ExecCancel(session=self.session)))
                cancelled = True
            watched = [self.heard["worker"]] + ([] if cancelled else [self.heard["client"]])
            await anyio.sleep(max(0.0, min(watched) + EXEC_SILENCE_S - now))

    async def _abandon(self, why: str) -> None:
        """The session ends here: the worker's command is cancelled, the client told."""
        self.log.info("exec_abandoned", why=why)
        try:
            await self.nc.publish(self.worker, encode(ExecCancel(session=self.session)))
            await self.nc.publish(self.client, encode(Error(code="internal", detail=why)))
        except Exception:  # the connection itself is gone
            self.log.warning("exec_abandon_unsent")
