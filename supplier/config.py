"""What a worker sells and how it prices: its identity, capacity, labels, images, curves.

A single worker comes from ``supplier run`` flags; a fleet of virtual workers sharing one
process and one NATS connection comes from a TOML (or JSON) file (``--fleet FILE``):

    [defaults]
    data_dir = "/var/lib/bourse"

    [[worker]]
    worker_id = "mad-1"
    region = "mad"
    capacity = { cpus = 16, memory_mb = 65536, disk_mb = 500000 }
    labels = { disk = "ssd" }
    images = ["web", "db"]
    pricing = { preset = "binpack" }
    ports = "20000-20999"

A capacity's ``cpus`` may be fractional, as people write it: ``cpus = 0.5`` or
``cpus = "1500m"`` (millicores); it becomes the wire's ``cpus`` + ``cpu_millis``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from bourse.errors import BourseError
from bourse.runtime.words import in_words
from bourse.wire.codec import validation_detail
from bourse.wire.limits import MAX_HOLD_MS
from bourse.wire.messages import EXCHANGE_EVENT_WORKER, Amount, Image, Labels, Region, WorkerId
from bourse.wire.resources import vec, wire_cpus
from supplier.machines.host.confine import (
    DEFAULT_PIDS_MAX,
    ConfineChoice,
    ConfineError,
    Confiner,
)
from supplier.machines.host.network import machine_net_problem
from supplier.machines.host.output import LogCaps
from supplier.machines.oci.runtime import RUNTIMES, RuntimeUnavailable, detect
from supplier.machines.process import ImageSpec
from supplier.machines.shim.logfiles import DEFAULT_MACHINE_LOG_MB, DEFAULT_WORKER_LOG_MB
from supplier.ports import PortError, PortRange, overlap
from supplier.pricing import PricingConfig, build_curves

# The longest a worker holds capacity for a bid it offers on, whatever the bid's hold_ms
# asks (docs/security.md: a bid, even an unauthenticated one, may not lock capacity for a
# minute). The auction asks deadline + 250 ms (750 ms by default), and commits within
# milliseconds of the offer, so this is rarely reached.
DEFAULT_MAX_HOLD_MS = 5000

DriverName = Literal["sim", "process", "oci"]
TenantImages = Literal["isolated", "oci-only", "allow"]
TENANT_IMAGES: tuple[TenantImages, ...] = ("isolated", "oci-only", "allow")
DEFAULT_TENANT_IMAGES: TenantImages = "isolated"


class WorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    worker_id: WorkerId
    region: Region
    capacity: Amount
    labels: Labels = {}
    images: list[Image] = []  # cached at start
    pricing: PricingConfig = msgspec.field(default_factory=PricingConfig)
    draining: bool = False
    # How machines run: "sim" (none: simulated), "process" (supervised processes), "oci"
    # (containers of content images through runc or crun: supplier/machines/oci/kind.py).
    driver: DriverName = "sim"
    # Process and oci drivers: machines are held by shims of their own and run on when the
    # supplier stops or dies (the next one adopts them), or stop with it (false). Unset:
    # supplier run's --keep-machines (its default) or --machines-stop-with-supplier; a
    # worker driven in-process without a value stops them.
    keep_machines: bool | None = None
    # Process and oci drivers: each machine its own users and mounts ("auto": where the
    # supplier is root; supplier/machines/host/ids.py), or as the supplier ("off").
    isolate: Literal["auto", "off"] = "auto"
    # Where a tenant's orders may run (docs/protocol.md §6.8e): "isolated" (machines with
    # users and a network of their own), "oci-only" (only such containers), "allow"
    # (anywhere). Unset: supplier run --tenant-images, else DEFAULT_TENANT_IMAGES.
    tenant_images: TenantImages | None = None
    # The addresses its machines' private networks are drawn from: a /24 of it per worker,
    # claimed on the host, never one of the host's own networks. Unset: BOURSE_MACHINE_NET,
    # else 10.77.0.0/16 (supplier/machines/host/network.py).
    machine_net: Annotated[str, msgspec.Meta(max_length=32)] = ""
    # The oci driver's runtime: the first usable of runc and crun ("auto"), or that one.
    oci_runtime: Literal["auto", "runc", "crun"] = "auto"
    # Images this worker knows (the process driver runs only these); sim runs any image.
    catalog: dict[Image, ImageSpec] = {}
    # LRU budget of the image cache; default: a fifth of the disk, at least 10 GiB.
    image_cache_mb: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # The most an image's layers may unpack to, in all (bourse/images/bounds.py: a pull
    # stops the moment it passes this, a layer's recorded size or the cache's budget left).
    # Unset: supplier run --max-image-mb, else DEFAULT_MAX_IMAGE_MB.
    max_image_mb: Annotated[int, msgspec.Meta(ge=1)] | None = None
    pull_mb_per_s: Annotated[float, msgspec.Meta(ge=0)] = 1000.0  # sim pull speed
    # Process driver: how machines are confined (supplier/machines/host/confine.py): "auto" takes
    # the first usable of cgroup2, cgroup1, rlimit; naming one forces it (an error at start
    # if the host cannot). pids_max: each machine's process limit. cgroup_parent: the cgroup
    # (from the hierarchy's root) under which the worker makes bourse/<owner>/<worker_id>/
    # (owner: its supplier's data dir, hashed); default the supplier's own cgroup.
    confine: ConfineChoice = "auto"
    pids_max: Annotated[int, msgspec.Meta(ge=8, le=4_194_304)] = DEFAULT_PIDS_MAX
    cgroup_parent: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    # Cap on a bid's hold_ms here; unset: supplier run --max-hold-ms, else DEFAULT_MAX_HOLD_MS.
    max_hold_ms: Annotated[int, msgspec.Meta(ge=1, le=MAX_HOLD_MS)] | None = None
    # Process driver: a machine's output is kept in two files of at most machine_log_mb MiB
    # each (<id>.log, <id>.log.1); all the worker's machine logs together take at most
    # worker_log_mb MiB (supplier/machines/shim/logfiles.py). Unset: supplier run --machine-log-mb /
    # --worker-log-mb, else DEFAULT_MACHINE_LOG_MB / DEFAULT_WORKER_LOG_MB.
    machine_log_mb: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    worker_log_mb: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)] | None = None
    # The host ports its machines' named ports are given ("20000-20999", docs/protocol.md
    # §4.2a); workers on one host must not overlap. Unset: a sim worker has none, any other
    # takes a free default block of its host (supplier/ports.py), kept across restarts.
    ports: Annotated[str, msgspec.Meta(max_length=32)] = ""
    # The host its machines' addresses name; unset: supplier run --advertise-host, else the
    # host's primary address (supplier/ports.py default_host).
    advertise_host: Annotated[str, msgspec.Meta(max_length=255)] = ""

    @property
    def runtimes(self) -> tuple[str, ...]:
        """The OCI runtimes the oci driver may use, in order of preference."""
        return RUNTIMES if self.oci_runtime == "auto" else (self.oci_runtime,)

    @property
    def hold_cap_ms(self) -> int:
        return self.max_hold_ms if self.max_hold_ms is not None else DEFAULT_MAX_HOLD_MS

    @property
    def log_caps(self) -> LogCaps:
        """How much of its machines' output the worker keeps on disk."""
        return LogCaps(
            machine_mb=self.machine_log_mb or DEFAULT_MACHINE_LOG_MB,
            worker_mb=self.worker_log_mb or DEFAULT_WORKER_LOG_MB,
        )

    @property
    def port_range(self) -> PortRange | None:
        """Its port range (checked by check_workers), None without one."""
        return PortRange.parse(self.ports) if self.ports else None

    @property
    def image_budget_mb(self) -> int:
        if self.image_cache_mb is not None:
            return self.image_cache_mb
        return max(self.capacity.disk_mb // 5, 10 * 1024)


class FleetFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    worker: list[WorkerConfig]


class ConfigError(BourseError, ValueError):
    """A fleet file or worker flags that cannot describe a worker; the message names the
    file, the worker and the offending field."""


def load_fleet(path: str | Path) -> list[WorkerConfig]:
    """Read a fleet file (TOML, or JSON if it ends in .json); errors name the file and the
    offending field."""
    path = Path(path)
    try:
        text = path.read_text()
        raw = msgspec.json.decode(text) if path.suffix == ".json" else tomllib.loads(text)
    except OSError as exc:
        raise ConfigError(f"cannot read fleet file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, msgspec.DecodeError) as exc:
        raise ConfigError(f"fleet file {path} is malformed: {exc}") from None
    try:
        fleet = msgspec.convert(fractional_cpus(raw), FleetFile, strict=True)
    except ConfigError as exc:
        raise ConfigError(f"fleet file {path}: {exc}") from None
    except msgspec.ValidationError as exc:
        raise ConfigError(f"fleet file {path}: {in_words(validation_detail(exc))}") from None
    if not fleet.worker:
        raise ConfigError(f"fleet file {path} lists no workers (one [[worker]] table each)")
    check_workers(fleet.worker)
    return fleet.worker


def fractional_cpus(raw: object) -> object:
    """A fleet file's data with each worker's ``capacity.cpus`` as the wire has it (``0.5``
    or ``"250m"`` -> ``cpus`` rounded up + ``cpu_millis``); anything else is left for the
    strict conversion to judge."""
    if not isinstance(raw, dict) or not isinstance(raw.get("worker"), list):
        return raw
    workers = []
    for i, w in enumerate(raw["worker"]):
        if isinstance(w, dict) and isinstance(w.get("capacity"), dict):
            try:
                w = {**w, "capacity": wire_cpus(w["capacity"])}
            except ValueError as exc:
                raise ConfigError(f"{exc} - at `$.worker[{i}].capacity.cpus`") from None
        workers.append(w)
    return {**raw, "worker": workers}


def unrunnable_images(w: WorkerConfig) -> list[str]:
    """The images a worker lists as cached that its driver cannot run: a process worker
    runs a catalog image only when its catalog gives it a command; an oci worker runs only
    images pushed to the market's store (by tag or digest), never a catalog image; sim runs
    anything (nothing runs)."""
    if w.driver == "sim":
        return []
    if w.driver == "oci":
        return list(w.images)
    return [i for i in w.images if not (i in w.catalog and w.catalog[i].command)]


def check_workers(workers: list[WorkerConfig]) -> None:
    """Raise ConfigError unless the workers can be served together: unique ids, a capacity
    of more than 0 CPUs (a millicore at least) and 1 MB of memory, pricing curves that build,
    port ranges that parse and do not overlap."""
    seen: set[str] = set()
    ranges: list[tuple[str, PortRange]] = []
    for w in workers:
        if w.worker_id in seen:
            raise ConfigError(f"worker id {w.worker_id!r} appears twice")
        if w.worker_id == EXCHANGE_EVENT_WORKER:
            raise ConfigError(
                f"worker id {w.worker_id!r} is reserved: the exchange publishes order outcomes "
                "under it (docs/protocol.md §6.9)"
            )
        seen.add(w.worker_id)
        if vec(w.capacity)[0] < 1 or w.capacity.memory_mb < 1:
            raise ConfigError(f"worker {w.worker_id}: capacity needs cpus > 0 and memory_mb >= 1")
        try:
            build_curves(w.pricing)
        except ValueError as exc:
            raise ConfigError(f"worker {w.worker_id}: {exc}") from None
        if w.driver == "oci":  # a host without a usable runtime: one line naming what to install
            try:
                detect(w.runtimes)
            except RuntimeUnavailable as exc:
                raise ConfigError(f"worker {w.worker_id}: driver oci: {exc}") from None
        if w.machine_net:
            why = machine_net_problem(w.machine_net)
            if why:
                raise ConfigError(f"worker {w.worker_id}: machine_net {w.machine_net!r}: {why}")
        if w.capacity.ports:
            raise ConfigError(
                f"worker {w.worker_id}: capacity.ports: give it a port range instead "
                '(ports = "FIRST-LAST")'
            )
        try:
            r = w.port_range
        except PortError as exc:
            raise ConfigError(f"worker {w.worker_id}: {exc}") from None
        if r is not None:
            ranges.append((w.worker_id, r))
        if w.driver == "process" and w.confine != "auto":  # forced: the host must offer it
            try:  # (whether it does: no owner needed, nothing is made)
                Confiner.probe(w.confine, w.worker_id, owner="", cgroup_parent=w.cgroup_parent)
            except ConfineError as exc:
                raise ConfigError(f"worker {w.worker_id}: {exc}") from None
    clash = overlap(ranges)
    if clash:
        raise ConfigError(f"{clash}: workers of one host need ranges apart")
