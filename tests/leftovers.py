"""What a supplier's worker leaves on the host, found by the names it gives things
(supplier/machines/host/network.py ``Names``, its data dir's owner): network namespaces,
veths, its bridge and nftables table, mounts below its data dir, its cgroups, its
containers' bundles' directory, its host claims (ports, user id blocks, subnet), and
processes running as a user id block; and :func:`left_below`: all of that for every supplier
whose data dir is below a directory (``bourse up``'s), with the processes, mounts, loop
devices, runtime state and shims that name the directory."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from collections.abc import Collection
from pathlib import Path

from supplier.machines.host.claims import default_directory
from supplier.machines.host.confine import Confiner, owner_of
from supplier.machines.host.ids import BLOCK, processes_of
from supplier.machines.host.network import NETNS_DIR, Names
from supplier.machines.host.nftables import NFT
from supplier.machines.oci.boxes import BUNDLES


def processes_with(marker: str) -> list[int]:
    """The host's processes whose environment holds ``marker`` (``KEY=VALUE``)."""
    want = marker.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if want in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return sorted(found)


def claims_of(data_dir: Path) -> list[dict[str, object]]:
    """The host claims (this session's directory) of the supplier of ``data_dir``."""
    owner = owner_of(data_dir)
    found = []
    for path in sorted(default_directory().glob("*.claim")):
        claim = json.loads(path.read_text())
        if claim["owner"] == owner:
            found.append(claim)
    return found


def namespaces(data_dir: Path, worker_id: str) -> set[str]:
    """The worker's machines' network namespaces on the host."""
    tag = Names.of(owner_of(data_dir), worker_id).tag
    return {p.name for p in NETNS_DIR.glob(f"bn{tag}*")} if NETNS_DIR.is_dir() else set()


def namespace_of(pid: int) -> str:
    """The name of the network namespace process ``pid`` is in ("" : none named)."""
    inode = os.stat(f"/proc/{pid}/ns/net").st_ino
    for path in NETNS_DIR.glob("*") if NETNS_DIR.is_dir() else ():
        if path.stat().st_ino == inode:
            return path.name
    return ""


def uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


def leftovers(
    data_dir: Path,
    worker_id: str,
    blocks: tuple[int, ...] = (),
    recorded: Collection[str] = (),
) -> list[str]:
    """Everything of the worker's on the host (its supplier stopped, its machines
    destroyed): namespaces, veths, bridge, table, mounts below the data dir, host claims,
    and processes of the user id blocks (their first ids) its machines had. ``recorded``:
    the machines its store still records (stopped with their supplier, not destroyed): they
    keep their user ids and the worker's port range (held claims), nothing else."""
    names = Names.of(owner_of(data_dir), worker_id)
    left = [f"namespace {n}" for n in sorted(namespaces(data_dir, worker_id))]
    for link in sorted(os.listdir("/sys/class/net")):
        if link == names.bridge or link.startswith(f"bv{names.tag}"):
            left.append(f"link {link}")
    table = subprocess.run([NFT, "list", "table", "ip", names.table], capture_output=True)
    if table.returncode == 0:
        left.append(f"table {names.table}")
    top = str(data_dir.resolve())
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if line.split()[4].startswith(top):
            left.append(f"mount {line.split()[4]}")
    confiner, _ = Confiner.probe("auto", worker_id, owner=owner_of(data_dir))
    left += [f"cgroup {d}" for d in sorted(set(confiner.bases.values())) if d.exists()]
    bundles = BUNDLES / f"{owner_of(data_dir)}-{worker_id}"
    if bundles.exists():
        left.append(f"bundles {bundles}")
    left += [
        f"claim {c['kind']} {c['key']}"
        for c in claims_of(data_dir)
        if _holds(c, worker_id) and not _kept(c, worker_id, recorded)
    ]
    # a zombie holds nothing: a machine's process killed after its parent is init's to reap
    # (this sandbox's init reaps in its own time)
    left += [
        f"process {pid} of block {base}: {how}"
        for base in blocks
        for pid in processes_of(base)
        if not (how := _described(pid)).startswith(("state Z", "gone"))
    ]
    return left


def _described(pid: int) -> str:
    """A process's state, parent and command line, as far as it is still there."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return f"state {state}, parent {ppid}: {cmdline[:80]}"


def _holds(claim: dict[str, object], worker_id: str) -> bool:
    """Whether the claim is the worker's (its range, its subnet) or one of its machines'."""
    holder = str(claim["holder"])
    return holder == worker_id or holder.startswith(f"{worker_id}~")


def _kept(claim: dict[str, object], worker_id: str, recorded: Collection[str]) -> bool:
    """A held claim that a machine its store still records keeps: its user ids, its
    worker's port range."""
    if not claim.get("held"):
        return False
    if claim["kind"] == "uids":
        return claim["holder"] in recorded
    if claim["kind"] == "ports":
        return claim["holder"] == worker_id and bool(recorded)
    return False


def recorded_machines(data_dir: Path) -> dict[str, list[str]]:
    """Worker id -> the machines the supplier's store (``data_dir``) records, not destroyed
    (every worker with a port range or a machine, none left out)."""
    db = sqlite3.connect(f"file:{data_dir / 'supplier.db'}?mode=ro", uri=True)
    try:
        found: dict[str, list[str]] = {
            w: [] for (w,) in db.execute("SELECT worker_id FROM worker_ports")
        }
        rows = db.execute("SELECT worker_id, machine_id FROM machines WHERE state != 'destroyed'")
        for w, m in rows:
            found.setdefault(w, []).append(m)
        for (w,) in db.execute("SELECT DISTINCT worker_id FROM machines"):
            found.setdefault(w, [])
    finally:
        db.close()
    return found


def left_below(top: Path) -> list[str]:
    """What the host still holds of anything below ``top`` (suppliers' data dirs: ``bourse
    up``'s, a test's): processes whose command line or working directory name it, mounts
    (a container's root names its image below it), loop devices of files below it, runtime
    state, shims' directories; and for each supplier's worker what :func:`leftovers` finds
    (its machines as its store records them)."""
    text = str(top.resolve())
    found: list[str] = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = str((entry / "cwd").readlink())
        except OSError:
            continue
        if text in cmdline or cwd.startswith(text):
            found.append(f"process {entry.name}: {cmdline[:120]}")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if text in line:
            found.append(f"mount {line.split()[4]}")
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    found += [f"loop {line}" for line in loops.splitlines() if text in line]
    found += [f"runtime state {s}" for s in sorted(top.glob("**/containers/*/state/*"))]
    found += [f"shim {s}" for s in sorted(top.glob("**/shims/*/*"))]
    for db in sorted(top.glob("**/supplier.db")):
        for worker_id, machines in sorted(recorded_machines(db.parent).items()):
            blocks = tuple(
                int(str(c["key"])) * BLOCK
                for c in claims_of(db.parent)
                if c["kind"] == "uids" and str(c["holder"]).startswith(f"{worker_id}~")
            )
            found += leftovers(db.parent, worker_id, blocks, machines)
    return found
