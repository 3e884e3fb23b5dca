"""What a supplier's worker leaves on the host, found by the names it gives things
(supplier/machines/host/network.py ``Names``, its data dir's owner): network namespaces,
veths, its bridge and nftables table, mounts below its data dir, its cgroups, its
containers' bundles' directory, its host claims (ports, user id blocks, subnet), and
processes running as a user id block."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from supplier.machines.host.claims import default_directory
from supplier.machines.host.confine import Confiner, owner_of
from supplier.machines.host.ids import processes_of
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


def leftovers(data_dir: Path, worker_id: str, blocks: tuple[int, ...] = ()) -> list[str]:
    """Everything of the worker's on the host (its supplier stopped, its machines
    destroyed): namespaces, veths, bridge, table, mounts below the data dir, host claims,
    and processes of the user id blocks (their first ids) its machines had."""
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
    left += [f"claim {c['kind']} {c['key']}" for c in claims_of(data_dir)]
    left += [f"process {pid} of block {base}" for base in blocks for pid in processes_of(base)]
    return left
