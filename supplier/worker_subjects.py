"""A worker's own subjects (``bourse.v1.worker.<worker_id>.…``), as its supplier answers
them: a commit (docs/protocol.md §4.6), a release (§4.11), the machine verbs (§4.13), a
command run inside a machine (§4.24, supplier/execs.py).
Decoding and answering only; what each one does is the worker's (supplier/worker.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.msg import Msg

from bourse.nats.responder import Responder
from bourse.wire.codec import BadMessage, decode
from bourse.wire.messages import (
    EXEC_VERB,
    MACHINE_VERBS,
    Commit,
    ExecRequest,
    ListMachines,
    MachineRequest,
    Placed,
    Release,
    worker_of_machine,
)
from bourse.wire.subjects import Subjects
from supplier.desk import Desk
from supplier.execs import ExecSessions
from supplier.worker import Worker


class WorkerSubjects:
    """The answers on every worker's subjects of one supplier process."""

    def __init__(
        self,
        subjects: Subjects,
        workers: dict[str, Worker],
        desk: Desk,
        responder: Callable[[], Responder],
        release_region: Callable[[Release, str], None],
        execs: ExecSessions,
    ) -> None:
        self.subjects = subjects
        self.workers = workers
        self.desk = desk
        self._responder = responder  # the host's, made when it runs
        self.release_region = release_region
        self.execs = execs

    @property
    def responder(self) -> Responder:
        return self._responder()

    async def on_message(self, msg: Msg) -> None:
        wid, *rest = self.subjects.tail(msg.subject, 1)
        w = self.workers[wid]
        if rest == ["commit"]:
            commit = decode(msg.data, Commit)
            self.responder.spawn(msg, self._committed(msg, w, commit))
        elif rest == ["release"]:
            rel = decode(msg.data, Release)
            if rel.worker_id and rel.worker_id != wid:
                raise BadMessage(f"release for worker {rel.worker_id!r} sent to worker {wid!r}")
            w.release(rel.order_id, rel.auction_id, rel.abort_commit)
        elif len(rest) == 2 and rest[0] == "machine" and rest[1] in MACHINE_VERBS:
            await self._machine(w, msg, rest[1])
        elif rest == ["machine", EXEC_VERB]:
            req = decode(msg.data, ExecRequest)
            if worker_of_machine(req.machine_id) != w.worker_id:
                raise BadMessage(f"machine {req.machine_id} does not belong to worker {wid}")
            if not req.session or not msg.reply:
                raise BadMessage("machine.exec on a worker needs a session and a reply subject")
            self.responder.spawn(msg, self.execs.run(msg, w, req))
        else:
            await self.responder.error(
                msg,
                "unknown_subject",
                f"unknown subject {msg.subject!r}: a worker answers commit, release and "
                f"machine.<{'|'.join((*MACHINE_VERBS, EXEC_VERB))}>",
            )

    async def _committed(self, msg: Msg, w: Worker, commit: Commit) -> None:
        result = await w.commits.commit(commit)
        if isinstance(result, Placed):
            self.desk.placed(result.order_id, w)
        await self.responder.reply(msg, result)
        if isinstance(result, Placed) and commit.release_others and commit.auction_id:
            # every offer was this process's: the auction sends no region release (§4.6)
            self.release_region(
                Release(order_id=commit.order_id, auction_id=commit.auction_id), w.region
            )

    async def _answer(self, msg: Msg, result: Awaitable[msgspec.Struct]) -> None:
        await self.responder.reply(msg, await result)

    async def _machine(self, w: Worker, msg: Msg, verb: str) -> None:
        if verb == "list":
            req = decode(msg.data, ListMachines) if msg.data.strip() else ListMachines()
            await self.responder.reply(msg, w.list_machines(req=req))
            return
        mreq = decode(msg.data, MachineRequest)
        if worker_of_machine(mreq.machine_id) != w.worker_id:
            raise BadMessage(f"machine {mreq.machine_id} does not belong to worker {w.worker_id}")
        if verb == "get":
            await self.responder.reply(msg, w.get_machine(mreq.machine_id))
        elif verb == "logs":
            logs = await w.logs(mreq.machine_id, mreq.tail, mreq.since)
            await self.responder.reply(msg, logs)
        else:
            self.responder.spawn(msg, self._answer(msg, w.transition(verb, mreq.machine_id)))
