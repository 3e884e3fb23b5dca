"""One owner per state directory: an exclusive OS lock that dies with its process.

`supplier run` and `bourse up` keep durable state in a directory; two processes on one
directory would both resume its machines (each would run twice) and interleave writes. The
owner holds ``flock(LOCK_EX)`` on ``<dir>/.lock`` for as long as it lives: the kernel drops
the lock when the process ends however it ends (kill -9 included), so nothing stale is ever
left to clean up, and the lock file itself only carries the owner's pid for the message.
The descriptor is not inherited by child processes (Python opens it close-on-exec), so a
program's children never keep its directory locked after it is gone.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from bourse.errors import BourseError

LOCK_NAME = ".lock"


class StateDirBusy(BourseError):
    """Another live process owns the directory; the message names it and its pid."""


class StateDirLock:
    """The held lock on one directory (see :func:`lock_state_dir`)."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self._fd: int | None = fd

    def release(self) -> None:
        """Give the directory up (the process's end does the same)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> StateDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_state_dir(directory: Path) -> StateDirLock:
    """Own ``directory`` (created if missing) or raise :class:`StateDirBusy` at once."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        os.close(fd)
        who = f"pid {holder}" if holder else "another process"
        raise StateDirBusy(
            f"state directory {directory} is in use by {who}: stop it first, or pass"
            " another --data-dir"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return StateDirLock(directory, fd)


def _read_pid(fd: int) -> int | None:
    """The pid the owner wrote, if it is readable (it writes it right after locking)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
