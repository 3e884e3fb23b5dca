"""``bourse loadtest``: its options (each profile field one of them) and the run or soak
they ask for; the harness itself is loadtest/."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from bourse.client import render
from bourse.nats.connection import split_urls
from bourse.runtime import logs
from bourse.runtime.cli import OwnServerNatsOpt, fail, json_flag
from bourse.runtime.supervise import run
from loadtest.workload import SCENARIOS, resolve_profile


def loadtest(
    scenario: Annotated[
        str,
        typer.Option(
            help=f"A named profile: {', '.join(SCENARIOS)}; or pulls (real pulls of images, "
            "cache-aware pricing against cache-blind: --workers per arm, --rate, --duration-s, "
            "--lifetime-s, --seed, --images, --image-mb); or starts (a machine's start through "
            "the market against its program started by hand, and the shims' memory: "
            "--starts, --machines); or edge (the edge's p50 over a direct request and its "
            "throughput against nginx's reverse proxy, by wrk: --processes edge processes "
            "and nginx workers, --concurrency connections, --duration-s); or edge-cold (a "
            "request to a stopped app through the edge, its first byte against the app's own "
            "start, and to an app with no machine, placed: --starts); or edge-faults (GETs "
            "through an edge to an app of a primary and a spare, through a rolling deploy, a "
            "supplier restart and a kill -9 of the primary's worker: --rate GET/s, 200); or "
            "view (the view "
            "of the market: a change's delay to a view, a build from scratch, the CLI's "
            "listing: --workers, --machines, --changes-per-s, --duration-s, --build-machines, "
            "--regions, --cli-runs)."
        ),
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
            help="--no-jetstream: the run without JetStream, the degraded mode: its embedded "
            "nats-server core NATS only, every program started with --no-jetstream (no claims,"
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
    nats: OwnServerNatsOpt = None,
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
    json: Annotated[bool, json_flag("Print the report as JSON.")] = False,
    images: Annotated[
        int | None, typer.Option(min=1, help="pulls: images the harness makes (default 5).")
    ] = None,
    image_mb: Annotated[
        str | None,
        typer.Option(metavar="MIN-MAX", help="pulls: image sizes in MB (default 20-60)."),
    ] = None,
    starts: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="starts: starts of each kind, market and by hand (default 30); edge-cold: "
            "starts of each, own and through the edge (default 20).",
        ),
    ] = None,
    machines: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="starts: machines at once for the shims' memory (default 100); view: "
            "machines placed before the changes (default 2,000).",
        ),
    ] = None,
    changes_per_s: Annotated[
        float | None,
        typer.Option(min=1, help="view: recorded machine changes a second (default 1,000)."),
    ] = None,
    build_machines: Annotated[
        int | None,
        typer.Option(min=1, help="view: machine rows a view is built from (default 100,000)."),
    ] = None,
    cli_runs: Annotated[
        int | None,
        typer.Option(min=1, help="view: timed runs of the CLI's listing (default 10)."),
    ] = None,
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
    if scenario == "starts":
        given = {"starts": starts, "machines": machines}
        _starts({k: v for k, v in given.items() if v is not None}, out, json)
        return
    if scenario == "edge":
        edge: dict[str, object] = {
            "processes": processes, "concurrency": concurrency, "duration_s": duration_s
        }  # fmt: skip
        _edge({k: v for k, v in edge.items() if v is not None}, out, json)
        return
    if scenario == "edge-cold":
        _edge_cold({"starts": starts} if starts is not None else {}, out, json)
        return
    if scenario == "edge-faults":
        _edge_faults({"rate": int(rate)} if rate is not None else {}, out, json)
        return
    if scenario == "view":
        view: dict[str, object] = {
            "workers": workers, "machines": machines, "changes_per_s": changes_per_s,
            "duration_s": duration_s, "build_machines": build_machines, "regions": regions,
            "cli_runs": cli_runs,
        }  # fmt: skip
        _views({k: v for k, v in view.items() if v is not None}, out, json)
        return
    if scenario == "pulls":
        pulls = {
            "workers": workers, "rate": rate, "duration_s": duration_s,
            "lifetime_s": lifetime_s, "seed": seed, "images": images, "image_mb": image_mb,
        }  # fmt: skip
        _pulls({k: v for k, v in pulls.items() if v is not None}, out, json)
        return
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


def _starts(given: dict[str, object], out: Path | None, json: bool) -> None:
    """The starts scenario (loadtest/starts.py) with the options given."""
    from loadtest import starts

    _scenario("starts", starts.profile_of, starts.run_starts, starts.table, given, out, json)


def _edge(given: dict[str, object], out: Path | None, json: bool) -> None:
    """The edge scenario (loadtest/edge.py) with the options given."""
    from loadtest import edge

    _scenario("edge", edge.profile_of, edge.run_edge, edge.table, given, out, json)


def _edge_cold(given: dict[str, object], out: Path | None, json: bool) -> None:
    """The edge-cold scenario (loadtest/edgecold.py) with the options given."""
    from loadtest import edgecold

    _scenario("edge-cold", edgecold.profile_of, edgecold.run_cold, edgecold.table, given, out, json)


def _edge_faults(given: dict[str, object], out: Path | None, json: bool) -> None:
    """The edge-faults scenario (loadtest/edgefail.py) with the options given."""
    from loadtest import edgefail

    _scenario("edge-faults", edgefail.profile_of, edgefail.run_faults, edgefail.table, given, out,
              json)  # fmt: skip


def _views(given: dict[str, object], out: Path | None, json: bool) -> None:
    """The view scenario (loadtest/views.py) with the options given."""
    from loadtest import views

    _scenario("view", views.profile_of, views.run_views, views.table, given, out, json)


def _pulls(given: dict[str, object], out: Path | None, json: bool) -> None:
    """The pulls scenario (loadtest/pulls.py) with the options given."""
    from loadtest import pulls

    _scenario("pulls", pulls.profile_of, pulls.run_pulls, pulls.table, given, out, json)


def _scenario(
    name: str,
    profile_of: Callable[[dict[str, Any]], Any],
    run_it: Callable[[Any, Path, Callable[[str], None]], Awaitable[dict[str, Any]]],
    table: Callable[[dict[str, Any]], Any],
    given: dict[str, object],
    out: Path | None,
    json: bool,
) -> None:
    """A scenario of its own (not a load profile): its profile from the options, one run,
    its report printed (a table, or JSON) and written to ``<out>/report.json``."""
    try:
        profile = profile_of(given)
    except (ValueError, TypeError) as exc:
        fail(f"invalid {name} profile: {exc}")
    target = out or Path(".bourse") / "loadtest" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    say = (lambda _: None) if json else render.console.print
    rep = run(lambda: run_it(profile, target, say))
    if json:
        typer.echo(render.as_json(rep))
    else:
        render.console.print(table(rep))
        render.console.print(f"report: {target / 'report.json'}")
