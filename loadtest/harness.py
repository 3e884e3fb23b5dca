"""``bourse loadtest``: the whole run, from an embedded NATS to the report files."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bourse.auction.admission import adaptive_limit
from bourse.auction.core import AuctionConfig
from bourse.client import BourseClient
from bourse.nats.connection import connect, shutdown
from bourse.nats.embedded import EmbeddedNats, read_connz, read_varz
from bourse.runtime.launcher import Program, stop_all
from bourse.runtime.supervise import settle_heap
from bourse.wire.subjects import Subjects
from loadtest import report as reports
from loadtest.oracle import run_oracle
from loadtest.runner import (
    Generator,
    Measured,
    Sampler,
    check_invariants,
    fresh_run_dir,
    messages_between,
    nats_ceiling,
    start_fleet,
)
from loadtest.tap import tapped
from loadtest.workload import Profile, trace


async def run_loadtest(
    profile: Profile,
    out: Path,
    urls: list[str] | None = None,
    *,
    ceiling: bool = True,
    ceiling_s: float = 3.0,
    oracle: bool = True,
    console: Console | None = None,
    supplier_urls: list[str] | None = None,
    monitor_url: str | None = None,
    tap: bool = False,
) -> dict[str, Any]:
    """Run one load test; writes report.json (and PNG plots) to ``out``; returns the report.
    ``supplier_urls``: the suppliers connect there (e.g. another cluster of a supercluster),
    the generator and the exchanges to ``urls``. ``monitor_url``: the monitoring endpoint
    of the server at ``urls`` (the embedded server's own otherwise): its message counters
    give the messages per placement. ``tap``: count every message of the load window by
    kind too (loadtest/tap.py: a process of its own, which perturbs CPU and latency)."""
    fresh_run_dir(out)  # every run starts from an empty fleet
    say = console.print if console else (lambda *_: None)
    server = None
    if supplier_urls and not urls:
        raise ValueError(
            "supplier URLs need the generator's URLs too: the embedded server would not reach them"
        )
    if not urls:
        server = EmbeddedNats(
            workdir=out / "nats", tie_to_parent=True, monitor=True, jetstream=profile.jetstream
        ).start()
        urls = [server.url]
        monitor_url = server.monitor_url
    subjects = Subjects(f"lt{uuid.uuid4().hex[:8]}")  # a run never sees another's traffic
    programs: list[Program] = []
    m = Measured()
    try:
        refs = None
        if ceiling:
            say("measuring the NATS request-reply ceiling and round trip...")
            refs = await nats_ceiling(
                urls, out, seconds=ceiling_s, pace_per_s=profile.rate, paced_s=ceiling_s
            )
        say(f"starting {profile.workers} workers in {profile.supplier_processes} process(es)...")
        programs = await start_fleet(profile, urls, subjects, out, supplier_urls)
        watched = [(p.name, p.proc.pid) for p in programs]
        watched.append(("loadgen", os.getpid()))  # this process: generator and client
        if server is not None and server.proc is not None:
            watched.append(("nats-server", server.proc.pid))
        sampler = Sampler(watched)
        m.processes = sampler.stats
        orders = trace(profile)
        nc = await connect(urls, name="bourse-loadgen", service=False)
        market = BourseClient(nc, subjects)
        auction = AuctionConfig(
            quiet_ms=profile.exchange_quiet_ms,  # direct: the generator is the exchange
            bid_shards=profile.bid_shards,
            bid_sample=profile.bid_sample,
            prompt_offers=profile.prompt_offers,
            batch_bids=profile.batches,
        )
        limit = adaptive_limit(profile.exchange_max_inflight, profile.exchange_target_ms)
        direct = BourseClient(
            nc, subjects, direct=True, auction=auction, admission=limit, claims=profile.claims
        )
        try:
            settle_heap()  # the trace and the fleet's bookkeeping: no GC walks them mid-run
            tapping = (urls[0], subjects, out) if tap else None
            await _send(profile, orders, market, direct, m, sampler, console, monitor_url, tapping)
            await check_invariants(direct, profile, orders, m)
        finally:
            await shutdown(nc)
    finally:
        await stop_all(programs)
        if server is not None:
            server.stop()
    oracle_result = None
    if oracle:
        say("replaying the trace through the oracle...")
        oracle_result = run_oracle(profile, orders)
    rep = reports.build(profile, m, refs, oracle_result)
    (out / "report.json").write_text(json.dumps(rep, indent=2))
    rep["plots"] = [str(p) for p in reports.plots(m, rep, out)]
    return rep


async def _send(
    profile: Profile,
    orders: list[Any],
    market: BourseClient,
    direct: BourseClient,
    m: Measured,
    sampler: Sampler,
    console: Console | None,
    monitor_url: str | None,
    tapping: tuple[str, Subjects, Path] | None = None,
) -> None:
    progress = Progress(
        TextColumn("orders"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=console is None,
        transient=True,
    )
    with progress:
        bar = progress.add_task("orders", total=len(orders))
        gen = Generator(profile, market, direct, m, lambda n: progress.advance(bar, n))

        async def sample() -> None:
            while True:
                sampler.sample()
                await anyio.sleep(0.5)

        async with contextlib.AsyncExitStack() as stack:
            stop_tap = await stack.enter_async_context(tapped(*tapping)) if tapping else None
            before = await _varz(monitor_url)
            conns_before = await _connz(monitor_url)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(sample)
                await gen.run(orders)
                tasks.cancel_scope.cancel()
            sampler.sample()  # CPU over the load window only (not the checks after it)
            after = await _varz(monitor_url)
            conns_after = await _connz(monitor_url)
            if stop_tap is not None:
                m.messages_by_kind = await stop_tap()
        if before is not None and after is not None:  # messages over the same window
            m.nats_in_msgs = after["in_msgs"] - before["in_msgs"]
            m.nats_out_msgs = after["out_msgs"] - before["out_msgs"]
        if conns_before is not None and conns_after is not None:
            m.nats_msgs_by_program = messages_between(conns_before, conns_after)


async def _connz(monitor_url: str | None) -> list[dict[str, Any]] | None:
    """The server's open connections (``/connz``), read off the event loop."""
    if monitor_url is None:
        return None
    return await anyio.to_thread.run_sync(read_connz, monitor_url)


async def _varz(monitor_url: str | None) -> dict[str, Any] | None:
    """The server's /varz, read off the event loop; None without a monitoring endpoint."""
    if monitor_url is None:
        return None
    return await anyio.to_thread.run_sync(read_varz, monitor_url)
