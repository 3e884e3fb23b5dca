"""Exec wrapper that ties a child to its parent: ``python -m bourse.runtime.reaper -- CMD ARGS...``.

It asks Linux to send SIGTERM to this process when its parent dies, then execs the command
(the setting survives exec). Machine processes are started through it by the process
driver, so a supplier killed with -9 leaves no orphan machines (its restart starts them
again, without duplicates); ``bourse up`` starts its suppliers and exchange through it, so
no daemon outlives an ``up`` that was killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if not argv or argv[0] != "--" or len(argv) < 2:
        sys.stderr.write("usage: python -m bourse.runtime.reaper -- CMD [ARGS...]\n")
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
