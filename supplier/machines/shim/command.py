"""How a shim's process is made, one way whether its supplier ran the shim's command
(``python -I -S supplier/machines/shim/main.py DIR [FD]``: :func:`main`) or the fork server
forked it (supplier/machines/shim/forkserver.py): nothing of its parent's descriptors
kept, its plan read, then forked once more so that it is nobody's child and a session of
its own (:func:`go_alone`), its output its directory's ``shim.log``.

Standard library only (the shim's start path)."""

from __future__ import annotations

import os
import sys

from supplier.machines.shim import contract
from supplier.machines.shim.server import Shim


def main(argv: list[str]) -> None:
    if len(argv) not in (1, 2):
        sys.stderr.write("usage: python -I -S supplier/machines/shim/main.py DIR [FD]\n")
        raise SystemExit(2)
    directory = os.path.abspath(argv[0])
    first = int(argv[1]) if len(argv) == 2 else -1
    try:
        plan = contract.read_plan(directory)
    except contract.ContractError as exc:
        sys.stderr.write(f"{exc}\n")
        raise SystemExit(contract.START_FAILED) from None
    close_all_but(first)
    go_alone(directory, plan, first)


def close_all_but(first: int) -> None:
    """Nothing of the parent's but stdin, stdout, stderr and the first connection: a
    descriptor it leaked would be held for the shim's life."""
    keep = sorted({0, 1, 2, first} - {-1})
    low = 3
    for fd in keep:
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def own_output(directory: str, name: str) -> None:
    """stdin ``/dev/null``, stdout and stderr the log ``directory/name``."""
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)


def go_alone(directory: str, plan: contract.Plan, first: int) -> None:
    """Fork the shim proper and end this process (the shim's command, or the fork server's
    child): the shim is a session of its own, nobody's child, and runs the machine of
    ``plan``. Never returns."""
    if os.fork():
        os._exit(0)
    os.setsid()
    own_output(directory, contract.SHIM_LOG)
    os.chdir(directory)  # its socket is bound by name here (a path may be too long for one)
    if first >= 0:
        os.set_inheritable(first, False)
    code = Shim(directory, plan, first).run()
    sys.stdout.flush()
    os._exit(code)
