"""The ``edge-cold`` scenario: a request to a stopped app through the edge, its first byte,
against the app's own start (issue 38: first byte <= the app's own start + 100 ms at p50).

One market in the run (an embedded nats-server with JetStream, an exchange, one ``supplier
run`` with a process worker, ``edge serve`` following the view), the example app
(``examples/hello-http``) pushed to its image store, one machine of app ``cold`` placed and
started once (its image pulled and unpacked: every start after finds it cached) and
stopped. Then, alternated (each first every other round) so that both see the machine as
busy:

- **own start**: ``start`` through the exchange (as ``buyer machines start``), timed from
  the verb sent to the machine's port answering ``GET /`` with 200 (polled every
  millisecond, straight at its published address);
- **through the edge**: ``GET /`` with ``Host: cold.localhost`` sent to the edge while the
  machine is stopped, timed to the answer's first byte (the edge starts the machine, probes
  its port, then proxies the request held meanwhile);
- **placed through the edge** (scale from zero by placing): app ``zero`` deployed (a spec,
  one primary: the apps bucket has its record), its machine destroyed: ``GET /`` with
  ``Host: zero.localhost`` timed to the first byte (the edge places the slot's machine
  through the exchange, the image cached on the worker, starts it, probes, proxies).

After each, the machine is stopped (the placed one destroyed) and the run waits until its
row says so in the state stream (the edge follows the same stream) and a little more. The
report gives each one's p50 and p99 and the edge's p50s over the own start's.

``python -m loadtest.edgecold --help``; ``bourse loadtest --scenario edge-cold``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
from rich.table import Table

from bourse.client import BourseClient
from bourse.errors import BourseError
from bourse.images import ImageStore
from bourse.nats.connection import connect, shutdown
from bourse.nats.embedded import EmbeddedNats
from bourse.nats.jetstream import EventStream
from bourse.nats.state import state_stream_name
from bourse.runtime.launcher import Program, start_program, stop_all
from bourse.wire.codec import decode
from bourse.wire.messages import Machine, Placed, PlaceOrder, Resources, worker_of_machine
from bourse.wire.subjects import Subjects
from loadtest.runner import fresh_run_dir
from loadtest.starts import HELLO, HELLO_DIR, http_ok, market_programs, percentile
from ops.jetstream import set_up

Say = Callable[[str], None]
REGION = "cold"
APP = "cold"
WORKER = "cold-p"
PORTS = "27700-27799"
READY_S = 30.0
SETTLE_S = 0.2  # after the stopped row: the edge's view applies it (a pace, not a wait)
TARGET_MS = 100.0  # issue 38: through the edge <= the own start + 100 ms at p50
PLACED_TARGET_MS = 200.0  # issue 38: placed through the edge <= the own start + 200 ms
ZERO = "zero"  # the app whose machine a request places


class ColdError(BourseError):
    pass


STARTS = 20


@dataclass(frozen=True, slots=True)
class ColdProfile:
    starts: int = STARTS  # of each, alternated


@dataclass(slots=True)
class Times:
    own_ms: list[float] = field(default_factory=list)
    edge_ms: list[float] = field(default_factory=list)
    placed_ms: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def fleet(path: Path, worker: str = WORKER, ports: str = PORTS, region: str = REGION) -> Path:
    """A supplier's fleet file of one process worker advertising loopback."""
    w = {
        "worker_id": worker,
        "region": region,
        "capacity": {"cpus": 8, "memory_mb": 8192, "disk_mb": 100_000},
        "driver": "process",
        "ports": ports,
        "advertise_host": "127.0.0.1",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode({"worker": [w]}))
    return path


async def stopped(client: BourseClient, machine_id: str, state: str = "stopped") -> None:
    """Stop (or destroy) the machine, then until the state stream's row of it says
    ``state``."""
    await client.machine("stop" if state == "stopped" else "destroy", machine_id)
    subjects = client.subjects
    subject = subjects.state_machines(worker_id=worker_of_machine(machine_id))[:-1] + machine_id
    ask = f"$JS.API.DIRECT.GET.{state_stream_name(subjects.prefix)}.{subject}"
    end = time.monotonic() + READY_S
    while time.monotonic() < end:
        msg = await client.nc.request(ask, b"", timeout=2.0)
        if not (msg.headers or {}).get("Status") and decode(msg.data, Machine).state == state:
            await anyio.sleep(SETTLE_S)
            return
        await anyio.sleep(0.01)  # the next look at the stream
    raise ColdError(f"no {state} row of {machine_id} in {READY_S:.0f} s")


async def own_start(client: BourseClient, machine_id: str) -> float:
    """ms from the start verb sent to the machine's port answering 200."""
    began = time.perf_counter()
    m = await client.machine("start", machine_id)
    host, _, port = m.addresses["http"].rpartition(":")
    await http_ok(host, int(port), began + READY_S)
    return (time.perf_counter() - began) * 1000


async def through_edge(edge: tuple[str, int], app: str, machine_id: str = "") -> tuple[float, str]:
    """ms from ``GET /`` sent to the edge for ``app`` to the first byte of its answer (a
    200 from ``machine_id``, or any machine), and the machine that answered."""
    began = time.perf_counter()
    reader, writer = await asyncio.open_connection(*edge)
    try:
        writer.write(
            f"GET / HTTP/1.1\r\nHost: {app}.localhost\r\nConnection: close\r\n\r\n".encode()
        )
        with anyio.fail_after(READY_S):
            first = await reader.read(1)
            took = (time.perf_counter() - began) * 1000
            rest = await reader.read()
    finally:
        writer.close()
    head = (first + rest).split(b"\r\n\r\n", 1)[0].decode("latin-1")
    by = next((ln.split(":", 1)[1].strip() for ln in head.splitlines()
               if ln.lower().startswith("bourse-machine:")), "")  # fmt: skip
    if not head.startswith("HTTP/1.1 200") or not by or machine_id not in ("", by):
        raise ColdError(f"through the edge: {head.splitlines()[0] if head else 'no answer'}")
    return took, by


@dataclass(slots=True)
class Machines:
    """The run's machines: the stopped app's, and the one the placing app has now."""

    cold: str
    zero: str


async def arm(
    client: BourseClient, edge: tuple[str, int], m: Machines, which: str, t: Times
) -> None:
    """One start of ``which`` (own, edge, placed), timed, then undone."""
    if which == "own":
        t.own_ms.append(await own_start(client, m.cold))
    elif which == "edge":
        t.edge_ms.append((await through_edge(edge, APP, m.cold))[0])
    else:
        await stopped(client, m.zero, "destroyed")  # nothing left to start: placed
        took, m.zero = await through_edge(edge, ZERO)
        t.placed_ms.append(took)
        return  # destroyed before the next one
    await stopped(client, m.cold)


async def measure(
    client: BourseClient, edge: tuple[str, int], machines: Machines, n: int, say: Say
) -> Times:
    times = Times()
    say(f"{n} starts of each, in turn: the own start, through the edge, placed through it...")
    arms = ("own", "edge", "placed")
    for i in range(n):
        for which in arms[i % 3 :] + arms[: i % 3]:
            try:
                await arm(client, edge, machines, which, times)
            except (BourseError, OSError, TimeoutError) as exc:
                times.failed.append(f"{which}: {exc}")
    return times


async def deploy_zero(client: BourseClient) -> str:
    """App ``zero`` deployed (one primary of the example app): its machine's id."""
    from bourse.client.apps.apply import apply, context
    from bourse.client.apps.spec import AppSpec
    from bourse.client.apps.store import AppStore

    spec = AppSpec(app=ZERO, image="hello:latest", regions=[REGION], ports=["http"],
                   resources=Resources(cpus=1, memory_mb=256, disk_mb=64))  # fmt: skip
    store = await AppStore.open(client.nc, client.subjects.prefix)
    done = await apply(client, store, await context(client, store, spec))
    if not done.complete:
        raise ColdError(f"deploy of {ZERO}: {done.outcomes}")
    return next(o.machine_id for o in done.outcomes if o.machine_id)


async def run_cold(profile: ColdProfile, out: Path, say: Say) -> dict[str, Any]:
    fresh_run_dir(out)
    server = EmbeddedNats(workdir=out / "nats", tie_to_parent=True).start()
    subjects = Subjects(f"ec{os.urandom(4).hex()}")
    programs: list[Program] = []
    try:
        nc = await connect([server.url], name="bourse-edge-cold", service=False)
        try:
            await set_up(nc, subjects, EventStream.of(subjects), replicas=1)
            store = await ImageStore.open(nc, subjects.prefix)
            await store.push_directory(HELLO_DIR, "hello:latest", HELLO)
            args = ("--nats", server.url, "--prefix", subjects.prefix, "--metrics-addr", "off")
            path = fleet(out / "config" / "fleet.json")
            await market_programs(programs, path, out / "data", args, out / "logs")
            edge = await start_program(
                "edge", "serve", "--listen", "127.0.0.1:0", "--region", REGION,
                "--nats", server.url, "--prefix", subjects.prefix,
                log_path=out / "logs" / "edge.log", ready="edge serving on",
            )  # fmt: skip
            programs.append(edge)
            host, _, port = edge.ready_line.split()[3].rpartition(":")
            client = BourseClient(nc, subjects)
            order = PlaceOrder(
                region=REGION,
                resources=Resources(cpus=1, memory_mb=256, disk_mb=64),
                image="hello:latest",
                ports=["http"],
                metadata={"app": APP},
            )
            placed = await client.place(order)
            if not isinstance(placed, Placed):
                raise ColdError(f"unfilled: {placed.reason} {placed.detail}")
            mid = placed.machine_id
            await own_start(client, mid)  # the image pulled and unpacked: cached from now on
            await stopped(client, mid)
            machines = Machines(mid, await deploy_zero(client))
            times = await measure(client, (host, int(port)), machines, profile.starts, say)
            for m in (machines.cold, machines.zero):
                await client.machine("destroy", m)
        finally:
            await shutdown(nc)
    finally:
        await stop_all(programs)
        server.stop()
    rep = report(profile, times)
    (out / "report.json").write_bytes(msgspec.json.format(msgspec.json.encode(rep)))
    return rep


def report(profile: ColdProfile, t: Times) -> dict[str, Any]:
    own50, edge50 = percentile(t.own_ms, 50), percentile(t.edge_ms, 50)
    over = None if own50 is None or edge50 is None else round(edge50 - own50, 1)
    placed50 = percentile(t.placed_ms, 50)
    placed_over = None if own50 is None or placed50 is None else round(placed50 - own50, 1)
    return {
        "scenario": "edge-cold",
        "profile": asdict(profile),
        "own_start_p50_ms": own50,
        "own_start_p99_ms": percentile(t.own_ms, 99),
        "edge_first_byte_p50_ms": edge50,
        "edge_first_byte_p99_ms": percentile(t.edge_ms, 99),
        "over_p50_ms": over,
        "target_over_p50_ms": TARGET_MS,
        "met": over is not None and over <= TARGET_MS,
        "placed_first_byte_p50_ms": placed50,
        "placed_first_byte_p99_ms": percentile(t.placed_ms, 99),
        "placed_over_p50_ms": placed_over,
        "target_placed_over_p50_ms": PLACED_TARGET_MS,
        "placed_met": placed_over is not None and placed_over <= PLACED_TARGET_MS,
        "samples": {"own": len(t.own_ms), "edge": len(t.edge_ms), "placed": len(t.placed_ms)},
        "failed": t.failed,
    }


def table(rep: dict[str, Any]) -> Table:
    t = Table(title="edge-cold: a request to a stopped app through the edge, against its own start")
    for column in ("", "starts", "p50", "p99"):
        t.add_column(column, justify="right")
    s = rep["samples"]
    t.add_row("own start (verb -> 200)", str(s["own"]), f"{rep['own_start_p50_ms']} ms",
              f"{rep['own_start_p99_ms']} ms")  # fmt: skip
    edge50, edge99 = rep["edge_first_byte_p50_ms"], rep["edge_first_byte_p99_ms"]
    t.add_row("through the edge (first byte)", str(s["edge"]), f"{edge50} ms", f"{edge99} ms")
    p50, p99 = rep["placed_first_byte_p50_ms"], rep["placed_first_byte_p99_ms"]
    t.add_row("placed through the edge (first byte)", str(s["placed"]), f"{p50} ms", f"{p99} ms")
    t.caption = (
        f"the edge over the own start at p50: {rep['over_p50_ms']} ms (target <= "
        f"{rep['target_over_p50_ms']:g} ms: {'met' if rep['met'] else 'NOT met'}); placed: "
        f"{rep['placed_over_p50_ms']} ms (target <= {rep['target_placed_over_p50_ms']:g} ms: "
        f"{'met' if rep['placed_met'] else 'NOT met'})"
        + (f"; failed: {rep['failed']}" if rep["failed"] else "")
    )
    return t


def profile_of(given: dict[str, Any]) -> ColdProfile:
    return ColdProfile(**{k: v for k, v in given.items() if k in ColdProfile.__dataclass_fields__})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.edgecold", description=__doc__)
    parser.add_argument("--starts", type=int, default=STARTS)
    parser.add_argument("--out", type=Path, default=Path(".bourse/loadtest/edge-cold"))
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args(argv)
    say: Say = (lambda _: None) if a.json else print
    rep = anyio.run(run_cold, ColdProfile(starts=a.starts), a.out, say)
    show(rep, table, a.json)


def show(rep: dict[str, Any], table: Callable[[dict[str, Any]], Table], as_json: bool) -> None:
    """A scenario's report on stdout: JSON, or its table."""
    if as_json:
        json.dump(rep, sys.stdout, indent=2)
        print()
    else:
        from rich.console import Console

        Console().print(table(rep))


if __name__ == "__main__":
    main()
