"""The pure part of confinement (supplier/drivers/confine.py): what the host offers, the
choice, the limit arithmetic, how an exit is read; and the lifecycle's ``failed`` state."""

from __future__ import annotations

import pytest

from bourse.wire.messages import Resources
from supplier.machines.api import Exit, exit_of
from supplier.machines.host.confine import (
    MIB,
    Limits,
    Mounts,
    Offer,
    choose,
    cpu_quota,
    limits_for,
    parse_mountinfo,
    parse_proc_cgroup,
    rlimits,
    too_small,
    v1_files,
    v2_files,
)
from supplier.machines.lifecycle import InvalidTransition, next_state

# This host's shape: v1 cpu, cpuacct, memory, pids; a cgroup2 mount without controllers.
HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
# A modern host: one cgroup2 hierarchy; and an old one with cpu,cpuacct co-mounted.
PURE_V2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
COMOUNTED = "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw shared:9 - cgroup cgroup rw,cpu,cpuacct\n"


@pytest.mark.parametrize(
    ("millicores", "expected"),
    [
        (500, (50_000, 100_000)),
        (1000, (100_000, 100_000)),
        (250, (25_000, 100_000)),
        (2000, (200_000, 100_000)),
        (10, (1_000, 100_000)),  # the kernel's minimum quota is 1 ms
        # smaller shares: a longer period (at most 1 s), so the quota is still exact
        (9, (9_000, 1_000_000)),
        (1, (1_000, 1_000_000)),
    ],
)
def test_cpu_quota_from_millicores(millicores: int, expected: tuple[int, int]) -> None:
    assert cpu_quota(millicores) == expected


def test_cpu_quota_refuses_zero() -> None:
    with pytest.raises(ValueError, match="millicores must be >= 1"):
        cpu_quota(0)


def test_limits_of_whole_cpus_and_mebibytes() -> None:
    lim = limits_for(Resources(cpus=2, memory_mb=64), pids_max=100)
    assert lim == Limits(millicores=2000, memory_bytes=64 * MIB, pids=100)


def test_v2_files() -> None:
    assert v2_files(Limits(millicores=500, memory_bytes=64 * MIB, pids=32)) == [
        ("cpu.max", "50000 100000"),
        ("memory.max", str(64 * MIB)),
        ("memory.swap.max", "0"),
        ("pids.max", "32"),
    ]


@pytest.mark.parametrize("memsw", [True, False])
def test_v1_files_memory_before_memsw(memsw: bool) -> None:
    files = v1_files(Limits(millicores=1000, memory_bytes=MIB * 8, pids=16), memsw)
    assert files[:3] == [
        ("cpu", "cpu.cfs_period_us", "100000"),
        ("cpu", "cpu.cfs_quota_us", "100000"),
        ("memory", "memory.limit_in_bytes", str(8 * MIB)),
    ]
    assert (("memory", "memory.memsw.limit_in_bytes", str(8 * MIB)) in files) is memsw
    assert files[-1] == ("pids", "pids.max", "16")


def test_rlimits_count_the_users_processes() -> None:
    lim = Limits(millicores=1000, memory_bytes=64 * MIB, pids=32)
    assert rlimits(lim, user_processes=100) == [("DATA", 64 * MIB), ("NPROC", 132)]


@pytest.mark.parametrize(
    ("memory_mb", "mechanism", "refused"),
    [(3, "cgroup1", True), (4, "cgroup1", False), (1, "rlimit", True), (1, "none", False)],
)
def test_too_small(memory_mb: int, mechanism: str, refused: bool) -> None:
    why = too_small(memory_mb, mechanism)  # type: ignore[arg-type]  # str params
    assert bool(why) is refused
    if refused:
        assert (
            why == f"memory_mb {memory_mb} is below the 4 MiB this worker can confine ({mechanism})"
        )


def test_parse_mountinfo_hybrid_pure_and_comounted() -> None:
    hybrid = parse_mountinfo(HYBRID)
    assert hybrid.v2 == "/sys/fs/cgroup/unified"
    assert hybrid.v1 == {
        "cpu": "/sys/fs/cgroup/cpu",
        "cpuacct": "/sys/fs/cgroup/cpuacct",
        "memory": "/sys/fs/cgroup/memory",
        "pids": "/sys/fs/cgroup/pids",
    }
    assert parse_mountinfo(PURE_V2) == Mounts(v2="/sys/fs/cgroup", v1={})
    both = parse_mountinfo(COMOUNTED).v1
    assert both == {"cpu": "/sys/fs/cgroup/cpu,cpuacct", "cpuacct": "/sys/fs/cgroup/cpu,cpuacct"}


def test_parse_proc_cgroup() -> None:
    text = "9:name=systemd:/\n4:memory:/process_api/abc\n2:cpu,cpuacct:/x\n0::/user.slice\n"
    v2, v1 = parse_proc_cgroup(text)
    assert v2 == "/user.slice"
    assert v1 == {"name=systemd": "/", "memory": "/process_api/abc", "cpu": "/x", "cpuacct": "/x"}


NO_V2 = "cgroup2 at /sys/fs/cgroup/unified lacks the cpu, memory, pids controller(s)"


@pytest.mark.parametrize(
    ("want", "offer", "expected"),
    [
        ("auto", Offer(cgroup2="", cgroup1=""), ("cgroup2", "")),
        ("auto", Offer(cgroup2=NO_V2, cgroup1=""), ("cgroup1", "")),  # this host
        ("auto", Offer(cgroup2=NO_V2, cgroup1="not writable"), ("rlimit", "")),
        ("auto", Offer(cgroup2="x", cgroup1="y", rlimit="z"), ("none", "")),
        ("rlimit", Offer(cgroup2="", cgroup1=""), ("rlimit", "")),  # forced
        ("cgroup2", Offer(cgroup2=NO_V2, cgroup1=""), ("cgroup2", NO_V2)),  # forced, not usable
        ("none", Offer(), ("none", "")),
    ],
)
def test_choose(want: str, offer: Offer, expected: tuple[str, str]) -> None:
    assert choose(want, offer) == expected  # type: ignore[arg-type]  # str params


@pytest.mark.parametrize(
    ("returncode", "oom_kills", "expected", "failed", "describe"),
    [
        (0, 0, Exit(code=0), False, "exited with code 0"),
        (3, 1, Exit(code=3), False, "exited with code 3"),  # an oom of a child: still exit 3
        (-9, 1, Exit(signal=9, oom=True), True, "oom: killed at its memory limit"),
        (-9, 0, Exit(signal=9), True, "killed by signal 9"),
        (-15, 1, Exit(signal=15), True, "killed by signal 15"),
    ],
)
def test_exit_of(
    returncode: int, oom_kills: int, expected: Exit, failed: bool, describe: str
) -> None:
    how = exit_of(returncode, oom_kills)
    assert how == expected
    assert how.failed is failed
    assert how.describe() == describe
    assert how.reason == ("oom" if how.oom else "signal" if failed else "exit")


@pytest.mark.parametrize(
    ("verb", "state", "to"),
    [
        ("start", "failed", "started"),
        ("stop", "failed", "failed"),
        ("destroy", "failed", "destroyed"),
    ],
)
def test_failed_state_transitions(verb: str, state: str, to: str) -> None:
    assert next_state(verb, "m", state) == to


def test_failed_is_not_reached_by_a_verb_from_reserved() -> None:
    with pytest.raises(InvalidTransition, match="cannot stop machine m: it is reserved"):
        next_state("stop", "m", "reserved")


@pytest.mark.parametrize(
    ("resources", "millicores", "quota"),
    [
        (Resources(cpus=1, cpu_millis=500, memory_mb=64), 500, (50000, 100000)),
        (Resources(cpus=1, cpu_millis=250, memory_mb=64), 250, (25000, 100000)),
        (Resources(cpus=2, cpu_millis=1500, memory_mb=64), 1500, (150000, 100000)),
        (Resources(cpus=2, memory_mb=64), 2000, (200000, 100000)),  # a v1 order: whole
    ],
)
def test_limits_of_fractional_cpus_take_the_millicores(
    resources: Resources, millicores: int, quota: tuple[int, int]
) -> None:
    lim = limits_for(resources, pids_max=100)
    assert lim.millicores == millicores
    assert cpu_quota(lim.millicores) == quota


def test_a_cgroup2_mount_with_favordynmods_says_moves_do_not_wait() -> None:
    """A move between cgroups waits for an RCU grace period unless a cgroup2 mount has
    ``favordynmods`` (the kernel's lock for moves is one for every hierarchy)."""
    assert not parse_mountinfo(HYBRID).favors_moves
    assert not parse_mountinfo(PURE_V2).favors_moves
    favoring = HYBRID.replace("cgroup2 cgroup2 rw\n", "cgroup2 cgroup2 rw,favordynmods\n")
    assert parse_mountinfo(favoring).favors_moves
    assert parse_mountinfo(favoring).v1 == parse_mountinfo(HYBRID).v1
