"""What a machine held on the host, removed: its cgroups (killing what is left in them),
and a container's runtime state, mounts, loop device and directory.

One home for it, standard library only: a shim calls it when its machine ended
(supplier/machines/shim/server.py), a supplier when it sweeps what a dead shim left or
undoes a start cut short (supplier/machines/oci/, supplier/machines/host/confine.py).
Every function is idempotent and says what it could not remove; none raises for a thing
already gone.
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # typing costs the shim an import: mypy reads this name alike
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal

# A pace while killed processes leave their cgroup (or the kernel releases a loop device).
PACE_S = 0.005
CGROUP_S = 2.0
LOOPS_S = 2.0
RUNTIME_S = 30.0
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def run(argv: list[str], timeout_s: float = RUNTIME_S) -> tuple[int, str]:
    """Run a tool to its end: its exit status and what it printed (killed past
    ``timeout_s``: status -9). 127 when it cannot be started."""
    r, w = os.pipe()
    try:
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, w, 1),
            (os.POSIX_SPAWN_DUP2, w, 2),
            (os.POSIX_SPAWN_CLOSE, r),
        ]
        pid = os.posix_spawnp(argv[0], argv, {"PATH": PATH}, file_actions=actions)
    except OSError as exc:
        os.close(r)
        return 127, f"cannot run {argv[0]}: {exc.strerror}"
    finally:
        os.close(w)
    out = bytearray()
    end = time.monotonic() + timeout_s
    with os.fdopen(r, "rb", buffering=0) as f:
        while chunk := f.read(65536):
            out += chunk
            if time.monotonic() > end:
                break
    status = _wait(pid, end)
    return status, out.decode(errors="replace").strip()


def _wait(pid: int, end: float) -> int:
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.kill(pid, _signal.SIGKILL)
            os.waitpid(pid, 0)
            return -9
        time.sleep(PACE_S)


# -- cgroups --------------------------------------------------------------------------------
def cgroup_pids(d: str) -> list[int]:
    try:
        with open(os.path.join(d, "cgroup.procs"), "rb") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


def kill_cgroups(dirs: list[str], timeout_s: float = CGROUP_S) -> list[int]:
    """SIGKILL what is in these cgroups until they are empty (bounded); the pids left."""
    end = time.monotonic() + timeout_s
    while True:
        pids = {p for d in dirs for p in cgroup_pids(d)}
        if not pids or time.monotonic() > end:
            return sorted(pids)
        for pid in pids:
            try:
                os.kill(pid, _signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(PACE_S)


def remove_cgroups(dirs: list[str], timeout_s: float = CGROUP_S) -> list[str]:
    """Kill what is left in these cgroup directories (one machine's, in each hierarchy)
    and remove them; those that stay."""
    kill_cgroups(dirs, timeout_s)
    return [d for d in dirs if not remove_cgroup(d, timeout_s)]


def remove_cgroup(d: str, timeout_s: float = CGROUP_S) -> bool:
    """Remove a cgroup directory (its files are not removable: rmdir it), killing what
    is left in it while it is busy; whether it is gone."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(d)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != 16 or time.monotonic() > end:  # EBUSY: processes still leaving
                return False
        for pid in cgroup_pids(d):
            try:
                os.kill(pid, _signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(PACE_S)


def oom_kills(files: list[str]) -> int:
    """``oom_kill N`` from memory.oom_control (v1) or memory.events (v2), the largest of
    the files given; 0 where absent."""
    kills = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError:
            continue
        for row in text.splitlines():
            key, _, value = row.partition(b" ")
            if key == b"oom_kill":
                kills = max(kills, int(value.strip() or 0))
    return kills


# -- mounts and loop devices ------------------------------------------------------------------
def _unescape(field: str) -> str:
    """A mountinfo path field (spaces and such as ``\\040``)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_below(directory: str, mountinfo: str | None = None) -> list[str]:
    """Mount points at or below ``directory``, deepest first."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo") as f:
                mountinfo = f.read()
        except OSError:
            return []
    top = os.path.abspath(directory)
    points = []
    for row in mountinfo.splitlines():
        fields = row.split(" ")
        if len(fields) > 4:
            point = _unescape(fields[4])
            if point == top or point.startswith(top + "/"):
                points.append(point)
    # deepest first; of one depth, the latest mounted first (a root over its layer)
    latest_first = list(dict.fromkeys(reversed(points)))
    return sorted(latest_first, key=lambda p: p.count("/"), reverse=True)


def unmount_below(directory: str) -> list[str]:
    """Unmount everything at or below ``directory`` (lazily where busy); what stays."""
    for point in mounts_below(directory):
        if run(["umount", point])[0] != 0:
            run(["umount", "-l", point])
    return mounts_below(directory)


def loops_of(disk: str) -> list[str]:
    """The loop devices backed by ``disk``."""
    code, out = run(["losetup", "-j", disk])
    return [row.split(":", 1)[0] for row in out.splitlines() if ":" in row] if code == 0 else []


def detach_loops(disk: str, timeout_s: float = LOOPS_S) -> list[str]:
    """Detach the loop devices backed by ``disk``; those still attached after a while. An
    unmounted loop device clears itself in the kernel's own time (autoclear): it is waited
    for, so the disk is never removed under a device that still names it."""
    end = time.monotonic() + timeout_s
    while devices := loops_of(disk):
        if time.monotonic() > end:
            return devices
        for device in devices:
            run(["losetup", "-d", device])
        time.sleep(PACE_S)
    return []


def remove_tree(directory: str) -> bool:
    """Remove a directory and all below it, never following links nor crossing into a
    mount; whether it is gone."""
    if not os.path.lexists(directory):
        return True
    if mounts_below(directory):
        return False  # never into a mount: what is mounted there is not the machine's
    if os.path.islink(directory) or not os.path.isdir(directory):
        os.unlink(directory)
        return True
    for parent, dirs, files in os.walk(directory, topdown=False):
        for name in files:
            try:
                os.unlink(os.path.join(parent, name))
            except FileNotFoundError:
                pass
        for name in dirs:
            path = os.path.join(parent, name)
            try:
                if os.path.islink(path):
                    os.unlink(path)
                else:
                    os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                pass  # a mount still there: reported below
    try:
        os.rmdir(directory)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


# -- a container ----------------------------------------------------------------------------
DISK = "disk.ext4"
RECORD = "record.json"


def runtime_cgroups(state_root: str, runtime_id: str) -> list[str]:
    """The cgroups the runtime's state says the container joined."""
    import json  # not on a start path: a container's end, or a sweep

    try:
        with open(os.path.join(state_root, runtime_id, "state.json"), "rb") as f:
            state = json.loads(f.read())
        return sorted(set(state.get("cgroup_paths", {}).values()))
    except (OSError, ValueError, AttributeError):
        return []


def box_run(box: str) -> str | None:
    """Which start made the box (its record's ``run``), None without a record."""
    import json  # not on a start path

    try:
        with open(os.path.join(box, RECORD), "rb") as f:
            run = json.loads(f.read()).get("run", "")
        return run if isinstance(run, str) else ""
    except (OSError, ValueError, AttributeError):
        return None


def remove_container(
    runtime: str,
    state_root: str,
    runtime_id: str,
    box: str,
    cgroup_dirs: list[str],
    token: str = "",
    bundle: str = "",
) -> list[str]:
    """Everything of one container, removed: its runtime state (the container killed),
    its cgroups in every hierarchy, the mounts below its box (its root and writable
    layer), the loop device of its disk, its box. What is left, each named. With ``token``,
    only if that start made the box (a later start of the machine removed them, and what is
    there now is its own)."""
    if token and box_run(box) not in (None, token):
        return []
    left: list[str] = []
    cgroups = sorted({*cgroup_dirs, *runtime_cgroups(state_root, runtime_id)})
    if os.path.exists(os.path.join(state_root, runtime_id)):
        code, out = run([runtime, "--root", state_root, "delete", "--force", runtime_id])
        if code != 0 and os.path.exists(os.path.join(state_root, runtime_id)):
            left.append(f"runtime state ({out})")
    left += [f"cgroup {d}" for d in remove_cgroups(cgroups)]
    if bundle:  # its root is mounted there, over the layer: unmounted first
        left += [f"mount {p}" for p in unmount_below(bundle)]
    left += [f"mount {p}" for p in unmount_below(box)]
    disk = os.path.join(box, DISK)
    if os.path.exists(disk):
        left += [f"loop device {d}" for d in detach_loops(disk)]
    for d in (bundle, box) if bundle else (box,):
        if not left and not remove_tree(d):
            left.append(f"directory {d}")
    return left
