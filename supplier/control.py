"""The operator's verbs on one worker (docs/protocol.md §4.22): drain, stop and start,
answered on ``<prefix>.v1.control.<worker_id>`` by the worker's supplier whatever the
worker's state, one verb at a time per worker. Decoding and answering only: a drain is the
worker's (supplier/worker.py), what stopping and starting a worker take (its subjects, its
kept commands, its machines) is the host's (``stop`` and ``start`` here)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
from nats.aio.msg import Msg

from bourse.nats.responder import Responder
from bourse.wire.codec import BadMessage, decode
from bourse.wire.messages import WorkerControl
from bourse.wire.subjects import Subjects
from supplier.worker import Worker

WorkerFn = Callable[[Worker], Awaitable[None]]


class WorkerControls:
    """The answers on the control subjects of one supplier process's workers."""

    def __init__(
        self,
        subjects: Subjects,
        workers: dict[str, Worker],
        responder: Callable[[], Responder],
        stop: WorkerFn,
        start: WorkerFn,
    ) -> None:
        self.subjects = subjects
        self.workers = workers
        self._responder = responder  # the host's, made when it runs
        self.stop = stop
        self.start = start
        self._locks: dict[str, anyio.Lock] = {}

    async def on_message(self, msg: Msg) -> None:
        (wid,) = self.subjects.tail(msg.subject, 1)
        req = decode(msg.data, WorkerControl)
        if req.worker_id != wid:
            raise BadMessage(f"control of worker {req.worker_id!r} sent to worker {wid!r}")
        responder = self._responder()
        responder.spawn(msg, self._act(responder, msg, self.workers[wid], req.action))

    async def _act(self, responder: Responder, msg: Msg, w: Worker, action: str) -> None:
        lock = self._locks.setdefault(w.worker_id, anyio.Lock())
        async with lock:  # one verb at a time: a start never overtakes a stop under way
            if action == "drain":
                w.drain()
            elif action == "stop" and w.serving:
                await self.stop(w)
            elif action == "start":
                if not w.serving:
                    await self.start(w)
                w.undrain()
        await responder.reply(msg, w.state())
