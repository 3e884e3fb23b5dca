"""The OCI runtime bundle of one container machine: its ``config.json``, and what runc does
with a bundle that its caller has to know (pure: text and numbers in, a spec out).

What the spec says and where each part comes from:

- **command** (``process.args``): the image's ``Entrypoint`` followed by its ``Cmd``, as
  Docker combines them; an order may replace the ``Cmd`` (the entrypoint stays) or the
  entrypoint (the image's ``Cmd`` is then dropped too, as ``docker run --entrypoint``
  does). Neither left is an error naming the image's missing command.
- **environment**: ``PATH`` (Docker's default), ``HOME`` (the user's, else ``/``) and
  ``HOSTNAME`` beneath the image's ``Env``, then the order's, then Bourse's own variables
  (``PORT``, ``BOURSE_PORT_<NAME>``, ``BOURSE_MACHINE_ID``, …); a later one wins. Nothing of
  the supplier's own environment goes in.
- **user**: the image's ``User``, numeric (``uid[:gid]``) or names looked up in the image's
  ``/etc/passwd`` and ``/etc/group`` (text given by the caller); supplementary groups are
  those of ``/etc/group`` that list the user's name.
- **limits** (the order's): CPU as a CFS quota over a period (100 ms, or 1 s for shares
  under 10 millicores, so that every share is exact: 1m is 1 ms of CPU per second),
  memory, swap equal to memory (no swap beyond it, where the kernel accounts swap), pids.
- **isolation**: pid, mount, ipc and uts namespaces; a user namespace mapping the machine's
  users to its block of host ids and the network namespace its worker made for it, where
  the host allows (else the host's users and network, binding the ports Bourse gives);
  ``noNewPrivileges``; the capability set :data:`CAPABILITIES`; Docker's default seccomp
  profile for that set (supplier/machines/oci/seccomp.py); runc's default masked and
  read-only paths; every device denied but runc's defaults (null, zero, tty, …).
- **mounts**: ``/proc``, ``/dev`` (tmpfs), ``/dev/pts``, ``/dev/shm``, ``/dev/mqueue``,
  ``/sys`` and ``/sys/fs/cgroup`` (read-only: runtimes read their limits there; the host's
  /sys bound where a user namespace may not mount one), and a resolv.conf and
  ``/etc/hosts`` bound read-only (the host's, or the worker's for machines' networks).
  Nothing else of the host: not the supplier's data or credentials.
- **paths**: the root is the bundle's ``rootfs`` (the shell mounts the machine's overlay
  there); ``cgroupsPath`` is the caller's, keyed by its owner.

And what runc does with a bundle: a machine id (``<worker>~<ULID>``) is no valid runc
container id, :func:`runtime_id` maps it to one (reversibly: :func:`machine_id_of`);
:func:`cgroup_dirs` says where runc makes ``cgroupsPath`` in each hierarchy;
the shim reads ``runc run``'s exit status (supplier/machines/shim/server.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bourse.errors import BourseError
from bourse.images.oci import RunConfig
from bourse.wire.limits import MACHINE_ID_PATTERN, MACHINE_ID_SEPARATOR
from supplier.machines.host.confine import Limits, parse_proc_cgroup
from supplier.machines.oci.seccomp import for_container
from supplier.machines.oci.spec import (
    Capabilities,
    Cpu,
    DeviceRule,
    IdMapping,
    Linux,
    LinuxResources,
    Memory,
    Mount,
    Namespace,
    Pids,
    Process,
    Rlimit,
    Root,
    Spec,
    SpecUser,
)
from supplier.machines.oci.users import UserError, resolve_user

OCI_VERSION = "1.0.2"
# The host ids a user namespace maps a container's ids to (supplier/machines/host/ids.py).
ID_BLOCK = 65536
ROOTFS = "rootfs"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CFS_PERIOD_US = 100_000
# The kernel's bounds: a quota of at least 1 ms, a period of at most 1 s.
CFS_QUOTA_MIN_US = 1_000
CFS_PERIOD_MAX_US = 1_000_000
# Open files: plenty for a server with many connections, and a bound on what one machine
# holds of the host's file table.
NOFILE = 65_536
# Docker's default capability set without NET_RAW (on the host's network, raw sockets would
# let a machine read and forge the worker's traffic), NET_BIND_SERVICE (the host's
# privileged ports are the host's: a machine binds the ports Bourse gives it), MKNOD (the
# device rules deny new devices anyway), SETFCAP (file capabilities have no effect under
# no_new_privileges) and AUDIT_WRITE (the host's audit log). The same set for every user:
# a non-root user keeps none of them past its exec (no ambient set, and file capabilities
# do not count under no_new_privileges); root keeps these and no others.
CAPABILITIES = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_SETUID",
    "CAP_SYS_CHROOT",
)
NAMESPACES = ("pid", "mount", "ipc", "uts")
# runc spec's defaults.
MASKED_PATHS = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/sys/firmware",
    "/proc/scsi",
)
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
# Bound read-only from the host, so that names resolve as on the host's network.
HOST_FILES = ("/etc/resolv.conf", "/etc/hosts")

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_MACHINE_ID = re.compile(MACHINE_ID_PATTERN)
# runc's own rule for container ids, and the character that stands for the separator.
_RUNTIME_ID = re.compile(r"[A-Za-z0-9_+,.-]+")
_RUNTIME_SEPARATOR = "."


class BundleError(BourseError, ValueError):
    """A container cannot be described: bad input, or an image without what it needs."""


# -- the command ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Command:
    """What an order replaces of the image's command; None keeps the image's (an empty
    ``cmd`` is no arguments after the entrypoint)."""

    entrypoint: tuple[str, ...] | None = None
    cmd: tuple[str, ...] | None = None


def argv(image: RunConfig, command: Command = Command()) -> list[str]:
    """The process's arguments: entrypoint then cmd, as Docker combines them."""
    if command.entrypoint is not None:
        entrypoint, cmd = list(command.entrypoint), list(command.cmd or ())
    else:
        entrypoint = list(image.entrypoint or ())
        cmd = list(command.cmd) if command.cmd is not None else list(image.cmd or ())
    args = entrypoint + cmd
    if not args:
        raise BundleError(
            "the image has no command (neither Entrypoint nor Cmd in its config) and the "
            "order gives none"
        )
    if any("\0" in a for a in args):
        raise BundleError("a command argument holds a NUL byte")
    return args


# -- the environment ------------------------------------------------------------------------
def check_env(env: Mapping[str, str], what: str) -> None:
    """Every key a valid variable name, no value with a NUL byte (``what`` names the source
    in the error)."""
    for key, value in env.items():
        if not _ENV_KEY.fullmatch(key):
            raise BundleError(
                f"{what} env key {key!r} is not a valid name ([A-Za-z_][A-Za-z0-9_]*)"
            )
        if "\0" in value:
            raise BundleError(f"{what} env {key} holds a NUL byte")


def image_env(entries: Sequence[str]) -> dict[str, str]:
    """The image config's ``Env`` (``KEY=VALUE`` entries) as a mapping; a later entry of
    the same key wins, as in Docker."""
    env: dict[str, str] = {}
    for entry in entries:
        key, eq, value = entry.partition("=")
        if not eq:
            raise BundleError(f"the image's env entry {entry!r} is not KEY=VALUE")
        env[key] = value
    check_env(env, "the image's")
    return env


def merge_env(
    base: Mapping[str, str],
    image: Sequence[str],
    order: Mapping[str, str],
    bourse: Mapping[str, str],
) -> list[str]:
    """``KEY=VALUE`` entries: ``base`` (defaults), then the image's, the order's and
    Bourse's own; a later source wins. Nothing else: never the caller's environment."""
    check_env(order, "the order's")
    check_env(bourse, "Bourse's")
    merged = {**base, **image_env(image), **order, **bourse}
    return [f"{k}={v}" for k, v in merged.items()]


# -- the limits -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Host:
    """What the host gives a container: whether its kernel accounts swap (only then is swap
    held to memory), the highest open-file limit the runtime may set (its caller's own hard
    limit: raising it takes CAP_SYS_RESOURCE, which the caller may lack), and which of
    :data:`HOST_FILES` it has to bind."""

    swap_accounted: bool = True
    nofile_max: int = NOFILE
    files: tuple[str, ...] = HOST_FILES
    # where each of ``files`` is bound from, where that is not the host's own file (a
    # machine of a network of its own gets a resolv.conf it can use)
    sources: tuple[tuple[str, str], ...] = ()


def cfs(millicores: int) -> tuple[int, int]:
    """CFS quota and period (µs) for ``millicores`` (1000 = one CPU), exact for every share:
    a period of 100 ms, or of 1 s when the quota would fall under the kernel's 1 ms
    (1 -> (1000, 1000000), 250 -> (25000, 100000), 16000 -> (1600000, 100000))."""
    if millicores < 1:
        raise BundleError(f"millicores must be >= 1, not {millicores}")
    period = CFS_PERIOD_US
    if millicores * period // 1000 < CFS_QUOTA_MIN_US:
        period = CFS_PERIOD_MAX_US
    return millicores * period // 1000, period


def _resources(limits: Limits, host: Host) -> LinuxResources:
    if limits.memory_bytes < 1 or limits.pids < 1:
        raise BundleError(
            f"memory ({limits.memory_bytes} bytes) and pids ({limits.pids}) must be positive"
        )
    quota, period = cfs(limits.millicores)
    swap = limits.memory_bytes if host.swap_accounted else None
    return LinuxResources(
        devices=[DeviceRule(allow=False, access="rwm")],
        memory=Memory(limit=limits.memory_bytes, swap=swap),
        cpu=Cpu(quota=quota, period=period),
        pids=Pids(limit=limits.pids),
    )


# -- mounts and the rest --------------------------------------------------------------------
def _mounts(
    host_files: Sequence[str], own_sysfs: bool = True, sources: Mapping[str, str] = {}
) -> list[Mount]:
    """``own_sysfs``: a sysfs of its own (a container of the host's users); else the host's
    /sys bound read-only (a user namespace may mount sysfs only for a network namespace it
    owns, and a machine's is made by its worker, owned by the host's)."""
    hidden = ("nosuid", "noexec", "nodev")
    sys = (
        Mount(destination="/sys", type="sysfs", source="sysfs", options=[*hidden, "ro"])
        if own_sysfs
        else Mount(destination="/sys", type="bind", source="/sys", options=["rbind", "ro", *hidden])
    )
    return [
        Mount(destination="/proc", type="proc", source="proc", options=[*hidden]),
        Mount(
            destination="/dev",
            type="tmpfs",
            source="tmpfs",
            options=["nosuid", "strictatime", "mode=755", "size=65536k"],
        ),
        Mount(
            destination="/dev/pts",
            type="devpts",
            source="devpts",
            options=["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        ),
        Mount(
            destination="/dev/shm",
            type="tmpfs",
            source="shm",
            options=[*hidden, "mode=1777", "size=65536k"],
        ),
        Mount(destination="/dev/mqueue", type="mqueue", source="mqueue", options=[*hidden]),
        sys,
        Mount(
            destination="/sys/fs/cgroup",
            type="cgroup",
            source="cgroup",
            options=[*hidden, "relatime", "ro"],
        ),
        *(
            Mount(
                destination=path,
                type="bind",
                source=sources.get(path, path),
                options=["bind", "ro", *hidden],
            )
            for path in host_files
        ),
    ]


def capabilities() -> Capabilities:
    """The capability sets of every container process (see :data:`CAPABILITIES`)."""
    caps = list(CAPABILITIES)
    return Capabilities(bounding=caps, effective=caps, permitted=caps, inheritable=[], ambient=[])


def _check_cgroups_path(path: str) -> None:
    parts = path.strip("/").split("/")
    if not path or any(p in ("", ".", "..") for p in parts) or any(c in path for c in "\n\0"):
        raise BundleError(f"cgroups path {path!r} is not a clean path")


def runtime_spec(
    image: RunConfig,
    limits: Limits,
    *,
    cgroups_path: str,
    hostname: str,
    bourse_env: Mapping[str, str],
    order_env: Mapping[str, str] | None = None,
    command: Command = Command(),
    passwd: str = "",
    group: str = "",
    host: Host = Host(),
    rootfs: str = ROOTFS,
    ids: int = -1,
    netns: str = "",
) -> Spec:
    """The bundle's spec for one machine: ``image`` (the image config's ``config``),
    ``limits`` (the order's), ``passwd``/``group`` (the text of the image's
    ``/etc/passwd`` and ``/etc/group``, "" where it has none), ``host`` (what the host
    gives). ``rootfs`` is relative to the bundle. ``ids``: the first of the machine's
    block of host ids (>= 0: a user namespace maps its ids 0..65535 there, root
    included); ``netns``: the network namespace it joins ("": the host's network). Bad
    input raises BundleError naming it."""
    if not _HOSTNAME.fullmatch(hostname):
        raise BundleError(
            f"hostname {hostname!r} is not a host name label (1 to 63 letters, digits, -)"
        )
    _check_cgroups_path(cgroups_path)
    cwd = image.working_dir or "/"
    if not cwd.startswith("/"):
        raise BundleError(f"the image's working dir {cwd!r} is not an absolute path")
    try:
        user = resolve_user(image.user, passwd, group)
    except UserError as exc:
        raise BundleError(str(exc)) from None
    base = {"PATH": DEFAULT_PATH, "HOME": user.home, "HOSTNAME": hostname}
    env = merge_env(base, image.env or [], order_env or {}, bourse_env)
    nofile = min(NOFILE, host.nofile_max)
    process = Process(
        terminal=False,
        user=SpecUser(uid=user.uid, gid=user.gid, additional_gids=list(user.additional_gids)),
        args=argv(image, command),
        env=env,
        cwd=cwd,
        capabilities=capabilities(),
        rlimits=[Rlimit(type="RLIMIT_NOFILE", hard=nofile, soft=nofile)],
        no_new_privileges=True,
    )
    namespaces = [Namespace(type=n) for n in NAMESPACES]
    mapped: list[IdMapping] = []
    if ids >= 0:
        namespaces.append(Namespace(type="user"))
        mapped = [IdMapping(container_id=0, host_id=ids, size=ID_BLOCK)]
    if netns:
        namespaces.append(Namespace(type="network", path=netns))
    linux = Linux(
        cgroups_path=cgroups_path,
        namespaces=namespaces,
        resources=_resources(limits, host),
        masked_paths=list(MASKED_PATHS),
        readonly_paths=list(READONLY_PATHS),
        uid_mappings=mapped,
        gid_mappings=mapped,
        seccomp=for_container(tuple(process.capabilities.bounding)),
    )
    return Spec(
        oci_version=OCI_VERSION,
        process=process,
        root=Root(path=rootfs, readonly=False),
        hostname=hostname,
        mounts=_mounts(host.files, ids < 0, dict(host.sources)),
        linux=linux,
    )


# -- what runc does with a bundle -----------------------------------------------------------
def runtime_id(machine_id: str) -> str:
    """The runc container id of a machine: its id with the separator ``~`` (which runc
    refuses) as ``.`` (which no machine id holds), so the map is one to one."""
    if not _MACHINE_ID.match(machine_id):
        raise BundleError(f"{machine_id!r} is not a machine id (<worker>~<id>)")
    return machine_id.replace(MACHINE_ID_SEPARATOR, _RUNTIME_SEPARATOR, 1)


def machine_id_of(rid: str) -> str:
    """The machine id a runtime id was made from (:func:`runtime_id` reversed)."""
    machine_id = rid.replace(_RUNTIME_SEPARATOR, MACHINE_ID_SEPARATOR, 1)
    if not _RUNTIME_ID.fullmatch(rid) or not _MACHINE_ID.match(machine_id):
        raise BundleError(f"{rid!r} is not a runtime id of a machine")
    return machine_id


def cgroup_dirs(mountinfo: str, proc_cgroup: str, cgroups_path: str) -> dict[str, Path]:
    """Where runc makes the cgroup ``cgroups_path`` in every cgroup hierarchy mounted
    (``mountinfo``: /proc/self/mountinfo; ``proc_cgroup``: /proc/self/cgroup of runc's
    caller): a relative path below the caller's own cgroup in that hierarchy (runc's rule),
    an absolute one below the hierarchy's root. Keyed by controller (each controller of a
    co-mounted hierarchy; ``name=systemd`` for a named one; "" for cgroup2)."""
    own_v2, own_v1 = parse_proc_cgroup(proc_cgroup)
    inner = cgroups_path.lstrip("/")
    dirs: dict[str, Path] = {}
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        if rest[0] == "cgroup2":
            keys, own = [""], own_v2
        elif rest[0] == "cgroup":
            keys = [o for o in rest[2].split(",") if o in own_v1]
            if not keys:
                continue
            own = own_v1[keys[0]]
        else:
            continue
        base = Path(fields[4])
        if not cgroups_path.startswith("/"):
            base = base / own.lstrip("/")
        for key in keys:
            dirs.setdefault(key, base / inner)
    return dirs
