"""``bourse loadtest --soak SECONDS``: load for a bounded time while faults strike at random
intervals (kill -9 of a supplier or an exchange, a nats-server restart, a stalled supplier,
a full state file, bad input), every order id sent several times at once through the
exchanges and a direct buyer (``--duplicates``, a duplicate storm), then the audit of every
supplier's SQLite file against what the client saw. The report counts orders sent, placed,
unfilled, failed, the faults by kind, the largest RSS of each program (buffering must stay
bounded), and the violations, which must be none.

The load, the fault injector and the progress/RSS watcher are tasks of nested anyio groups:
the injector stops once the load is done (a fault under way completes first, so what it
broke is back before the audit), the watcher once the injector is.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import anyio
import msgspec
import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from loadtest.chaos import ChaosRun
from loadtest.chaos_report import write_report
from loadtest.faults import Managed
from loadtest.workload import Profile, trace

# Each supplier's state file is capped, so the fill-disk fault can fill it (and it frees
# the room again); large enough for hours of this load.
SOAK_DB_MB = 64


async def run_soak(
    profile: Profile,
    out: Path,
    seconds: float,
    fault_every_s: float,
    console: Console | None = None,
    nats_nodes: int = 1,
    duplicates: int = 1,
) -> dict[str, Any]:
    """One soak run; writes ``out/soak-report.json`` and returns the report."""
    profile = _with_duration(profile, seconds)
    orders = trace(profile, "soak")
    rng = random.Random(f"{profile.seed}:faults")
    rss: dict[str, float] = {}
    run = ChaosRun(
        profile,
        out,
        max_db_mb=SOAK_DB_MB,
        seed=profile.seed,
        nats_nodes=nats_nodes,
        duplicates=duplicates,
    )
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=console is None,
        transient=True,
    )
    async with run:
        with progress:
            bar = progress.add_task("orders", total=len(orders))
            loaded = anyio.Event()

            async def faults() -> None:
                """A fault at random intervals until the load is done."""
                while not loaded.is_set():
                    with anyio.move_on_after(rng.expovariate(1.0 / fault_every_s)):
                        await loaded.wait()  # the next fault is due, or the load is done
                    if loaded.is_set():
                        break
                    await run.random_fault()
                    progress.update(bar, description=f"orders ({len(run.stats.faults)} faults)")

            async def watch() -> None:
                while True:
                    done = sum(1 for r in run.records.values() if r.outcome)
                    progress.update(bar, completed=done)
                    _sample_rss(run.suppliers + run.exchanges, rss)
                    await anyio.sleep(0.5)

            async with anyio.create_task_group() as watching:
                watching.start_soon(watch)
                async with anyio.create_task_group() as injecting:
                    injecting.start_soon(faults)
                    await run.load(orders)
                    loaded.set()
                watching.cancel_scope.cancel()
        result = await run.finish()
        report = run.report(result)
    report["profile"] = {
        "workers": profile.workers,
        "regions": profile.regions,
        "supplier_processes": profile.supplier_processes,
        "exchanges": profile.exchanges,
        "rate": profile.rate,
        "seconds": seconds,
        "fault_every_s": fault_every_s,
        "nats_nodes": nats_nodes,
        "duplicates": duplicates,
        "seed": profile.seed,
    }
    report["max_rss_mb"] = {k: round(v, 1) for k, v in sorted(rss.items())}
    report["path"] = str(write_report(report, out))
    return report


def _with_duration(p: Profile, seconds: float) -> Profile:
    return msgspec.structs.replace(p, duration_s=seconds)


def _sample_rss(programs: list[Managed], rss: dict[str, float]) -> None:
    for m in programs:
        if not m.alive:
            continue
        with contextlib.suppress(psutil.Error):
            mb = psutil.Process(m.pid).memory_info().rss / 2**20
            rss[m.name] = max(rss.get(m.name, 0.0), mb)


def table(report: dict[str, Any]) -> Table:
    o, f, a = report["orders"], report["faults"], report["audit"]
    t = Table(title="soak", show_header=False)
    t.add_row("orders sent", str(o["sent"]))
    t.add_row("placed", str(o["placed"]))
    t.add_row("unfilled", _counts(o["unfilled"]))
    t.add_row("failed (after retries)", _counts(o["failed"]))
    t.add_row("errors retried", _counts(o["retried_after_error"]))
    t.add_row("answer time (ms)", _counts(o["answer_ms"]) + " (send to Placed/Unfilled)")
    t.add_row("faults injected", f"{f['total']}: {_counts(f['by_kind'])}")
    t.add_row("bad-input requests", str(report["bad_input_requests"]))
    t.add_row("max RSS (MiB)", _counts(report["max_rss_mb"]))
    t.add_row(
        "audit", f"{a['files']} files, {a['machines']} machines, {a['ops_replayed']} ops replayed"
    )
    t.add_row("violations", str(len(a["violations"])) + "".join(f"\n{v}" for v in a["violations"]))
    return t


def _counts(c: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items()) or "0"
