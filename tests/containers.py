"""What the container tests share: runc (or a skip naming what to install) and a root made
from the host's static busybox."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from supplier.drivers.oci_runtime import INSTALL, Runtime, RuntimeUnavailable, detect

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
