"""One load run: start the processes, send the trace, measure, check the invariants.

Latency is measured from when each order was DUE (open loop), not from when it was sent, so
a generator that falls behind shows up in the figures instead of hiding (no coordinated
omission).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import psutil
from hdrh.histogram import HdrHistogram
from nats.aio.client import Client as NATS

from bourse.client import BourseClient, ClientError
from bourse.nats.connection import connect, shutdown
from bourse.nats.jetstream import NO_JETSTREAM_FLAG
from bourse.runtime.launcher import Program, start_program, stop_all
from bourse.runtime.tasks import TaskSet
from bourse.wire.messages import Machine, Placed, Unfilled, WorkerStatus
from bourse.wire.resources import RESOURCES, add, format_value, vec
from bourse.wire.subjects import Subjects, shard_of
from loadtest.workload import Profile, TraceOrder, fleet

HIST_MAX_US = 120_000_000


def new_hist() -> HdrHistogram:
    return HdrHistogram(1, HIST_MAX_US, 3)


@dataclass
class ProcessStats:
    name: str
    pid: int
    cpu_s: float = 0.0
    max_rss_mb: float = 0.0


@dataclass
class Measured:
    """What the generator saw, plus what the suppliers' own state says at the end."""

    started_at: float = 0.0
    seconds: float = 0.0
    sent: int = 0
    placed: int = 0
    image_hits: int = 0
    unfilled: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    commits_rejected_unfilled: int = 0
    latency_all: HdrHistogram = field(default_factory=new_hist)
    latency_placed: HdrHistogram = field(default_factory=new_hist)
    # The same placements timed from the moment the request went out, as the NATS round
    # trip reference is (latency_placed counts from the order's due time: the generator's
    # own lateness, its timer's sub-millisecond slack or a backlog, included).
    latency_placed_from_send: HdrHistogram = field(default_factory=new_hist)
    auction_placed: HdrHistogram = field(default_factory=new_hist)  # Placed.elapsed_ms
    per_second: Counter[int] = field(default_factory=Counter)  # placements completed per s
    lag_max_ms: float = 0.0
    statuses: list[WorkerStatus] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    processes: list[ProcessStats] = field(default_factory=list)
    machines_checked: int = 0
    # nats-server's own counters over the load window (/varz), when its monitoring is on
    nats_in_msgs: int | None = None  # published into the server by its clients
    nats_out_msgs: int | None = None  # delivered by the server to subscribers
    # the same per program (/connz, by connection name): (published, delivered)
    nats_msgs_by_program: dict[str, tuple[int, int]] | None = None
    # --tap: every message of the load window by kind (loadtest/tap.py)
    messages_by_kind: dict[str, int] | None = None


# A run's connections by the name they give the server (bourse/nats/connection.py), as the
# program kinds of the CPU figures; JetStream's own answers come from no client connection.
CONNECTION_PROGRAMS = (
    ("bourse-supplier", "supplier"),
    ("bourse-exchange", "exchange"),
    ("bourse-loadgen", "loadgen"),
)


def program_of(connection_name: str) -> str:
    """The program kind a connection belongs to ("other": a tap, the ceiling probe...)."""
    for prefix, program in CONNECTION_PROGRAMS:
        if connection_name.startswith(prefix):
            return program
    return "other"


def messages_between(
    before: list[dict[str, Any]], after: list[dict[str, Any]]
) -> dict[str, tuple[int, int]]:
    """Messages published and delivered per program between two ``/connz`` readings: each
    connection's counters, less what it had at ``before`` (a connection opened since
    counts from zero; one closed since is not in ``after`` and not counted)."""
    had = {c["cid"]: (c.get("in_msgs", 0), c.get("out_msgs", 0)) for c in before}
    out: dict[str, tuple[int, int]] = {}
    for c in after:
        was_in, was_out = had.get(c["cid"], (0, 0))
        program = program_of(c.get("name") or "")
        pub, got = out.get(program, (0, 0))
        out[program] = (pub + c.get("in_msgs", 0) - was_in, got + c.get("out_msgs", 0) - was_out)
    return dict(sorted(out.items()))


class Sampler:
    """CPU time and peak RSS of each process of the run (psutil)."""

    def __init__(self, programs: list[tuple[str, int]]) -> None:
        self.stats = [ProcessStats(name, pid) for name, pid in programs]
        self._procs = {s.pid: psutil.Process(s.pid) for s in self.stats}
        self._cpu0 = {pid: self._cpu(p) for pid, p in self._procs.items()}

    @staticmethod
    def _cpu(p: psutil.Process) -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    def sample(self) -> None:
        for s in self.stats:
            p = self._procs[s.pid]
            try:
                s.max_rss_mb = max(s.max_rss_mb, p.memory_info().rss / 2**20)
            except psutil.Error:
                continue
            s.cpu_s = self._cpu(p) - self._cpu0[s.pid]


# What a run writes under its out directory (the fleet's files, state, logs and
# nats-server's store): an earlier run's must not mix with this one's.
RUN_STATE_DIRS = ("config", "data", "logs", "nats")


def fresh_run_dir(out: Path) -> None:
    """Make ``out`` ready for a run: created if missing, and an earlier run's state
    removed (its suppliers' SQLite files would be recovered, and audited, as this run's:
    the same order ids twice look like two machines per order). Reports and anything
    else in ``out`` stay."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in RUN_STATE_DIRS:
        shutil.rmtree(out / stale, ignore_errors=True)


def supplier_args(
    profile: Profile, fleet_file: Path, data_dir: Path, common: list[str]
) -> list[str]:
    """The command line of one supplier process of the run (one home: tested)."""
    return [
        "run", "--fleet", str(fleet_file), "--data-dir", str(data_dir), *common,
        "--bid-shards", str(profile.bid_shards), "--max-offers", str(profile.max_offers),
        "--quote-sample", str(profile.quote_sample),
        "--reclaim-after-s", str(profile.reclaim_after_s),
    ]  # fmt: skip


def exchange_args(profile: Profile, common: list[str]) -> list[str]:
    """The command line of one exchange process of the run."""
    return [
        "serve", *common, "--bid-shards", str(profile.bid_shards),
        "--bid-sample", str(profile.bid_sample),
        "--max-inflight", str(profile.exchange_max_inflight),
        "--target-auction-ms", str(profile.exchange_target_ms),
        "--quiet-ms", str(profile.exchange_quiet_ms),
        "--claims" if profile.claims else "--no-claims",
        "--prompt-offers" if profile.prompt_offers else "--no-prompt-offers",
        "--batches" if profile.batches else "--no-batches",
    ]  # fmt: skip


@dataclass
class Spec:
    """How to start (and restart) one program of a run."""

    name: str
    module: str
    args: list[str]
    log_path: Path
    ready: str
    data_dir: Path | None = None  # a supplier's state
    env: dict[str, str] = field(default_factory=dict)

    async def start(self) -> Program:
        return await start_program(
            self.module, *self.args, log_path=self.log_path, ready=self.ready, env=self.env
        )


def split_fleet(
    workers: list[dict[str, Any]], processes: int, bid_shards: int
) -> list[list[dict[str, Any]]]:
    """The workers of each supplier process. Under sampled bidding a shard's workers share
    a process, so a bid to d shards reaches at most d processes instead of every one: whole
    shards, the biggest first to the process with the fewest workers. Otherwise, or when
    that would leave a process without workers (a small fleet with empty shards), the
    workers are dealt round-robin."""
    round_robin = [workers[i::processes] for i in range(processes)]
    if not bid_shards or bid_shards < processes:
        return round_robin
    by_shard: dict[int, list[dict[str, Any]]] = {}
    for w in workers:
        by_shard.setdefault(shard_of(str(w["worker_id"]), bid_shards), []).append(w)
    shares: list[list[dict[str, Any]]] = [[] for _ in range(processes)]
    for shard in sorted(by_shard, key=lambda k: (-len(by_shard[k]), k)):
        min(shares, key=len).extend(by_shard[shard])
    return shares if all(shares) else round_robin


def fleet_specs(
    profile: Profile,
    urls: list[str],
    subjects: Subjects,
    root: Path,
    supplier_extra: list[str] | None = None,
    supplier_urls: list[str] | None = None,
    log_level: str = "warning",
) -> list[Spec]:
    """Supplier processes (the workers split evenly, fleet files written under ``root``),
    then the exchange instances. The suppliers connect to ``supplier_urls`` when given
    (another cluster of a supercluster), the exchanges to ``urls``."""
    workers = fleet(profile)
    tail = ["--prefix", subjects.prefix, "--log-level", log_level]
    tail += [] if profile.jetstream else [NO_JETSTREAM_FLAG]  # a server without it
    supplier_common = ["--nats", ",".join(supplier_urls or urls), *tail]
    common = ["--nats", ",".join(urls), *tail]
    specs: list[Spec] = []
    n = max(1, profile.supplier_processes)
    for i, share in enumerate(split_fleet(workers, n, profile.bid_shards)):
        path = root / "config" / f"fleet-{i}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"worker": share}))
        data_dir = root / "data" / f"s{i}"
        args = supplier_args(profile, path, data_dir, supplier_common) + list(supplier_extra or [])
        log_path = root / "logs" / f"supplier-{i}.log"
        specs.append(Spec(f"supplier-{i}", "supplier", args, log_path, "supplier ready", data_dir))
    for i in range(0 if profile.direct else profile.exchanges):
        args = exchange_args(profile, common)
        log_path = root / "logs" / f"exchange-{i}.log"
        specs.append(Spec(f"exchange-{i}", "exchange", args, log_path, "exchange ready"))
    return specs


async def start_fleet(
    profile: Profile,
    urls: list[str],
    subjects: Subjects,
    root: Path,
    supplier_urls: list[str] | None = None,
) -> list[Program]:
    """Start every program of :func:`fleet_specs`; all or none."""
    programs: list[Program] = []
    try:
        for spec in fleet_specs(profile, urls, subjects, root, supplier_urls=supplier_urls):
            programs.append(await spec.start())
    except BaseException:
        await stop_all(programs)
        raise
    return programs


class Generator:
    """Sends the trace (open or closed loop) and records every outcome."""

    def __init__(
        self,
        profile: Profile,
        market: BourseClient,
        direct: BourseClient,
        measured: Measured,
        on_progress: Callable[[int], None],
    ) -> None:
        self.p = profile
        self.market = market
        self.direct = direct
        self.placer = direct if profile.direct else market  # who runs the auctions
        self.m = measured
        self.on_progress = on_progress
        # A task per order sent and per machine placed, on a TaskSet: an anyio task each
        # was a tenth of the generator's CPU (bourse/runtime/tasks.py).
        self._sends = TaskSet("loadgen.sends")
        self._lifecycles = TaskSet("loadgen.lifecycles")  # started machines

    async def run(self, orders: list[TraceOrder]) -> None:
        """Send every order (each in a task of its own) and wait for the answers; the
        lifecycles of the machines placed (start, destroy after their life) run in tasks of
        their own, cancelled once the last answer is in (or the run is)."""
        try:
            t0 = self.m.started_at = time.monotonic()
            if self.p.mode == "open":
                for t in orders:
                    due = t0 + t.due_s
                    wait = due - time.monotonic()
                    if wait > 0:
                        await anyio.sleep(wait)
                    else:
                        self.m.lag_max_ms = max(self.m.lag_max_ms, -wait * 1000)
                    self._sends.spawn(self._one(t, due))
            else:
                queue = iter(orders)
                for _ in range(self.p.concurrency):
                    self._sends.spawn(self._closed(queue))
            await self._sends.wait()
            self.m.seconds = time.monotonic() - t0
            if self._sends.failed:  # a send raised past ClientError: a bug, not a result
                raise RuntimeError(f"{self._sends.failed} order sends failed (see the log)")
        finally:
            await self._sends.finish(0)  # none left unless the run was cancelled
            await self._lifecycles.finish(0)

    async def _closed(self, queue: Any) -> None:
        for t in queue:
            await self._one(t, time.monotonic())

    async def _one(self, t: TraceOrder, due: float) -> None:
        m = self.m
        m.sent += 1
        sent = time.monotonic()
        try:
            r = await self.placer.place(t.order)
        except ClientError as exc:
            m.errors[exc.code] += 1  # "overloaded": refused past admission, nothing bid
            self.on_progress(1)
            return
        done = time.monotonic()
        # from the due time (a late send's wait counts: no coordinated omission), or from
        # the send when the timer woke a little early (uvloop's millisecond timers)
        us = max(1, int((done - min(due, sent)) * 1e6))
        m.latency_all.record_value(min(us, HIST_MAX_US))
        if isinstance(r, Placed):
            m.placed += 1
            m.image_hits += r.image_cached
            m.latency_placed.record_value(min(us, HIST_MAX_US))
            m.latency_placed_from_send.record_value(
                min(max(1, int((done - sent) * 1e6)), HIST_MAX_US)
            )
            m.auction_placed.record_value(max(1, min(int(r.elapsed_ms * 1000), HIST_MAX_US)))
            m.per_second[int(done - m.started_at)] += 1
            self._lifecycles.spawn(self._lifecycle(r, t.lifetime_s))
        else:
            assert isinstance(r, Unfilled)
            m.unfilled[r.reason] += 1
            if r.reason == "all_commits_rejected":
                m.commits_rejected_unfilled += 1
        self.on_progress(1)

    async def _lifecycle(self, r: Placed, lifetime_s: float) -> None:
        """Start the machine (its image gets pulled and cached), destroy it after its life."""
        try:
            if self.p.start_machines:
                await self.direct.machine("start", r.machine_id)
            await anyio.sleep(lifetime_s)
            await self.direct.machine("destroy", r.machine_id)
        except ClientError as exc:
            self.m.errors[f"lifecycle:{exc.code}"] += 1


async def check_invariants(
    client: BourseClient, profile: Profile, orders: list[TraceOrder], m: Measured
) -> None:
    """I1, I3, I5 from the suppliers' own state (status and machine lists)."""
    m.statuses = [s for r in profile.region_names() for s in await client.status(r, within_s=5)]
    if len(m.statuses) != profile.workers:
        m.violations.append(f"only {len(m.statuses)} of {profile.workers} workers answered")
    for s in m.statuses:  # I1, in millicores for CPU (cpu_millis when a worker sends it)
        used, cap = add(vec(s.committed), vec(s.held)), vec(s.capacity)
        for i, res in enumerate(RESOURCES):
            if used[i] > cap[i]:
                over = f"{format_value(i, used[i])} > {format_value(i, cap[i])}"
                m.violations.append(f"I1 {s.worker_id}: {res} {over}")
    asked = {t.order.order_id: t.order.region for t in orders}
    per_order: Counter[str] = Counter()
    sem = asyncio.Semaphore(32)

    async def listed(worker_id: str) -> list[Machine]:
        async with sem:
            return (await client.machines(worker_id, include_destroyed=True)).machines

    for ms in await asyncio.gather(*(listed(s.worker_id) for s in m.statuses)):
        for mach in ms:
            m.machines_checked += 1
            if not mach.aborted:
                per_order[mach.order_id] += 1
            if asked.get(mach.order_id, mach.region) != mach.region:  # I5
                m.violations.append(f"I5 {mach.machine_id} in {mach.region}, asked elsewhere")
    m.violations.extend(f"I3 order {o} has {n} machines" for o, n in per_order.items() if n > 1)


@dataclass
class Ceiling:
    """The references from raw NATS on the same machine and client library: the closed-loop
    request-reply rate (the throughput ceiling), and one request-reply's latency when sent
    at the run's own pace (the floor under every hop of an auction: an idle process wakes
    up slower than a busy one)."""

    rps: float
    rtt: HdrHistogram = field(default_factory=new_hist)


async def nats_ceiling(
    urls: list[str],
    root: Path,
    seconds: float = 3.0,
    concurrency: int = 64,
    pace_per_s: float = 20.0,
    paced_s: float = 3.0,
) -> Ceiling:
    """Against a trivial responder process: the closed-loop rate, then the latency of
    requests sent one at a time at ``pace_per_s`` (at most 100/s) for ``paced_s``."""
    subject = "bourse-ceiling.echo"
    echo = await start_program(
        "loadtest.echo",
        urls[0],
        subject,
        log_path=root / "logs" / "echo.log",
        ready="echo ready",
    )
    nc: NATS = await connect(urls, name="bourse-ceiling", service=False)
    done = 0
    try:
        end = time.monotonic() + seconds

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < end:
                await nc.request(subject, b"", timeout=5)
                done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        ceiling = Ceiling(done / (time.monotonic() - t0))
        gap = 1.0 / min(max(pace_per_s, 1.0), 100.0)
        for _ in range(max(20, int(paced_s / gap))):
            await asyncio.sleep(gap)
            sent = time.perf_counter()
            await nc.request(subject, b"", timeout=5)
            ceiling.rtt.record_value(max(1, int((time.perf_counter() - sent) * 1e6)))
        return ceiling
    finally:
        await shutdown(nc)
        await stop_all([echo])
