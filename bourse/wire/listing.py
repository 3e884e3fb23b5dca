"""Listing machines (docs/protocol.md §4.17): which machines a ListMachines asks for, and
one worker's answer in pages, for the fan-out (``machines.<region>``: MachinePage 1..n) and
for its own ``machine.list`` (a cursor per page).

Pure; the supplier answers with it (supplier/worker.py, supplier/host.py) and the client
checks what older workers sent with the same filter (bourse/client).
"""

from __future__ import annotations

from collections.abc import Iterable

from bourse.wire.codec import encode
from bourse.wire.messages import ListMachines, Machine, MachineList, MachinePage
from bourse.wire.metadata import APP
from bourse.wire.paging import PAGE_BYTES, cut, encoded_size


def matches(req: ListMachines, m: Machine) -> bool:
    """Whether ``m`` is one the request lists: its state (destroyed ones only when asked
    for, by ``include_destroyed`` or by naming the state), its app, and every label, which
    is matched against the machine's METADATA (the order's constraints are not stored)."""
    if req.states:
        if m.state not in req.states:
            return False
    elif m.state == "destroyed" and not req.include_destroyed:
        return False
    if req.app and m.metadata.get(APP) != req.app:
        return False
    return all(m.metadata.get(k) == v for k, v in req.labels.items())


def order_key(m: Machine) -> tuple[str, str, int, str]:
    """How listings are sorted: region, worker, creation time, then the id."""
    return (m.region, m.worker_id, m.created_at_ms, m.machine_id)


def listed(req: ListMachines, machines: Iterable[Machine]) -> list[Machine]:
    """The machines the request asks for, in listing order."""
    return sorted((m for m in machines if matches(req, m)), key=order_key)


def machine_pages(
    worker_id: str, region: str, machines: list[Machine], limit_bytes: int = PAGE_BYTES
) -> list[MachinePage]:
    """One worker's machines as MachinePage 1..n, each at most ``limit_bytes`` encoded
    unless one machine alone is larger (then it is alone on its page); one empty last page
    when there are none."""
    frame = len(encode(MachinePage(worker_id=worker_id, region=region, last=False)))
    chunks = cut(machines, frame, limit_bytes)
    n = len(chunks)
    return [
        MachinePage(
            worker_id=worker_id, region=region, page=i, pages=n, last=i == n, machines=chunk
        )
        for i, chunk in enumerate(chunks, 1)
    ]


def cursor_page(
    worker_id: str, machines: list[Machine], cursor: str, limit_bytes: int = PAGE_BYTES
) -> MachineList:
    """One page of a worker's ``machine.list``: the machines (in id order) whose id sorts
    after ``cursor``, as many as fit in ``limit_bytes`` (at least one), and the cursor of
    the next page (None when none is left). Ids sort by creation within a worker (ULIDs),
    so a machine placed while a client pages through comes on a later page, never twice."""
    after = sorted((m for m in machines if m.machine_id > cursor), key=lambda m: m.machine_id)
    frame = len(encode(MachineList(worker_id=worker_id, machines=[], next_cursor=cursor)))
    first = cut(after, frame + len(cursor), limit_bytes, encoded_size, max_chunks=1)[0]
    more = len(first) < len(after)
    return MachineList(
        worker_id=worker_id,
        machines=first,
        next_cursor=first[-1].machine_id if more else None,
    )
