"""Confinement: a process-driver machine runs within what was sold (CPU, memory, processes).

Which mechanism a worker uses is decided once, at start, from what the host offers (the
first that works, or the one ``WorkerConfig.confine`` forces):

- ``cgroup2``: a cgroup2 hierarchy whose parent cgroup *has* the ``cpu``, ``memory`` and
  ``pids`` controllers (its ``cgroup.controllers`` lists them) and lets the supplier enable
  them for its subtree; per machine ``cpu.max``, ``memory.max``, ``memory.swap.max = 0``,
  ``pids.max``. A cgroup2 mount without those controllers (a hybrid host, where they are
  bound to v1 hierarchies) is not usable: detected from ``cgroup.controllers``, not from
  path names.
- ``cgroup1``: writable v1 hierarchies for ``cpu``, ``memory`` and ``pids``; per machine
  ``cpu.cfs_quota_us``/``cpu.cfs_period_us``, ``memory.limit_in_bytes`` (and
  ``memory.memsw.limit_in_bytes`` at the same value when the kernel accounts swap, so a
  machine cannot swap past its memory), ``pids.max``. A ``cpuacct`` hierarchy, when
  mounted, is joined too (for the usage counter ``cpuacct.usage``).
- ``rlimit``: no writable cgroups. ``RLIMIT_DATA`` caps memory (heap and private mappings:
  an allocation past it fails instead of the process being killed); ``RLIMIT_NPROC`` caps
  processes, but it counts every process of the user (so it is set to the user's count at
  spawn plus the machine's allowance) and root is exempt from it. CPU is not enforced.
- ``none``: nothing (the sim driver; or forced).

The subtree: ``<hierarchy>/<parent>/bourse/<owner>/<worker_id>/<machine_id>``, where
``parent`` is ``WorkerConfig.cgroup_parent`` or, by default, the supplier's own cgroup in
that hierarchy (``/proc/self/cgroup``), so machines nest inside whatever confines the
supplier itself; and ``owner`` names the supplier's data dir (:func:`owner_of`), so a
supplier sweeps only its own leftovers, never the machines of another supplier on the host
that serves the same worker id (another market, another data dir).

This module is the pure part (parsing /proc, the choice, the limit arithmetic, reading an
exit) plus :class:`Confiner`, the thin shell that touches /sys and is used by
supplier/drivers/process.py. The process joins its cgroups in the exec wrapper
(bourse/runtime/reaper.py ``--cgroup``/``--rlimit``), before it execs the image's command.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import structlog

from bourse.errors import BourseError
from bourse.wire.messages import Resources
from bourse.wire.resources import millis_of
from supplier.machines.api import Mechanism
from supplier.machines.shim import teardown

log = structlog.get_logger("bourse.driver.confine")

ConfineChoice = Literal["auto", "cgroup2", "cgroup1", "rlimit", "none"]
MECHANISMS: tuple[Mechanism, ...] = ("cgroup2", "cgroup1", "rlimit", "none")
CGROUP_MECHANISMS = ("cgroup2", "cgroup1")
V1_REQUIRED = ("cpu", "memory", "pids")
V1_OPTIONAL = ("cpuacct",)  # joined when mounted: its usage counter
V2_REQUIRED = ("cpu", "memory", "pids")
CPU_PERIOD_US = 100_000
CPU_QUOTA_MIN_US = 1_000  # the kernel refuses a CFS quota under 1 ms
CPU_PERIOD_MAX_US = 1_000_000  # ... and a CFS period over 1 s
# Below this a cgroup cannot hold a process at all (the kernel's own page tables, the
# binary); an order asking for less is declined (``too_small_to_confine``).
MIN_MEMORY_MB = 4
DEFAULT_PIDS_MAX = 256
MIB = 1024 * 1024
SUBTREE = "bourse"


class ConfineError(BourseError, RuntimeError):
    """A cgroup could not be made, written or removed."""


# -- pure: limits --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Limits:
    millicores: int
    memory_bytes: int
    pids: int


def limits_for(r: Resources, pids_max: int) -> Limits:
    """What a machine of these resources may use (``cpu_millis`` when the order has it)."""
    return Limits(millicores=millis_of(r), memory_bytes=r.memory_mb * MIB, pids=pids_max)


def cpu_quota(millicores: int) -> tuple[int, int]:
    """CFS quota and period for ``millicores`` (1000 = one CPU): 500 -> (50000, 100000).
    A share too small for a 1 ms quota per 100 ms period (under 10 millicores) gets the
    longest period the kernel allows instead, so it is still exact: 1 -> (1000, 1000000),
    1 ms of CPU per second."""
    if millicores < 1:
        raise ValueError(f"millicores must be >= 1, not {millicores}")
    period = CPU_PERIOD_US
    if millicores * period // 1000 < CPU_QUOTA_MIN_US:
        period = CPU_PERIOD_MAX_US  # 1 ms per millicore: at least the minimum quota
    return millicores * period // 1000, period


def v2_files(lim: Limits) -> list[tuple[str, str]]:
    """(file, value) to write in a machine's cgroup2 directory, in order."""
    quota, period = cpu_quota(lim.millicores)
    return [
        ("cpu.max", f"{quota} {period}"),
        ("memory.max", str(lim.memory_bytes)),
        ("memory.swap.max", "0"),
        ("pids.max", str(lim.pids)),
    ]


def v1_files(lim: Limits, memsw: bool) -> list[tuple[str, str, str]]:
    """(controller, file, value) to write in a machine's v1 directories, in order (the
    memory limit before memsw: memsw may not be below it)."""
    quota, period = cpu_quota(lim.millicores)
    files = [
        ("cpu", "cpu.cfs_period_us", str(period)),
        ("cpu", "cpu.cfs_quota_us", str(quota)),
        ("memory", "memory.limit_in_bytes", str(lim.memory_bytes)),
    ]
    if memsw:
        files.append(("memory", "memory.memsw.limit_in_bytes", str(lim.memory_bytes)))
    files.append(("pids", "pids.max", str(lim.pids)))
    return files


def rlimits(lim: Limits, user_processes: int) -> list[tuple[str, int]]:
    """(resource name, value) for the exec wrapper: memory as RLIMIT_DATA; processes as
    RLIMIT_NPROC, which counts all the user's processes: theirs now plus the allowance."""
    return [("DATA", lim.memory_bytes), ("NPROC", user_processes + lim.pids)]


def too_small(memory_mb: int, mechanism: Mechanism) -> str:
    """Why a machine of ``memory_mb`` cannot be confined here, or ""."""
    if mechanism == "none" or memory_mb >= MIN_MEMORY_MB:
        return ""
    return (
        f"memory_mb {memory_mb} is below the {MIN_MEMORY_MB} MiB this worker can confine"
        f" ({mechanism})"
    )


def owner_of(data_dir: Path) -> str:
    """What owns a worker's cgroups on this host: its supplier's data dir, by its real path
    (12 hex digits). One data dir has one supplier at a time (its lock), so its leftovers
    are its own."""
    return hashlib.blake2b(os.fsencode(data_dir.resolve()), digest_size=6).hexdigest()


# -- pure: what the host offers, and the choice --------------------------------------------------
@dataclass(frozen=True, slots=True)
class Mounts:
    v2: str | None = None  # the cgroup2 mount point
    v1: dict[str, str] = field(default_factory=dict)  # controller -> mount point
    # A cgroup2 mount has ``favordynmods``: moving a process between cgroups (any hierarchy:
    # the kernel's lock for it is one) does not wait for an RCU grace period, 5-20 ms a
    # start's first move on a host without it (docs/operations.md, "Host tuning").
    favors_moves: bool = False


def parse_mountinfo(text: str) -> Mounts:
    """cgroup mounts from /proc/self/mountinfo (a v1 mount's super options name its
    controllers, e.g. ``rw,cpu,cpuacct``)."""
    v2: str | None = None
    v1: dict[str, str] = {}
    favors = False
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        point, fstype, options = fields[4], rest[0], rest[2].split(",")
        if fstype == "cgroup2":
            v2 = v2 or point
            favors = favors or "favordynmods" in options
        elif fstype == "cgroup":
            for opt in options:
                if opt in V1_REQUIRED or opt in V1_OPTIONAL:
                    v1.setdefault(opt, point)
    return Mounts(v2=v2, v1=v1, favors_moves=favors)


def moves_favored() -> bool:
    """Whether this host's cgroup moves skip the kernel's wait (:attr:`Mounts.favors_moves`)."""
    try:
        return parse_mountinfo(_read(Path("/proc/self/mountinfo"))).favors_moves
    except OSError:
        return False


def parse_proc_cgroup(text: str) -> tuple[str, dict[str, str]]:
    """(the cgroup2 path, {v1 controller: path}) from /proc/<pid>/cgroup."""
    v2 = "/"
    v1: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        for c in controllers.split(","):
            if c:
                v1[c] = path
    return v2, v1


@dataclass(frozen=True, slots=True)
class Offer:
    """What the probe found: whether each mechanism works, and why not when it does not."""

    cgroup2: str = "not probed"  # "" when usable, else why not
    cgroup1: str = "not probed"
    rlimit: str = ""


def choose(want: ConfineChoice, offer: Offer) -> tuple[Mechanism, str]:
    """The mechanism to use and, when it cannot be had, why (mechanism "" is not returned:
    a forced one that is not usable is an error the caller raises)."""
    why = {"cgroup2": offer.cgroup2, "cgroup1": offer.cgroup1, "rlimit": offer.rlimit, "none": ""}
    if want != "auto":
        return want, why[want]
    for m in MECHANISMS:
        if not why[m]:
            return m, ""
    return "none", ""


def weaker_than_cgroups(m: Mechanism) -> bool:
    return m not in CGROUP_MECHANISMS


# -- the shell ------------------------------------------------------------------------------------
def _read(path: Path) -> str:
    return path.read_text()


def _write(path: Path, value: str) -> None:
    try:
        with path.open("w") as f:
            f.write(value)
    except OSError as exc:
        raise ConfineError(f"cannot write {value!r} to {path}: {exc.strerror}") from None


def _user_processes(uid: int) -> int:
    n = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                n += entry.stat().st_uid == uid
    return n


class Confiner:
    """One worker's confinement: its mechanism and its cgroup subtree (if any)."""

    def __init__(
        self,
        mechanism: Mechanism,
        worker_id: str,
        pids_max: int = DEFAULT_PIDS_MAX,
        bases: dict[str, Path] | None = None,
    ) -> None:
        self.mechanism: Mechanism = mechanism
        self.worker_id = worker_id
        self.pids_max = pids_max
        # cgroup1: controller -> the worker's directory; cgroup2: {"": directory}
        self.bases = bases or {}

    @classmethod
    def probe(
        cls,
        want: ConfineChoice,
        worker_id: str,
        *,
        owner: str,
        pids_max: int = DEFAULT_PIDS_MAX,
        cgroup_parent: str = "",
    ) -> tuple[Confiner, Offer]:
        """Look at the host, choose, and return the confiner of ``worker_id`` of the
        supplier ``owner`` (:func:`owner_of` its data dir), and what was found. A forced
        mechanism that is not usable raises ConfineError naming why."""
        try:
            mounts = parse_mountinfo(_read(Path("/proc/self/mountinfo")))
            own_v2, own_v1 = parse_proc_cgroup(_read(Path("/proc/self/cgroup")))
        except OSError:
            mounts, own_v2, own_v1 = Mounts(), "/", {}
        subtree = Path(SUBTREE, owner, worker_id)
        v2_base, v2_why = _probe_v2(mounts, own_v2, cgroup_parent, subtree)
        v1_bases, v1_why = _probe_v1(mounts, own_v1, cgroup_parent, subtree)
        offer = Offer(cgroup2=v2_why, cgroup1=v1_why, rlimit="")
        mechanism, why = choose(want, offer)
        if why:
            raise ConfineError(f"confine = {mechanism} is not usable here: {why}")
        if mechanism in CGROUP_MECHANISMS and not mounts.favors_moves:
            log.info(
                "cgroup_moves_wait",
                worker_id=worker_id,
                detail="each machine's move into its cgroups waits for the kernel (5-20 ms "
                "a start): `mount -o remount,favordynmods <the cgroup2 mount>` makes it "
                "sub-millisecond (docs/operations.md, Host tuning)",
            )
        bases: dict[str, Path] = {}
        if mechanism == "cgroup2" and v2_base is not None:
            bases = {"": v2_base}
        elif mechanism == "cgroup1":
            bases = v1_bases
        return cls(mechanism, worker_id, pids_max, bases), offer

    # -- per machine -------------------------------------------------------------------------------
    def dirs(self, machine_id: str) -> dict[str, Path]:
        return {c: base / machine_id for c, base in self.bases.items()}

    def prepare(self, machine_id: str, r: Resources) -> tuple[list[str], list[str]]:
        """Make the machine's cgroups (killing leftovers of an earlier run in them) and
        write its limits; returns what its shim applies before its command runs: the
        ``cgroup.procs`` files to join and the rlimits to set (``NAME=VALUE``)."""
        lim = limits_for(r, self.pids_max)
        if self.mechanism == "rlimit":
            return [], [f"{n}={v}" for n, v in rlimits(lim, _user_processes(os.getuid()))]
        if self.mechanism == "none":
            return [], []
        dirs = self.dirs(machine_id)
        self.kill_all(machine_id)  # leftovers of a supplier that died
        if self.mechanism == "cgroup2":
            d = dirs[""]
            _enable_v2(d.parent)
            _mkdir(d)
            for name, value in v2_files(lim):
                _write(d / name, value)
        else:
            for d in dirs.values():
                _mkdir(d)
            memsw = (dirs["memory"] / "memory.memsw.limit_in_bytes").exists()
            for controller, name, value in v1_files(lim, memsw):
                _write(dirs[controller] / name, value)
        procs = dict.fromkeys(str(d / "cgroup.procs") for d in dirs.values())  # co-mounted: once
        return list(procs), []

    def oom_files(self, machine_id: str) -> list[str]:
        """The file that counts the machine's OOM kills (none without a memory cgroup)."""
        d = self.dirs(machine_id)
        if self.mechanism == "cgroup2":
            return [str(d[""] / "memory.events")]
        if self.mechanism == "cgroup1":
            return [str(d["memory"] / "memory.oom_control")]
        return []

    def usage_ns(self, machine_id: str) -> int | None:
        """CPU time the machine's cgroup used (ns), from the cgroup's own counter."""
        d = self.dirs(machine_id)
        try:
            if self.mechanism == "cgroup2":
                for line in _read(d[""] / "cpu.stat").splitlines():
                    key, _, value = line.partition(" ")
                    if key == "usage_usec":
                        return int(value) * 1000
            elif "cpuacct" in d:
                return int(_read(d["cpuacct"] / "cpuacct.usage"))
        except OSError:
            return None
        return None

    def pids(self, machine_id: str) -> list[int]:
        """Processes in the machine's cgroup (empty when it has none, or no cgroup)."""
        d = self.dirs(machine_id)
        if not d:
            return []
        key = "" if self.mechanism == "cgroup2" else "pids"
        try:
            return [int(p) for p in _read(d[key] / "cgroup.procs").split()]
        except OSError:
            return []

    def kill_all(self, machine_id: str) -> None:
        """SIGKILL every process in the machine's cgroups until they are empty (bounded)."""
        left = teardown.kill_cgroups([str(d) for d in set(self.dirs(machine_id).values())])
        if left:
            log.warning("cgroup_not_empty", machine_id=machine_id, pids=left)

    def remove(self, machine_id: str) -> None:
        """Kill what is left in the machine's cgroups and remove them."""
        left = teardown.remove_cgroups([str(d) for d in set(self.dirs(machine_id).values())])
        if left:
            log.warning("cgroup_not_removed", machine_id=machine_id, paths=left)

    def cgroup_dirs(self, machine_id: str) -> list[str]:
        """The machine's cgroup directories, one per hierarchy (co-mounted ones once)."""
        return sorted({str(d) for d in self.dirs(machine_id).values()})

    def sweep(self, remove_base: bool = False, keep: Collection[str] = ()) -> list[str]:
        """Remove every machine cgroup of this worker of this supplier but those of the
        machines in ``keep`` (at the driver's start: leftovers of its run that died, beside
        the machines their shims still hold; at its end: none should be left), and with
        ``remove_base`` the worker's own directories and the supplier's above them, when
        empty; returns the machines it removed. Bourse's own directory above every
        supplier's stays: removed by one supplier while another makes its directories
        below it, the other's make would fail."""
        gone: set[str] = set()
        for base in self.bases.values():
            if base.is_dir():
                for d in base.iterdir():
                    if d.is_dir() and d.name not in keep:
                        self.remove(d.name)
                        gone.add(d.name)
        if remove_base:
            for base in set(self.bases.values()):
                _rmdir(base, wait=False)
                _rmdir(base.parent, wait=False)  # the supplier's, if no other worker uses it
        return sorted(gone)


def _mkdir(d: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfineError(f"cannot make cgroup {d}: {exc.strerror}") from None


def _rmdir(d: Path, wait: bool = True) -> None:
    """Remove an empty cgroup (a cgroup directory's files are not removable: rmdir it).
    ``wait``: retry while it is busy (its killed processes are still leaving), up to 1 s."""
    for _ in range(200 if wait else 1):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                log.warning("cgroup_not_removed", path=str(d), error=exc.strerror)
                return
            time.sleep(0.005)  # a pace: the killed processes' exit is under way


def _enable_v2(d: Path) -> None:
    """Enable the controllers for ``d``'s children, and for each ancestor up to the parent
    the probe checked (which has them in cgroup.controllers)."""
    chain = [d.parent, d]
    for c in chain:
        _mkdir(c)
        have = set(_read(c / "cgroup.subtree_control").split())
        missing = [x for x in V2_REQUIRED if x not in have]
        if missing:
            _write(c / "cgroup.subtree_control", " ".join(f"+{x}" for x in missing))


def _parent_path(own: str, cgroup_parent: str) -> str:
    return (cgroup_parent or own).strip("/")


def _probe_v2(
    mounts: Mounts, own: str, cgroup_parent: str, subtree: Path
) -> tuple[Path | None, str]:
    if mounts.v2 is None:
        return None, "no cgroup2 mount"
    parent = Path(mounts.v2) / _parent_path(own, cgroup_parent)
    try:
        have = set(_read(parent / "cgroup.controllers").split())
    except OSError as exc:
        return None, f"cannot read {parent}/cgroup.controllers: {exc.strerror}"
    missing = [c for c in V2_REQUIRED if c not in have]
    if missing:
        return None, f"cgroup2 at {parent} lacks the {', '.join(missing)} controller(s)"
    if not os.access(parent, os.W_OK):
        return None, f"{parent} is not writable"
    try:  # the parent must let its children have them (fails if it has processes itself)
        enabled = set(_read(parent / "cgroup.subtree_control").split())
        missing = [c for c in V2_REQUIRED if c not in enabled]
        if missing:
            _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))
    except (OSError, ConfineError) as exc:
        return None, f"cannot enable controllers below {parent}: {exc}"
    return parent / subtree, ""


def _probe_v1(
    mounts: Mounts, own: dict[str, str], cgroup_parent: str, subtree: Path
) -> tuple[dict[str, Path], str]:
    bases: dict[str, Path] = {}
    for c in (*V1_REQUIRED, *V1_OPTIONAL):
        point = mounts.v1.get(c)
        if point is None:
            if c in V1_REQUIRED:
                return {}, f"no cgroup v1 {c} hierarchy"
            continue
        parent = Path(point) / _parent_path(own.get(c, "/"), cgroup_parent)
        if not (parent / "cgroup.procs").exists() or not os.access(parent, os.W_OK):
            if c in V1_REQUIRED:
                return {}, f"cgroup v1 {c} at {parent} is not writable"
            continue
        bases[c] = parent / subtree
    return bases, ""
