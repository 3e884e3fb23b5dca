"""``supplier run``: one worker from flags, or a fleet of virtual workers from a TOML file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import anyio
import msgspec
import structlog
import typer
from nats.aio.client import Client as NATS

from bourse.images.bounds import DEFAULT_MAX_IMAGE_MB
from bourse.nats.auth import AuthError, signing_seed
from bourse.nats.connection import shutdown, stats_of
from bourse.nats.jetstream import degraded, jetstream_mode
from bourse.runtime import logs
from bourse.runtime.cli import (
    CredsOpt,
    LogJsonOpt,
    LogLevelOpt,
    MetricsAddrOpt,
    NatsOpt,
    NoJetStreamOpt,
    PrefixOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    VersionOpt,
    cli_main,
    fail,
    parse_labels,
)
from bourse.runtime.connection import Connection
from bourse.runtime.endpoint import MetricsAddrError, parse_addr, start_endpoint
from bourse.runtime.metrics import SupplierMetrics
from bourse.runtime.statedir import StateDirBusy, lock_state_dir
from bourse.runtime.supervise import run, settle_heap
from bourse.runtime.words import in_words
from bourse.wire.codec import validation_detail
from bourse.wire.limits import MAX_HOLD_MS
from bourse.wire.resources import cpu_fields, parse_cpus
from bourse.wire.signing import OfferSigner, TrustError
from bourse.wire.subjects import DEFAULT_PREFIX, Subjects
from supplier.candidates import DEFAULT_QUOTE_SAMPLE
from supplier.config import (
    DEFAULT_MAX_HOLD_MS,
    DEFAULT_TENANT_IMAGES,
    TENANT_IMAGES,
    ConfigError,
    WorkerConfig,
    check_workers,
    load_fleet,
    unrunnable_images,
)
from supplier.host import (
    DEFAULT_MAX_BID_BACKLOG,
    DEFAULT_MAX_OFFERS,
    SupplierHost,
    WorkerIdInUse,
)
from supplier.machines.shim.logfiles import DEFAULT_MACHINE_LOG_MB, DEFAULT_WORKER_LOG_MB
from supplier.ports import PortClaims, PortError
from supplier.reclaim import DEFAULT_AFTER_S as DEFAULT_RECLAIM_AFTER_S
from supplier.store import DEFAULT_LINGER_MS, Store, StoreError

log = structlog.get_logger("bourse.supplier")

app = typer.Typer(
    help="Bourse supplier: sells a worker's capacity on the market.",
    rich_markup_mode=None,  # plain help: rich would nearly double a help's time
)

DB_NAME = "supplier.db"


@app.callback()
def _callback(version: VersionOpt = False) -> None:
    """Bourse supplier daemon."""


def _cpus(text: str) -> int:
    """``--cpus`` as people write it (16, 0.5, 1500m), in millicores; one clear error else."""
    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command("run")
def run_cmd(
    worker_id: Annotated[str | None, typer.Option(help="This worker's id.")] = None,
    region: Annotated[str | None, typer.Option(help="The region it sells in.")] = None,
    cpus: Annotated[
        int | None,
        typer.Option(
            metavar="CPUS",
            parser=_cpus,
            help="CPUs the worker offers (--worker-id): 16, 0.5 or 1500m (millicores).",
        ),
    ] = None,
    memory_mb: Annotated[int, typer.Option(min=0, help="Memory it offers, MiB.")] = 0,
    disk_mb: Annotated[int, typer.Option(min=0, help="Disk it offers, MiB.")] = 0,
    gpus: Annotated[int, typer.Option(min=0, help="GPUs it offers.")] = 0,
    label: Annotated[list[str] | None, typer.Option(help="key=value (repeatable).")] = None,
    image: Annotated[list[str] | None, typer.Option(help="A cached image (repeatable).")] = None,
    preset: Annotated[str, typer.Option(help="Utility preset: spread or binpack.")] = "spread",
    image_weight: Annotated[
        float,
        typer.Option(min=0, max=1, help="Score weight of the image term, what a pull costs (0-1)."),
    ] = 0.3,
    spread_ms: Annotated[
        float, typer.Option(min=0, max=1000, help="Offer delay spread, ms (better scores first).")
    ] = 4.0,
    fleet: Annotated[
        Path | None, typer.Option(help="TOML file of virtual workers to host in this process.")
    ] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Where the SQLite state lives.")] = None,
    draining: Annotated[bool, typer.Option(help="Start without offering capacity.")] = False,
    driver: Annotated[
        str,
        typer.Option(
            metavar="DRIVER",
            help="How the worker (--worker-id) runs machines: process (confined processes, "
            "each under a shim), oci (containers through runc or crun) or sim (simulated: "
            "nothing runs; for load tests). A fleet file's workers say their own (default "
            "sim).",
        ),
    ] = "process",
    max_db_mb: Annotated[
        int | None,
        typer.Option(min=1, help="Cap the state file (MiB); past it the supplier drains."),
    ] = None,
    max_offers: Annotated[
        int, typer.Option(min=0, help="Offers per bid from this process (its best); 0: all.")
    ] = DEFAULT_MAX_OFFERS,
    bid_shards: Annotated[
        int, typer.Option(min=0, help="Sampled bidding: shards per region (0: off).")
    ] = 0,
    max_bid_backlog: Annotated[
        int, typer.Option(min=1, help="Shed bids queued beyond this many (overload).")
    ] = DEFAULT_MAX_BID_BACKLOG,
    commit_linger_ms: Annotated[
        float,
        typer.Option(
            min=0,
            max=50,
            help="While busy, the store waits this long for more writes to share an fsync.",
        ),
    ] = DEFAULT_LINGER_MS,
    quote_sample: Annotated[
        int,
        typer.Option(
            min=0,
            help="Price a bid on a sample of this many workers per source (owner, cached "
            "image, random) once a bid group here exceeds twice it; 0: price all.",
        ),
    ] = DEFAULT_QUOTE_SAMPLE,
    reclaim_after_s: Annotated[
        float,
        typer.Option(
            min=0,
            metavar="SECONDS",
            help="Ask the exchange about a machine still reserved this long after its commit, "
            "and destroy it if its order's claim says no buyer holds it (an orphan); 0: never.",
        ),
    ] = DEFAULT_RECLAIM_AFTER_S,
    max_hold_ms: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=MAX_HOLD_MS,
            help="Hold offered capacity at most this long, whatever a bid asks (a fleet "
            f"worker's own max_hold_ms wins) [default: {DEFAULT_MAX_HOLD_MS}]",
        ),
    ] = None,
    machine_log_mb: Annotated[
        int | None,
        typer.Option(
            min=1,
            metavar="MIB",
            help="Keep a process machine's output in two files of at most this many MiB "
            "each, rotated (a fleet worker's own machine_log_mb wins) "
            f"[default: {DEFAULT_MACHINE_LOG_MB}]",
        ),
    ] = None,
    worker_log_mb: Annotated[
        int | None,
        typer.Option(
            min=1,
            metavar="MIB",
            help="Keep at most this many MiB of output of all a worker's machines together "
            f"(a fleet worker's own worker_log_mb wins) [default: {DEFAULT_WORKER_LOG_MB}]",
        ),
    ] = None,
    max_image_mb: Annotated[
        int | None,
        typer.Option(
            min=1,
            metavar="MIB",
            help="Unpack no image past this many MiB in all: a pull stops the moment its "
            "layers pass it, a layer its size recorded at push or the image cache's budget "
            "left, and keeps nothing of it (a fleet worker's own max_image_mb wins) "
            f"[default: {DEFAULT_MAX_IMAGE_MB}]",
        ),
    ] = None,
    ports: Annotated[
        str,
        typer.Option(
            metavar="FIRST-LAST",
            help="The host ports its machines' named ports are given (e.g. 20000-20999); "
            "a fleet worker sets its own (ports = ...) [default: a free block of 100 from "
            "20000 for a process worker, none for sim]",
        ),
    ] = "",
    advertise_host: Annotated[
        str,
        typer.Option(
            help="The host its machines' addresses name (a fleet worker's own wins) "
            "[default: the host's primary address, else 127.0.0.1]"
        ),
    ] = "",
    keep_machines: Annotated[
        bool,
        typer.Option(
            "--keep-machines/--machines-stop-with-supplier",
            help="Machines (process and oci drivers) run on when this supplier stops or "
            "dies, each held by a shim of its own, and the next supplier on the data dir "
            "takes them over; or they stop with the supplier (a fleet worker's own "
            "keep_machines wins).",
        ),
    ] = True,
    tenant_images: Annotated[
        str | None,
        typer.Option(
            metavar="POLICY",
            help="Where a tenant's orders may run (docs/protocol.md §6.8e): isolated, only "
            "on a worker whose machines have users and a network of their own; oci-only, "
            "only in such a worker's containers; allow, anywhere (a fleet worker's own "
            f"tenant_images wins) [default: {DEFAULT_TENANT_IMAGES}]",
        ),
    ] = None,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    no_jetstream: NoJetStreamOpt = False,
    metrics_addr: MetricsAddrOpt = "",
    log_level: LogLevelOpt = "info",
    log_json: LogJsonOpt = False,
) -> None:
    """Serve bids, commits and machine requests until SIGINT/SIGTERM."""
    logs.configure(log_level, log_json)
    conn = Connection.from_options(nats, creds, tls_ca, tls_cert, tls_key)
    signer = _offer_signer(conn.creds)
    try:
        if fleet is not None:
            if worker_id or region or ports:
                fail(
                    "--fleet and --worker-id/--region/--ports are exclusive: describe workers "
                    "in one place"
                )
            workers = load_fleet(fleet)
            data_dir = data_dir or Path(".bourse") / f"fleet-{fleet.stem}"
        else:
            workers = [
                _single_worker(
                    worker_id,
                    region,
                    cpus,
                    memory_mb,
                    disk_mb,
                    gpus,
                    label,
                    image,
                    preset,
                    image_weight,
                    spread_ms,
                    draining,
                    ports,
                    driver,
                )
            ]
            data_dir = data_dir or Path(".bourse") / workers[0].worker_id
        if tenant_images is not None and tenant_images not in TENANT_IMAGES:
            fail(f"--tenant-images {tenant_images!r}: use one of {', '.join(TENANT_IMAGES)}")
        # a worker's own settings (fleet file) win over these flags
        flags: dict[str, int | bool | str | None] = {
            "max_hold_ms": max_hold_ms,
            "machine_log_mb": machine_log_mb,
            "worker_log_mb": worker_log_mb,
            "max_image_mb": max_image_mb,
            "keep_machines": keep_machines,
            "tenant_images": tenant_images,
        }
        workers = [_unset_from(w, flags) for w in workers]
        check_workers(workers)
        for w in workers:
            if images := unrunnable_images(w):
                log.warning(
                    "images_not_runnable",
                    worker_id=w.worker_id,
                    driver=w.driver,
                    images=images,
                    detail="its orders are declined: give each a catalog entry with a command "
                    "(process), push it to the image store and order it by tag (process, oci), "
                    "or run --driver sim (nothing runs)",
                )
        subjects = Subjects(prefix)
        metrics_at = parse_addr(metrics_addr)
        owner = lock_state_dir(data_dir)  # one supplier per state directory, or none
        store = Store(data_dir / DB_NAME, max_db_mb=max_db_mb, linger_ms=commit_linger_ms)
    except (ConfigError, StoreError, StateDirBusy, ValueError) as exc:
        fail(str(exc))

    assert data_dir is not None  # both branches above set it (fail() does not return)
    state_dir = data_dir

    async def main() -> None:
        try:
            name = f"bourse-supplier:{workers[0].worker_id}"
            nc = await conn.connect(name)
            try:
                options["jetstream"] = await jetstream_mode(nc, "supplier run", off=no_jetstream)
                await _serve(nc, workers, store, subjects, state_dir, options, metrics_at)
            finally:
                await shutdown(nc)
        finally:
            store.close()  # flushed and closed whatever stopped the supplier
            owner.release()

    options = {
        "max_offers": max_offers,
        "bid_shards": bid_shards,
        "max_bid_backlog": max_bid_backlog,
        "signer": signer,
        "quote_sample": quote_sample,
        "reclaim_after_s": reclaim_after_s,
        "port_claims": PortClaims(),
        "advertise_host": advertise_host,
    }
    run(main)


async def _serve(
    nc: NATS,
    workers: list[WorkerConfig],
    store: Store,
    subjects: Subjects,
    data_dir: Path,
    options: dict[str, Any],
    metrics_at: tuple[str, int] | None = None,
) -> None:
    """The host (and its metrics endpoint) in a task group until cancelled (SIGINT/SIGTERM)."""
    metrics = SupplierMetrics() if metrics_at is not None else None
    if metrics is not None:
        metrics.watch_connection(stats_of(nc))
    try:
        host = SupplierHost(nc, workers, store, subjects, **options, metrics=metrics)
    except PortError as exc:
        fail(str(exc))
    refused: Exception | None = None
    async with anyio.create_task_group() as tasks:
        serving = ""
        try:
            if metrics is not None and metrics_at is not None:
                serving = f"; metrics on {(await start_endpoint(tasks, metrics, metrics_at)).url}"
            await tasks.start(host.run)
        except (WorkerIdInUse, MetricsAddrError) as exc:
            refused = exc
            tasks.cancel_scope.cancel()
        else:
            settle_heap()
            typer.echo(
                f"supplier ready: {len(workers)} worker(s), data in {data_dir}"
                f"{degraded(host.jetstream)}{serving}"
            )
    if refused is not None:
        fail(str(refused))


def _offer_signer(creds: str | None) -> OfferSigner | None:
    """Offers are signed with the key of the --creds file (an exchange started with --trust
    takes only signed offers); without credentials they go unsigned."""
    if not creds:
        return None
    try:
        return OfferSigner(signing_seed(creds))
    except (AuthError, TrustError) as exc:
        return fail(str(exc))


def _single_worker(
    worker_id: str | None,
    region: str | None,
    cpus: int | None,
    memory_mb: int,
    disk_mb: int,
    gpus: int,
    label: list[str] | None,
    image: list[str] | None,
    preset: str,
    image_weight: float,
    spread_ms: float,
    draining: bool,
    ports: str = "",
    driver: str = "process",
) -> WorkerConfig:
    if not worker_id or not region:
        fail("--worker-id and --region are required (or use --fleet FILE)")
    if cpus is None or memory_mb < 1:
        fail("--cpus and --memory-mb are required: --cpus more than 0, --memory-mb at least 1")
        raise AssertionError("unreachable")
    raw = {
        "worker_id": worker_id,
        "region": region,
        "capacity": {**cpu_fields(cpus), "memory_mb": memory_mb, "disk_mb": disk_mb, "gpus": gpus},
        "labels": parse_labels(label),
        "images": image or [],
        "pricing": {"preset": preset, "image_weight": image_weight, "spread_ms": spread_ms},
        "draining": draining,
        "ports": ports,
        "driver": driver,
    }
    try:
        return msgspec.convert(raw, WorkerConfig, strict=True)
    except msgspec.ValidationError as exc:
        fail(f"invalid worker: {in_words(validation_detail(exc))}")
    raise AssertionError("unreachable")


def main() -> None:
    cli_main(app)


def _unset_from(w: WorkerConfig, flags: dict[str, int | bool | str | None]) -> WorkerConfig:
    """``w`` with each of its settings it leaves unset taken from the flag of that name
    (given: not None)."""
    unset = {k: v for k, v in flags.items() if v is not None and getattr(w, k) is None}
    return msgspec.structs.replace(w, **unset) if unset else w
