"""The scatter-gathers a supplier process answers for its workers: status (docs/protocol.md
§4.12), why not (§4.15) and machine listings (§4.17), each asked of a region's workers or
of every region's, and answered by every worker here that serves (one the operator
stopped answers none, §4.22).

Decoding and answering only: a status is the worker's (supplier/status.py), a verdict the
desk's (supplier/desk.py ``Desk.explain``), a listing's pages the worker's
(``Worker.machine_pages``); the host subscribes these handlers (supplier/host.py)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable

import msgspec
from nats.aio.msg import Msg

from bourse.nats.responder import Responder, subject_region_mismatch
from bourse.wire.codec import decode
from bourse.wire.messages import ExplainRequest, ListMachines, StatusRequest
from bourse.wire.subjects import Subjects
from supplier.desk import Desk
from supplier.explain import explanation_pages
from supplier.status import worker_status
from supplier.worker import Worker


def serving(workers: Iterable[Worker]) -> list[Worker]:
    """Those of ``workers`` that answer the market (not stopped by the operator)."""
    return [w for w in workers if w.serving]


class Queries:
    """The answers on the status, explain and machines subjects of one supplier process."""

    def __init__(
        self,
        subjects: Subjects,
        workers: dict[str, Worker],
        by_region: dict[str, list[Worker]],
        desk: Desk[Worker],
        responder: Callable[[], Responder],
        jetstream: bool,
    ) -> None:
        self.subjects = subjects
        self.workers = workers
        self.by_region = by_region
        self.desk = desk
        self._responder = responder  # the host's, made when it runs
        self.jetstream = jetstream

    def _region_of(self, msg: Msg) -> str:
        return self.subjects.tail(msg.subject, 1)[0]

    def _reached(self, msg: Msg, every: str) -> list[Worker]:
        """The workers a scatter-gather reaches here: of every region on ``every``, else of
        the subject's region; those the operator stopped answer none."""
        if msg.subject == every:
            return serving(self.workers.values())
        return serving(self.by_region.get(self._region_of(msg), ()))

    async def on_status(self, msg: Msg) -> None:
        if msg.data.strip():
            decode(msg.data, StatusRequest)
        responder = self._responder()
        for w in self._reached(msg, self.subjects.status_every):
            status = worker_status(w)
            if not self.jetstream:  # the degraded mode, said in every worker's status
                status = msgspec.structs.replace(status, jetstream=False)
            await responder.reply(msg, status)

    async def on_explain(self, msg: Msg) -> None:
        """Why not (docs/protocol.md §4.15): the desk's verdict of EVERY worker of the
        region here (nothing held), sent in pages under the payload limit."""
        req = decode(msg.data, ExplainRequest)
        region = self._region_of(msg)
        if req.region != region:
            raise subject_region_mismatch("explain", req.region, region)
        if not msg.reply:
            return
        verdicts = self.desk.explain(req, time.monotonic(), serving(self.by_region.get(region, ())))
        responder = self._responder()
        answer = secrets.token_hex(8)  # groups this answer's pages at the requester
        for page in explanation_pages(req.order_id, region, answer, verdicts):
            await responder.reply(msg, page)

    async def on_machines(self, msg: Msg) -> None:
        """Every machine the request asks for (docs/protocol.md §4.17), of every worker of
        the region here (or of every region, or the one worker it names): each worker's in
        its own MachinePage 1..n, under the page budget, one empty page when none match."""
        req = decode(msg.data, ListMachines) if msg.data.strip() else ListMachines()
        if not msg.reply:
            return
        responder = self._responder()
        for w in self._reached(msg, self.subjects.machines_every):
            if req.worker_id and w.worker_id != req.worker_id:
                continue
            for page in w.machine_pages(req):
                await responder.reply(msg, page)
