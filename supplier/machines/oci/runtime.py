"""The OCI runtime on this host: which one (runc, or crun where cgroup2 is unified) can run
containers here and its version, or why none can, naming what to install.

Rootful only (runc as root: the loop device and the mounts of a machine's box need it too).
On a hybrid cgroup layout (v1 controllers beside a cgroup2 mount), runc only: crun does not
support it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import structlog

from bourse.errors import BourseError
from supplier.machines.host.confine import Mounts, parse_mountinfo

log = structlog.get_logger("bourse.driver.oci")

RUNTIMES = ("runc", "crun")
INSTALL = "apt-get install runc"
# Where the tools live on Debian: /usr/sbin is not on every user's PATH.
SEARCH_PATH = f"{os.environ.get('PATH', '')}:/usr/local/sbin:/usr/sbin:/sbin"
TOOLS = {"mkfs.ext4": "e2fsprogs", "mount": "mount", "umount": "mount", "losetup": "mount"}


class RuntimeUnavailable(BourseError, RuntimeError):
    """No OCI runtime that can work here."""


# -- the runtime ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Runtime:
    """An OCI runtime found on this host."""

    name: str
    path: str
    version: str

    def describe(self) -> str:
        return f"{self.name} {self.version}"


def hybrid(mounts: Mounts) -> bool:
    """cgroup v1 controllers beside a cgroup2 mount."""
    return mounts.v2 is not None and bool(mounts.v1)


def verdict(name: str, euid: int, mounts: Mounts, missing: dict[str, str]) -> str:
    """Why runtime ``name`` cannot run this driver's containers here, or "" (pure).
    ``missing``: the tools not found, each with the package that has it."""
    if euid != 0:
        return f"{name} needs root here: this driver runs rootful containers (mounts, loop devices)"
    if name == "crun" and hybrid(mounts):
        return (
            "crun does not support this host's hybrid cgroup layout (v1 controllers beside a "
            f"cgroup2 mount): install runc ({INSTALL})"
        )
    if missing:
        tools = ", ".join(sorted(missing))
        packages = " ".join(sorted(set(missing.values())))
        return f"{tools} not found: install them (apt-get install {packages})"
    return ""


def _version(path: str) -> str:
    """``runc version 1.1.5`` -> ``1.1.5``."""
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeUnavailable(f"{path} --version failed: {exc}") from None
    words = (out.splitlines() or [""])[0].split()
    return words[words.index("version") + 1] if "version" in words[:-1] else (out.strip() or "?")


def detect(names: tuple[str, ...] = RUNTIMES) -> Runtime:
    """The first runtime of ``names`` that is installed and can work here, with its
    version; RuntimeUnavailable says why none can, and what to install."""
    try:
        mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    except OSError:
        mounts = Mounts()
    missing = {t: p for t, p in TOOLS.items() if shutil.which(t, path=SEARCH_PATH) is None}
    refused = []
    for name in names:
        path = shutil.which(name, path=SEARCH_PATH)
        if path is None:
            continue
        why = verdict(name, os.geteuid(), mounts, missing)
        if not why:
            return Runtime(name, path, _version(path))
        refused.append(why)
    if refused:
        raise RuntimeUnavailable("; ".join(refused))
    raise RuntimeUnavailable(
        f"no OCI runtime found ({' or '.join(names)}): install runc ({INSTALL})"
    )
