"""Exec wrapper for machine processes: ``python -m supplier.drivers.reaper -- CMD ARGS...``.

It asks Linux to send SIGTERM to this process when its parent (the supplier) dies, then
execs the command (the setting survives exec). So a supplier killed with -9 leaves no
orphan machines behind, and its restart can start them again without duplicates.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if not argv or argv[0] != "--" or len(argv) < 2:
        sys.stderr.write("usage: python -m supplier.drivers.reaper -- CMD [ARGS...]\n")
        raise SystemExit(2)
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            raise SystemExit(1)
    cmd = argv[1:]
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        sys.stderr.write(f"cannot run {cmd[0]!r}: {exc.strerror}\n")
        raise SystemExit(127) from None


if __name__ == "__main__":
    main(sys.argv[1:])
