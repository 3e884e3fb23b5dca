"""``bourse``: the main job in one command.

``bourse demo`` starts an embedded nats-server (unless ``--nats`` is given), a demo fleet of
suppliers in three regions as real processes, one exchange process, places a scripted batch
of real orders plus a concurrent burst, prints what happened, and stops everything.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from buyer_cli import render
from buyer_cli.client import BourseClient
from buyer_cli.demo import DEMO_FLEET, run_burst, run_script, write_fleet_files
from buyer_cli.launcher import Program, start_program
from exchange import logs
from exchange.connection import connect, split_urls
from exchange.embedded_nats import EmbeddedNats
from exchange.protocol import Placed
from exchange.runtime import NatsOpt, PrefixOpt, cli_main
from exchange.subjects import DEFAULT_PREFIX, Subjects

app = typer.Typer(help="Bourse: a market-style machine scheduler on NATS.", no_args_is_help=True)


@app.callback()
def _callback() -> None:
    """Bourse."""


@app.command()
def demo(
    nats: NatsOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    data_dir: Annotated[
        Path | None,
        typer.Option(help="Keep the suppliers' state and logs here (default: a temp dir)."),
    ] = None,
    burst: Annotated[int, typer.Option(min=0, help="Concurrent orders in the burst.")] = 200,
    json: Annotated[bool, typer.Option("--json", help="Print the outcomes as JSON.")] = False,
) -> None:
    """Run a demo market and place real orders on it."""
    logs.configure("warning")
    keep = data_dir is not None
    root = data_dir or Path(tempfile.mkdtemp(prefix="bourse-demo-"))
    try:
        asyncio.run(_demo(split_urls(nats), Subjects(prefix), root, burst, json, keep))
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


async def _demo(
    urls: list[str], subjects: Subjects, root: Path, burst: int, json: bool, keep: bool
) -> None:
    say = (lambda *_: None) if json else render.console.print
    server = None
    if not urls:
        server = EmbeddedNats(workdir=root / "nats").start()
        urls = [server.url]
        say(f"embedded nats-server on {server.url} (log: {server.log_path})")
    programs: list[Program] = []
    try:
        common = ["--nats", ",".join(urls), "--prefix", subjects.prefix]
        fleets = write_fleet_files(root / "config")
        for region, path in fleets.items():
            programs.append(
                await start_program(
                    "supplier",
                    "run",
                    "--fleet",
                    str(path),
                    "--data-dir",
                    str(root / "data" / region),
                    *common,
                    log_path=root / "logs" / f"supplier-{region}.log",
                    ready="supplier ready",
                )
            )
            say(f"supplier for {region}: {len(DEMO_FLEET[region])} workers")
        programs.append(
            await start_program(
                "exchange",
                "serve",
                *common,
                log_path=root / "logs" / "exchange.log",
                ready="exchange ready",
            )
        )
        say("exchange ready; placing orders\n")
        nc = await connect(urls, name="bourse-demo", service=False)
        client = BourseClient(nc, subjects)
        try:
            outcomes = await run_script(client)
            report = await run_burst(client, burst) if burst else None
            statuses = [s for region in DEMO_FLEET for s in await client.status(region)]
        finally:
            await nc.drain()
        if json:
            typer.echo(
                render.as_json(
                    {
                        "orders": [{"scenario": n, "result": r} for n, r in outcomes],
                        "burst": report.__dict__ if report else None,
                        "fleet": statuses,
                    }
                )
            )
        else:
            render.console.print(_outcome_table(outcomes))
            if report:
                say(
                    f"\nburst: {report.orders} concurrent orders in {report.seconds:.2f}s: "
                    f"{report.placed} placed, unfilled {report.unfilled or 0} (the fleet is "
                    f"full); placed latency p50 {report.p50_ms:.1f} ms, p99 {report.p99_ms:.1f} ms"
                )
            render.console.print(render.fleet(statuses))
            if keep:
                say(f"\nlogs and state kept in {root}")
    finally:
        for p in reversed(programs):
            await p.stop()
        if server is not None:
            server.stop()


def _outcome_table(outcomes: list[tuple[str, object]]) -> Table:
    t = Table(title="orders")
    for col in ("scenario", "outcome", "worker / reason", "score", "cached", "ms"):
        t.add_column(col)
    for name, r in outcomes:
        if isinstance(r, Placed):
            t.add_row(
                name,
                "existing" if r.existing else "placed",
                r.worker_id,
                f"{r.score:.3f}",
                "yes" if r.image_cached else "no",
                f"{r.elapsed_ms:.1f}",
            )
        else:
            t.add_row(name, "unfilled", r.reason, "", "", f"{r.elapsed_ms:.1f}")  # type: ignore[attr-defined]
    return t


def main() -> None:
    cli_main(app)


if __name__ == "__main__":
    main()
