"""``bourse demo`` and ``bourse up``: the main job in one command.

``bourse demo`` starts an embedded nats-server, a demo fleet of suppliers in three regions
as real processes, one exchange process, places a scripted batch of real orders plus a
concurrent burst, prints what happened, and stops everything. With ``--nats URL`` it only
places the orders, on a market that is already up (``bourse up``).

``bourse up`` runs that market until Ctrl-C, keeping state in a data dir so the next ``up``
resumes (machines that were running start again).

The market itself is ops/market.py; this module parses the options and prints.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from bourse.client import render
from bourse.client.fleet import fleet
from bourse.nats.connection import split_urls
from bourse.runtime import logs
from bourse.runtime.cli import NoJetStreamOpt, OwnServerNatsOpt, PrefixOpt, fail, json_flag
from bourse.runtime.endpoint import DEFAULT_PORT, parse_addr
from bourse.runtime.statedir import lock_state_dir
from bourse.runtime.supervise import run
from bourse.wire.messages import Placed, Unfilled
from bourse.wire.subjects import DEFAULT_PREFIX, Subjects
from ops.demo import DEMO_APP
from ops.market import DemoRun, run_demo, run_up
from supplier import RuntimeUnavailable, detect_runtime


def demo(
    nats: OwnServerNatsOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    data_dir: Annotated[
        Path | None,
        typer.Option(help="Keep the suppliers' state and logs here (default: a temp dir)."),
    ] = None,
    burst: Annotated[int, typer.Option(min=0, help="Concurrent orders in the burst.")] = 200,
    no_jetstream: NoJetStreamOpt = False,
    json: Annotated[bool, json_flag("Print the outcomes as JSON.")] = False,
    keep_machines: Annotated[
        bool,
        typer.Option(
            "--keep",
            help=f"On a market given with --nats: leave the demo's machines (app {DEMO_APP})"
            " in place; by default they are destroyed at the end.",
        ),
    ] = False,
) -> None:
    """Run a demo market and place real orders on it (or on yours, with --nats: its
    machines carry the app name bourse-demo and are destroyed at the end unless --keep)."""
    logs.configure("warning")
    keep = data_dir is not None
    root = data_dir or Path(tempfile.mkdtemp(prefix="bourse-demo-"))
    urls = split_urls(nats, from_env=False)
    tidy = bool(urls) and not keep_machines  # the user's market: leave it as it was
    say = (lambda *_: None) if json else render.console.print
    try:
        done = run(
            lambda: run_demo(urls, Subjects(prefix), root, burst, tidy, say, not no_jetstream)
        )
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    if json:
        typer.echo(render.as_json(_demo_json(done)))
        return
    _show_demo(done, on_users_market=bool(urls))
    if keep:
        say(f"\nlogs and state kept in {root}")


def _demo_json(done: DemoRun) -> dict[str, object]:
    return {
        "orders": [{"scenario": n, "result": r} for n, r in done.outcomes],
        "burst": done.burst.__dict__ if done.burst else None,
        "fleet": done.fleet,
        "app": DEMO_APP,
        "cleanup": done.cleanup.__dict__ if done.cleanup else None,
    }


def _show_demo(done: DemoRun, on_users_market: bool) -> None:
    say = render.console.print
    render.show(_outcome_table(done.outcomes))
    if b := done.burst:
        say(
            f"\nburst: {b.orders} concurrent orders in {b.seconds:.2f}s: "
            f"{b.placed} placed, unfilled {b.unfilled or 0}; placed latency "
            f"p50 {b.p50_ms:.1f} ms, p99 {b.p99_ms:.1f} ms"
        )
    render.show(fleet(done.fleet))
    if done.cleanup is None:
        how = "" if on_users_market else " (the demo market stops with it)"
        say(f"\nthe demo placed {done.placed} machines, app {DEMO_APP}{how}")
        return
    say(
        f"\nthe demo placed {done.placed} machines (app {DEMO_APP}) and destroyed "
        f"{done.cleanup.destroyed} of them; --keep leaves them in place"
    )
    for machine_id, why in done.cleanup.failed.items():
        say(f"[red]not destroyed: {render.safe(machine_id)}: {render.safe(why)}[/]")


def _outcome_table(outcomes: Sequence[tuple[str, Placed | Unfilled]]) -> Table:
    t = Table(title="orders")
    for col in ("scenario", "outcome", "worker / reason", "score", "cached", "ms"):
        t.add_column(col)
    for name, r in outcomes:
        if isinstance(r, Placed):
            t.add_row(
                name,
                "existing" if r.existing else "placed",
                render.safe(r.worker_id),
                f"{r.score:.3f}",
                "yes" if r.image_cached else "no",
                f"{r.elapsed_ms:.1f}",
            )
        else:
            t.add_row(name, "unfilled", render.safe(r.reason), "", "", f"{r.elapsed_ms:.1f}")
    return t


def up(
    nats: OwnServerNatsOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    data_dir: Annotated[
        Path, typer.Option(help="State and logs; a second `up` resumes from it.")
    ] = Path(".bourse/up"),
    port: Annotated[
        int, typer.Option(help="Port of the embedded nats-server (-1: any free port).")
    ] = 4222,
    metrics_addr: Annotated[
        str,
        typer.Option(
            help="Prometheus metrics: the exchange serves them on HOST:PORT, each supplier on "
            "the next free port (port 0: any free ones); '' or off: none.",
        ),
    ] = f"127.0.0.1:{DEFAULT_PORT}",
    no_jetstream: NoJetStreamOpt = False,
    driver: Annotated[
        str,
        typer.Option(
            help="How the demo workers run machines: process (the catalog's commands and "
            "pushed images as processes) or oci (pushed images as containers: needs runc).",
        ),
    ] = "process",
) -> None:
    """Run a demo market until Ctrl-C: NATS, suppliers in 3 regions, an exchange, an edge."""
    if driver not in ("process", "oci"):
        fail(f"--driver {driver!r}: use process or oci")
    if driver == "oci":
        try:
            detect_runtime()
        except RuntimeUnavailable as exc:
            fail(f"--driver oci: {exc}")
    logs.configure("warning")
    metrics_at = parse_addr(metrics_addr)
    urls = split_urls(nats, from_env=False)
    with lock_state_dir(data_dir):  # one `up` per state directory
        run(
            lambda: run_up(
                urls,
                Subjects(prefix),
                data_dir,
                port,
                render.console.print,
                metrics_at,
                not no_jetstream,
                driver,
            )
        )
