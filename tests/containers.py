"""What the container tests share: runc (or a skip naming what to install) and a root made
from the host's static busybox."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import anyio
import pytest

from supplier.machines.api import Exit
from supplier.machines.host.netns import available
from supplier.machines.oci.boxes import Containers
from supplier.machines.oci.bundle import runtime_id
from supplier.machines.oci.runtime import INSTALL, Runtime, RuntimeUnavailable, detect
from supplier.machines.oci.spec import Spec
from supplier.machines.shim.client import Shim, launch
from supplier.machines.shim.contract import Plan

APPLETS = (
    *("awk", "cat", "dd", "echo", "env", "grep", "id", "ls"),
    *("hostname", "mkdir", "mount", "pwd", "sh", "sleep", "touch", "true"),
)
PASSWD = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n"
GROUP = "root:x:0:\napp:x:1000:\n"


def need_runc() -> Runtime:
    """runc, or the test is skipped saying what to install."""
    if os.geteuid() != 0:
        pytest.skip(f"container tests need root, and runc ({INSTALL})")
    try:
        return detect(("runc",))
    except RuntimeUnavailable as exc:
        pytest.skip(f"{exc} ({INSTALL})")


def need_isolation() -> None:
    """Root, runc, and what machines' users and networks of their own take, or the test
    skipped saying which is missing."""
    need_runc()
    why = available()
    if why:
        pytest.skip(f"machines cannot have networks of their own here: {why}")


def busybox_root(root: Path) -> Path:
    """``root``: a static busybox and its applets, /etc/passwd and /etc/group, /tmp (the
    test is skipped where the host has no static busybox)."""
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("needs busybox (Debian package busybox-static)")
    linked = subprocess.run(["ldd", busybox], capture_output=True, text=True, check=False)
    if "not a dynamic executable" not in linked.stdout + linked.stderr:
        pytest.skip(f"{busybox} is not static (Debian package busybox-static)")
    for d in ("bin", "etc", "mnt", "tmp"):
        (root / d).mkdir(parents=True)
    (root / "tmp").chmod(0o1777)
    shutil.copy(busybox, root / "bin/busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc/passwd").write_text(PASSWD)
    (root / "etc/group").write_text(GROUP)
    return root


def reap_kept(top: Path) -> None:
    """What kept machines under ``top`` left when their test failed midway (a supplier
    killed and not started again): their shims and machines killed, their containers
    deleted and their mounts gone, so that a failure costs nothing beyond itself."""
    for state in top.glob("**/shims/*/*/state.json"):
        try:
            pid = int(json.loads(state.read_text())["pid"])
            os.killpg(pid, signal.SIGKILL)  # a machine leads a session of its own
        except (OSError, ValueError, KeyError, TypeError):
            pass
    subprocess.run(["pkill", "-9", "-f", str(top)], capture_output=True, check=False)
    for root in top.glob("**/containers/*/state"):
        listed = subprocess.run(
            ["runc", "--root", str(root), "list", "-q"], capture_output=True, text=True
        )
        for cid in listed.stdout.split():
            subprocess.run(["runc", "--root", str(root), "delete", "--force", cid], check=False)
    for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
        point = line.split()[4]
        if point.startswith(str(top)):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)


class Boxed:
    """One container run the way a worker runs it (its box made by ``Containers.prepare``,
    its runtime run by a shim), with what the container tests ask of it; its output is
    ``<log_dir>/<machine_id>.log`` (:meth:`output`, without the shim's header line)."""

    def __init__(self, boxes: Containers, machine_id: str, shim: Shim, log_dir: Path) -> None:
        self.boxes = boxes
        self.machine_id = machine_id
        self.shim = shim
        self.log_dir = log_dir
        self.box = boxes.box(machine_id)
        self.runtime_id = self.box.dir.name
        self.cgroups = boxes.cgroups(boxes.cgroups_path(machine_id))

    @classmethod
    async def start(
        cls, boxes: Containers, machine_id: str, spec: Spec, root: Path, disk_mb: int, log_dir: Path
    ) -> Boxed:
        run = await anyio.to_thread.run_sync(boxes.prepare, machine_id, spec, root, disk_mb)
        plan = Plan(machine_id, run, str(log_dir), 1, 64, 10.0)
        shim = await launch(log_dir.parent / "shims" / runtime_id(machine_id), plan)
        return cls(boxes, machine_id, shim, log_dir)

    @property
    def running(self) -> bool:
        return not self.shim.ended.is_set()

    def output(self) -> str:
        path = self.log_dir / f"{self.machine_id}.log"
        text = path.read_text() if path.exists() else ""
        return text.split("\n", 1)[1] if text.startswith("--- ") else text

    async def wait(self) -> Exit:
        await self.shim._await(self.shim.ended, 3600)
        return exit_of_shim(self.shim)

    async def stop(self, grace_s: float) -> Exit:
        await self.shim.stop(grace_s)
        return exit_of_shim(self.shim)

    async def cleanup(self) -> None:
        """Stopped if it runs, its shim collected (it removed what the container held)."""
        with anyio.CancelScope(shield=True):
            if not self.shim.collected.is_set():
                if not self.shim.ended.is_set():
                    await self.shim.stop(0.0)
                await self.shim.collect()


def exit_of_shim(shim: Shim) -> Exit:
    return shim.exit()
