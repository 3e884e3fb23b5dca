"""``exchange serve``: run one stateless exchange instance (queue group ``exchange``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import anyio
import typer

from bourse.auction.admission import DEFAULT_TARGET_MS
from bourse.auction.core import AuctionConfig
from bourse.auction.room import DEFAULT_MAX_BYTES, DEFAULT_WINDOW_S, ClaimLimits
from bourse.images.bounds import DEFAULT_MAX_IMAGE_MB, MAX_RATIO, Bounds
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
)
from bourse.runtime.connection import Connection
from bourse.runtime.endpoint import MetricsAddrError, parse_addr, start_endpoint
from bourse.runtime.metrics import ExchangeMetrics
from bourse.runtime.supervise import run, settle_heap
from bourse.wire.signing import TrustError, TrustStore
from bourse.wire.subjects import DEFAULT_PREFIX, Subjects, is_valid_id
from exchange.service import ExchangeService

app = typer.Typer(
    help="Bourse exchange: a stateless broker running immediate-or-cancel auctions.",
    rich_markup_mode=None,  # plain help: rich would nearly double a help's time
)


@app.callback()
def _callback(version: VersionOpt = False) -> None:
    """Bourse exchange."""


@app.command()
def serve(
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    no_jetstream: NoJetStreamOpt = False,
    regions: Annotated[
        str, typer.Option(help="Comma-separated regions to serve; others get an Error.")
    ] = "",
    quiet_ms: Annotated[
        float, typer.Option(min=1, help="Stop collecting offers after this much silence.")
    ] = 100.0,
    commit_grace_ms: Annotated[
        float, typer.Option(min=0, help="How long past the deadline a started commit may take.")
    ] = 100.0,
    max_inflight: Annotated[
        int, typer.Option(min=1, help="Auctions run at once, at most (the adaptive cap's top).")
    ] = 10_000,
    target_auction_ms: Annotated[
        float,
        typer.Option(
            min=0,
            help="Admission: adapt how many auctions run at once so they end within this "
            "(AIMD); past it orders are refused at once. 0: a fixed cap of --max-inflight.",
        ),
    ] = DEFAULT_TARGET_MS,
    max_order_backlog: Annotated[
        int, typer.Option(min=1, help="Orders queued beyond this many are refused at once.")
    ] = 256,
    bid_shards: Annotated[
        int, typer.Option(min=0, help="Sampled bidding: shards per region (0: broadcast).")
    ] = 0,
    bid_sample: Annotated[int, typer.Option(min=1, help="Shards a bid goes to first.")] = 2,
    claims: Annotated[
        bool,
        typer.Option(
            help="Order claims in JetStream KV: one machine per order id across every "
            "exchange and direct buyer (docs/protocol.md §5.3c); on where the server has "
            "JetStream. --no-claims: per-process deduplication only.",
        ),
    ] = True,
    claims_window_s: Annotated[
        float,
        typer.Option(
            min=1,
            help="Age limit of the order claims' bucket, if this exchange creates it: how "
            "long a retry is answered from its claim (docs/protocol.md §5.3c).",
        ),
    ] = DEFAULT_WINDOW_S,
    claims_max_bytes: Annotated[
        int,
        typer.Option(
            min=1,
            help="Byte limit of the order claims' bucket, if this exchange creates it: "
            "800 bytes x orders a second x --claims-window-s, and 5% more "
            "(docs/operations.md: sizing the order claims).",
        ),
    ] = DEFAULT_MAX_BYTES,
    prompt_offers: Annotated[
        bool,
        typer.Option(
            help="Bids ask suppliers to answer at once and the auction ranks the offers "
            "(docs/protocol.md §4.4.3). --no-prompt-offers: suppliers delay their offers.",
        ),
    ] = True,
    batches: Annotated[
        bool,
        typer.Option(
            help="Send the bids and releases of one region queued in the same instant as "
            "one Batch message where every supplier process takes it (§4.4.4).",
        ),
    ] = True,
    name: Annotated[str, typer.Option(help="Connection name shown by the NATS server.")] = "",
    trust: Annotated[
        Path | None,
        typer.Option(
            help="Trust file (worker id -> public nkey, from `bourse auth init`): take only "
            "offers signed by their worker's key."
        ),
    ] = None,
    max_image_mb: Annotated[
        int,
        typer.Option(
            min=1,
            metavar="MIB",
            help="Refuse a tenant's push whose layers unpack to more than this many MiB in "
            f"all, or a layer past {MAX_RATIO} times its compressed size (each layer the "
            "store lacks is read once before it is stored).",
        ),
    ] = DEFAULT_MAX_IMAGE_MB,
    metrics_addr: MetricsAddrOpt = "",
    log_level: LogLevelOpt = "info",
    log_json: LogJsonOpt = False,
) -> None:
    """Serve orders and machine requests until SIGINT/SIGTERM, then drain."""
    logs.configure(log_level, log_json)
    conn = Connection.from_options(nats, creds, tls_ca, tls_cert, tls_key)
    region_set = {r.strip() for r in regions.split(",") if r.strip()}
    bad = [r for r in region_set if not is_valid_id(r)]
    if bad:
        fail(f"invalid region id(s) {bad}: use [a-z0-9][a-z0-9-]{{0,62}}")
    try:
        subjects = Subjects(prefix)
    except ValueError as exc:
        fail(str(exc))
    try:
        trust_store = TrustStore.load(trust) if trust is not None else None
        metrics_at = parse_addr(metrics_addr)
    except (TrustError, MetricsAddrError) as exc:
        fail(str(exc))
    config = AuctionConfig(
        quiet_ms=quiet_ms,
        commit_grace_ms=commit_grace_ms,
        bid_shards=bid_shards,
        bid_sample=bid_sample,
        prompt_offers=prompt_offers,
        batch_bids=batches,
    )

    async def main() -> None:
        nc = await conn.connect(name or "bourse-exchange")
        try:
            jetstream = await jetstream_mode(nc, "exchange serve", off=no_jetstream)
            metrics = ExchangeMetrics() if metrics_at is not None else None
            if metrics is not None:
                metrics.watch_connection(stats_of(nc))
            svc = ExchangeService(
                nc,
                subjects,
                auction=config,
                regions=region_set,
                max_inflight=max_inflight,
                max_order_backlog=max_order_backlog,
                trust=trust_store,
                target_auction_ms=target_auction_ms,
                metrics=metrics,
                image_bounds=Bounds.of_mb(max_image_mb),
                claims=claims,
                claim_limits=ClaimLimits(claims_window_s, claims_max_bytes),
                jetstream=jetstream,
            )
            async with anyio.create_task_group() as tasks:
                serving = ""
                if metrics is not None and metrics_at is not None:
                    try:
                        endpoint = await start_endpoint(tasks, metrics, metrics_at)
                    except MetricsAddrError as exc:
                        fail(str(exc))
                    serving = f"; metrics on {endpoint.url}"
                await tasks.start(svc.run)
                settle_heap()
                where = nc.connected_url.netloc if nc.connected_url else conn.urls
                typer.echo(f"exchange ready on {where}{degraded(jetstream)}{serving}")
        finally:
            await shutdown(nc)

    run(main)


def main() -> None:
    cli_main(app)
