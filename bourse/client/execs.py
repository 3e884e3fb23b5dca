"""A command run inside a machine, the client's side (docs/protocol.md §4.24): the
ExecRequest sent to the exchange (a tenant's on its own subject; direct mode: to the worker,
the session named here), then the session: output handed to the caller as it comes and
acknowledged once written (the worker's window), input sent within the worker's window, a
keepalive, the terminal's size; the command's ExecExit at the end.

A lost chunk, a session that goes silent (EXEC_SILENCE_S) or an Error from the market is a
ClientError.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import nats.errors
from anyio.streams.memory import MemoryObjectReceiveStream
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bourse.client.errors import ClientError
from bourse.nats.execflow import Inflow, StreamError, Window
from bourse.nats.scatter import no_responders
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.limits import EXEC_KEEPALIVE_S, EXEC_SILENCE_S, MAX_EXEC_CHUNK
from bourse.wire.messages import (
    EXCHANGE_REQUESTER,
    Error,
    ExecAck,
    ExecCancel,
    ExecExit,
    ExecInput,
    ExecOutput,
    ExecReply,
    ExecRequest,
    ExecResize,
    ExecStarted,
    Message,
)

# How long the first answer may take (the exchange asks the worker, which starts it).
START_TIMEOUT_S = 15.0

# The caller's parts: where output goes (stream, bytes), where input comes from (b"": its
# end), the terminal's sizes as they change.
Output = Callable[[str, bytes], Awaitable[None]]
Input = Callable[[int], Awaitable[bytes]]


@dataclass(frozen=True, slots=True)
class Ended:
    """How the command ended: its exit code, or the signal that killed it, and why the
    worker ended it (``detail``)."""

    code: int | None
    signal: int | None
    detail: str

    @property
    def status(self) -> int:
        """As a shell gives it: the code, or 128 + the signal."""
        if self.code is not None:
            return self.code
        return 128 + (self.signal or 0) if self.signal else 1


async def run(
    nc: NATS,
    subject: str,
    req: ExecRequest,
    output: Output,
    read_input: Input | None = None,
    sizes: MemoryObjectReceiveStream[tuple[int, int]] | None = None,
) -> Ended:
    """Run ``req`` through ``subject`` (the exchange's machine.exec, or a worker's in direct
    mode: ``req.session`` then set), to its end."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, encode(req), reply=inbox)
        started = await _started(sub, subject)
        return await Session(nc, started, req).run(sub, output, read_input, sizes)
    finally:
        with anyio.CancelScope(shield=True):
            await sub.unsubscribe()


def direct_request(req: ExecRequest) -> ExecRequest:
    """A request sent to the worker itself (direct mode: the client is the exchange's key)."""
    import msgspec

    return msgspec.structs.replace(req, session=secrets.token_hex(16), requester=EXCHANGE_REQUESTER)


async def _started(sub: Subscription, subject: str) -> ExecStarted:
    try:
        first = await sub.next_msg(timeout=START_TIMEOUT_S)
    except nats.errors.TimeoutError:
        raise ClientError(f"no answer on {subject} within {START_TIMEOUT_S:.0f} s") from None
    if no_responders(first):
        raise ClientError(f"nobody is listening on {subject}")
    reply: ExecReply = _decode(first)
    if isinstance(reply, Error):
        raise ClientError(reply.detail, reply.code)
    if not isinstance(reply, ExecStarted):
        raise ClientError(f"expected ExecStarted, got {type(reply).__name__}")
    return reply


def _decode(msg: Msg) -> ExecReply:
    try:
        reply: ExecReply = decode(msg.data, ExecReply)
    except BadMessage as exc:
        raise ClientError(f"unreadable exec answer: {exc}") from None
    return reply


class Session:
    """One session, the client's side."""

    def __init__(self, nc: NATS, started: ExecStarted, req: ExecRequest) -> None:
        self.nc = nc
        self.id = started.session
        self.input = started.input
        self.received = Inflow(req.window_bytes)  # output
        self.sent = Window(started.window_bytes)  # input
        self._room = anyio.Event()
        self._acked = 0  # output acknowledged so far

    async def run(
        self,
        sub: Subscription,
        output: Output,
        read_input: Input | None,
        sizes: MemoryObjectReceiveStream[tuple[int, int]] | None,
    ) -> Ended:
        ended: Ended | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._keepalive)
                if read_input is not None:
                    tg.start_soon(self._send_input, read_input)
                if sizes is not None:
                    tg.start_soon(self._resize, sizes)
                ended = await self._receive(sub, output)
                tg.cancel_scope.cancel()
            if ended is None:  # never: the task group ends with _receive's answer
                raise ClientError("the session ended without the command's exit")
            return ended
        finally:
            if ended is None:  # cut short here (Ctrl-C, an error): the command ends too
                with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                    await self._send(ExecCancel(session=self.id))

    async def _receive(self, sub: Subscription, output: Output) -> Ended:
        while True:
            try:
                msg = await sub.next_msg(timeout=EXEC_SILENCE_S)
            except nats.errors.TimeoutError:
                raise ClientError(f"the session went silent for {EXEC_SILENCE_S} s") from None
            reply = _decode(msg)
            if isinstance(reply, Error):
                raise ClientError(reply.detail, reply.code)
            if reply.session != self.id:
                continue
            if isinstance(reply, ExecOutput):
                try:
                    self.received.take(reply.offset, len(reply.data))
                except StreamError as exc:
                    raise ClientError(f"output lost: {exc}") from None
                await output(reply.stream, reply.data)
                self.received.wrote(len(reply.data))
                if self.received.written - self._acked >= self.received.size // 4:
                    await self._ack()
            elif isinstance(reply, ExecAck):
                try:
                    if self.sent.ack(reply.received):
                        self._room.set()
                except StreamError as exc:
                    raise ClientError(f"input: {exc}") from None
            elif isinstance(reply, ExecExit):
                return Ended(reply.code, reply.signal, reply.detail)

    async def _ack(self) -> None:
        self._acked = self.received.written
        await self._send(ExecAck(session=self.id, received=self._acked))

    async def _send(self, message: Message) -> None:
        await self.nc.publish(self.input, encode(message))

    async def _keepalive(self) -> None:
        while True:
            await anyio.sleep(EXEC_KEEPALIVE_S)
            await self._ack()

    async def _send_input(self, read_input: Input) -> None:
        while True:
            while self.sent.room <= 0:
                self._room = anyio.Event()
                await self._room.wait()
            data = await read_input(min(MAX_EXEC_CHUNK, self.sent.room))
            offset = self.sent.sending(len(data))
            await self._send(ExecInput(session=self.id, offset=offset, data=data, eof=not data))
            if not data:
                return

    async def _resize(self, sizes: MemoryObjectReceiveStream[tuple[int, int]]) -> None:
        async for rows, cols in sizes:
            await self._send(ExecResize(session=self.id, rows=rows, cols=cols))
