"""A machine an update replaces, drained before its destroy (docs/protocol.md §4.19).

The deploy names the machine in its app's record (``draining``): every edge follows the
apps' records and sends it no new request. The edges' activity (§4.23: each edge's
requests per machine every second, ``at_ms`` for one in flight) then says when the
requests under way have finished: :func:`drained` is that decision, pure; :func:`drain`
the shell (the record written, the activity heard, then the machine's graceful stop).

The times compared are the deploy's own clock at each report's arrival, never an edge's
clock against the deploy's: a report that arrived one interval after the record was
written was made by an edge that had had that interval to see the record.

A tenant's deploy hears each edge's share of its own machines (``R.edge.activity.<edge>.
<tenant>``, §4.23): a whole report names the machines of every tenant an edge served (their
ids and when their requests began), which its key may not hear. An edge that served none of
its machines lately sends it no share: the drain counts the edges it hears.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import msgspec
import structlog

from bourse.client.apps.store import AppChanged
from bourse.errors import BourseError
from bourse.wire.codec import BadMessage, decode
from bourse.wire.messages import EdgeActivity

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from bourse.client.apps.store import AppStore
    from bourse.client.client import BourseClient

log = structlog.get_logger("bourse.apps")

DRAIN_S = 30.0  # the most a drain waits for the edges' requests under way
LISTEN_INTERVALS = 1.5  # heard for this many intervals: every live edge has reported
GONE_INTERVALS = 3  # an edge silent this long is not waited for (§4.23)
INTERVAL_S = 1.0  # the edges' activity period, until a report says its own


@dataclass(frozen=True, slots=True)
class Heard:
    """An edge's last report, as the draining deploy heard it."""

    at: float  # when it arrived (the deploy's clock, seconds)
    interval_s: float
    busy: bool  # the machine had a request in flight at this edge


def drained(heard: Mapping[str, Heard], marked: float, now: float) -> bool:
    """Whether the machine is drained at ``now``: heard for LISTEN_INTERVALS since it was
    marked draining (``marked``), and every edge heard within GONE_INTERVALS has reported
    at least one interval after the mark, without a request in flight to it."""
    longest = max((h.interval_s for h in heard.values()), default=INTERVAL_S)
    if now - marked < LISTEN_INTERVALS * longest:
        return False
    live = [h for h in heard.values() if now - h.at <= GONE_INTERVALS * h.interval_s]
    return all(h.at >= marked + h.interval_s and not h.busy for h in live)


def heard_of(report: EdgeActivity, machine_id: str, at: float) -> Heard:
    """What a report says of the machine, heard at ``at``."""
    return Heard(at, report.interval_ms / 1000, report.machines.get(machine_id) == report.at_ms)


async def drain(
    client: BourseClient,
    apps: AppStore,
    app: str,
    machine_id: str,
    revision: int,
    *,
    bound_s: float = DRAIN_S,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Drain ``machine_id`` of ``app`` (see the module doc), then stop it: the record's
    revision after the write (the deploy's own from then on). The record moved since
    ``revision``: :class:`AppChanged`."""
    heard: dict[str, Heard] = {}
    news = anyio.Event()

    async def on_report(msg: Msg) -> None:
        nonlocal news
        try:
            report = decode(msg.data, EdgeActivity)
        except BadMessage:
            return
        heard[report.edge] = heard_of(report, machine_id, clock())
        news.set()

    # heard from before the mark; a tenant's key hears each edge's share of its own
    # machines (a whole report names every tenant's: §4.23)
    subjects = client.subjects
    if client.tenant:
        subject = subjects.edge_activity_of(client.tenant)
    else:
        subject = subjects.edge_activity()
    sub = await client.nc.subscribe(subject, cb=on_report)
    try:
        record, at = await apps.read(app)
        if record is None or at != revision:
            raise AppChanged(f"app {app!r} changed while this deploy ran: run it again")
        marked_record = msgspec.structs.replace(
            record, draining=sorted({*record.draining, machine_id})
        )
        revision = await apps.write(app, marked_record, revision, by="deploy")
        marked = clock()
        with anyio.move_on_after(bound_s) as bound:
            while not drained(heard, marked, clock()):
                # the next report, or the listening time's end, or an interval (an edge
                # silent since may be gone now)
                wait = max(0.0, marked + LISTEN_INTERVALS * INTERVAL_S - clock()) or INTERVAL_S
                with anyio.move_on_after(wait):
                    await news.wait()
                news = anyio.Event()
        log.info("drained", app=app, machine=machine_id, edges=len(heard),
                 ms=round((clock() - marked) * 1000), bounded=bound.cancelled_caught)  # fmt: skip
    finally:
        await sub.unsubscribe()
    try:
        await client.machine("stop", machine_id)  # its graceful stop: signal, then grace
    except BourseError as exc:  # stopped already, or its worker away: the destroy says
        log.info("drain_stop", app=app, machine=machine_id, error=str(exc))
    return revision
