"""A worker's exec sessions (docs/protocol.md §4.24): ``worker.<id>.machine.exec`` from the
exchange, a command started inside the machine (supplier/machines/execs.py), its output sent
to the exchange's inbox within the client's window, its input taken on an inbox of the
worker's own, a keepalive each way, its time limit, and its end as ExecExit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import PurePosixPath

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bourse.nats.execflow import Inflow, StreamError, Window
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.limits import (
    EXEC_KEEPALIVE_S,
    EXEC_SILENCE_S,
    EXEC_WINDOW_BYTES,
    MAX_EXEC_CHUNK,
)
from bourse.wire.messages import (
    EXEC_VERB,
    Error,
    Event,
    ExecAck,
    ExecCancel,
    ExecExit,
    ExecFeed,
    ExecInput,
    ExecOutput,
    ExecRequest,
    ExecResize,
    ExecStarted,
    Message,
)
from supplier.machines import execs
from supplier.machines.api import Entry
from supplier.machines.execs import Command
from supplier.worker import Worker

log = structlog.get_logger("bourse.exec")

# Where the event names who asked when the exchange did not say (a direct request).
UNNAMED = "exchange"
MAX_DETAIL = 1024


def event_detail(req: ExecRequest) -> str:
    """The ``exec`` event's detail: who asked and what it ran (its first word only: the
    arguments may hold a secret)."""
    return f"{req.requester or UNNAMED}: {PurePosixPath(req.command[0]).name}"[:MAX_DETAIL]


class ExecSessions:
    """The exec sessions of one supplier process's workers."""

    def __init__(self, nc: Callable[[], NATS], announce: Callable[[Event], None]) -> None:
        self._nc = nc  # the host's connection, made when it runs
        self.announce = announce  # at most once, as the ``command`` events

    async def run(self, msg: Msg, w: Worker, req: ExecRequest) -> None:
        """Answer an ExecRequest: an Error, or ExecStarted and the session to its end."""
        nc = self._nc()
        refused = await self._refused(w, req)
        if isinstance(refused, Error):
            await nc.publish(msg.reply, encode(refused))
            return
        entry = refused
        try:
            size = (req.rows, req.cols)
            cmd = await execs.start(entry, req.command, req.env, req.tty, req.stdin, size)
        except OSError as exc:
            why = f"cannot start a command in {req.machine_id}: {exc}"
            await nc.publish(msg.reply, encode(Error(code="internal", detail=why)))
            return
        m = w.get_machine(req.machine_id)
        order_id = "" if isinstance(m, Error) else m.order_id
        self.announce(w.event(EXEC_VERB, order_id, req.machine_id, event_detail(req)))
        await Session(nc, msg.reply, req, cmd).run()

    async def _refused(self, w: Worker, req: ExecRequest) -> Error | Entry:
        """What the command enters, or why there is none."""
        m = w.get_machine(req.machine_id)
        if isinstance(m, Error):
            return m
        if m.state != "started":
            return Error(
                code="bad_request",
                detail=f"machine {m.machine_id} is {m.state}: exec needs a started machine",
            )
        entry = await w.keeper.driver.entry(m.machine_id)
        if entry is None:
            return Error(
                code="bad_request",
                detail=f"machine {m.machine_id} runs nothing to enter (its worker's driver "
                f"is {w.keeper.driver.name})",
            )
        return entry


class Session:
    """One command's session on the worker: output within the client's window, input as
    it comes, a keepalive each way, the time limit; ExecExit at its end."""

    def __init__(self, nc: NATS, reply: str, req: ExecRequest, cmd: Command) -> None:
        self.nc = nc
        self.reply = reply
        self.req = req
        self.cmd = cmd
        self.id = req.session
        self.out = Window(req.window_bytes)
        self.reserved = 0  # bytes of the window a pump reads into now
        self.inflow = Inflow(EXEC_WINDOW_BYTES)
        self._room = anyio.Event()
        self.heard_at = time.monotonic()
        self.detail = ""  # why the worker ended the command
        self._sending = anyio.Lock()
        self._inputs: tuple[MemoryObjectSendStream[ExecInput], MemoryObjectReceiveStream[ExecInput]]
        self._inputs = anyio.create_memory_object_stream[ExecInput](math.inf)
        self.log = log.bind(machine_id=req.machine_id, session=req.session)

    async def run(self) -> None:
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, cb=self._feed)
        ended: tuple[int | None, int | None] = (None, None)
        try:
            started = ExecStarted(
                session=self.id,
                machine_id=self.req.machine_id,
                input=inbox,
                window_bytes=self.inflow.size,
            )
            await self._send(started)
            self.log.info("exec_started", requester=self.req.requester, tty=self.req.tty)
            ended = await self._serve()
        finally:
            with anyio.CancelScope(shield=True):
                if self.cmd.proc.returncode is None:
                    self.detail = self.detail or "the worker stopped"
                    self.cmd.kill()
                    ended = await self.cmd.wait()
                await sub.unsubscribe()
                for end in self._inputs:
                    end.close()
                await anyio.to_thread.run_sync(self.cmd.close)
                code, sig = ended
                done = ExecExit(session=self.id, code=code, signal=sig, detail=self.detail)
                await self._send(done)
                self.log.info("exec_ended", code=code, signal=sig, detail=self.detail)

    async def _serve(self) -> tuple[int | None, int | None]:
        """The command's end, once its output was read to its end (at most DRAIN_S after)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write_input)
            tg.start_soon(self._watch)
            async with anyio.create_task_group() as pumps:
                for stream, fd in self.cmd.outputs.items():
                    pumps.start_soon(self._pump, stream, fd)
                ended = await self.cmd.wait()
                pumps.cancel_scope.deadline = anyio.current_time() + execs.DRAIN_S
            tg.cancel_scope.cancel()
        return ended

    def _end(self, detail: str) -> None:
        """The worker ends the command (its exit says why)."""
        if not self.detail:
            self.detail = detail[:MAX_DETAIL]
        self.cmd.kill()

    # -- output ---------------------------------------------------------------------------
    async def _pump(self, stream: str, fd: int) -> None:
        while True:
            while self.out.room - self.reserved <= 0:
                self._room = anyio.Event()
                await self._room.wait()
            n = min(MAX_EXEC_CHUNK, self.out.room - self.reserved)
            self.reserved += n
            try:
                data = await self.cmd.read(fd, n)
            finally:
                self.reserved -= n
            if not data:
                return
            async with self._sending:
                offset = self.out.sending(len(data))
                chunk = ExecOutput(
                    session=self.id,
                    stream="stderr" if stream == "stderr" else "stdout",
                    offset=offset,
                    data=data,
                )
                await self.nc.publish(self.reply, encode(chunk))

    async def _send(self, message: Message) -> None:
        async with self._sending:
            await self.nc.publish(self.reply, encode(message))

    # -- input, acknowledgements, the client's verbs ----------------------------------------
    async def _feed(self, msg: Msg) -> None:
        """A message from the client (through the exchange), in order."""
        try:
            feed: ExecFeed = decode(msg.data, ExecFeed)
        except BadMessage as exc:
            self.log.warning("exec_feed_refused", detail=str(exc))
            return
        if feed.session != self.id:
            self.log.warning("exec_feed_refused", detail=f"session {feed.session!r}")
            return
        self.heard_at = time.monotonic()
        try:
            if isinstance(feed, ExecInput):
                self.inflow.take(feed.offset, len(feed.data))
                self._inputs[0].send_nowait(feed)
            elif isinstance(feed, ExecAck):
                if self.out.ack(feed.received):
                    self._room.set()
            elif isinstance(feed, ExecResize):
                self.cmd.resize(feed.rows, feed.cols)
            elif isinstance(feed, ExecCancel):
                self._end("cancelled")
        except StreamError as exc:
            self._end(f"lost input: {exc}")

    async def _write_input(self) -> None:
        async for chunk in self._inputs[1]:
            if chunk.data:
                await self.cmd.write(chunk.data)
                self.inflow.wrote(len(chunk.data))
                await self._send(ExecAck(session=self.id, received=self.inflow.written))
            if chunk.eof:
                self.cmd.close_input()

    async def _watch(self) -> None:
        """A keepalive every EXEC_KEEPALIVE_S; the command ended at the time limit or when
        the client is silent for EXEC_SILENCE_S."""
        deadline = time.monotonic() + self.req.timeout_s
        while True:
            now = time.monotonic()
            if now >= deadline:
                self._end(f"timeout: {self.req.timeout_s} s")
                return
            if now - self.heard_at >= EXEC_SILENCE_S:
                self._end(f"the client went away (nothing heard for {EXEC_SILENCE_S} s)")
                return
            await self._send(ExecAck(session=self.id, received=self.inflow.written))
            await anyio.sleep(min(EXEC_KEEPALIVE_S, deadline - now))
