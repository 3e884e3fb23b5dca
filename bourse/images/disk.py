"""An image cache's files on disk: the bytes a tree takes, a tree removed whatever an image
made read-only in it, a last use kept as a file's time."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

_HEX = frozenset("0123456789abcdef")


def hex_of(digest: str) -> str:
    """A sha256 digest's hex: the name of its files in a cache."""
    return digest.removeprefix("sha256:")


def is_hex_name(name: str) -> bool:
    """Whether ``name`` is a sha256 hex (a blob's file name in a cache)."""
    return len(name) == 64 and set(name) <= _HEX


def disk_usage(top: Path) -> int:
    """Bytes on disk under ``top`` (allocated blocks; a hard-linked file once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    pending = [top]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))
    return total


def remove_tree(path: Path) -> None:
    """Remove ``path`` whatever it is; directories an image made read-only included."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        path.unlink()
        return
    if os.geteuid() != 0:  # root may remove what it cannot write; others make it writable
        _writable(path)
    shutil.rmtree(path)


def _writable(top: Path) -> None:
    """Give the owner full rights on every directory under ``top``, never through a link
    (an image's absolute symlink names a path of the host here)."""
    top.chmod(stat.S_IMODE(top.lstat().st_mode) | stat.S_IRWXU)
    for parent, dirs, _ in os.walk(top):
        for name in dirs:
            path = Path(parent, name)
            if not path.is_symlink():
                path.chmod(stat.S_IMODE(path.lstat().st_mode) | stat.S_IRWXU)


def remove_all(paths: Iterable[Path]) -> None:
    for path in paths:
        remove_tree(path)


def set_mtime(path: Path, when: float) -> None:
    """Keep a last use as the file's time (best effort: an entry being evicted may be gone)."""
    with contextlib.suppress(FileNotFoundError):
        os.utime(path, (when, when))
