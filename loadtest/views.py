"""The ``view`` scenario: what the view of the market (docs/protocol.md §4.21, bourse/view)
costs and how current it is. Three parts, one embedded nats-server with JetStream:

- **delay**: a real ``supplier run --fleet`` process (sim workers) with ``--machines``
  machines placed (direct auctions), then machine verbs (start, stop) sent to the workers
  open loop for ``--duration-s`` at ``--changes-per-s`` / 2 verbs a second, each verb two
  recorded changes (``starting`` then ``started``, ``stopping`` then ``stopped``). A view
  follows the stream in this process and measures, for every machine row it applies, the
  time from the change the row carries (its ``updated_at_ms``, the worker's clock: the same
  host) to the row committed to its SQLite database;
- **build**: ``--build-machines`` machine rows of ``--build-workers`` workers in ``--regions``
  regions (rows shaped as a supplier publishes them: an app's metadata, an address, a
  check, a digest; published here, straight into the stream) and the stream's size per row,
  before and after every row of one region is published again (one row per subject); then a
  view built from scratch in a process of its own (loadtest/viewbuild.py): seconds, peak RSS;
- **cli**: ``buyer machines list --region <one region> --json`` (one region's machines,
  ``--build-machines`` / ``--regions``), run ``--cli-runs`` times as a user runs it (a new
  process each, bytecode cached, the view warm in its cache directory), wall time each,
  while the workers' heartbeats go on: each run catching the view up first through the
  view's keeper (bourse/view/keeper.py: the first run started it), then each catching up
  by itself (no keeper), then each reading it as it stands (caught up a moment ago:
  bourse/view/stored.py); the keeper is stopped at the end.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
from hdrh.histogram import HdrHistogram
from nats.aio.client import Client as NATS
from rich.table import Table
from ulid import ULID

from bourse.client import BourseClient
from bourse.errors import BourseError
from bourse.nats.connection import connect, shutdown
from bourse.nats.embedded import EmbeddedNats
from bourse.nats.jetstream import EventStream
from bourse.nats.state import HEADER_TTL, state_stream_name
from bourse.runtime.launcher import Program, start_program, stop_all
from bourse.view.db import ViewDB
from bourse.view.keeper import ENV_KEEPER_S
from bourse.view.rows import MachineRowOp, Op
from bourse.view.stored import ENV_FRESH_MS
from bourse.view.view import View
from bourse.wire.codec import encode
from bourse.wire.messages import (
    Amount,
    Check,
    Health,
    Heartbeat,
    Machine,
    MachineRequest,
    Placed,
    PlaceOrder,
    Resources,
    WorkerRow,
    now_ms,
)
from bourse.wire.subjects import Subjects
from loadtest.runner import fresh_run_dir
from ops.jetstream import set_up

Say = Callable[[str], None]
REGION = "lat"
PUBLISH_BATCH = 2000  # rows whose acks are awaited together while the harness publishes


class ViewRunError(BourseError):
    pass


@dataclass(frozen=True, slots=True)
class ViewProfile:
    workers: int = 100  # the delay part's sim workers, one supplier process
    machines: int = 2000  # placed before the changes
    changes_per_s: float = 1000.0
    duration_s: float = 10.0
    build_machines: int = 100_000
    build_workers: int = 1000
    regions: int = 10
    cli_runs: int = 10


def profile_of(given: dict[str, Any]) -> ViewProfile:
    p = ViewProfile(**given)
    if min(p.workers, p.machines, p.build_machines, p.build_workers, p.regions) < 1:
        raise ValueError("workers, machines, build sizes and regions must be at least 1")
    return p


# -- delay: a change to a view's SQLite -----------------------------------------------------------
def fleet_file(path: Path, workers: int) -> Path:
    rows = [
        {"worker_id": f"lat-{i}", "region": REGION, "driver": "sim",
         "capacity": {"cpus": 4096, "memory_mb": 64 * 1024 * 1024}}
        for i in range(workers)
    ]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode({"worker": rows}))
    return path


async def place_all(client: BourseClient, n: int) -> list[tuple[str, str]]:
    """``n`` machines placed (64 orders at a time): (worker id, machine id) each."""
    placed: list[tuple[str, str]] = []
    limit = anyio.Semaphore(64)

    async def one() -> None:
        order = PlaceOrder(
            region=REGION, resources=Resources(cpus=1, memory_mb=64), image="web",
            metadata={"app": "lat"}, deadline_ms=10_000,
        )  # fmt: skip
        for attempt in range(3):  # a slow machine may leave one unfilled: its id again
            async with limit:
                got = await client.place(msgspec.structs.replace(order, retry=attempt > 0))
            if isinstance(got, Placed):
                placed.append((got.worker_id, got.machine_id))
                return

    async with anyio.create_task_group() as tasks:
        for _ in range(n):
            tasks.start_soon(one)
    if len(placed) < n:
        raise ViewRunError(f"only {len(placed)} of {n} machines were placed")
    return placed


async def drive(
    nc: NATS, subjects: Subjects, machines: list[tuple[str, str]], verbs_per_s: float, s: float
) -> dict[str, float]:
    """Start and stop the machines in turn, open loop at ``verbs_per_s`` for ``s``."""
    started: set[str] = set()
    sent = failed = 0
    began = time.perf_counter()

    async def verb(wid: str, mid: str) -> None:
        nonlocal failed
        name = "stop" if mid in started else "start"
        (started.discard if name == "stop" else started.add)(mid)
        try:
            await nc.request(
                subjects.worker_machine(wid, name), encode(MachineRequest(machine_id=mid)), 5.0
            )
        except Exception:
            failed += 1

    async with anyio.create_task_group() as tasks:
        while (elapsed := time.perf_counter() - began) < s:
            due = int(elapsed * verbs_per_s) - sent
            for _ in range(due):
                wid, mid = machines[sent % len(machines)]
                tasks.start_soon(verb, wid, mid)
                sent += 1
            await anyio.sleep(0.001)  # the generator's pace
    took = round(time.perf_counter() - began, 3)
    return {"verbs": sent, "failed": failed, "seconds": took}


async def delay(p: ViewProfile, url: str, out: Path, say: Say) -> dict[str, Any]:
    subjects = Subjects(f"vl{os.urandom(4).hex()}")
    programs: list[Program] = []
    nc = await connect([url], name="bourse-view-driver", service=False)
    vc = await connect([url], name="bourse-view", service=False)
    try:
        await set_up(nc, subjects, EventStream.of(subjects), replicas=1)
        args = ("--nats", url, "--prefix", subjects.prefix, "--metrics-addr", "off")
        programs.append(
            await start_program(
                "supplier", "run", "--fleet", str(fleet_file(out / "fleet.json", p.workers)),
                "--data-dir", str(out / "data"), "--machines-stop-with-supplier", *args,
                log_path=out / "logs" / "supplier.log", ready="supplier ready",
            )
        )  # fmt: skip
        client = BourseClient(nc, subjects, direct=True)
        say(f"delay: {p.machines} machines placed on {p.workers} workers...")
        machines = await place_all(client, p.machines)
        view = View(vc, subjects, ViewDB(out / "delay-view.sqlite"))
        await view.start()
        await view.catch_up()
        # the change to the view; of which, to the stream (stored: the server's clock)
        hist, stored = HdrHistogram(1, 600_000, 3), HdrHistogram(1, 600_000, 3)
        rows = 0
        since = now_ms()

        def observe(ops: list[tuple[Op, int, int]]) -> None:
            nonlocal rows
            now = time.time() * 1000
            for op, _, at in ops:
                if isinstance(op, MachineRowOp) and op.machine.updated_at_ms >= since:
                    rows += 1
                    hist.record_value(max(1, round(now - op.machine.updated_at_ms)))
                    stored.record_value(max(1, at - op.machine.updated_at_ms))

        view.observe = observe
        say(f"delay: {p.changes_per_s:g} changes/s for {p.duration_s:g} s...")
        async with anyio.create_task_group() as tasks:

            async def follow() -> None:
                async for _ in view.follow():
                    pass

            tasks.start_soon(follow)
            driven = await drive(nc, subjects, machines, p.changes_per_s / 2, p.duration_s)
            seen = -1
            while seen != rows:  # until no row came for a second: the last ones are in
                seen = rows
                await anyio.sleep(1.0)  # the pace of looking
            tasks.cancel_scope.cancel()
        await view.close()
        await client.close()
        return {
            "workers": p.workers, "machines": p.machines, "changes_per_s": p.changes_per_s,
            "duration_s": p.duration_s, **driven, "changes": 2 * driven["verbs"],
            "rows_applied": rows,
            "delay_ms": quantiles(hist), "to_stream_ms": quantiles(stored),
        }  # fmt: skip
    finally:
        await stop_all(programs)
        await shutdown(vc)
        await shutdown(nc)


def quantiles(h: HdrHistogram) -> dict[str, int]:
    qs = (("p50", 50), ("p90", 90), ("p99", 99), ("p99.9", 99.9))
    return {q: h.get_value_at_percentile(v) for q, v in qs} | {"max": h.get_max_value()}


# -- build and size ------------------------------------------------------------------------------
def synthetic(i: int, wid: str, region: str, at: int) -> Machine:
    """A machine row as a supplier publishes one of an app's: metadata, an address, a
    check passing, an env key, a digest."""
    meta = {
        "app": f"app-{i % 500}", "role": "primary" if i % 4 else "spare", "slot": str(i % 4),
        "gen": "3", "fields": "checks=4f0e1a2b3c,env=9a8b7c6d5e,image=0a1b2c3d4e,ports=5f6e7d8c9b",
    }  # fmt: skip
    return Machine(
        machine_id=f"{wid}~{ULID()}", order_id=f"app-{i % 500}.g3.{region}.{i}",
        worker_id=wid, region=region, state="started" if i % 4 else "reserved",
        resources=Resources(cpus=1, cpu_millis=500, memory_mb=256), image="web:v3",
        image_digest="sha256:" + f"{i:064x}"[-64:], metadata=meta, score=0.91,
        created_at_ms=at, updated_at_ms=at,
        addresses={"web": f"10.0.{i % 250}.1:{20000 + i % 1000}"},
        checks=[Check(port="web", kind="http", path="/healthz")],
        health=Health(status="passing", since_ms=at), env_keys=["TOKEN"],
        simulated=True,
    )  # fmt: skip


async def publish(nc: NATS, rows: list[tuple[str, bytes]]) -> None:
    js = nc.jetstream(timeout=30)
    for i in range(0, len(rows), PUBLISH_BATCH):
        acks = [await js.publish_async(s, d) for s, d in rows[i : i + PUBLISH_BATCH]]
        for ack in acks:
            await ack


async def heartbeats(nc: NATS, subjects: Subjects, regions: dict[str, list[str]]) -> None:
    """The build's workers beat, a heartbeat a second per region (as a process would)."""
    while True:
        for region, wids in regions.items():
            hb = Heartbeat(beat=wids[0], workers=wids, at_ms=now_ms())
            await nc.jetstream().publish(
                subjects.state_beat(region, wids[0]), encode(hb),
                headers={HEADER_TTL: "3600"},
            )  # fmt: skip
        await anyio.sleep(1.0)  # the heartbeat's pace


async def stream_size(nc: NATS, subjects: Subjects) -> dict[str, Any]:
    info = await nc.jetstream().stream_info(state_stream_name(subjects.prefix))
    n = info.state.messages
    return {"messages": n, "bytes": info.state.bytes, "bytes_per_row": round(info.state.bytes / n)}


async def build(p: ViewProfile, url: str, out: Path, say: Say) -> dict[str, Any]:
    subjects = Subjects(f"vb{os.urandom(4).hex()}")
    nc = await connect([url], name="bourse-view-rows", service=False)
    try:
        await set_up(nc, subjects, EventStream.of(subjects), replicas=1)
        at = now_ms()
        regions = {f"r{r}": [f"w{r}-{i}" for i in range(r, p.build_workers, p.regions)]
                   for r in range(p.regions)}  # fmt: skip
        workers = [(wid, r) for r, wids in regions.items() for wid in wids]
        rows = [
            (subjects.state_worker(r, wid), encode(WorkerRow(
                worker_id=wid, region=r, beat=regions[r][0],
                capacity=Amount(cpus=64, memory_mb=262_144), free=Amount(cpus=8, memory_mb=9000),
                machines=p.build_machines // p.build_workers, driver="sim", version="0.1.0",
                at_ms=at)))
            for wid, r in workers
        ]  # fmt: skip
        machines = []
        for i in range(p.build_machines):
            wid, region = workers[i % len(workers)]
            m = synthetic(i, wid, region, at)
            machines.append((subjects.state_machine("_", region, wid, m.machine_id), m))
        say(f"build: {len(rows)} worker rows, {len(machines)} machine rows published...")
        await publish(nc, rows + [(s, encode(m)) for s, m in machines])
        async with anyio.create_task_group() as beating:
            beating.start_soon(heartbeats, nc, subjects, regions)
            size = await stream_size(nc, subjects)
            again = [(s, encode(msgspec.structs.replace(m, restarts=1)))
                     for s, m in machines if m.region == "r0"]  # fmt: skip
            await publish(nc, again)  # one row per subject: the stream does not grow
            size_after = await stream_size(nc, subjects) | {"republished": len(again)}
            say("build: a view built from scratch in a process of its own...")
            built = await run_json(
                "loadtest.viewbuild", url, subjects.prefix, str(out / "built-view.sqlite")
            )
            say(f"cli: buyer machines list --region r0 --json, {p.cli_runs} runs...")
            cli = await cli_runs(p, url, subjects, out)
            beating.cancel_scope.cancel()
        return {"stream": size, "stream_after_republish": size_after, "build": built,
                "cli": cli}  # fmt: skip
    finally:
        await shutdown(nc)


async def run_json(module: str, *args: str) -> dict[str, Any]:
    done = await anyio.run_process([sys.executable, "-m", module, *args], check=False)
    if done.returncode:
        raise ViewRunError(f"{module}: {done.stderr.decode()[-2000:]}")
    out: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])  # its answer: the last line
    return out


async def cli_runs(p: ViewProfile, url: str, subjects: Subjects, out: Path) -> dict[str, Any]:
    """``buyer machines list --region r0 --json`` as a user runs it: a new process each,
    bytecode cached (a first run writes it: not timed), its view warm in its cache. Two
    series: each run catching its view up first (``BOURSE_VIEW_FRESH_MS=0``: a user running
    it seconds apart), then each reading it as it stands (the view caught up a moment ago:
    here within a minute, so that every run is one)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env |= {"XDG_CACHE_HOME": str(out / "cache"), "BOURSE_NATS_URL": url}
    buyer = Path(sys.executable).parent / "buyer"
    argv = [str(buyer) if buyer.exists() else sys.executable, *([] if buyer.exists() else
            ["-m", "buyer_cli"]), "machines", "list", "--region", "r0", "--json",
            "--prefix", subjects.prefix]  # fmt: skip
    env.pop(ENV_KEEPER_S, None)  # the first run starts the view's keeper
    try:
        began = time.perf_counter()
        first = await anyio.run_process(argv, env=env, check=False)  # builds its view
        cold_s = time.perf_counter() - began
        if first.returncode:
            raise ViewRunError(f"buyer: {first.stderr.decode()[-2000:]}")
        caught_up = await _timed(argv, env | {ENV_FRESH_MS: "0"}, p.cli_runs)
        by_itself = await _timed(argv, env | {ENV_FRESH_MS: "0", ENV_KEEPER_S: "0"}, p.cli_runs)
        as_it_stands = await _timed(argv, env | {ENV_FRESH_MS: "60000"}, p.cli_runs)
    finally:
        stop = [*argv[: argv.index("machines")], "view", "stop", "--prefix", subjects.prefix]
        await anyio.run_process(stop, env=env, check=False)
    return {"first_run_s": round(cold_s, 3), **caught_up, "by_itself": by_itself,
            "as_it_stands": as_it_stands}  # fmt: skip


async def _timed(argv: list[str], env: dict[str, str], runs: int) -> dict[str, Any]:
    """``runs`` runs of ``argv`` one after the other: wall and CPU of each, and how old
    the view each answered from said it was."""
    ms: list[float] = []
    cpu: list[float] = []  # each run's CPU (user + system): its cost whatever else runs
    ages: list[int] = []
    listed = 0
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        began = time.perf_counter()
        done = await anyio.run_process(argv, env=env, check=False)
        ms.append((time.perf_counter() - began) * 1000)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        used = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        cpu.append(used * 1000)
        answer = json.loads(done.stdout)
        listed = len(answer["machines"])
        ages.append(answer["view"]["age_ms"])
    ms.sort()
    cpu.sort()
    return {
        "machines_listed": listed, "runs": len(ms),
        "ms_min": round(ms[0], 1), "ms_p50": round(ms[len(ms) // 2], 1),
        "ms_max": round(ms[-1], 1), "ms_each": [round(x, 1) for x in ms],
        "cpu_ms_p50": round(cpu[len(cpu) // 2], 1), "cpu_ms_min": round(cpu[0], 1),
        "view_age_ms_max": max(ages),
    }  # fmt: skip


# -- the run ---------------------------------------------------------------------------------------
async def run_views(profile: ViewProfile, out: Path, say: Say) -> dict[str, Any]:
    fresh_run_dir(out)
    server = EmbeddedNats(workdir=out / "nats", tie_to_parent=True).start()
    try:
        report: dict[str, Any] = {"scenario": "view", "profile": asdict(profile)}
        report["delay"] = await delay(profile, server.url, out, say)
        report |= await build(profile, server.url, out, say)
    finally:
        server.stop()
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def table(rep: dict[str, Any]) -> Table:
    d, b, c = rep["delay"], rep["build"], rep["cli"]
    t = Table(title="view")
    for col in ("figure", "value"):
        t.add_column(col)
    for key, what in (("delay_ms", "view"), ("to_stream_ms", "stream")):
        q = d[key]
        t.add_row(
            f"change -> {what}, {d['changes'] / d['seconds']:.0f} changes/s "
            f"({d['rows_applied']} rows)",
            f"p50 {q['p50']} / p90 {q['p90']} / p99 {q['p99']} / max {q['max']} ms",
        )
    t.add_row(
        f"view built from scratch, {b['machines']} machines + {b['workers']} workers",
        f"{b['seconds']} s ({b['cpu_s']} s CPU), peak RSS {b['peak_rss_mb']} MB, "
        f"file {b['file_mb']} MB",
    )
    for series, what in (
        (c, "caught up (by its keeper)"),
        (c["by_itself"], "caught up by itself"),
        (c["as_it_stands"], "as it stands"),
    ):
        t.add_row(
            f"buyer machines list --json, {series['machines_listed']} machines, warm view, {what}",
            f"p50 {series['ms_p50']} ms (min {series['ms_min']}, max {series['ms_max']}; CPU "
            f"p50 {series['cpu_ms_p50']} ms) of {series['runs']} runs; view up to "
            f"{series['view_age_ms_max']} ms old",
        )
    s, s2 = rep["stream"], rep["stream_after_republish"]
    t.add_row(
        "state stream",
        f"{s['messages']} rows, {s['bytes_per_row']} B/row; after {s2['republished']} rows "
        f"published again: {s2['messages']} rows",
    )
    return t
