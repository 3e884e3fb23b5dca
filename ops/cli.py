"""``bourse``: the main job in one command.

``bourse demo`` starts an embedded nats-server, a demo fleet of suppliers in three regions
as real processes, one exchange process, places a scripted batch of real orders plus a
concurrent burst, prints what happened, and stops everything. With ``--nats URL`` it only
places the orders, on a market that is already up (``bourse up``).

``bourse up`` runs that market until Ctrl-C, keeping state in a data dir so the next ``up``
resumes (machines that were running start again).
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import anyio
import typer
from rich.table import Table
from ulid import ULID

from bourse.client import BourseClient, render
from bourse.nats.connection import connect, split_urls
from bourse.nats.embedded import EmbeddedNats, NatsServerError
from bourse.runtime import logs
from bourse.runtime.cli import PrefixOpt, cli_main, fail
from bourse.runtime.launcher import Program, start_program, stop_all
from bourse.runtime.metrics import (
    DEFAULT_PORT,
    MetricsAddrError,
    format_addr,
    free_port,
    parse_addr,
)
from bourse.runtime.statedir import StateDirBusy, lock_state_dir
from bourse.runtime.supervise import run
from bourse.wire.messages import Placed, Unfilled
from bourse.wire.subjects import DEFAULT_PREFIX, Subjects
from loadtest.workload import SCENARIOS, resolve_profile
from ops.auth_cli import auth_app
from ops.demo import DEMO_APP, DEMO_FLEET, clean_up, run_burst, run_script, write_fleet_files
from ops.nats_config import nats_config

app = typer.Typer(help="Bourse: a market-style machine scheduler on NATS.", no_args_is_help=True)
app.add_typer(auth_app, name="auth")


@app.callback()
def _callback() -> None:
    """Bourse."""


app.command("nats-config")(nats_config)

# `demo` and `up` start their own market unless told otherwise: their --nats reads no
# environment variable, so an exported BOURSE_NATS_URL (as the walk-through has a person do)
# never silently points them at another market.
OwnMarketNatsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--nats",
        help="Use this NATS server (repeat, or comma-separate, for a cluster) instead of "
        "starting one; BOURSE_NATS_URL is not read here.",
        show_default=False,
    ),
]


@app.command()
def demo(
    nats: OwnMarketNatsOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    data_dir: Annotated[
        Path | None,
        typer.Option(help="Keep the suppliers' state and logs here (default: a temp dir)."),
    ] = None,
    burst: Annotated[int, typer.Option(min=0, help="Concurrent orders in the burst.")] = 200,
    json: Annotated[bool, typer.Option("--json", help="Print the outcomes as JSON.")] = False,
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
    try:
        run(lambda: _demo(urls, Subjects(prefix), root, burst, json, keep, tidy))
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


@app.command()
def loadtest(
    scenario: Annotated[
        str, typer.Option(help=f"A named profile: {', '.join(SCENARIOS)}.")
    ] = "smoke",
    profile_file: Annotated[
        Path | None, typer.Option("--profile", help="A profile file (JSON or TOML).")
    ] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Virtual workers (default: the scenario's).")
    ] = None,
    regions: Annotated[
        int | None, typer.Option(min=1, help="Regions (default: the scenario's).")
    ] = None,
    rate: Annotated[float | None, typer.Option(min=0.1, help="Orders/s (open loop).")] = None,
    duration_s: Annotated[
        float | None, typer.Option(min=0.1, help="Seconds of load (default: the scenario's).")
    ] = None,
    mode: Annotated[str | None, typer.Option(help="open or closed.")] = None,
    concurrency: Annotated[int | None, typer.Option(min=1, help="Closed loop.")] = None,
    lifetime_s: Annotated[
        float | None,
        typer.Option(min=0.01, help="Seconds a machine lives (default: the scenario's)."),
    ] = None,
    processes: Annotated[int | None, typer.Option(min=1, help="Supplier processes.")] = None,
    exchanges: Annotated[
        int | None, typer.Option(min=1, help="Exchange processes (default: the scenario's).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Workload seed (default: the scenario's).")
    ] = None,
    spread_ms: Annotated[float | None, typer.Option(min=0, help="Suppliers' offer delay.")] = None,
    bid_shards: Annotated[int | None, typer.Option(min=0, help="Sampled bidding shards.")] = None,
    bid_sample: Annotated[
        int | None, typer.Option(min=1, help="Shards a bid goes to (default: the scenario's).")
    ] = None,
    max_offers: Annotated[
        int | None, typer.Option(min=0, help="Offers per bid from a supplier process.")
    ] = None,
    direct: Annotated[
        bool | None,
        typer.Option(
            "--direct/--via-exchange",
            help="The generator runs the auctions itself (buyer --direct): no exchange.",
            show_default=False,
        ),
    ] = None,
    target_auction_ms: Annotated[
        float | None, typer.Option(min=0, help="Exchange admission target (0: fixed cap).")
    ] = None,
    quote_sample: Annotated[
        int | None, typer.Option(min=0, help="Workers a big host prices per bid (0: all).")
    ] = None,
    max_inflight: Annotated[
        int | None, typer.Option(min=1, help="Auctions one exchange runs at once.")
    ] = None,
    claims: Annotated[
        bool | None,
        typer.Option(
            "--claims/--no-claims",
            help="Order claims in JetStream KV in the exchanges and a direct generator.",
            show_default=False,
        ),
    ] = None,
    jetstream: Annotated[
        bool | None,
        typer.Option(
            "--jetstream/--no-jetstream",
            help="The embedded nats-server runs JetStream; off: core NATS only (no claims,"
            " events at most once), to measure what durability costs.",
            show_default=False,
        ),
    ] = None,
    prompt_offers: Annotated[
        bool | None,
        typer.Option(
            "--prompt-offers/--no-prompt-offers",
            help="Suppliers answer at once and the auction ranks (protocol §4.4.3).",
            show_default=False,
        ),
    ] = None,
    batches: Annotated[
        bool | None,
        typer.Option(
            "--batches/--no-batches",
            help="Bids and releases of a region sent together (protocol §4.4.4).",
            show_default=False,
        ),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Where the report goes.")] = None,
    ceiling: Annotated[bool, typer.Option(help="Measure the NATS ceiling first.")] = True,
    oracle: Annotated[bool, typer.Option(help="Replay the trace through the oracle.")] = True,
    nats: OwnMarketNatsOpt = None,
    supplier_nats: Annotated[
        list[str] | None,
        typer.Option(
            help="The suppliers connect here (e.g. another cluster of a supercluster); "
            "the generator and exchanges to --nats.",
            show_default=False,
        ),
    ] = None,
    nats_monitor: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help="The monitoring endpoint (http://host:port) of the --nats server: the report's "
            "messages per placement come from its /varz (the embedded server's own without "
            "--nats).",
            show_default=False,
        ),
    ] = None,
    tap: Annotated[
        bool,
        typer.Option(
            "--tap",
            help="Count every message of the load window by kind (a subscriber on '>' in a "
            "process of its own: its counts are exact, but the run's CPU and latency are not "
            "comparable with an untapped run's).",
        ),
    ] = False,
    json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    soak: Annotated[
        float | None,
        typer.Option(
            min=1, help="Soak mode: this many seconds of load with random faults, then audit."
        ),
    ] = None,
    fault_every_s: Annotated[
        float, typer.Option(min=0.1, help="Soak mode: mean seconds between faults.")
    ] = 5.0,
    nats_nodes: Annotated[
        int,
        typer.Option(
            min=1, max=5, help="Soak mode: a NATS cluster of this many nodes (nodes get killed)."
        ),
    ] = 1,
    duplicates: Annotated[
        int,
        typer.Option(
            min=1,
            max=20,
            metavar="N",
            help="Soak mode: send every order id N times at once, through the exchanges and "
            "a direct buyer (a duplicate storm; the audit checks one machine per id).",
        ),
    ] = 3,
) -> None:
    """Load-test a simulated fleet; report against the NATS ceiling and the oracle.

    With --soak: faults (kill -9 of suppliers and exchanges, nats-server restarts, stalled
    suppliers, a full state file, bad input) strike at random while the load runs; the
    suppliers' SQLite files are then audited against what the client saw (I1-I6).

    Exit code 1 if any invariant was violated."""
    logs.configure("warning")
    try:  # the harness's own dependencies (psutil) come with the `loadtest` extra
        from loadtest import report as loadtest_report
        from loadtest.harness import run_loadtest
        from loadtest.soak import run_soak
        from loadtest.soak import table as soak_table
    except ImportError as exc:
        fail(
            f"bourse loadtest needs the load-test extra ({exc.name} is missing): "
            "pip install 'bourse[loadtest]'"
        )
    if soak is not None:
        logs.configure("error")  # the faults make every client log warnings by design
        if nats:
            fail("--soak starts (and restarts) its own nats-server: leave out --nats")
        if tap:
            fail("--tap counts the messages of a plain run: leave out --soak")
        if scenario == "smoke" and profile_file is None:
            scenario = "soak"
    overrides = {
        "workers": workers, "regions": regions, "rate": rate, "duration_s": duration_s,
        "mode": mode, "concurrency": concurrency, "lifetime_s": lifetime_s,
        "supplier_processes": processes, "exchanges": exchanges, "seed": seed,
        "spread_ms": spread_ms, "bid_shards": bid_shards, "bid_sample": bid_sample,
        "exchange_max_inflight": max_inflight, "max_offers": max_offers,
        "quote_sample": quote_sample, "exchange_target_ms": target_auction_ms,
        "direct": direct, "claims": claims, "prompt_offers": prompt_offers,
        "batches": batches, "jetstream": jetstream,
    }  # fmt: skip
    try:
        profile = resolve_profile(scenario, profile_file, overrides)
    except ValueError as exc:
        fail(f"invalid load profile: {exc}")
    if not profile.jetstream and (soak is not None or split_urls(nats, from_env=False)):
        fail(
            "--no-jetstream is for the embedded server of a plain run: leave out --nats and --soak"
        )
    if nats_monitor and not split_urls(nats, from_env=False):
        fail("--nats-monitor needs --nats: the embedded server's own endpoint is read anyway")
    if supplier_nats and not split_urls(nats, from_env=False):
        fail("--supplier-nats needs --nats: the generator and exchanges' cluster")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = out or Path(".bourse") / "loadtest" / f"{profile.name}-{stamp}"
    console = None if json else render.console
    if soak is not None:
        rep = run(
            lambda: run_soak(profile, target, soak, fault_every_s, console, nats_nodes, duplicates)
        )
        if json:
            typer.echo(render.as_json(rep))
        else:
            render.console.print(soak_table(rep))
            render.console.print(f"report: {rep['path']}")
        if rep["audit"]["violations"]:
            raise typer.Exit(1)
        return
    rep = run(  # uvloop when installed: the generator is a load source
        lambda: run_loadtest(
            profile,
            target,
            split_urls(nats, from_env=False),
            ceiling=ceiling,
            oracle=oracle,
            console=console,
            supplier_urls=split_urls(supplier_nats) if supplier_nats else None,
            monitor_url=nats_monitor,
            tap=tap,
        )
    )
    if json:
        typer.echo(render.as_json(rep))
    else:
        render.console.print(loadtest_report.table(rep))
        render.console.print(f"report: {target / 'report.json'}")
        for plot in rep["plots"]:
            render.console.print(f"plot: {plot}")
    if rep["violations"]:
        raise typer.Exit(1)


def _metrics_addrs(at: tuple[str, int] | None, count: int) -> list[str]:
    """One --metrics-addr per program: ``at``'s port for the first, the next free ones for
    the others (port 0: each its own free one); "off" for all without ``at``."""
    if at is None:
        return ["off"] * count
    host, port = at
    if port == 0:
        return [format_addr(host, 0)] * count
    ports: list[int] = []
    for _ in range(count):
        ports.append(free_port(host, ports[-1] + 1 if ports else port, ports))
    return [format_addr(host, p) for p in ports]


def _metrics_url(program: Program) -> str:
    """The metrics URL a program's ready line names ("...; metrics on URL"), or ""."""
    _, sep, url = program.ready_line.partition("metrics on ")
    return url.strip() if sep else ""


async def _start_market(
    urls: list[str],
    subjects: Subjects,
    root: Path,
    say: Callable[[str], None],
    metrics_at: tuple[str, int] | None = None,
) -> list[Program]:
    """One exchange process and supplier processes (one per demo region); each serves its
    metrics on its own port of ``metrics_at`` (the exchange on its port) when given."""
    programs: list[Program] = []
    common = ["--nats", ",".join(urls), "--prefix", subjects.prefix]
    fleets = write_fleet_files(root / "config")
    addrs = iter(_metrics_addrs(metrics_at, 1 + len(fleets)))
    exchange_addr = next(addrs)
    try:
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
                    "--metrics-addr",
                    next(addrs),
                    log_path=root / "logs" / f"supplier-{region}.log",
                    ready="supplier ready",
                )
            )
            programs[-1].name = f"supplier-{region}"
            say(f"supplier for {region}: {len(DEMO_FLEET[region])} workers")
        programs.append(
            await start_program(
                "exchange",
                "serve",
                *common,
                "--metrics-addr",
                exchange_addr,
                log_path=root / "logs" / "exchange.log",
                ready="exchange ready",
            )
        )
    except BaseException:
        await stop_all(programs)
        raise
    return programs


async def _demo(
    urls: list[str],
    subjects: Subjects,
    root: Path,
    burst: int,
    json: bool,
    keep: bool,
    tidy: bool,
) -> None:
    say = (lambda *_: None) if json else render.console.print
    server = None
    programs: list[Program] = []
    try:
        if urls:
            say(f"placing orders on the market at {', '.join(urls)}")
        else:
            server = EmbeddedNats(workdir=root / "nats", tie_to_parent=True).start()
            urls = [server.url]
            say(f"embedded nats-server on {server.url}")
            programs = await _start_market(urls, subjects, root, say)
            say("exchange ready; placing orders\n")
        nc = await connect(urls, name="bourse-demo", service=False)
        client = BourseClient(nc, subjects)
        run_id = str(ULID())
        placed: list[str] = []
        cleanup = None
        try:
            try:
                outcomes = await run_script(client, run_id)
                placed += [r.machine_id for _, r in outcomes if isinstance(r, Placed)]
                report = await run_burst(client, run_id, placed, burst) if burst else None
                statuses = [s for region in DEMO_FLEET for s in await client.status(region)]
            finally:
                if tidy:  # also when interrupted: what was placed is destroyed
                    with anyio.CancelScope(shield=True):
                        cleanup = await clean_up(client, placed)
        finally:
            await nc.drain()
        if json:
            typer.echo(
                render.as_json(
                    {
                        "orders": [{"scenario": n, "result": r} for n, r in outcomes],
                        "burst": report.__dict__ if report else None,
                        "fleet": statuses,
                        "app": DEMO_APP,
                        "cleanup": cleanup.__dict__ if cleanup else None,
                    }
                )
            )
        else:
            render.show(_outcome_table(outcomes))
            if report:
                say(
                    f"\nburst: {report.orders} concurrent orders in {report.seconds:.2f}s: "
                    f"{report.placed} placed, unfilled {report.unfilled or 0}; placed latency "
                    f"p50 {report.p50_ms:.1f} ms, p99 {report.p99_ms:.1f} ms"
                )
            render.show(render.fleet(statuses))
            n = len(set(placed))
            if cleanup is None:
                how = "" if urls else " (the demo market stops with it)"
                say(f"\nthe demo placed {n} machines, app {DEMO_APP}{how}")
            else:
                say(
                    f"\nthe demo placed {n} machines (app {DEMO_APP}) and destroyed "
                    f"{cleanup.destroyed} of them; --keep leaves them in place"
                )
                for machine_id, why in cleanup.failed.items():
                    say(f"[red]not destroyed: {machine_id}: {why}[/]")
            if keep:
                say(f"\nlogs and state kept in {root}")
    finally:
        await stop_all(programs)
        if server is not None:
            server.stop()


@app.command()
def up(
    nats: OwnMarketNatsOpt = None,
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
) -> None:
    """Run a demo market until Ctrl-C: NATS, suppliers in 3 regions, an exchange."""
    logs.configure("warning")
    try:
        metrics_at = parse_addr(metrics_addr)
        with lock_state_dir(data_dir):  # one `up` per state directory
            run(
                lambda: _up(
                    split_urls(nats, from_env=False), Subjects(prefix), data_dir, port, metrics_at
                )
            )
    except typer.Exit:
        raise  # a RuntimeError too, already reported on its one line
    except (NatsServerError, RuntimeError, MetricsAddrError, StateDirBusy) as exc:
        fail(str(exc))


async def _up(
    urls: list[str],
    subjects: Subjects,
    root: Path,
    port: int,
    metrics_at: tuple[str, int] | None = None,
) -> None:
    """The market until cancelled (SIGINT/SIGTERM); its programs stop on the way out."""
    say = render.console.print
    server = None
    if not urls:
        if port > 0 and _port_busy(port):
            fail(f"port {port} is in use: pass --port -1 for a free one, or --nats URL")
        server = EmbeddedNats(workdir=root / "nats", port=port, tie_to_parent=True).start()
        urls = [server.url]
        say(f"embedded nats-server on {server.url} (log: {server.log_path})")
    else:
        say(f"using the NATS server at {', '.join(urls)} (--nats)")
    programs: list[Program] = []
    try:
        programs = await _start_market(urls, subjects, root, say, metrics_at)
        for p in programs:
            if _metrics_url(p):
                say(f"metrics of {p.name}: {_metrics_url(p)}")
        px = "" if subjects.prefix == DEFAULT_PREFIX else f" --prefix {subjects.prefix}"
        say(
            f"\n[bold]Bourse is up.[/] State and logs in {root}. In another shell:\n"
            f"  export BOURSE_NATS_URL={urls[0]}\n"
            f"  buyer place --region mad --cpus 2 --memory-mb 1024 --image web --start{px}\n"
            f"  buyer fleet{px}\n"
            f"  buyer watch{px}\n"
            f"  bourse demo --nats {urls[0]}{px}\n"
            "Ctrl-C stops everything; machines that were running start again on the next up."
        )
        await _watch_programs(programs, say)
    finally:
        say("stopping...")
        await stop_all(programs)
        if server is not None:
            server.stop()


async def _watch_programs(programs: list[Program], say: Callable[[str], None]) -> None:
    """Until every program has exited: one that exits is reported, and the rest keep
    serving (workers come and go on a market; that is what failover is for)."""

    async def watch(p: Program) -> None:
        await p.proc.wait()
        say(f"[red]{p.name} exited with code {p.proc.returncode}[/]; see {p.log_path}")

    async with anyio.create_task_group() as tasks:
        for p in programs:
            tasks.start_soon(watch, p)
    say("every program has exited")


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _outcome_table(outcomes: Sequence[tuple[str, Placed | Unfilled]]) -> Table:
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
            t.add_row(name, "unfilled", r.reason, "", "", f"{r.elapsed_ms:.1f}")
    return t


def main() -> None:
    cli_main(app)


if __name__ == "__main__":
    main()
