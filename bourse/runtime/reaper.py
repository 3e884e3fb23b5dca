"""Exec wrapper that ties a child to its parent:
``python -m bourse.runtime.reaper [--cgroup FILE]... [--rlimit NAME=N]... -- CMD ARGS...``.

It asks Linux to send SIGTERM to this process when its parent dies, then execs the command
(the setting survives exec). Machine processes are started through it by the process
driver, so a supplier killed with -9 leaves no orphan machines (its restart starts them
again, without duplicates); ``bourse up`` starts its suppliers and exchange through it, so
no daemon outlives an ``up`` that was killed.

Confinement (supplier/machines/host/confine.py) is applied here, in the child, before the exec:
``--cgroup`` writes this process's pid into each given ``cgroup.procs`` file and
``--rlimit DATA=N`` / ``NPROC=N`` sets ``RLIMIT_<NAME>``; so the command is confined from
its first instruction, and so is every process it forks. (Not a ``preexec_fn`` in the
supplier: that runs Python between fork and exec in a process with threads, which the
subprocess docs warn can deadlock; this wrapper is a fresh single-threaded process.) A step
that fails ends it with code 125 and one line on stderr (the machine's log).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1


USAGE = "usage: python -m bourse.runtime.reaper [--cgroup FILE]... [--rlimit NAME=N]... -- CMD\n"
CONFINE_FAILED = 125


def _confine(cgroups: list[str], limits: list[str]) -> None:
    """Join the cgroups and set the rlimits (before the exec), or exit 125 saying why."""
    try:
        for procs in cgroups:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        for spec in limits:
            name, _, value = spec.partition("=")
            res = getattr(resource, f"RLIMIT_{name}")
            hard = resource.getrlimit(res)[1]
            limit = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
            resource.setrlimit(res, (limit, limit))
    except (OSError, ValueError, AttributeError) as exc:
        sys.stderr.write(f"cannot confine the machine: {exc}\n")
        raise SystemExit(CONFINE_FAILED) from None


def main(argv: list[str]) -> None:
    cgroups: list[str] = []
    limits: list[str] = []
    while len(argv) >= 2 and argv[0] in ("--cgroup", "--rlimit"):
        (cgroups if argv[0] == "--cgroup" else limits).append(argv[1])
        argv = argv[2:]
    if not argv or argv[0] != "--" or len(argv) < 2:
        sys.stderr.write(USAGE)
        raise SystemExit(2)
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            raise SystemExit(1)
    _confine(cgroups, limits)
    cmd = argv[1:]
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        sys.stderr.write(f"cannot run {cmd[0]!r}: {exc.strerror}\n")
        raise SystemExit(127) from None


if __name__ == "__main__":
    main(sys.argv[1:])
