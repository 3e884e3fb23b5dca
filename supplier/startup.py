"""What a supplier process takes before it serves: its workers' port ranges on the host, and
their worker ids on the market.

A worker's host ports come from its own range or, for a process or oci worker that names
none, a default block of the host, the one it had before where it can (kept in the store,
claimed against the host's other suppliers: supplier/ports.py). A worker id is the market's
only once: a second process answering one worker's commits could place two machines for
one order, so a start is refused while another process answers for one of its ids."""

from __future__ import annotations

import asyncio

import nats.errors
import structlog
from nats.aio.client import Client as NATS

from bourse.errors import BourseError
from bourse.wire.subjects import Subjects
from supplier.config import WorkerConfig
from supplier.machines.host.confine import owner_of
from supplier.ports import PortClaims, PortRange, Wanted, host_ranges
from supplier.store import Store

log = structlog.get_logger("bourse.supplier")

# How long a worker's subject may stay silent before the id counts as free.
CLAIM_CHECK_S = 0.5


class WorkerIdInUse(BourseError, RuntimeError):
    """Another supplier process already serves one of these worker ids."""


def port_ranges(
    workers: list[WorkerConfig], store: Store, claims: PortClaims | None
) -> dict[str, PortRange]:
    """Each worker's range: its own, else (a process or oci worker) a default block of
    the host, the one it had before where it can (kept in the store); claimed against the
    host's other suppliers when ``claims`` is given (PortError names the overlap)."""
    kept = store.kept_port_ranges()
    wanted = [
        Wanted(w.worker_id, w.port_range, default=w.driver != "sim" and not w.ports)
        for w in workers
    ]
    home = store.path.parent
    ranges = host_ranges(wanted, kept, claims, owner_of(home), home)
    store.keep_port_ranges({w.worker_id: str(ranges[w.worker_id]) for w in wanted if w.default})
    return ranges


async def check_unclaimed(nc: NATS, subjects: Subjects, worker_ids: list[str]) -> None:
    """Refuse to start (WorkerIdInUse) if another process already serves one of these
    worker ids: two processes answering one worker's commits could place two machines for
    one order."""

    async def served(wid: str) -> bool:
        try:
            await nc.request(subjects.worker_machine(wid, "list"), b"", timeout=CLAIM_CHECK_S)
        except nats.errors.NoRespondersError:
            return False
        except nats.errors.TimeoutError:
            # Someone subscribes but does not answer: a passive listener (a `nats sub`
            # on bourse.v1.>) rather than a supplier, which would answer machine.list.
            log.warning("worker_subject_has_silent_listener", worker_id=wid)
            return False
        return True

    answered = await asyncio.gather(*map(served, worker_ids))
    taken = [w for w, t in zip(worker_ids, answered, strict=True) if t]
    if taken:
        raise WorkerIdInUse(
            f"worker id(s) {', '.join(taken[:5])} already served by another supplier process"
        )
