"""The demo market: a fleet across three regions and a scripted batch of orders that shows
every outcome (placed for a reason, each kind of unfilled, an idempotent retry, a burst)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from hdrh.histogram import HdrHistogram

from bourse.client import OVERLOADED_CODE, BourseClient, ClientError
from bourse.wire.messages import Placed, PlaceOrder, Resources, Unfilled
from supplier import heartbeat_command

# region -> workers (fleet-file dicts, written to one fleet file per region)
DEMO_FLEET: dict[str, list[dict[str, object]]] = {
    "mad": [
        {
            "worker_id": "mad-1",
            "capacity": {"cpus": 16, "memory_mb": 65536, "disk_mb": 500_000},
            "labels": {"disk": "ssd"},
            "images": ["web", "api"],
        },
        {
            "worker_id": "mad-2",
            "capacity": {"cpus": 8, "memory_mb": 16384, "disk_mb": 200_000},
            "labels": {"disk": "hdd"},
            "images": ["web"],
        },
        {
            "worker_id": "mad-3",
            "capacity": {"cpus": 32, "memory_mb": 131072, "gpus": 2},
            "labels": {"disk": "ssd", "gpu": "a100"},
            "images": ["ml"],
        },
        {"worker_id": "mad-4", "capacity": {"cpus": 4, "memory_mb": 8192}},
    ],
    "fra": [
        {
            "worker_id": "fra-1",
            "capacity": {"cpus": 16, "memory_mb": 32768},
            "labels": {"disk": "ssd"},
            "images": ["db"],
        },
        {
            "worker_id": "fra-2",
            "capacity": {"cpus": 16, "memory_mb": 32768},
            "labels": {"disk": "hdd"},
            "images": ["web"],
        },
        {
            "worker_id": "fra-3",
            "capacity": {"cpus": 8, "memory_mb": 16384},
            "labels": {"disk": "ssd"},
        },
    ],
    "sjc": [
        {
            "worker_id": "sjc-1",
            "capacity": {"cpus": 8, "memory_mb": 16384},
            "pricing": {"preset": "binpack"},
            "images": ["web"],
        },
        {
            "worker_id": "sjc-2",
            "capacity": {"cpus": 8, "memory_mb": 16384},
            "pricing": {"preset": "binpack"},
            "images": ["web"],
        },
    ],
}


# What the demo's machines run (process driver): a heartbeat printer named after the image.
DEMO_CATALOG = {
    image: {
        "command": heartbeat_command(image, every_s=5),
        "size_mb": size,
        "restart": "on-failure",
        "stop_grace_s": 5,
    }
    for image, size in (("web", 150), ("api", 200), ("db", 800), ("ml", 4000))
}


def write_fleet_files(directory: Path, driver: str = "process") -> dict[str, Path]:
    """One fleet file (JSON) per region, its workers of ``driver`` (process, or oci:
    containers of pushed images; the catalog is then not run); returns region -> path."""
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for region, workers in DEMO_FLEET.items():
        path = directory / f"fleet-{region}.json"
        doc = {
            "worker": [
                {**w, "region": region, "driver": driver, "catalog": DEMO_CATALOG} for w in workers
            ]
        }
        path.write_bytes(msgspec.json.format(msgspec.json.encode(doc)))
        out[region] = path
    return out


# Every machine the demo places carries this app name (metadata "app"), so a person can
# tell them apart on a market they share, and the demo can clean up after itself.
DEMO_APP = "bourse-demo"


def _o(region: str, cpus: int, mem: int, image: str, run_id: str, **kw: Any) -> PlaceOrder:
    return PlaceOrder(
        region=region,
        resources=Resources(cpus=cpus, memory_mb=mem),
        image=image,
        metadata={"app": DEMO_APP, "demo_run": run_id},
        **kw,
    )


def script(run_id: str) -> list[tuple[str, PlaceOrder]]:
    """The scripted orders of one demo run (``run_id`` keeps its retry id its own)."""
    retry = f"demo-retry-{run_id}"

    def o(region: str, cpus: int, mem: int, image: str, **kw: Any) -> PlaceOrder:
        return _o(region, cpus, mem, image, run_id, **kw)

    return [
        ("web: the worker with the image cached wins", o("mad", 2, 2048, "web")),
        ("api: only mad-1 has it cached", o("mad", 2, 2048, "api")),
        ("ml job: needs the gpu=a100 label", o("mad", 8, 32768, "ml", constraints={"gpu": "a100"})),
        ("db on ssd only, in fra", o("fra", 4, 8192, "db", constraints={"disk": "ssd"})),
        ("binpack region: 1st", o("sjc", 2, 1024, "web")),
        ("binpack region: 2nd packs the same worker", o("sjc", 2, 1024, "web")),
        ("idempotent: order demo-retry", o("fra", 1, 512, "web", order_id=retry)),
        ("idempotent: demo-retry again", o("fra", 1, 512, "web", order_id=retry)),
        ("too big for any worker", o("mad", 64, 1024, "web", deadline_ms=300)),
        ("a region nobody serves", o("syd", 1, 512, "web")),
        ("picky buyer: min_score 0.99", o("fra", 1, 512, "web", min_score=0.99, deadline_ms=300)),
    ]


@dataclass
class BurstReport:
    orders: int
    placed: int
    unfilled: dict[str, int]
    seconds: float
    p50_ms: float
    p99_ms: float


async def run_script(client: BourseClient, run_id: str) -> list[tuple[str, Placed | Unfilled]]:
    return [(name, await client.place(order)) for name, order in script(run_id)]


async def run_burst(
    client: BourseClient, run_id: str, placed: list[str], n: int = 200
) -> BurstReport:
    """n small orders at once, spread over the three regions; the ids of the machines placed
    go into ``placed``. Latency is of placed orders."""
    regions = list(DEMO_FLEET)
    hist = HdrHistogram(1, 60_000_000, 3)  # microseconds

    async def one(i: int) -> Placed | Unfilled | str:
        t = time.perf_counter()
        region = regions[i % len(regions)]
        try:
            r = await client.place(_o(region, 1, 256, "web", run_id, deadline_ms=2000))
        except ClientError as exc:
            # A user's exchange may refuse part of a burst as overloaded (its admission
            # control): nothing was placed, and the report counts it.
            if exc.code != OVERLOADED_CODE:
                raise
            return OVERLOADED_CODE
        if isinstance(r, Placed):  # unfilled ones wait out the quiet window by design
            hist.record_value(max(1, int((time.perf_counter() - t) * 1e6)))
        return r

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    seconds = time.perf_counter() - t0
    placed.extend(r.machine_id for r in results if isinstance(r, Placed))
    unfilled: dict[str, int] = {}
    for r in results:
        if isinstance(r, Unfilled):
            unfilled[r.reason] = unfilled.get(r.reason, 0) + 1
        elif isinstance(r, str):  # refused: the report's "unfilled" counts it by its code
            unfilled[r] = unfilled.get(r, 0) + 1
    return BurstReport(
        orders=n,
        placed=sum(isinstance(r, Placed) for r in results),
        unfilled=unfilled,
        seconds=seconds,
        p50_ms=hist.get_value_at_percentile(50) / 1000,
        p99_ms=hist.get_value_at_percentile(99) / 1000,
    )


@dataclass
class Cleanup:
    placed: int
    destroyed: int
    failed: dict[str, str]  # machine id -> why it could not be destroyed


async def clean_up(client: BourseClient, machine_ids: list[str]) -> Cleanup:
    """Destroy the machines the demo placed (each once: a retry shares its machine)."""
    ids = list(dict.fromkeys(machine_ids))
    failed: dict[str, str] = {}
    limit = asyncio.Semaphore(32)

    async def destroy(machine_id: str) -> None:
        async with limit:
            try:
                await client.machine("destroy", machine_id)
            except Exception as exc:  # one line per machine left behind, the rest go on
                failed[machine_id] = str(exc) or type(exc).__name__

    await asyncio.gather(*(destroy(m) for m in ids))
    return Cleanup(placed=len(ids), destroyed=len(ids) - len(failed), failed=failed)
