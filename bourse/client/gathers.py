"""What a scatter-gather's replies add up to (bourse/nats/scatter.py reads them): the
pages of a dry run's explanations and of a machine listing, per responder, and whether
every worker the region's status named has given its whole answer.
"""

from __future__ import annotations

from typing import Any

import msgspec

from bourse.wire.codec import BadMessage, decode
from bourse.wire.messages import (
    Error,
    ExplainReply,
    Explanation,
    Machine,
    MachinePage,
    MachinesReply,
    WorkerVerdict,
)
from bourse.wire.paging import PageSet


class Listing(msgspec.Struct, kw_only=True):
    """Every machine a listing asked for (``buyer machines list``, §4.17), sorted by
    region, worker and creation; ``complete`` when every worker the regions' status named
    sent all its pages, else ``missing`` names those that did not (all of them or the rest
    of their pages); ``regions``: those where some worker answered."""

    machines: list[Machine]
    complete: bool
    missing: list[str] = []
    regions: list[str] = []
    errors: list[str] = []  # Error replies of suppliers (e.g. a bad request)


class Gather:
    """A scatter-gather's paged answers as they arrive (bourse/wire/paging.py ``PageSet``),
    and whether it is complete: the status said which workers exist (``known``), each
    responder sent every page, and every known worker answered."""

    reply_type: Any = None  # the union a reply decodes as (set by each kind)

    def __init__(self) -> None:
        self.pages: PageSet[Any] = PageSet()
        self.known: set[str] | None = None  # from status; None until it has ended
        self.regions: set[str] = set()  # regions some worker answered in
        self.nobody = False  # no supplier subscribes to the subject (no responders)
        self.errors: list[str] = []

    def add(self, data: bytes | None) -> None:
        """One reply's bytes; None: nobody heard the request (no responders)."""
        if data is None:
            self.nobody = True
            return
        try:
            reply = decode(data, self.reply_type)
        except BadMessage as exc:
            self.errors.append(f"unreadable reply: {exc}")
            return
        if isinstance(reply, Error):
            self.errors.append(reply.detail)
            return
        self.page(reply)

    def page(self, reply: Any) -> None:
        raise NotImplementedError

    def answered(self) -> set[str]:
        """The workers that gave their whole answer."""
        raise NotImplementedError

    def complete(self) -> bool:
        if self.known is None or not self.pages.all_complete():
            return False
        return self.nobody or self.known <= self.answered()


class ExplainGather(Gather):
    """The pages of a dry run: one responder per supplier process, verdicts per worker."""

    reply_type = ExplainReply

    def page(self, reply: Explanation) -> None:
        self.pages.add(reply.responder, reply.page, reply.pages, reply.verdicts)

    def _by_worker(self) -> dict[str, WorkerVerdict]:
        return {v.worker_id: v for r in self.pages.responders() for v in self.pages.items(r)}

    def answered(self) -> set[str]:
        return set(self._by_worker())

    def verdicts(self) -> list[WorkerVerdict]:
        by_worker = self._by_worker()
        silent = sorted((self.known or set()) - by_worker.keys())
        return [
            *by_worker.values(),
            *(WorkerVerdict(worker_id=w, verdict="no_answer") for w in silent),
        ]


class MachinesGather(Gather):
    """The pages of a machine listing: one responder per worker."""

    reply_type = MachinesReply

    def page(self, reply: MachinePage) -> None:
        self.regions.add(reply.region)
        self.pages.add(reply.worker_id, reply.page, reply.pages, reply.machines)

    def whole(self, worker_id: str, region: str, machines: list[Machine]) -> None:
        """A worker's whole list, got another way (a tenant's, through the exchange)."""
        self.regions.add(region)
        self.pages.add(worker_id, 1, 1, machines)

    def answered(self) -> set[str]:
        return set(self.pages.complete())

    def machines(self) -> list[Machine]:
        return [m for w in self.pages.responders() for m in self.pages.items(w)]

    def missing(self) -> list[str]:
        """Known workers (and answering ones) that did not send every page."""
        return sorted(({*(self.known or ())} | {*self.pages.responders()}) - self.answered())
