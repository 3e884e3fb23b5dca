"""The demo market behind ``bourse demo`` and ``bourse up``: an embedded nats-server (unless
one is given), one supplier process per demo region and one exchange process; the example
app pushed into its image store; the demo's scripted batch (with a machine of the example
app) and burst placed on it; and ``up``'s watch over its programs until cancelled. Progress
goes to a ``say`` callback; what the demo saw is returned."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
from nats.aio.client import Client as NATS
from ulid import ULID

from bourse.client import BourseClient
from bourse.images import ImageError, ImageInfo
from bourse.nats.connection import connect, shutdown
from bourse.nats.embedded import EmbeddedNats, NatsServerError
from bourse.nats.jetstream import NO_JETSTREAM_FLAG, jetstream_mode
from bourse.runtime.endpoint import CANNOT_LISTEN, format_addr, free_port
from bourse.runtime.launcher import Program, ProgramFailed, start_program, stop_all
from bourse.wire.messages import Placed, Unfilled, WorkerStatus
from bourse.wire.subjects import DEFAULT_PREFIX, Subjects
from ops.busybox import BUSYBOX_PLACE, BUSYBOX_REF, push_busybox
from ops.demo import (
    DEMO_APP,
    DEMO_FLEET,
    BurstReport,
    Cleanup,
    clean_up,
    run_burst,
    run_script,
    write_fleet_files,
)
from ops.hello import HELLO_REF, place_hello, push_hello

Say = Callable[[str], None]
# The host a demo market's machines' addresses name.
DEMO_HOST = "127.0.0.1"
EDGE_PORT = 8080  # bourse up's edge, where free
PAGE_PORT = 8081  # its page (edge serve --admin), where free


def edge_address(program: Program) -> str:
    """The address an edge's ready line names ("edge serving on HOST:PORT (...)")."""
    return program.ready_line.split()[3]


def page_url(program: Program) -> str:
    """The page's URL an edge's ready line names ("...; page on URL"), or ""."""
    _, sep, rest = program.ready_line.partition("page on ")
    return rest.split(";", 1)[0].strip() if sep else ""


class MetricsPorts:
    """Where the programs of a demo market serve their metrics: ``at``'s port for the first
    (the exchange), the next free ones for the others, a taken one skipped (port 0: each its
    own free one; None: none, "off"). A port is free when it is picked, but another process
    (a second ``bourse up`` starting at the same moment) may bind it before the program
    does: :meth:`again` picks the next one for a program that could not listen."""

    def __init__(self, at: tuple[str, int] | None) -> None:
        self.at = at
        self.taken: list[int] = []

    def pick(self) -> str:
        """The next program's --metrics-addr."""
        if self.at is None:
            return "off"
        host, port = self.at
        if port == 0:
            return format_addr(host, 0)
        self.taken.append(free_port(host, self.taken[-1] + 1 if self.taken else port, self.taken))
        return format_addr(host, self.taken[-1])

    def again(self, failed: ProgramFailed) -> str | None:
        """Another free port for a program that ``failed`` because it could not listen on
        the one picked for it; None when it failed for another reason (or serves none)."""
        if self.at is None or self.at[1] == 0 or CANNOT_LISTEN not in failed.reason:
            return None
        return self.pick()


# A program that could not listen on its picked metrics port is started again on the next
# free one, this many times at most.
METRICS_ATTEMPTS = 5


async def start_serving(
    ports: MetricsPorts, addr: str, module: str, *args: str, log_path: Path, ready: str
) -> Program:
    """``start_program`` with ``--metrics-addr addr``; started again on another free port
    (:meth:`MetricsPorts.again`) when it could not listen on ``addr``."""
    for attempt in range(1, METRICS_ATTEMPTS + 1):
        try:
            return await start_program(
                module, *args, "--metrics-addr", addr, log_path=log_path, ready=ready
            )
        except ProgramFailed as exc:
            other = ports.again(exc) if attempt < METRICS_ATTEMPTS else None
            if other is None:
                raise
            addr = other
    raise AssertionError("unreachable: the last attempt returns or raises")


def metrics_url(program: Program) -> str:
    """The metrics URL a program's ready line names ("...; metrics on URL"), or ""."""
    _, sep, url = program.ready_line.partition("metrics on ")
    return url.strip() if sep else ""


async def start_market(
    urls: list[str],
    subjects: Subjects,
    root: Path,
    say: Say,
    metrics_at: tuple[str, int] | None = None,
    jetstream: bool = True,
    driver: str = "process",
    edge: bool = False,
) -> list[Program]:
    """One exchange process and supplier processes (one per demo region); each serves its
    metrics on its own port of ``metrics_at`` (the exchange on its port) when given;
    ``jetstream`` False: each runs in the degraded mode (--no-jetstream); ``driver``: how
    the demo fleet's workers run machines; ``edge``: an ``edge serve`` too (with its
    controller), on port 8080 or, taken, a free one (:func:`edge_address`), its page
    on 127.0.0.1:8081 or, taken, a free one (:func:`page_url`)."""
    programs: list[Program] = []
    common = ["--nats", ",".join(urls), "--prefix", subjects.prefix]
    common += [] if jetstream else [NO_JETSTREAM_FLAG]
    fleets = write_fleet_files(root / "config", driver)
    ports = MetricsPorts(metrics_at)
    exchange_addr = ports.pick()  # the first port: the exchange's
    try:
        for region, path in fleets.items():
            programs.append(
                await start_serving(
                    ports,
                    ports.pick(),
                    "supplier",
                    "run",
                    "--fleet",
                    str(path),
                    "--data-dir",
                    str(root / "data" / region),
                    "--machines-stop-with-supplier",  # the demo's machines go with it
                    # a local market: its machines are reached on loopback, not on the
                    # host's outward address (which a laptop's network may change)
                    *("--advertise-host", DEMO_HOST),
                    *common,
                    log_path=root / "logs" / f"supplier-{region}.log",
                    ready="supplier ready",
                )
            )
            programs[-1].name = f"supplier-{region}"
            say(f"supplier for {region}: {len(DEMO_FLEET[region])} workers")
        programs.append(
            await start_serving(
                ports,
                exchange_addr,
                "exchange",
                "serve",
                *common,
                log_path=root / "logs" / "exchange.log",
                ready="exchange ready",
            )
        )
        if edge:
            listen = f"127.0.0.1:{0 if _port_busy(EDGE_PORT) else EDGE_PORT}"
            page = f"127.0.0.1:{0 if _port_busy(PAGE_PORT) else PAGE_PORT}"
            programs.append(
                await start_serving(
                    ports, ports.pick(),
                    "edge", "serve", "--listen", listen, "--controller", "--admin", page,
                    "--nats", ",".join(urls), "--prefix", subjects.prefix,
                    log_path=root / "logs" / "edge.log", ready="edge serving on",
                )
            )  # fmt: skip
            programs[-1].name = "edge"
    except BaseException:
        await stop_all(programs)
        raise
    return programs


@dataclass
class DemoRun:
    """What one demo saw: each scripted order's outcome, the burst, the fleet after them,
    how many machines it placed, and (on a user's market) what its clean-up destroyed."""

    outcomes: list[tuple[str, Placed | Unfilled]]
    burst: BurstReport | None
    fleet: list[WorkerStatus]
    placed: int
    cleanup: Cleanup | None


async def check_jetstream(
    urls: list[str], program: str, jetstream: bool, *, wait: bool = False
) -> None:
    """Refuse a server given with --nats that has no JetStream (JetStreamMissing, one
    line), unless ``jetstream`` is False (--no-jetstream): then the warning says so.
    ``wait``: until the server is reachable (as the programs ``up`` starts would), else one
    clear error if it is not."""
    try:
        nc = await connect(urls, name=program, service=wait)
    except Exception as exc:  # nats-py's own errors, OSError, TimeoutError: all one line
        raise NatsServerError(
            f"cannot connect to NATS at {', '.join(urls)}: {exc or type(exc).__name__}"
        ) from None
    try:
        await jetstream_mode(nc, program, off=not jetstream)
    finally:
        await shutdown(nc)


async def run_demo(
    urls: list[str],
    subjects: Subjects,
    root: Path,
    burst: int,
    tidy: bool,
    say: Say,
    jetstream: bool = True,
) -> DemoRun:
    """The scripted orders and a burst of ``burst`` on the market at ``urls``, or (none
    given) on a demo market started under ``root`` and stopped after; ``tidy``: destroy
    what the demo placed, even when interrupted; ``jetstream`` False: without JetStream
    (the degraded mode, --no-jetstream)."""
    server = None
    programs: list[Program] = []
    try:
        if urls:
            await check_jetstream(urls, "bourse demo", jetstream)
            say(f"placing orders on the market at {', '.join(urls)}")
        else:
            server = EmbeddedNats(
                workdir=root / "nats", tie_to_parent=True, jetstream=jetstream
            ).start()
            urls = [server.url]
            say(f"embedded nats-server on {server.url}")
            programs = await start_market(urls, subjects, root, say, jetstream=jetstream)
            say("exchange ready; placing orders\n")
        return await _place_demo(urls, subjects, burst, tidy, say if jetstream else None)
    finally:
        await stop_all(programs)
        if server is not None:
            server.stop()


async def _place_demo(
    urls: list[str], subjects: Subjects, burst: int, tidy: bool, say: Say | None
) -> DemoRun:
    """The demo's orders; ``say`` None: without JetStream, so without the example app."""
    nc = await connect(urls, name="bourse-demo", service=False)
    client = BourseClient(nc, subjects)
    run_id = str(ULID())
    placed: list[str] = []
    cleanup = None
    try:
        try:
            hello = await pushed_hello(nc, subjects, say) if say else None
            outcomes = await run_script(client, run_id)
            if hello is not None:
                metadata = {"app": DEMO_APP, "demo_run": run_id}
                got = await place_hello(client, "mad", metadata)
                outcomes.append(("hello: the example app, pushed and placed by its tag", got))
            placed += [r.machine_id for _, r in outcomes if isinstance(r, Placed)]
            report = await run_burst(client, run_id, placed, burst) if burst else None
            statuses = [s for region in DEMO_FLEET for s in await client.status(region)]
        finally:
            if tidy:  # also when interrupted: what was placed is destroyed
                with anyio.CancelScope(shield=True):
                    cleanup = await clean_up(client, placed)
    finally:
        await nc.drain()
    return DemoRun(outcomes, report, statuses, len(set(placed)), cleanup)


async def pushed_hello(nc: NATS, subjects: Subjects, say: Say) -> ImageInfo | None:
    """The example app pushed as ``hello:latest`` (said), or None where the store refused it
    (said too: the rest of the market does not need it)."""
    try:
        info = await push_hello(nc, subjects.prefix)
    except ImageError as exc:
        say(f"[yellow]{HELLO_REF} not pushed[/]: {exc}")
        return None
    say(f"pushed the example app as {HELLO_REF} ({info.digest}, {info.size} bytes)")
    return info


async def pushed_busybox(nc: NATS, subjects: Subjects, root: Path, say: Say) -> None:
    """The container example pushed as ``busybox-httpd:latest`` (said), or why not (said
    too: the market runs without it)."""
    try:
        info = await push_busybox(nc, subjects.prefix, root)
    except ImageError as exc:
        say(f"[yellow]{BUSYBOX_REF} not pushed[/]: {exc}")
        return
    say(f"pushed the container example as {BUSYBOX_REF} ({info.digest}, {info.size} bytes)")


def up_hints(url: str, prefix: str, driver: str) -> list[str]:
    """The commands ``bourse up`` suggests, each one that works on its market: process
    workers run the demo's catalog (web) and the example app; oci workers run containers,
    the busybox example (the demo's orders name catalog images they do not run)."""
    px = "" if prefix == DEFAULT_PREFIX else f" --prefix {prefix}"
    place = (
        [BUSYBOX_PLACE]
        if driver == "oci"
        else [
            "buyer place --region mad --cpus 2 --memory-mb 1024 --image web --start",
            f"buyer place --region mad --cpus 1 --memory-mb 256 --image {HELLO_REF} "
            "--port http --check http:http:/healthz --check-interval 1 --start",
        ]
    )
    demo = [] if driver == "oci" else [f"bourse demo --nats {url}"]
    return [
        f"export BOURSE_NATS_URL={url}",
        *(f"{cmd}{px}" for cmd in [*place, "buyer fleet", "buyer watch", *demo]),
    ]


async def run_up(
    urls: list[str],
    subjects: Subjects,
    root: Path,
    port: int,
    say: Say,
    metrics_at: tuple[str, int] | None = None,
    jetstream: bool = True,
    driver: str = "process",
) -> None:
    """The demo market until cancelled (SIGINT/SIGTERM), on the NATS at ``urls`` or an
    embedded one on ``port``; its programs stop on the way out. ``jetstream`` False:
    without JetStream (the degraded mode, --no-jetstream); ``driver``: the fleet's."""
    server = None
    if not urls:
        if port > 0 and _port_busy(port):
            raise NatsServerError(
                f"port {port} is in use: pass --port -1 for a free one, or --nats URL"
            )
        server = EmbeddedNats(
            workdir=root / "nats", port=port, tie_to_parent=True, jetstream=jetstream
        ).start()
        urls = [server.url]
        say(f"embedded nats-server on {server.url} (log: {server.log_path})")
    else:
        await check_jetstream(urls, "bourse up", jetstream, wait=True)
        say(f"using the NATS server at {', '.join(urls)} (--nats)")
    programs: list[Program] = []
    try:
        programs = await start_market(
            urls, subjects, root, say, metrics_at, jetstream, driver, edge=True
        )
        for p in programs:
            if metrics_url(p):
                say(f"metrics of {p.name}: {metrics_url(p)}")
        if jetstream:
            nc = await connect(urls, name="bourse-up", service=False)
            try:
                await pushed_hello(nc, subjects, say)
                if driver == "oci":
                    await pushed_busybox(nc, subjects, root / "busybox-httpd", say)
            finally:
                await shutdown(nc)
        edge_port = edge_address(programs[-1]).rpartition(":")[2]
        say(
            f"edge on {edge_address(programs[-1])} (its controller on): an app deployed as "
            f"NAME answers at http://NAME.localhost:{edge_port}/"
        )
        say(f"page on {page_url(programs[-1])} (regions, workers, machines, apps, events: live)")
        say(
            f"\n[bold]Bourse is up.[/] State and logs in {root}. In another shell:\n"
            + "".join(f"  {line}\n" for line in up_hints(urls[0], subjects.prefix, driver))
            + "Ctrl-C stops everything; machines that were running start again on the next up."
        )
        await watch_programs(programs, say)
    finally:
        say("stopping...")
        await stop_all(programs)
        if server is not None:
            server.stop()


async def watch_programs(programs: list[Program], say: Say) -> None:
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
