"""The ``pulls`` scenario: real pulls from the image store, cache-aware pricing against a
cache-blind baseline at the same offered load, in one run.

Two regions of real suppliers (``supplier run``, process driver), one per arm: ``aware``
prices an image by the bytes a worker lacks (the image term, ``image_half_s`` of the
profile), ``blind`` has the image term off (``image_weight`` 0). The harness makes its
images (random bytes: a shared base layer and one or two layers of their own each, 20 to
200 MB in all), pushes them into the store, and sends one order stream (seeded: times and
images, by popularity) to both regions at once: each order placed by its tag through the
direct buyer's auction (the tag resolved where the order enters, so the bid carries the
digest and layers), started at once, destroyed after its
lifetime. Per arm it reports the start latency (order sent to its start answered
``started``) p50 and p99, the bytes pulled per start and the cache hit rate (starts that
pulled nothing), from the workers' ``pulled`` events.
"""

from __future__ import annotations

import hashlib
import os
import random
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, cast

import anyio
import msgspec
import nats.errors
from hdrh.histogram import HdrHistogram
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from rich.table import Table

from bourse.auction.core import AuctionConfig
from bourse.client import BourseClient
from bourse.errors import BourseError
from bourse.images import ImageInfo, ImageStore, RunSpec
from bourse.images.build import Layer as BuiltLayer
from bourse.images.build import documents
from bourse.images.importer import Blob
from bourse.images.oci import OCI_LAYER, Descriptor, decode_manifest
from bourse.nats.connection import connect, shutdown
from bourse.nats.embedded import EmbeddedNats
from bourse.nats.jetstream import EventStream
from bourse.runtime.launcher import Program, start_program, stop_all
from bourse.wire.codec import decode
from bourse.wire.messages import Event, Placed, PlaceOrder, Resources
from bourse.wire.subjects import Subjects
from loadtest.runner import fresh_run_dir
from ops.jetstream import set_up

MB = 1_000_000
ARMS = ("aware", "blind")
# What a machine of a harness image runs: the host's sleep, destroyed after its lifetime.
RUN = RunSpec(cmd=("sleep", "3600"))
ORDER = Resources(cpus=1, memory_mb=256)
Say = Callable[[str], None]


class PullsError(BourseError):
    """A pulls run that cannot go on (an image the store refused, a supplier that did not
    start): the message says which."""


@dataclass(frozen=True, slots=True)
class PullsProfile:
    """The ``pulls`` scenario's knobs (sizes in MB of 10^6 bytes, times in seconds)."""

    seed: int = 1
    workers: int = 3  # per arm
    images: int = 5
    image_mb: tuple[int, int] = (20, 60)
    base_mb: int = 10  # the layer every image of a pair shares
    orders: int = 30  # per arm (the same stream to both)
    rate: float = 1.0  # orders per second
    lifetime_s: float = 4.0
    zipf_s: float = 1.0  # popularity of image k is proportional to 1 / k^s
    image_half_s: float = 1.0  # the aware arm's pricing: the image term is 1/2 at this pull
    # an order's deadline, and how long its auction listens for a first offer: workers
    # busy unpacking a pull answer bids late on a small host
    deadline_ms: int = 5000
    quiet_ms: float = 1000.0

    def __post_init__(self) -> None:
        low, high = self.image_mb
        if not 0 < low <= high or self.base_mb >= low:
            raise ValueError(
                f"image sizes {low}-{high} MB with a {self.base_mb} MB base: need "
                "0 < base < min <= max"
            )


@dataclass
class Arm:
    """What one arm saw: each start's latency and the bytes its machine pulled."""

    name: str
    latency_ms: dict[str, float] = field(default_factory=dict)  # machine id -> ms
    pulled: dict[str, int] = field(default_factory=dict)  # machine id -> bytes
    pull_s: dict[str, float] = field(default_factory=dict)  # machine id -> seconds
    unfilled: dict[str, int] = field(default_factory=dict)  # reason -> count
    failed: dict[str, str] = field(default_factory=dict)  # machine id -> state or error


# -- the images --------------------------------------------------------------------------


def write_random_layer(path: Path, name: str, size: int) -> BuiltLayer:
    """An uncompressed tar layer of one file of ``size`` random bytes (random bytes do not
    compress: a gzip layer would cost its pusher the time and save nothing)."""
    sha = hashlib.sha256()

    class Hashing:
        def __init__(self, out: BinaryIO) -> None:
            self.out = out

        def write(self, data: bytes) -> int:
            sha.update(data)
            return self.out.write(data)

    with path.open("wb") as out:
        stream = cast(BinaryIO, Hashing(out))
        with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo(f"data/{name}.bin")
            info.size, info.mode = size, 0o644
            tar.addfile(info, _RandomReader(size))
    digest = "sha256:" + sha.hexdigest()
    size = path.stat().st_size
    return BuiltLayer(Descriptor(media_type=OCI_LAYER, digest=digest, size=size), digest)


class _RandomReader:
    """``size`` random bytes as a file tarfile reads."""

    def __init__(self, size: int) -> None:
        self.left = size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        self.left -= n
        return os.urandom(n)


def _reader(path: Path) -> Callable[[], BinaryIO]:
    return lambda: path.open("rb")


def image_plan(profile: PullsProfile) -> list[list[tuple[str, int]]]:
    """Each image's layers as (name, bytes): a base shared by the images of its pair, then
    one layer of its own (two for odd images), the image ``image_mb`` in all."""
    rng = random.Random(profile.seed)
    low, high = profile.image_mb
    plans = []
    for i in range(profile.images):
        total = rng.randint(low, high) * MB
        own = total - profile.base_mb * MB
        layers = [(f"base{i // 2}", profile.base_mb * MB)]
        if i % 2:
            layers += [(f"img{i}a", own // 2), (f"img{i}b", own - own // 2)]
        else:
            layers.append((f"img{i}", own))
        plans.append(layers)
    return plans


async def push_images(store: ImageStore, profile: PullsProfile, tmp: Path) -> list[ImageInfo]:
    """The profile's images made and pushed as ``pulls-<k>:latest``; what the store says."""
    await anyio.Path(tmp).mkdir(parents=True, exist_ok=True)
    made: dict[str, BuiltLayer] = {}  # a shared base is written and pushed once
    infos = []
    for k, layers in enumerate(image_plan(profile)):
        for name, size in layers:
            if name not in made:
                path = tmp / name
                made[name] = await anyio.to_thread.run_sync(write_random_layer, path, name, size)
                await store.put_blob(Blob(made[name].descriptor, open=_reader(path)))
                await anyio.Path(path).unlink()
        docs = documents([made[name] for name, _ in layers], RUN)
        await store.put_blob(Blob(decode_manifest(docs.manifest, "m").config, docs.config))
        await store.put_blob(Blob(docs.descriptor, docs.manifest))
        await store.set_tag(f"pulls-{k}:latest", docs.descriptor.digest)
        infos.append(await store.inspect(f"pulls-{k}:latest"))
    return infos


# -- the fleet and the stream ------------------------------------------------------------


def fleet_file(path: Path, arm: str, profile: PullsProfile, cache_mb: int) -> Path:
    """The arm's workers: process driver, a cache that holds every image, its pricing."""
    pricing = {"image_weight": 0.0} if arm == "blind" else {"image_half_s": profile.image_half_s}
    workers = [
        {
            "worker_id": f"{arm}-{i + 1}",
            "region": arm,
            "capacity": {"cpus": 8, "memory_mb": 16384},
            "driver": "process",
            "image_cache_mb": cache_mb,
            "pricing": pricing,
        }
        for i in range(profile.workers)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode({"worker": workers}))
    return path


def stream(profile: PullsProfile) -> list[tuple[float, int]]:
    """The orders: (seconds from the start, image index), seeded, images by popularity."""
    rng = random.Random(profile.seed + 1)
    weights = [1 / (k + 1) ** profile.zipf_s for k in range(profile.images)]
    picks = rng.choices(range(profile.images), weights, k=profile.orders)
    return [(i / profile.rate, k) for i, k in enumerate(picks)]


async def start_suppliers(
    url: str, subjects: Subjects, out: Path, profile: PullsProfile, cache_mb: int
) -> list[Program]:
    programs: list[Program] = []
    try:
        for arm in ARMS:
            fleet = fleet_file(out / "config" / f"fleet-{arm}.json", arm, profile, cache_mb)
            programs.append(
                await start_program(
                    "supplier",
                    "run",
                    "--fleet",
                    str(fleet),
                    "--data-dir",
                    str(out / "data" / arm),
                    "--nats",
                    url,
                    "--prefix",
                    subjects.prefix,
                    "--metrics-addr",
                    "off",
                    log_path=out / "logs" / f"supplier-{arm}.log",
                    ready="supplier ready",
                )
            )
    except BaseException:
        await stop_all(programs)
        raise
    return programs


class Pulls:
    """Every ``pulled`` event of the run by machine; ``wait`` until the given machines
    each have one."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self._changed = anyio.Event()

    async def on_event(self, msg: Msg) -> None:
        try:
            event = decode(msg.data, Event)
        except BourseError:  # not an event this run can count: the machine stays unreported
            return
        self.bytes[event.machine_id] = self.bytes.get(event.machine_id, 0) + event.bytes
        self.seconds[event.machine_id] = self.seconds.get(event.machine_id, 0.0) + event.seconds
        self._changed.set()

    async def wait(self, machines: set[str], timeout_s: float) -> None:
        with anyio.move_on_after(timeout_s):
            while not machines <= self.bytes.keys():
                self._changed = anyio.Event()
                await self._changed.wait()


async def _one(client: BourseClient, arm: Arm, ref: str, profile: PullsProfile) -> None:
    order = PlaceOrder(
        region=arm.name,
        resources=ORDER,
        image=ref,
        metadata={"app": "pulls"},
        deadline_ms=profile.deadline_ms,
    )
    sent = time.perf_counter()
    try:
        placed = await client.place(order)
    except (BourseError, nats.errors.Error) as exc:  # counted: the run goes on
        arm.failed[order.order_id] = str(exc) or type(exc).__name__
        return
    if not isinstance(placed, Placed):
        arm.unfilled[placed.reason] = arm.unfilled.get(placed.reason, 0) + 1
        return
    try:
        machine = await client.machine("start", placed.machine_id)
        if machine.state != "started":
            arm.failed[placed.machine_id] = machine.state
            return
        arm.latency_ms[placed.machine_id] = (time.perf_counter() - sent) * 1000
        await anyio.sleep(profile.lifetime_s)  # the machine's life, not a synchronisation
    except BourseError as exc:
        arm.failed[placed.machine_id] = str(exc)
    finally:
        with anyio.CancelScope(shield=True):
            await _destroy(client, arm, placed.machine_id)


async def _destroy(client: BourseClient, arm: Arm, machine_id: str) -> None:
    """Destroy a machine of the run; one its worker did not destroy is counted as failed
    (it goes when the run's suppliers stop)."""
    try:
        await client.machine("destroy", machine_id)
    except BourseError as exc:
        arm.failed.setdefault(machine_id, f"destroy: {exc}")


async def send(
    nc: NATS, subjects: Subjects, infos: list[ImageInfo], profile: PullsProfile
) -> list[Arm]:
    """The stream to both arms at once; each arm's starts, with their pulls."""
    # the direct buyer's auction, listening longer than its default quiet window: a
    # worker unpacking a pull on this small host answers a bid late
    auction = AuctionConfig(quiet_ms=profile.quiet_ms)
    client = BourseClient(nc, subjects, direct=True, auction=auction)
    arms = [Arm(name) for name in ARMS]
    pulls = Pulls()
    sub = await nc.subscribe(subjects.events(kind="pulled"), cb=pulls.on_event)
    try:
        began = anyio.current_time()
        async with anyio.create_task_group() as tasks:
            for at, k in stream(profile):
                # open loop: each order at its time, whatever the ones before it do
                await anyio.sleep_until(began + at)
                for arm in arms:
                    ref = f"pulls-{k}:latest"
                    tasks.start_soon(_one, client, arm, ref, profile)
        started = {m for arm in arms for m in arm.latency_ms}
        await pulls.wait(started, timeout_s=30)
    finally:
        await sub.unsubscribe()
    for arm in arms:
        arm.pulled = {m: pulls.bytes[m] for m in arm.latency_ms if m in pulls.bytes}
        arm.pull_s = {m: pulls.seconds[m] for m in arm.pulled}
    return arms


# -- the run and its report --------------------------------------------------------------


async def run_pulls(profile: PullsProfile, out: Path, say: Say) -> dict[str, Any]:
    """One run: an embedded nats-server, the store, both arms; the report (also written to
    ``out/report.json``)."""
    fresh_run_dir(out)
    server = EmbeddedNats(workdir=out / "nats", tie_to_parent=True).start()
    subjects = Subjects(f"pl{os.urandom(4).hex()}")
    programs: list[Program] = []
    try:
        nc = await connect([server.url], name="bourse-pulls", service=False)
        try:
            await set_up(nc, subjects, EventStream.of(subjects), replicas=1)
            store = await ImageStore.open(nc, subjects.prefix)
            say(f"making and pushing {profile.images} images of {profile.image_mb} MB...")
            t = time.perf_counter()
            infos = await push_images(store, profile, out / "images")
            pushed_s = time.perf_counter() - t
            stored = sum(x.size for x in {lay for i in infos for lay in i.layers})
            # every image fits every worker: a run is too short for the cache's delay
            # before eviction (180 s), so the arms differ by where orders land only
            cache_mb = 2 * stored // (1 << 20) + 64
            say(f"starting {profile.workers} workers per arm ({', '.join(ARMS)})...")
            programs = await start_suppliers(server.url, subjects, out, profile, cache_mb)
            say(f"sending {profile.orders} orders at {profile.rate}/s to each arm...")
            t = time.perf_counter()
            arms = await send(nc, subjects, infos, profile)
            load_s = time.perf_counter() - t
        finally:
            await shutdown(nc)
    finally:
        await stop_all(programs)
        server.stop()
    rep = build_report(profile, arms, infos, stored, pushed_s, load_s)
    (out / "report.json").write_bytes(msgspec.json.format(msgspec.json.encode(rep)))
    return rep


def build_report(
    profile: PullsProfile,
    arms: list[Arm],
    infos: list[ImageInfo],
    stored: int,
    pushed_s: float,
    load_s: float,
) -> dict[str, Any]:
    return {
        "scenario": "pulls",
        "profile": asdict(profile),
        "images": [{"digest": i.digest, "bytes": sum(x.size for x in i.layers)} for i in infos],
        "stored_bytes": stored,
        "push_seconds": round(pushed_s, 2),
        "load_seconds": round(load_s, 2),
        "arms": {arm.name: arm_report(arm) for arm in arms},
    }


def arm_report(arm: Arm) -> dict[str, Any]:
    hist = HdrHistogram(1, 600_000, 3)  # milliseconds
    for ms in arm.latency_ms.values():
        hist.record_value(max(1, round(ms)))
    starts = len(arm.latency_ms)
    pulled = sum(arm.pulled.values())
    pulling = [m for m, b in arm.pulled.items() if b > 0]
    seconds = sum(arm.pull_s[m] for m in pulling)
    return {
        "starts": starts,
        "unfilled": arm.unfilled,
        "failed": arm.failed,
        "start_p50_ms": hist.get_value_at_percentile(50) if starts else None,
        "start_p99_ms": hist.get_value_at_percentile(99) if starts else None,
        "pulled_bytes": pulled,
        "pulled_bytes_per_start": round(pulled / starts) if starts else None,
        "hit_rate": round(1 - len(pulling) / len(arm.pulled), 3) if arm.pulled else None,
        "pulls": len(pulling),
        "pull_mb_per_s": round(pulled / seconds / (1 << 20), 1) if seconds else None,
        "unreported": starts - len(arm.pulled),
    }


def table(rep: dict[str, Any]) -> Table:
    """The report for people: one row per arm."""
    p = rep["profile"]
    title = (
        f"pulls: {len(rep['images'])} images of {p['image_mb'][0]}-{p['image_mb'][1]} MB, "
        f"{p['orders']} orders at {p['rate']}/s to each arm, {p['workers']} workers per arm"
    )
    out = Table(title=title, box=None, padding=(0, 1), title_justify="left")
    columns = ("arm", "starts", "p50 ms", "p99 ms", "MB/start", "hits", "pulls", "MiB/s")
    for column in (*columns, "unfilled", "failed"):
        out.add_column(column, justify="right", min_width=len(column))
    for name, a in rep["arms"].items():
        per_start = a["pulled_bytes_per_start"]
        out.add_row(
            name,
            str(a["starts"]),
            str(a["start_p50_ms"]),
            str(a["start_p99_ms"]),
            "-" if per_start is None else f"{per_start / MB:.1f}",
            str(a["hit_rate"]),
            str(a["pulls"]),
            str(a["pull_mb_per_s"]),
            str(sum(a["unfilled"].values())),
            str(len(a["failed"])),
        )
    return out


def profile_of(given: dict[str, Any]) -> PullsProfile:
    """The profile of the command's options: ``duration_s`` times ``rate`` orders,
    ``image_mb`` as ``MIN-MAX``. ValueError names what is wrong."""
    fields = dict(given)
    if "image_mb" in fields:
        low, sep, high = str(fields["image_mb"]).partition("-")
        if not (sep and low.isdigit() and high.isdigit()):
            raise ValueError(f"--image-mb {fields['image_mb']!r}: expected MIN-MAX, e.g. 20-200")
        fields["image_mb"] = (int(low), int(high))
    duration_s = fields.pop("duration_s", None)
    profile = PullsProfile(**fields)
    if duration_s is not None:
        profile = replace(profile, orders=max(1, round(duration_s * profile.rate)))
    return profile
