"""The fleet as tables: each worker's status (``buyer fleet --fresh``, ``bourse demo``), its
row from a view (``buyer fleet``), and its state after an operator's verb (``buyer workers
drain|stop|start``). Wire text is shown through ``render.safe``, as in every table."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rich.table import Table

from bourse.client.render import clock, cpus, safe
from bourse.wire.messages import WorkerRow, WorkerState, WorkerStatus
from bourse.wire.resources import format_cpus, vec


def fleet(statuses: Iterable[WorkerStatus]) -> Table:
    """Each worker's capacity, commitments, holds, image cache (bytes used / budget; the
    images it holds: catalog names, and digests by their first 12 hex digits), labels, and
    how it runs machines (its driver and runtime, how it confines and isolates them)."""
    t = Table(title="fleet")
    for col in ("region", "worker", "cpus", "mem MiB", "held", "machines", "cache"):
        t.add_column(col, no_wrap=True)
    for col in ("images", "labels", "state", "driver", "confined", "isolated", "jetstream"):
        t.add_column(col)
    for s in statuses:
        cache = f"{_size(s.cache_bytes)}/{_size(s.cache_budget_bytes)}"
        t.add_row(
            safe(s.region),
            safe(s.worker_id),
            f"{cpus(s.committed)}/{cpus(s.capacity)}",
            f"{s.committed.memory_mb}/{s.capacity.memory_mb}",
            cpus(s.held),
            str(s.machines),
            cache if s.cache_budget_bytes else "-",  # "-": a worker without the fields
            safe(",".join([*s.images, *(d[: len("sha256:") + 12] for d in s.image_digests)])),
            safe(",".join(f"{k}={v}" for k, v in s.labels.items())),
            "draining" if s.draining else "ok",
            safe(f"{s.driver} ({s.runtime})" if s.runtime else s.driver or "-"),
            safe(s.confinement or "-"),  # "" from a worker older than the field
            _isolated(s.isolation),
            "on" if s.jetstream else "[yellow]off[/]",
        )
    return t


def worker_states(states: Iterable[WorkerState]) -> Table:
    """``buyer workers drain|stop|start``: each worker as it is after (serving or stopped,
    draining and why, its live machines)."""
    t = Table(title="workers")
    for col in ("worker", "region", "state", "draining", "machines"):
        t.add_column(col, no_wrap=True)
    for s in states:
        t.add_row(
            safe(s.worker_id),
            safe(s.region),
            "serving" if s.serving else "stopped",
            safe(s.drain_reason or "yes") if s.draining else "-",
            str(s.machines),
        )
    return t


def _isolated(isolation: str) -> str:
    """What a worker's machines have of their own (docs/protocol.md §6.8e): ``users,network``
    as is, less in yellow (a tenant's order is not run there by default), ``-`` unsaid."""
    if not isolation:
        return "-"  # a worker older than the field
    return safe(isolation) if isolation == "users,network" else f"[yellow]{safe(isolation)}[/]"


def fleet_rows(rows: Iterable[WorkerRow], gone: Mapping[str, int]) -> Table:
    """``buyer fleet`` from a view: each worker's row (committed of capacity, its machines,
    image cache, labels, whether it drains or is gone, driver, how it confines and isolates
    its machines, version)."""
    t = Table(title="fleet")
    for col in ("region", "worker", "cpus", "mem MiB", "machines", "cache"):
        t.add_column(col, no_wrap=True)
    for col in ("labels", "state", "driver", "confined", "isolated", "version"):
        t.add_column(col)
    for w in rows:
        cache = f"{_size(w.cache_bytes)}/{_size(w.cache_budget_bytes)}"
        used = vec(w.capacity)[0] - vec(w.free)[0]
        since = gone.get(w.worker_id)
        state = "draining" if w.draining else "ok"
        t.add_row(
            safe(w.region),
            safe(w.worker_id),
            f"{format_cpus(used)}/{cpus(w.capacity)}",
            f"{w.capacity.memory_mb - w.free.memory_mb}/{w.capacity.memory_mb}",
            str(w.machines),
            cache if w.cache_budget_bytes else "-",
            safe(",".join(f"{k}={v}" for k, v in w.labels.items())),
            f"[yellow]{gone_worker(since)}[/]" if since is not None else state,
            safe(f"{w.driver} ({w.runtime})" if w.runtime else w.driver or "-"),
            safe(w.confinement or "-"),
            _isolated(w.isolation),
            safe(w.version or "-"),
        )
    return t


def gone_worker(since_ms: int) -> str:
    return f"gone since {clock(since_ms)}" if since_ms else "gone (no heartbeat seen)"


def _size(n: int) -> str:
    """Bytes as people read a disk's: 0, 512K, 200M, 1.5G, 20G (powers of 1024)."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return str(n)
