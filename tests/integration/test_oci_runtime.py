"""Containers as a worker runs them (a box made by supplier/machines/oci/boxes.py, the
runtime run by the machine's shim) on real parts: runc, loop devices, ext4, overlayfs,
cgroups, and a root made here from busybox-static. Skipped, with what to install, where
runc or root is missing; the pure checks at the top always run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bourse.images.oci import RunConfig
from supplier.machines.api import Exit
from supplier.machines.host.confine import MIB, Limits, Mounts
from supplier.machines.oci.boxes import ContainerError, Containers
from supplier.machines.oci.bundle import CAPABILITIES, Command, runtime_spec
from supplier.machines.oci.runtime import INSTALL, Runtime, RuntimeUnavailable, detect, verdict
from supplier.machines.oci.users import UserError, image_files, read_image_file
from tests.containers import PASSWD, Boxed, busybox_root, need_runc
from tests.market import wait_until

LIMITS = Limits(millicores=500, memory_bytes=64 * MIB, pids=64)
# The capability bits of bundle.CAPABILITIES (linux/capability.h).
CAP_BITS = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_FOWNER": 3,
    "CAP_FSETID": 4,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_SETPCAP": 8,
    "CAP_SYS_CHROOT": 18,
}
CAP_SYS_ADMIN = 21
WAIT_S = 30.0


# -- pure: always run -----------------------------------------------------------------------
HYBRID = Mounts(v2="/sys/fs/cgroup/unified", v1={"cpu": "/sys/fs/cgroup/cpu"})


@pytest.mark.parametrize(
    ("name", "euid", "mounts", "missing", "expected"),
    [
        ("runc", 0, HYBRID, {}, ""),
        ("crun", 0, Mounts(v2="/sys/fs/cgroup"), {}, ""),
        ("crun", 0, HYBRID, {}, f"crun does not support this host's hybrid.*{INSTALL}"),
        ("runc", 1000, HYBRID, {}, "runc needs root here"),
        (
            "runc",
            0,
            HYBRID,
            {"mkfs.ext4": "e2fsprogs", "losetup": "mount"},
            r"losetup, mkfs.ext4 not found: install them \(apt-get install e2fsprogs mount\)",
        ),
    ],
)
def test_verdict_says_why_a_runtime_cannot_work_here(
    name: str, euid: int, mounts: Mounts, missing: dict[str, str], expected: str
) -> None:
    why = verdict(name, euid, mounts, missing)
    if expected:
        assert re.search(expected, why), why
    else:
        assert why == ""


def test_no_runtime_names_the_package() -> None:
    with pytest.raises(RuntimeUnavailable, match=r"no OCI runtime found.*apt-get install runc"):
        detect(("no-such-runtime",))


def test_image_files_are_read_without_following_links(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host secret\n")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    assert image_files(root) == ("", "")  # no account files: root by number only
    (root / "etc/passwd").write_text(PASSWD)
    (root / "etc/group").symlink_to(secret)
    with pytest.raises(UserError, match="the image's /etc/group is reached through"):
        image_files(root)
    (root / "etc/group").unlink()
    os.mkfifo(root / "etc/group")
    with pytest.raises(UserError, match="the image's /etc/group is not a regular file"):
        image_files(root)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "etc").symlink_to(root / "etc")
    with pytest.raises(UserError, match="the image's /etc/passwd is reached through"):
        read_image_file(linked, "etc/passwd")
    assert read_image_file(root, "/etc/passwd") == PASSWD


# -- fixtures: runc, a busybox root, an owner's containers ----------------------------------
@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return need_runc()


@pytest.fixture(scope="module")
def image_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root of a static busybox and its applets, /etc/passwd and /etc/group, /tmp."""
    return busybox_root(tmp_path_factory.mktemp("image") / "root")


def _owner() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def boxes(runtime: Runtime, tmp_path: Path) -> AsyncIterator[Containers]:
    """One owner's containers below a data dir of this test; swept at the end whatever
    the test did (and nothing may be left of it then, not even the owner's subtree)."""
    c = Containers(runtime, tmp_path / "data" / "containers", _owner())
    yield c
    assert c.sweep() == [], "a test left a container behind"
    assert _leftovers(c) == []
    assert not any(d.exists() for d in _owner_cgroups(c))


def _mid(boxes: Containers) -> str:
    return f"{boxes.owner}~{uuid.uuid4().hex.upper()}"


def _owner_cgroups(boxes: Containers) -> list[Path]:
    """The owner's subtree in every hierarchy (its machines' cgroups are below)."""
    return sorted(set(boxes.cgroups(f"bourse/{boxes.owner}").values()))


def _leftovers(boxes: Containers) -> list[str]:
    """Anything of this owner's machines on the host: mounts, loop devices, cgroups,
    runtime state, machine directories."""
    home = str(boxes.home)
    left = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if home in line]
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout
    left += [line for line in loops.splitlines() if home in line]
    for subtree in _owner_cgroups(boxes):
        if subtree.is_dir():
            left += [str(d) for d in subtree.iterdir() if d.is_dir()]
    for d in (boxes.state, boxes.machines):
        if d.is_dir():
            left += [str(p) for p in d.iterdir()]
    return left


async def _start(
    boxes: Containers,
    root: Path,
    out: Path,
    cmd: Sequence[str],
    *,
    limits: Limits = LIMITS,
    disk_mb: int = 16,
    user: str = "",
    order_env: dict[str, str] | None = None,
    bourse_env: dict[str, str] | None = None,
    mid: str = "",
) -> Boxed:
    mid = mid or _mid(boxes)
    passwd, group = image_files(root)
    spec = runtime_spec(
        RunConfig(cmd=list(cmd), user=user),
        limits,
        cgroups_path=boxes.cgroups_path(mid),
        hostname="box",
        bourse_env=bourse_env if bourse_env is not None else {"BOURSE_MACHINE_ID": mid},
        order_env=order_env,
        passwd=passwd,
        group=group,
        host=boxes.host(),
    )
    return await Boxed.start(boxes, mid, spec, root, disk_mb, out)


async def _run(
    boxes: Containers, root: Path, out: Path, cmd: Sequence[str], **kw: object
) -> tuple[Exit, str]:
    """Run to its end; how it ended and what it printed."""
    c = await _start(boxes, root, out, cmd, **kw)  # type: ignore[arg-type]
    try:
        with anyio.fail_after(WAIT_S):
            how = await c.wait()
    finally:
        await c.cleanup()
    return how, c.output()


async def _said(c: Boxed, text: str) -> None:
    await wait_until(lambda: text in c.output(), WAIT_S)


SLEEPER = "echo ready; exec sleep 60"


@contextlib.asynccontextmanager
async def _running(
    boxes: Containers, root: Path, out: Path, script: str = SLEEPER, **kw: Any
) -> AsyncIterator[Boxed]:
    """A container running ``sh -c script`` once it said ``ready``; cleaned up after."""
    c = await _start(boxes, root, out, ["sh", "-c", script], **kw)
    try:
        await _said(c, "ready")
        yield c
    finally:
        await c.cleanup()


# -- containers ---------------------------------------------------------------------------
async def test_echo_exits_zero_with_its_output_in_the_given_fd(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    how, output = await _run(boxes, image_root, tmp_path / "out", ["echo", "hello from a box"])
    assert how == Exit(code=0)
    assert output == "hello from a box\n"


async def test_the_exit_code_propagates(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    how, _ = await _run(boxes, image_root, tmp_path / "out", ["sh", "-c", "exit 7"])
    assert how == Exit(code=7)


async def test_a_command_that_is_not_there_fails_and_says_so(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    how, output = await _run(boxes, image_root, tmp_path / "out", ["/no/such/program"])
    assert how.code != 0
    assert "/no/such/program" in output  # the runtime's own error, in the machine's output


async def test_a_memory_hog_is_oom_killed(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    hog = ["awk", 'BEGIN { while (1) a[i++] = sprintf("%100000s", i) }']
    limits = Limits(millicores=1000, memory_bytes=32 * MIB, pids=16)
    how, _ = await _run(boxes, image_root, tmp_path / "out", hog, limits=limits)
    assert how.oom and how.failed, how


@pytest.mark.parametrize(
    ("millicores", "quota", "period"),
    [
        (250, 25_000, 100_000),
        (1, 1_000, 1_000_000),  # 1 ms of CPU per second
    ],
)
async def test_the_limits_are_in_its_cgroups(
    boxes: Containers, image_root: Path, tmp_path: Path, millicores: int, quota: int, period: int
) -> None:
    limits = Limits(millicores=millicores, memory_bytes=48 * MIB, pids=20)
    # not waiting for the shell to say it is ready: at 1 ms of CPU a second that takes
    # seconds, more on a busy machine; runc writes the limits once it has made the cgroups
    c = await _start(boxes, image_root, tmp_path / "out", ["sh", "-c", SLEEPER], limits=limits)
    try:
        cpu, memory, pids = c.cgroups["cpu"], c.cgroups["memory"], c.cgroups["pids"]

        def quota_set() -> bool:
            with contextlib.suppress(OSError, ValueError):
                return int((cpu / "cpu.cfs_quota_us").read_text()) == quota
            return False

        await wait_until(quota_set)
        assert int((cpu / "cpu.cfs_period_us").read_text()) == period
        assert int((memory / "memory.limit_in_bytes").read_text()) == 48 * MIB
        memsw = memory / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            assert int(memsw.read_text()) == 48 * MIB
        assert (pids / "pids.max").read_text().strip() == "20"
        assert c.running
    finally:
        await c.cleanup()


@pytest.mark.slow
async def test_a_container_that_ignores_sigterm_is_killed_after_the_grace(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    # PID 1 of its namespace without a handler: SIGTERM does not reach it
    async with _running(boxes, image_root, tmp_path / "out") as c:
        began = time.monotonic()
        how = await c.stop(grace_s=0.5)
        assert how == Exit(signal=9)
        assert time.monotonic() - began >= 0.5


async def test_a_container_that_handles_sigterm_ends_within_the_grace(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    script = "trap 'echo bye; exit 3' TERM; echo ready; while :; do sleep 0.05; done"
    async with _running(boxes, image_root, out, script) as c:
        with anyio.fail_after(WAIT_S):
            how = await c.stop(grace_s=WAIT_S)
        assert how == Exit(code=3)
        assert "bye" in c.output()


async def test_writing_past_disk_mb_gets_enospc_and_nothing_else_notices(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    script = f"dd if=/dev/zero of=/fill bs=1M count=64; echo dd=$?; {SLEEPER}"
    async with _running(boxes, image_root, out, script, disk_mb=8) as c:
        said = c.output()
        assert "No space left on device" in said
        assert "dd=1" in said
        disk = c.box.disk
        assert disk.stat().st_size == 8 * MIB
        assert disk.stat().st_blocks * 512 <= 8 * MIB  # the host gave no more than that
        beside = tmp_path / "beside"
        beside.write_bytes(b"x" * MIB)  # the worker's own disk still takes writes
        assert beside.stat().st_size == MIB


def _caps(status: str, field: str) -> int:
    return int(re.search(rf"^{field}:\s*([0-9a-f]+)$", status, re.M).group(1), 16)  # type: ignore[union-attr]


async def test_root_inside_has_no_sys_admin_and_no_new_privileges(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    script = "cat /proc/self/status; mount -t tmpfs none /mnt; echo mount=$?"
    how, output = await _run(boxes, image_root, tmp_path / "out", ["sh", "-c", script])
    assert how == Exit(code=0)
    expected = sum(1 << CAP_BITS[c] for c in CAPABILITIES)
    assert _caps(output, "CapEff") == _caps(output, "CapBnd") == expected
    assert not _caps(output, "CapEff") & (1 << CAP_SYS_ADMIN)
    assert _caps(output, "CapAmb") == 0
    assert re.search(r"^NoNewPrivs:\s*1$", output, re.M)
    assert "mount=0" not in output and "mount=" in output


async def test_the_seccomp_filter_refuses_a_user_namespace_the_kernel_would_give(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    """Docker's profile (supplier/machines/oci/seccomp.py): ``unshare -U`` needs no
    capability, so only the filter stops it (the same spec without the filter runs it)."""
    script = "grep Seccomp: /proc/self/status; /bin/busybox unshare -U true; echo unshare=$?"
    how, output = await _run(boxes, image_root, tmp_path / "out", ["sh", "-c", script])
    assert how == Exit(code=0)
    assert re.search(r"^Seccomp:\s*2$", output, re.M), output  # a filter is on
    assert "Operation not permitted" in output and "unshare=1" in output

    mid = _mid(boxes)
    spec = runtime_spec(
        RunConfig(cmd=["sh", "-c", script]),
        LIMITS,
        cgroups_path=boxes.cgroups_path(mid),
        hostname="box",
        bourse_env={},
        host=boxes.host(),
    )
    assert spec.linux.seccomp is not None
    bare = msgspec.structs.replace(spec, linux=msgspec.structs.replace(spec.linux, seccomp=None))
    c = await Boxed.start(boxes, mid, bare, image_root, 8, tmp_path / "bare")
    try:
        assert await c.wait() == Exit(code=0)
    finally:
        await c.cleanup()
    assert re.search(r"^Seccomp:\s*0$", c.output(), re.M) and "unshare=0" in c.output()


async def test_a_named_user_runs_as_itself_with_no_capabilities(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    script = "id; cat /proc/self/status; echo $HOME"
    how, output = await _run(boxes, image_root, tmp_path / "out", ["sh", "-c", script], user="app")
    assert how == Exit(code=0)
    assert "uid=1000" in output and "gid=1000" in output
    assert _caps(output, "CapEff") == _caps(output, "CapPrm") == 0  # dropped at its exec
    assert _caps(output, "CapBnd") == sum(1 << CAP_BITS[c] for c in CAPABILITIES)
    assert "/home/app" in output


async def test_the_suppliers_data_dir_is_not_visible_inside(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    creds = data / "creds.seed"
    data.mkdir(parents=True, exist_ok=True)
    creds.write_text("SUAM-secret\n")
    script = f"cat {creds}; echo cat=$?; ls {data}; ls {boxes.home}; echo end"
    how, output = await _run(boxes, image_root, tmp_path / "out", ["sh", "-c", script])
    assert how == Exit(code=0)
    assert "SUAM-secret" not in output
    assert "cat=1" in output
    assert output.count("No such file or directory") == 3


async def test_the_environment_is_the_given_one_and_nothing_of_the_callers(
    boxes: Containers, image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BOURSE_TEST_MARKER", "leaked")
    how, output = await _run(
        boxes,
        image_root,
        tmp_path / "out",
        ["env"],
        order_env={"GREETING": "hi", "PORT": "1"},
        bourse_env={"PORT": "8080", "BOURSE_PORT_WEB": "8080", "BOURSE_ADDR_WEB": "h:8080"},
    )
    assert how == Exit(code=0)
    env = dict(line.split("=", 1) for line in output.splitlines())
    assert "BOURSE_TEST_MARKER" not in env
    assert env["GREETING"] == "hi"
    assert env["PORT"] == "8080"  # Bourse's wins over the order's
    assert env["BOURSE_ADDR_WEB"] == "h:8080"
    assert set(env) <= {
        "PATH", "HOME", "HOSTNAME", "GREETING", "PORT", "BOURSE_PORT_WEB", "BOURSE_ADDR_WEB"
    }  # fmt: skip


async def test_the_order_may_replace_the_command(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    mid = _mid(boxes)
    spec = runtime_spec(
        RunConfig(entrypoint=["echo", "image:"], cmd=["default"]),
        LIMITS,
        cgroups_path=boxes.cgroups_path(mid),
        hostname="box",
        bourse_env={},
        command=Command(cmd=("ordered",)),
        host=boxes.host(),
    )
    c = await Boxed.start(boxes, mid, spec, image_root, 8, tmp_path / "out")
    try:
        assert await c.wait() == Exit(code=0)
    finally:
        await c.cleanup()
    assert c.output() == "image: ordered\n"


# -- nothing left ---------------------------------------------------------------------------
async def test_cleanup_leaves_no_mount_loop_cgroup_or_state(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    c = await _start(boxes, image_root, out, ["sh", "-c", SLEEPER])
    await _said(c, "ready")
    state = boxes.state / c.runtime_id
    paths = json.loads((state / "state.json").read_text())["cgroup_paths"]
    joined = [Path(p) for p in paths.values()]
    assert joined and all(p.is_dir() for p in joined)
    assert {str(p) for p in c.cgroups.values()} >= {str(p) for p in joined}
    assert _leftovers(boxes)  # mounts, a loop device, cgroups, state: all there now

    await c.cleanup()
    assert not c.running
    assert _leftovers(boxes) == []
    assert not any(p.exists() for p in joined)
    assert not state.exists() and not c.box.dir.exists()
    await c.cleanup()  # idempotent


async def test_a_new_start_replaces_a_stale_one_whose_cleanup_then_leaves_it_be(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    mid, script = _mid(boxes), ["sh", "-c", SLEEPER]
    stale = await _start(boxes, image_root, tmp_path / "stale", script, mid=mid)
    await _said(stale, "ready")
    fresh = await _start(boxes, image_root, tmp_path / "fresh", script, mid=mid)
    try:
        with anyio.fail_after(WAIT_S):
            assert (await stale.wait()).signal == 9  # its leftovers were removed first
        await _said(fresh, "ready")
        await stale.cleanup()  # not the fresh one's to remove
        assert fresh.running and fresh.box.disk.exists()
    finally:
        await fresh.cleanup()
    assert _leftovers(boxes) == []


async def test_a_failed_start_leaves_nothing(
    boxes: Containers, image_root: Path, tmp_path: Path
) -> None:
    mid = _mid(boxes)
    spec = runtime_spec(
        RunConfig(cmd=["true"]),
        LIMITS,
        cgroups_path=boxes.cgroups_path(mid),
        hostname="box",
        bourse_env={},
    )
    with pytest.raises(ContainerError, match="is not a directory"):
        boxes.prepare(mid, spec, tmp_path / "no-image", 8)
    with pytest.raises(ContainerError, match="disk_mb must be >= 1"):
        boxes.prepare(mid, spec, image_root, 0)
    assert _leftovers(boxes) == []


async def test_sweep_removes_an_owners_leftovers_and_never_another_owners(
    runtime: Runtime, image_root: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "data" / "containers"
    mine, theirs = (
        Containers(runtime, directory, _owner()),
        Containers(runtime, directory, _owner()),
    )
    script = ["sh", "-c", SLEEPER]
    left = [await _start(mine, image_root, tmp_path / f"out{i}", script) for i in range(2)]
    other = await _start(theirs, image_root, tmp_path / "other", script)
    try:
        for c in [*left, other]:
            await _said(c, "ready")
        # a supplier that died left ``left``; its successor sweeps
        after = Containers(runtime, directory, mine.owner)
        swept = after.sweep()
        assert sorted(swept) == sorted(c.machine_id for c in left)
        for c in left:
            with anyio.fail_after(WAIT_S):
                assert (await c.wait()).signal == 9
        assert _leftovers(mine) == []
        assert other.running
        assert all(d.is_dir() for d in other.cgroups.values())
    finally:
        await other.cleanup()
        for c in left:
            await c.cleanup()
    assert theirs.sweep() == []
    assert _leftovers(theirs) == []
    assert not any(d.exists() for d in _owner_cgroups(mine) + _owner_cgroups(theirs))


def test_detect_finds_runc_and_its_version(runtime: Runtime) -> None:
    said = subprocess.run([runtime.path, "--version"], capture_output=True, text=True).stdout
    assert runtime.name == "runc"
    assert runtime.version and runtime.version in said.splitlines()[0]
    assert runtime.describe() == f"runc {runtime.version}"


def test_the_image_root_is_untouched(image_root: Path) -> None:
    """What containers wrote went to their own layers (this runs after them in the module)."""
    names = sorted(p.name for p in image_root.iterdir())
    assert names == ["bin", "etc", "mnt", "tmp"]
    assert stat.S_IMODE((image_root / "tmp").stat().st_mode) == 0o1777
    assert not (image_root / "fill").exists()
