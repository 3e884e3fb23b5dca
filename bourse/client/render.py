"""How results look: rich tables for people, JSON for scripts.

Ids are never cut: on a terminal the id columns keep their full width (the other columns
wrap); when stdout is not a terminal (a pipe, a file, a test) a table is printed as plain
aligned columns, as wide as its cells, so any id can be copied from it.

Text that came over the wire (a buyer's metadata, a worker's labels, ids, details relayed
from a worker) is shown through :func:`visible`: a control character in it is written as
an escape, so it can neither act on the terminal (clear it, move the cursor) nor start a
line of its own in a pipe (a forged row). JSON carries the text exactly. A machine's own
output (``machines logs``) is printed as the machine printed it. The fleet's tables (its
workers' statuses, rows and states) are bourse/client/fleet.py's."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from bourse.client.ranking import DryRun
from bourse.wire.messages import (
    Amount,
    Event,
    Machine,
    Placed,
    Resources,
    Unfilled,
    WorkerVerdict,
    now_ms,
)
from bourse.wire.resources import format_cpus, millis_of

if TYPE_CHECKING:
    from bourse.client.policy import Failover

# soft_wrap: a long line (an Unfilled detail) is never broken at 80 columns in a pipe.
console = Console(soft_wrap=True)
# Columns of free text: on a terminal they wrap (at least WRAP_MIN wide); every other
# column (ids, numbers, states) is shown whole or the table is printed plain.
WRAP_COLUMNS = frozenset({"why", "note", "images", "labels"})
WRAP_MIN = 12


# What a terminal acts on rather than shows: C0 controls (newline, tab, ESC among them), DEL,
# C1 controls (U+0080-U+009F: CSI among them), the Unicode line and paragraph separators, and
# the bidirectional overrides and isolates (they reorder what is shown around them).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    c = match.group()
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{ord(c):02x}" if ord(c) <= 0xFF else f"\\u{ord(c):04x}"


def visible(text: str) -> str:
    """``text`` as a table cell or a line of plain output may show it: every control
    character written as a visible escape (``\\x1b``, ``\\n``, ``\\t``, ``\\u202e``),
    everything else as it is. Every table and plain line shows wire text through this."""
    return _CONTROL.sub(_escaped, text)


def safe(text: object) -> str:
    """Wire text inside rich markup (a table cell, a printed line): :func:`visible`, and a
    ``[`` in it taken literally rather than as a style."""
    return escape(visible(str(text)))


def show(table: Table) -> None:
    """Print a table: boxed on a terminal wide enough for every id and number whole (only
    text columns such as "why" wrap), plain aligned columns otherwise (a pipe, or a
    terminal too narrow: the lines run past its edge rather than cut an id)."""
    lines = plain(table)
    if console.is_terminal:
        widths = _widths(table)
        need = 1  # the box: 3 columns per column (a rule, a space each side), and 1
        for col, w in zip(table.columns, widths, strict=True):
            if str(col.header) in WRAP_COLUMNS:
                need += min(w, WRAP_MIN) + 3
            else:
                col.no_wrap, col.min_width = True, w
                need += w + 3
        if need <= console.width:
            console.print(table)
            return
    for line in lines:
        console.out(line, highlight=False)


def _widths(table: Table) -> list[int]:
    return [
        max([len(str(col.header)), *(len(x) for c in col.cells for x in _plain(c).split("\n"))])
        for col in table.columns
    ]


def plain(table: Table) -> list[str]:
    """A table as text lines: a header, then one line per row (a cell of several lines
    continues on the next lines, in its column), columns two spaces apart, nothing cut."""
    headers = [str(c.header) for c in table.columns]
    cols = [[_plain(c).split("\n") for c in col.cells] for col in table.columns]
    rows = len(cols[0]) if cols else 0
    widths = [
        max([len(h), *(len(line) for cell in col for line in cell)])
        for h, col in zip(headers, cols, strict=True)
    ]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    out = [line(headers)]
    for r in range(rows):
        cells = [col[r] for col in cols]
        for k in range(max(len(c) for c in cells)):
            out.append(line([c[k] if k < len(c) else "" for c in cells]))
    return out


def _plain(cell: object) -> str:
    if isinstance(cell, Text):
        return cell.plain
    return Text.from_markup(str(cell)).plain


def as_json(obj: object) -> str:
    return msgspec.json.encode(obj).decode()


def subscores(s: dict[str, float]) -> str:
    """``name=value`` each; a whole number whole (``pull_bytes=104857600``, not 1.04858e+08)."""
    return " ".join(
        f"{safe(k)}={v:.0f}" if v.is_integer() else f"{safe(k)}={v:g}" for k, v in s.items()
    )


def outcome(r: Placed | Unfilled) -> None:
    if isinstance(r, Placed):
        again = " (existing machine for this order id)" if r.existing else ""
        console.print(
            f"[green]placed[/] {safe(r.machine_id)} on [bold]{safe(r.worker_id)}[/] "
            f"({safe(r.region)}){again}\n"
            f"  score {r.score:.3f}  {subscores(r.subscores)}\n"
            f"  image cached: {'yes' if r.image_cached else 'no'}   elapsed {r.elapsed_ms:.1f} ms"
        )
        if r.addresses:
            console.print(f"  addresses: {safe(addresses(r.addresses))}")
        if r.private_address:
            console.print(f"  private address: {safe(r.private_address)}")
        if r.simulated:
            console.print(f"  simulated: {SIMULATED}")
    else:
        console.print(
            f"[yellow]unfilled[/] ({safe(r.reason)}) in {safe(r.region)}: {safe(r.detail)}\n"
            f"  offers {r.offers}, commits tried {r.commits_tried}, elapsed {r.elapsed_ms:.1f} ms"
        )


def addresses(a: dict[str, str]) -> str:
    """``http=10.0.0.5:20001 admin=10.0.0.5:20002``, or ``-`` for none."""
    return " ".join(f"{name}={addr}" for name, addr in a.items()) or "-"


# The states in which a machine's checks run (or are about to, once it is started).
CHECKED_STATES = ("starting", "started")


def health(m: Machine, now: int | None = None) -> str:
    """``passing 3m`` / ``critical 12s`` (since when), ``checking`` before the first run,
    ``-`` without checks or when it does not run (a spare not started, a stopped machine:
    a health a worker of an older version kept is not shown)."""
    if not m.checks or m.state not in CHECKED_STATES:
        return "-"
    h = m.health
    if h is None or not h.status:
        return "checking"
    since = age(h.since_ms, now_ms() if now is None else now)
    return f"{h.status} {since}"


# What a sim worker's machine is: said wherever one is shown.
SIMULATED = "its worker runs nothing (driver sim)"


def clock(at_ms: int) -> str:
    """A time of today as people read it: ``14:02:03`` (local)."""
    return time.strftime("%H:%M:%S", time.localtime(at_ms / 1000))


def gone(since_ms: int) -> str:
    """A view's word for a machine whose worker stopped beating (docs/protocol.md §4.21):
    its state is not known any more."""
    when = clock(since_ms) if since_ms else "?, no heartbeat seen"
    return f"unknown (worker gone since {when})"


def state_of(m: Machine, gone_since_ms: int | None = None) -> str:
    """A machine's state as a listing shows it: a sim worker's says so; from a view, one
    whose worker is gone is ``unknown (worker gone since …)``."""
    if gone_since_ms is not None:
        return gone(gone_since_ms)
    return f"{m.state} (simulated)" if m.simulated else m.state


def machines(ms: Iterable[Machine], gone: Mapping[str, int] | None = None) -> Table:
    """Machines with their order ids (``gone``: from a view, the workers gone, since when)."""
    gone = gone or {}
    t = Table(title="machines")
    for col in ("machine", "order", "state", "cpus", "memory MiB", "image", "score"):
        t.add_column(col)
    t.add_column("addresses")
    for m in ms:
        t.add_row(
            safe(m.machine_id),
            safe(m.order_id),
            safe(state_of(m, gone.get(m.worker_id))),
            cpus(m.resources),
            str(m.resources.memory_mb),
            safe(m.image),
            f"{m.score:.3f}",
            safe(addresses(m.addresses)),
        )
    return t


def age(created_at_ms: int, now: int) -> str:
    """How long ago, in the largest whole unit: ``42s``, ``7m``, ``3h``, ``12d`` (``-``
    when unknown)."""
    if created_at_ms <= 0:
        return "-"
    s = max(0, now - created_at_ms) // 1000
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s // n}{unit}"
    return f"{s}s"


def machine_listing(
    ms: Iterable[Machine], now: int | None = None, gone: Mapping[str, int] | None = None
) -> Table:
    """``buyer machines list``: one row per machine in the order given (region, worker,
    creation), ids whole (``gone``: from a view, the workers gone, since when)."""
    now = now_ms() if now is None else now
    gone = gone or {}
    t = Table(title="machines")
    for col in ("machine", "worker", "region", "state", "cpus", "memory MiB", "image", "age"):
        t.add_column(col, no_wrap=True)
    for col in ("restarts", "health"):
        t.add_column(col, no_wrap=True)
    t.add_column("addresses")
    t.add_column("app")
    for m in ms:
        t.add_row(
            safe(m.machine_id),
            safe(m.worker_id),
            safe(m.region),
            safe(state_of(m, gone.get(m.worker_id))),
            format_cpus(millis_of(m.resources)),
            str(m.resources.memory_mb),
            safe(m.image),
            age(m.created_at_ms, now),
            str(m.restarts),
            "-" if m.worker_id in gone else health(m, now),  # not known either
            safe(addresses(m.addresses)),
            safe(m.metadata.get("app", "-")),
        )
    return t


def failover_json(app: str, machine_id: str, f: Failover | None) -> dict[str, object]:
    """``failover --json``: the same keys whatever happened; without a failover (``f``
    None: an error) its fields are empty and the CLI sets ``error``."""
    refill = f.refill if f is not None else None
    return {
        "app": app,
        "replaced": machine_id,
        "started": f.started if f is not None else None,
        "stopped": f.stopped if f is not None else None,
        "queued": f.queued if f is not None else None,
        "queue_error": f.queue_error if f is not None else "",
        "spare": refill.machine if refill is not None else None,
        "spare_unfilled": [u.detail for u in refill.unfilled] if refill is not None else [],
        "error": None,
    }


def failover_lines(f: Failover) -> list[str]:
    m = f.started
    lines = [
        f"started spare {safe(m.machine_id)} on {safe(m.worker_id)} ({safe(m.region)}) "
        f"in place of {safe(f.replaced)}"
    ]
    if f.stopped is not None:
        lines.append(f"stopped {safe(f.stopped.machine_id)} (its worker still answers: --force)")
    if f.queued is not None:
        lines.append(
            f"stop of {safe(f.replaced)} queued for worker {safe(f.queued.worker_id)} (it is "
            "applied when the worker is back, before it resumes anything)"
        )
    if f.queue_error:
        lines.append(f"[yellow]stop of {safe(f.replaced)} not queued[/]: {safe(f.queue_error)}")
    spare = f.refill.machine
    if spare is not None:
        lines.append(
            f"new spare {safe(spare.machine_id)} on {safe(spare.worker_id)} ({safe(spare.region)})"
        )
    else:
        why = "; ".join(u.detail for u in f.refill.unfilled) or "no region to place it in"
        lines.append(f"[yellow]no new spare[/]: {safe(why)}")
    return lines


def event_line(e: Event) -> str:
    """One event as a plain line (no markup)."""
    at = time.strftime("%H:%M:%S", time.localtime(e.at_ms / 1000)) + f".{e.at_ms % 1000:03d}"
    parts = [at, f"{e.kind:<12}", e.region, e.worker_id]
    if e.machine_id:
        parts.append(e.machine_id)
    if e.order_id:
        parts.append(f"order={e.order_id}")
    if e.detail:
        parts.append(e.detail)
    if e.addresses:
        parts.append(addresses(e.addresses))
    if e.health is not None:
        parts.append(f"health={e.health.status or 'checking'}")
    return visible("  ".join(parts))


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
    t = Table(title=f"dry run: order {safe(d.order_id)} in {safe(d.region)}")
    for col in ("worker", "verdict", "score"):
        t.add_column(col, no_wrap=True)
    t.add_column("why")
    for v in d.verdicts:
        label = "[green]would win[/]" if v.worker_id == d.winner else _VERDICTS[v.verdict]
        scored = v.verdict in ("existing", "offer", "wait")
        t.add_row(safe(v.worker_id), label, f"{v.score:.3f}" if scored else "-", _why(v))
    return t


def _why(v: WorkerVerdict) -> str:
    lines = [safe(r.detail) for r in v.reasons]
    if v.verdict == "existing":
        lines.insert(0, f"machine {safe(v.machine_id)} was placed here for this order id")
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
        f"would place on [bold]{safe(d.winner)}[/]"
        if d.winner
        else "[yellow]no worker would take it[/]"
    )
    partial = "" if d.complete else " (deadline reached: the list may be partial)"
    return f"{where}; {', '.join(parts) or 'no workers'}; {d.elapsed_ms:.1f} ms{partial}"


# How a worker words an exit in a last exit's detail (supplier/machines/api.py describe):
# a detail that only says this says nothing the line does not.
_RESTATED = ("exited with code ", "killed by signal ", "oom: ")


def last_exit(m: Machine, detail: bool = False) -> str:
    """How the machine's process last ended and how often it was restarted, in one line
    (``buyer machines show``); ``detail``: and what its worker said of it when that says
    more (why a start ended before its command ran: ``pull_failed: …``)."""
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
    said = f"; {e.detail}" if detail and e.detail and not e.detail.startswith(_RESTATED) else ""
    return f"last exit: {how}{'  at ' + at if at else ''}  {restarts}{said}"


def reach(m: Machine) -> list[str]:
    """``buyer machines show``: its addresses, its environment's keys (values may be
    secrets: never shown), its checks and their health."""
    lines = [f"addresses: {addresses(m.addresses)}"]
    if m.private_address:
        lines.append(f"private address: {m.private_address} (its named ports there too)")
    if m.env_keys:
        lines.append(f"env: {' '.join(m.env_keys)} (values not shown)")
    for c in m.checks:
        what = f"{c.kind} {c.path}" if c.path else c.kind
        lines.append(f"check: {c.port} {what} every {c.interval_s:g}s (timeout {c.timeout_s:g}s)")
    if m.checks:
        h = m.health
        detail = f": {h.detail}" if h is not None and h.detail else ""
        lines.append(f"health: {health(m)}{detail}")
    return [visible(line) for line in lines]


def cpus(r: Resources | Amount) -> str:
    """CPUs as people write them: ``2``, ``0.5`` (``cpu_millis`` when the amount has it)."""
    return format_cpus(millis_of(r))
