"""After a fault run: the invariants, from the suppliers' own SQLite files and the clients'
records (not from what the processes say about themselves).

- I1: replaying each worker's op log in order, its committed resources never exceed its
  capacity (holds live only in memory; the live checks of the load run cover them).
- I2: every ``Placed`` a client saw names a machine that is in that worker's file.
- I3: an order id has at most one machine that was not aborted, across every file; every
  ``Placed`` seen for one order id names the same machine.
- I4: an order whose final answer was ``Unfilled`` has no live machine, and (from the
  workers' status, once the longest hold TTL has passed) no hold is left anywhere.
- I5: every machine is in the region of its order, and of its worker.
- I6 is checked where bad input is sent: each request must get an ``Error`` reply.
- I8: no two machines that are not destroyed hold the same ``host:port``, at any step of
  one file's history, nor at the end across every file (the files of one run share a host).
"""

from __future__ import annotations

import sqlite3
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from bourse.wire.messages import Amount, Machine, Resources, WorkerStatus
from bourse.wire.resources import RESOURCES, ZERO, Vec, add, format_value, leq, sub, vec

_dec = msgspec.json.Decoder(Machine)


@dataclass(slots=True)
class OrderRecord:
    """What one client saw of one order id, over all its attempts."""

    order_id: str
    region: str
    resources: Resources
    deadline_ms: int
    attempts: int = 0
    outcome: str = ""  # placed, unfilled:<reason>, error:<code> (the final attempt's)
    machine_ids: list[str] = field(default_factory=list)  # every Placed seen (retries too)
    worker_id: str = ""
    # the slowest attempt, from send to answer (ms): an answer must come by the deadline
    # plus the commit grace; a hang shows up here
    slowest_ms: float = 0.0
    answered_at_s: float = 0.0  # when the final answer came, from the start of the run


@dataclass(slots=True)
class AuditResult:
    machines: int = 0
    ops: int = 0
    files: int = 0
    violations: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        self.violations.append(text)


def read_store(path: Path) -> tuple[list[Machine], list[tuple[str, str, Machine]]]:
    """(machines, op log as (worker_id, op, machine) oldest first) of one supplier file,
    opened read-only so a running supplier is not disturbed."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        machines = [_dec.decode(r[0]) for r in conn.execute("SELECT machine FROM machines")]
        ops = [
            (r[0], r[1], _dec.decode(r[2]))
            for r in conn.execute("SELECT worker_id, op, machine FROM oplog ORDER BY seq")
        ]
    finally:
        conn.close()
    return machines, ops


def audit(
    records: list[OrderRecord],
    stores: list[Path],
    capacity: dict[str, Amount],
    region_of: dict[str, str],
    statuses: list[WorkerStatus] | None = None,
) -> AuditResult:
    """Check I1-I5 and I8 over ``stores`` (supplier.db files) against the clients' ``records``.
    ``capacity`` and ``region_of`` come from the fleet's configuration, by worker id."""
    res = AuditResult()
    by_id: dict[str, Machine] = {}
    for path in stores:
        machines, ops = read_store(path)
        res.files += 1
        res.ops += len(ops)
        for m in machines:
            by_id[m.machine_id] = m
        _check_oplog(ops, capacity, res)
    res.machines = len(by_id)
    _check_ports(by_id.values(), res)
    asked = {r.order_id: r for r in records}
    live_per_order: Counter[str] = Counter()
    for m in by_id.values():
        if not m.aborted:
            live_per_order[m.order_id] += 1
        if region_of.get(m.worker_id, m.region) != m.region:  # I5
            res.add(f"I5 {m.machine_id} says region {m.region}, its worker is elsewhere")
        r = asked.get(m.order_id)
        if r is not None and r.region != m.region:
            res.add(f"I5 {m.machine_id} in {m.region}, order {m.order_id} asked {r.region}")
    res.violations.extend(
        f"I3 order {o} has {n} machines" for o, n in live_per_order.items() if n > 1
    )
    for r in records:
        for mid in r.machine_ids:  # I2
            stored = by_id.get(mid)
            if stored is None:
                res.add(f"I2 order {r.order_id}: Placed {mid} is in no supplier's file")
            elif stored.order_id != r.order_id:
                res.add(f"I2 order {r.order_id}: Placed {mid} is stored for {stored.order_id}")
        if len(set(r.machine_ids)) > 1:  # I3, as the client saw it
            res.add(f"I3 order {r.order_id} was Placed as {sorted(set(r.machine_ids))}")
        if r.outcome.startswith("unfilled") and not r.machine_ids:  # I4: nothing behind
            left = [
                m.machine_id
                for m in by_id.values()
                if m.order_id == r.order_id and not m.aborted and m.state != "destroyed"
            ]
            if left:
                res.add(f"I4 order {r.order_id} was Unfilled but left {left}")
    for s in statuses or ():
        if s.holds or vec(s.held) != ZERO:
            res.add(f"I4 {s.worker_id} still holds {s.holds} hold(s) after the longest TTL")
    return res


def _check_ports(machines: Iterable[Machine], res: AuditResult) -> None:
    """I8 at the end: each address held by one machine that is not destroyed."""
    holder: dict[str, str] = {}
    for m in machines:
        if m.state == "destroyed":
            continue
        for addr in m.addresses.values():
            other = holder.setdefault(addr, m.machine_id)
            if other != m.machine_id:
                res.add(f"I8 {addr} is held by {other} and {m.machine_id}")


def _check_oplog(
    ops: list[tuple[str, str, Machine]], capacity: dict[str, Amount], res: AuditResult
) -> None:
    """I1 and I8 at every step of the file's history, not only at the end."""
    committed: dict[str, Vec] = defaultdict(lambda: ZERO)
    live: dict[str, bool] = {}  # machine id -> counted as committed
    holder: dict[str, str] = {}  # host:port -> the live machine that holds it
    for worker_id, _op, m in ops:
        counted = m.state != "destroyed"
        was = live.get(m.machine_id, False)
        if counted == was:
            continue
        live[m.machine_id] = counted
        for addr in m.addresses.values():
            if not counted:
                holder.pop(addr, None)
            elif holder.setdefault(addr, m.machine_id) != m.machine_id:
                res.add(f"I8 {addr} is held by {holder[addr]} and {m.machine_id}")
        change = add if counted else sub
        totals = committed[worker_id] = change(committed[worker_id], vec(m.resources))
        cap = capacity.get(worker_id)
        if counted and cap is not None and not leq(totals, vec(cap)):
            for i, (k, used, limit) in enumerate(zip(RESOURCES, totals, vec(cap), strict=True)):
                if used > limit:
                    over = f"{format_value(i, used)} > {format_value(i, limit)}"
                    res.add(f"I1 {worker_id}: {k} {over} after {m.machine_id}")
