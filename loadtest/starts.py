"""The ``starts`` scenario: how long a start costs over the program's own start, and what a
shim costs per machine.

One market in the run (an embedded nats-server with JetStream, an exchange, one
``supplier run`` with a process worker and, where runc works, an oci worker), the example
apps pushed to its image store (``examples/hello-http`` for processes, a busybox httpd
root for containers) and pulled once (a first start) so that each start finds its image
cached. Then, alternated so that both see the same machine:

- **market**: ``place`` (through the exchange) then ``start``, timed from the order sent to
  the machine's port answering HTTP 200 (polled every millisecond), then the machine is
  destroyed;
- **by hand**: the same program, from the same unpacked root, started as a plain child
  process with the same kind of environment, timed from its spawn to its first HTTP 200.

It reports each one's p50 and p99 and the market's cost over the program's own (p50 minus
p50). ``--machines N`` then starts N machines at once on the process worker (a program that
sleeps) and reads every shim's proportional set size (PSS: shared pages divided among the
processes that share them) from ``/proc/<pid>/smaps_rollup``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
from hdrh.histogram import HdrHistogram
from rich.table import Table

from bourse.client import BourseClient
from bourse.errors import BourseError
from bourse.images import ImageInfo, ImageStore, RunSpec
from bourse.nats.connection import connect, shutdown
from bourse.nats.embedded import EmbeddedNats
from bourse.nats.jetstream import EventStream
from bourse.runtime.launcher import Program, start_program, stop_all
from bourse.wire.messages import Placed, PlaceOrder, Resources
from bourse.wire.subjects import Subjects
from loadtest.runner import fresh_run_dir
from loadtest.running import get_ms, memory, primary_address
from ops.hello import HELLO_DIR
from ops.jetstream import set_up
from supplier import cgroup_moves_favored

Say = Callable[[str], None]
REGION = "starts"
ORDER = Resources(cpus=1, memory_mb=256, disk_mb=64)
HELLO = RunSpec(cmd=("python3", "server.py"), env=("HELLO_VERSION=1",))
HELLO_ENV = {"HELLO_VERSION": "1"}
BOX = RunSpec(cmd=("sh", "-c", "trap 'exit 0' TERM; httpd -f -p $PORT -h /www & wait"))
SLEEPER = RunSpec(cmd=("sleep", "3600"))
READY_S = 30.0  # a start that does not answer in this long is a failure


class StartsError(BourseError):
    pass


@dataclass(frozen=True, slots=True)
class StartsProfile:
    starts: int = 30  # per kind, market and by hand each
    machines: int = 100  # started at once for the shims' memory (0: skipped)
    containers: bool = True  # where runc works here
    shared: bool = True  # the same kinds again with isolation off, in the same run
    requests: int = 200  # GETs through a published port and to the private address each


@dataclass(slots=True)
class Kind:
    """One kind of machine: its worker, its image, and the times measured."""

    name: str
    worker: str
    image: str
    market_ms: list[float] = field(default_factory=list)
    hand_ms: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    machine_ids: list[str] = field(default_factory=list)  # of its timed market starts
    # the harness's own steps of each timed market start, ms: the order placed, the start
    # verb's answer, the port's first 200 after it
    steps: dict[str, list[float]] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def http_ok(host: str, port: int, deadline: float) -> None:
    """Until ``GET /`` answers 200 (polled every millisecond: a pace); StartsError past
    ``deadline``."""
    request = f"GET / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode()
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(request)
                await writer.drain()
                head = await reader.readline()
            finally:
                writer.close()
            if head.split(b" ")[1:2] == [b"200"]:
                return
        except OSError:
            pass
        if time.perf_counter() > deadline:
            raise StartsError(f"{host}:{port} did not answer 200 in {READY_S:.0f}s")
        await anyio.sleep(0.001)  # a pace while the program starts listening


def fleet(path: Path, containers: bool, shared: bool) -> Path:
    """The run's workers: a process one and, where runc works, an oci one, each with its
    own label (an order names its kind) and port range, advertising loopback; with
    ``shared``, the same again with isolation off (their machines share the supplier's
    users and the host's network: what isolation costs, in the same run)."""
    kinds = [("starts-p", "process", "process", "27100-27299", "auto")]
    if containers:
        kinds.append(("starts-c", "oci", "container", "27300-27399", "auto"))
    if shared:
        kinds.append(("starts-ps", "process", "process-shared", "27400-27599", "off"))
        if containers:
            kinds.append(("starts-cs", "oci", "container-shared", "27600-27699", "off"))
    workers = [
        {
            "worker_id": wid,
            "region": REGION,
            "capacity": {"cpus": 64, "memory_mb": 65536, "disk_mb": 200_000},
            "driver": driver,
            "labels": {"kind": kind},
            "ports": ports,
            "advertise_host": "127.0.0.1",
            "isolate": isolate,
        }
        for wid, driver, kind, ports, isolate in kinds
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode({"worker": workers}))
    return path


def box_root(out: Path) -> Path | None:
    """The busybox httpd example's root, built here (None without a static busybox)."""
    build = HELLO_DIR.parent / "busybox-httpd" / "build.sh"
    root = out / "box"
    done = subprocess.run(["sh", str(build), str(root)], capture_output=True, check=False)
    return root if done.returncode == 0 else None


def runc_works() -> bool:
    from supplier import RuntimeUnavailable, detect_runtime

    try:
        detect_runtime()
    except RuntimeUnavailable:
        return False
    return True


async def market_start(
    client: BourseClient, kind: Kind, steps: dict[str, list[float]] | None = None
) -> tuple[float, str]:
    """Place and start one machine of ``kind`` with a port ``web``; the ms from the order
    to its port answering 200, and its id (each step's ms added to ``steps``)."""
    order = PlaceOrder(
        region=REGION,
        resources=ORDER,
        image=kind.image,
        ports=["web"],
        constraints={"kind": kind.name},
    )
    began = time.perf_counter()
    placed = await client.place(order)
    if not isinstance(placed, Placed):
        raise StartsError(f"unfilled: {placed.reason} {placed.detail}")
    placed_at = time.perf_counter()
    m = await client.machine("start", placed.machine_id)
    if m.state != "started":
        raise StartsError(f"{m.machine_id} is {m.state}")
    started_at = time.perf_counter()
    host, _, port = m.addresses["web"].rpartition(":")
    await http_ok(host, int(port), began + READY_S)
    ready_at = time.perf_counter()
    took = {
        "place_ms": placed_at - began,
        "start_verb_ms": started_at - placed_at,
        "ready_ms": ready_at - started_at,
    }
    if steps is not None:
        for name, seconds in took.items():
            steps.setdefault(name, []).append(seconds * 1000)
    return (ready_at - began) * 1000, placed.machine_id


# A program started by hand: its argv for a port, its working directory, its environment.
Hand = tuple[Callable[[int], list[str]], Path, dict[str, str]]


async def hand_start(hand: Hand) -> float:
    """The same program as a plain child process: ms from its spawn to its first 200."""
    argv_for, cwd, env = hand
    port = free_port()
    began = time.perf_counter()
    proc = await anyio.open_process(
        argv_for(port),
        cwd=cwd,
        env={"PATH": os.defpath, **env, "PORT": str(port)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await http_ok("127.0.0.1", port, began + READY_S)
        return (time.perf_counter() - began) * 1000
    finally:
        proc.kill()
        await proc.wait()


def hand_command(kind: Kind, roots: Path) -> Hand | None:
    """How to start the kind's program by hand: from its unpacked root in the worker's
    content cache (the same files the market's machine ran)."""
    if kind.name.startswith("process"):
        found = sorted(roots.glob("roots/*/server.py"))
        if found:
            return (lambda port: [sys.executable, "server.py"]), found[0].parent, HELLO_ENV
        return None
    boxes = sorted(roots.glob("roots/*/www"))
    if not boxes:
        return None
    root = boxes[0].parent
    httpd = [str(root / "bin" / "busybox"), "httpd", "-f", "-h", str(root / "www")]
    return (lambda port: [*httpd, "-p", str(port)]), root, {}


async def measure(client: BourseClient, kinds: list[Kind], roots: Path, n: int, say: Say) -> None:
    """``n`` starts of each kind each way, the kinds and the ways alternated (so that every
    one sees the machine as busy as the others)."""
    hands = {}
    for kind in kinds:
        _, first = await market_start(client, kind)  # the image pulled into the cache
        await client.machine("destroy", first)
        hand = hand_command(kind, roots / kind.worker)
        if hand is None:
            raise StartsError(f"no unpacked root of {kind.image} found below {roots}")
        hands[kind.name] = hand
    names = ", ".join(k.name for k in kinds)
    say(f"{names}: {n} starts each through the market and {n} by hand, alternated...")
    for _ in range(n):
        for kind in kinds:
            try:
                ms, mid = await market_start(client, kind, kind.steps)
                kind.market_ms.append(ms)
                kind.machine_ids.append(mid)
                await client.machine("destroy", mid)
            except (BourseError, OSError) as exc:
                kind.failed.append(str(exc))
            kind.hand_ms.append(await hand_start(hands[kind.name]))


# -- a request through the published port against the private address ---------------------
async def requests(client: BourseClient, kind: Kind, n: int, say: Say) -> dict[str, Any]:
    """``n`` GETs each to a started machine of ``kind`` through its published address
    (loopback: DNAT with route_localnet and a masquerade), through the host's routable
    address at the same port (DNAT alone) and straight to its private one (from the host),
    alternated: what the port's publication costs a request. Empty when the machine has no
    network of its own."""
    _, mid = await market_start(client, kind)
    try:
        m = await client.machine("get", mid)
        private = m.private_address
        if not private:
            return {}
        host, _, port = m.addresses["web"].rpartition(":")
        say(f"{kind.name}: {n} requests through {host}:{port} and to {private}:{port}...")
        routable = primary_address()
        published, direct, routed = [], [], []
        for _ in range(n):
            published.append(await anyio.to_thread.run_sync(get_ms, host, int(port)))
            direct.append(await anyio.to_thread.run_sync(get_ms, private, int(port)))
            if routable:
                routed.append(await anyio.to_thread.run_sync(get_ms, routable, int(port)))
    finally:
        await client.machine("destroy", mid)
    p50, d50 = percentile(published, 50, 3), percentile(direct, 50, 3)
    return {
        "requests": n,
        "published_p50_ms": p50,
        "private_p50_ms": d50,
        "published_p99_ms": percentile(published, 99, 3),
        "private_p99_ms": percentile(direct, 99, 3),
        "routable_p50_ms": percentile(routed, 50, 3),
        "ratio_p50": None if not p50 or not d50 else round(p50 / d50, 3),
    }


# -- the run -------------------------------------------------------------------------------
async def market_programs(
    programs: list[Program], fleet: Path, data: Path, args: tuple[str, ...], logs: Path
) -> None:
    """``supplier run`` with ``fleet`` (its machines stopped with it) and ``exchange
    serve``, each with ``args`` (the market's options), ready, added to ``programs``."""
    programs.append(
        await start_program(
            "supplier", "run", "--fleet", str(fleet), "--data-dir", str(data),
            "--machines-stop-with-supplier", "--log-json", *args,
            log_path=logs / "supplier.log", ready="supplier ready",
        )
    )  # fmt: skip
    programs.append(
        await start_program(
            "exchange", "serve", *args, log_path=logs / "exchange.log", ready="exchange ready"
        )
    )


async def run_starts(profile: StartsProfile, out: Path, say: Say) -> dict[str, Any]:
    fresh_run_dir(out)
    server = EmbeddedNats(workdir=out / "nats", tie_to_parent=True).start()
    subjects = Subjects(f"st{os.urandom(4).hex()}")
    programs: list[Program] = []
    box = box_root(out) if profile.containers and runc_works() else None
    kinds = [Kind("process", "starts-p", "hello:latest")]
    if box is not None:
        kinds.append(Kind("container", "starts-c", "box:latest"))
    if profile.shared:
        kinds.append(Kind("process-shared", "starts-ps", "hello:latest"))
        if box is not None:
            kinds.append(Kind("container-shared", "starts-cs", "box:latest"))
    data = out / "data"
    try:
        nc = await connect([server.url], name="bourse-starts", service=False)
        try:
            await set_up(nc, subjects, EventStream.of(subjects), replicas=1)
            store = await ImageStore.open(nc, subjects.prefix)
            await _push(store, "hello:latest", HELLO_DIR, HELLO)
            await _push(store, "sleeper:latest", HELLO_DIR, SLEEPER)
            if box is not None:
                await _push(store, "box:latest", box, BOX)
            args = ("--nats", server.url, "--prefix", subjects.prefix, "--metrics-addr", "off")
            path = fleet(out / "config" / "fleet.json", box is not None, profile.shared)
            await market_programs(programs, path, data, args, out / "logs")
            client = BourseClient(nc, subjects)
            await measure(client, kinds, data / "images", profile.starts, say)
            published = {}
            if profile.requests:
                published = await requests(client, kinds[0], profile.requests, say)
            mem = {}
            if profile.machines:
                mem = await memory(
                    client, profile.machines, data / "shims" / "starts-p", REGION, say
                )
        finally:
            await shutdown(nc)
    finally:
        await stop_all(programs)
        server.stop()
    rep = report(profile, kinds, mem)
    rep["steps"] = start_steps(out / "logs" / "supplier.log", kinds)
    rep["published_port"] = published
    rep["host"] = {"favordynmods": cgroup_moves_favored(), "load_end": list(os.getloadavg())}
    (out / "report.json").write_bytes(msgspec.json.format(msgspec.json.encode(rep)))
    return rep


async def _push(store: ImageStore, ref: str, directory: Path, run: RunSpec) -> ImageInfo:
    await store.push_directory(directory, ref, run)
    return await store.inspect(ref)


def percentile(values: list[float], q: float, digits: int = 1) -> float | None:
    """The ``q`` percentile of ``values`` (ms), in ms rounded to ``digits``."""
    if not values:
        return None
    hist = HdrHistogram(1, 600_000_000, 3)  # microseconds
    for v in values:
        hist.record_value(max(1, round(v * 1000)))
    return round(hist.get_value_at_percentile(q) / 1000, digits)


# The supplier's lines that time a start's steps (supplier/machines/keeper.py, runner.py),
# and the fields of each that are milliseconds.
STEP_LINES = {
    "machine_start_steps": ("starting_ms", "launch_ms", "started_ms"),
    "machine_launched": ("plan_ms", "network_ms", "running_ms", "shim_ms"),
}


def start_steps(log: Path, kinds: list[Kind]) -> dict[str, dict[str, float | None]]:
    """Each kind's median of each step of its timed market starts, ms: the supplier's (its
    JSON log lines) and the harness's own (the order, the start verb, the port)."""
    kind_of = {mid: k.name for k in kinds for mid in k.machine_ids}
    times: dict[str, dict[str, list[float]]] = {k.name: {} for k in kinds}
    for raw in log.read_bytes().splitlines() if log.exists() else ():
        if not raw.startswith(b"{"):
            continue
        line = msgspec.json.decode(raw)
        name = kind_of.get(line.get("machine_id", ""))
        for key in STEP_LINES.get(line.get("event", ""), ()) if name else ():
            if isinstance(line.get(key), int | float):
                times[str(name)].setdefault(key, []).append(float(line[key]))
    for k in kinds:
        times[k.name] |= k.steps
    return {
        name: {key: percentile(values, 50, 2) for key, values in steps.items()}
        for name, steps in times.items()
    }


def report(profile: StartsProfile, kinds: list[Kind], mem: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"scenario": "starts", "profile": asdict(profile), "kinds": {}}
    for k in kinds:
        m50, h50 = percentile(k.market_ms, 50), percentile(k.hand_ms, 50)
        out["kinds"][k.name] = {
            "starts": len(k.market_ms),
            "failed": k.failed,
            "market_p50_ms": m50,
            "market_p99_ms": percentile(k.market_ms, 99),
            "hand_p50_ms": h50,
            "hand_p99_ms": percentile(k.hand_ms, 99),
            "over_p50_ms": None if m50 is None or h50 is None else round(m50 - h50, 1),
        }
    out["shims"] = mem
    return out


def table(rep: dict[str, Any]) -> Table:
    t = Table(title="starts: the order to the port answering, against the program by hand")
    for column in ("kind", "starts", "market p50", "p99", "by hand p50", "p99", "over p50"):
        t.add_column(column, justify="right")
    for name, k in rep["kinds"].items():
        t.add_row(
            name,
            str(k["starts"]),
            f"{k['market_p50_ms']} ms",
            f"{k['market_p99_ms']} ms",
            f"{k['hand_p50_ms']} ms",
            f"{k['hand_p99_ms']} ms",
            f"{k['over_p50_ms']} ms",
        )
    notes = []
    kinds = rep["kinds"]
    for name in ("process", "container"):
        own, shared = kinds.get(name, {}), kinds.get(f"{name}-shared", {})
        if own.get("market_p50_ms") is not None and shared.get("market_p50_ms") is not None:
            cost = round(own["market_p50_ms"] - shared["market_p50_ms"], 1)
            notes.append(f"isolation costs a {name} start {cost} ms at p50")
    req = rep.get("published_port") or {}
    if req:
        notes.append(
            f"{req['requests']} GETs through the published port: p50 {req['published_p50_ms']} "
            f"ms, to the private address {req['private_p50_ms']} ms (x{req['ratio_p50']}), "
            f"through the host's routable address {req['routable_p50_ms']} ms"
        )
    mem = rep.get("shims") or {}
    if mem:
        notes.append(
            f"{mem['shims']} shims of {mem['machines']} machines at once: PSS mean "
            f"{mem['pss_kib_mean']} KiB, p50 {mem['pss_kib_p50']} KiB, max {mem['pss_kib_max']} KiB"
        )
    for name, steps in (rep.get("steps") or {}).items():
        if steps:
            said = ", ".join(f"{key[:-3]} {ms}" for key, ms in steps.items())
            notes.append(f"{name}'s steps, medians in ms: {said}")
    t.caption = "\n".join(notes) or None
    return t


def profile_of(given: dict[str, Any]) -> StartsProfile:
    fields = {k: v for k, v in given.items() if k in StartsProfile.__dataclass_fields__}
    return StartsProfile(**fields)
