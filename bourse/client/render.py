"""How results look: rich tables for people, JSON for scripts."""

from __future__ import annotations

import time
from collections.abc import Iterable

import msgspec
from rich.console import Console
from rich.table import Table

from bourse.client import DryRun
from bourse.client.policy import Deployment
from bourse.wire.messages import Event, Machine, Placed, Unfilled, WorkerStatus, WorkerVerdict

console = Console()


def as_json(obj: object) -> str:
    return msgspec.json.encode(obj).decode()


def subscores(s: dict[str, float]) -> str:
    return " ".join(f"{k}={v:g}" for k, v in s.items())


def outcome(r: Placed | Unfilled) -> None:
    if isinstance(r, Placed):
        again = " (existing machine for this order id)" if r.existing else ""
        console.print(
            f"[green]placed[/] {r.machine_id} on [bold]{r.worker_id}[/] ({r.region}){again}\n"
            f"  score {r.score:.3f}  {subscores(r.subscores)}\n"
            f"  image cached: {'yes' if r.image_cached else 'no'}   elapsed {r.elapsed_ms:.1f} ms"
        )
    else:
        console.print(
            f"[yellow]unfilled[/] ({r.reason}) in {r.region}: {r.detail}\n"
            f"  offers {r.offers}, commits tried {r.commits_tried}, elapsed {r.elapsed_ms:.1f} ms"
        )


def fleet(statuses: Iterable[WorkerStatus]) -> Table:
    t = Table(title="fleet")
    for col in ("region", "worker", "cpus", "mem MiB", "held", "machines"):
        t.add_column(col, no_wrap=True)
    for col in ("images", "labels", "state", "confined"):
        t.add_column(col)
    for s in statuses:
        t.add_row(
            s.region,
            s.worker_id,
            f"{s.committed.cpus}/{s.capacity.cpus}",
            f"{s.committed.memory_mb}/{s.capacity.memory_mb}",
            str(s.held.cpus),
            str(s.machines),
            ",".join(s.images),
            ",".join(f"{k}={v}" for k, v in s.labels.items()),
            "draining" if s.draining else "ok",
            s.confinement or "-",  # "" from a worker older than the field
        )
    return t


def machines(ms: Iterable[Machine]) -> Table:
    t = Table(title="machines")
    for col in ("machine", "order", "state", "cpus", "memory MiB", "image", "score"):
        t.add_column(col)
    for m in ms:
        t.add_row(
            m.machine_id,
            m.order_id,
            m.state,
            str(m.resources.cpus),
            str(m.resources.memory_mb),
            m.image,
            f"{m.score:.3f}",
        )
    return t


def deployment(d: Deployment) -> Table:
    t = Table(title=f"app {d.app}")
    for col in ("slot", "machine", "region", "worker", "state", "note"):
        t.add_column(col)
    for s in d.slots:
        if s.machine is not None:
            m = s.machine
            note = (
                "kept (already deployed)"
                if s.existed
                else f"score {s.placed.score:.3f}"
                if s.placed
                else ""
            )
            t.add_row(s.name, m.machine_id, m.region, m.worker_id, m.state, note)
        else:
            why = "; ".join(f"{u.region}: {u.reason}" for u in s.unfilled)
            t.add_row(s.name, "-", "-", "-", "[yellow]unfilled[/]", why)
    return t


def event_line(e: Event) -> str:
    at = time.strftime("%H:%M:%S", time.localtime(e.at_ms / 1000)) + f".{e.at_ms % 1000:03d}"
    parts = [at, f"{e.kind:<12}", e.region, e.worker_id]
    if e.machine_id:
        parts.append(e.machine_id)
    if e.order_id:
        parts.append(f"order={e.order_id}")
    if e.detail:
        parts.append(e.detail)
    return "  ".join(parts)


_VERDICTS = {
    "existing": "existing machine",
    "offer": "would offer",
    "wait": "would wait",
    "decline": "declines",
    "no_answer": "[dim]no answer[/]",
}


def dry_run(d: DryRun) -> Table:
    """Every worker of the region: the would-be winner first, then offers by score, waits,
    declines grouped by reason, no answers (the order of DryRun.verdicts)."""
    t = Table(title=f"dry run: order {d.order_id} in {d.region}")
    for col in ("worker", "verdict", "score"):
        t.add_column(col, no_wrap=True)
    t.add_column("why")
    for v in d.verdicts:
        label = "[green]would win[/]" if v.worker_id == d.winner else _VERDICTS[v.verdict]
        scored = v.verdict in ("existing", "offer", "wait")
        t.add_row(v.worker_id, label, f"{v.score:.3f}" if scored else "-", _why(v))
    return t


def _why(v: WorkerVerdict) -> str:
    lines = [r.detail for r in v.reasons]
    if v.verdict == "existing":
        lines.insert(0, f"machine {v.machine_id} was placed here for this order id")
    elif v.verdict in ("offer", "wait"):
        lines.insert(0, subscores(v.subscores))
    elif v.verdict == "no_answer":
        lines.append("its supplier does not answer explain (older or another implementation)")
    return "\n".join(lines)


def dry_run_summary(d: DryRun) -> str:
    """One line under the table: where it would go, and the counts."""
    counts: dict[str, int] = {}
    for v in d.verdicts:
        counts[v.verdict] = counts.get(v.verdict, 0) + 1
    parts = [
        f"{n} {_VERDICTS[k].removeprefix('[dim]').removesuffix('[/]')}" for k, n in counts.items()
    ]
    where = (
        f"would place on [bold]{d.winner}[/]" if d.winner else "[yellow]no worker would take it[/]"
    )
    partial = "" if d.complete else " (deadline reached: the list may be partial)"
    return f"{where}; {', '.join(parts) or 'no workers'}; {d.elapsed_ms:.1f} ms{partial}"


def last_exit(m: Machine) -> str:
    """How the machine's process last ended and how often it was restarted, in one line
    (``buyer machines show``)."""
    restarts = f"restarts: {m.restarts}"
    e = m.last_exit
    if e is None:
        return f"last exit: none  {restarts}"
    how = (
        f"oom (killed at its memory limit, signal {e.signal})"
        if e.reason == "oom"
        else f"signal {e.signal}"
        if e.reason == "signal"
        else f"code {e.code}"
    )
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.at_ms / 1000)) if e.at_ms else ""
    return f"last exit: {how}{'  at ' + at if at else ''}  {restarts}"
