"""A command entered into a running process machine (``buyer machines exec``, docs/protocol.md
§4.24): run as ``python -m supplier.machines.shim.enter`` by its worker's supplier, it takes
exactly what the machine's own process took before its first instruction
(supplier/machines/shim/spawn.py ``spawn``), then executes the command:

- a session of its own (a terminal's: its stdin made its controlling terminal);
- the machine's cgroups joined and its rlimits set;
- the machine's network and mount namespaces entered (``/proc/<pid>/ns/…`` of the
  machine's process: its /tmp, its image and working directory where it sees them, the
  supplier's data dir hidden, a /proc of its own user's processes);
- its user and group, no supplementary groups and no new privileges;
- its working directory and environment (as the supplier hands them over).

What to do comes as one JSON object on the fd its only argument names (the environment may
hold secrets: never on the command line). A step that fails is said on stderr (``cannot
<step>: <why>``) and the exit status is 126 (127: the command was not found), as a shell
says it.

Standard library only, cheap to import, single-threaded (entering a mount namespace needs
it).
"""

from __future__ import annotations

import json
import os
import sys
from errno import ENOENT

from supplier.machines.shim.spawn import (
    CLONE_NEWNET,
    CLONE_NEWNS,
    EXIT_CANNOT_RUN,
    _become,
    _call,
    exec_paths,
    libc,
    set_rlimits,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal

EXIT_CANNOT_ENTER = 126
TIOCSCTTY = 0x540E


def _read_spec(fd: int) -> dict[str, object]:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    spec = json.loads(data)
    if not isinstance(spec, dict):
        raise ValueError("the spec is not an object")
    return spec


def _strings(spec: dict[str, object], key: str) -> list[str]:
    value = spec.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} is not a list of strings")
    return value


def _join(path: str, nstype: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _call("setns", fd, nstype)
    finally:
        os.close(fd)


def enter(spec: dict[str, object]) -> None:
    """Confine this process as the machine's and execute its command (never returns)."""
    argv = _strings(spec, "argv")
    raw_env = spec.get("env") or {}
    if not isinstance(raw_env, dict):
        raise ValueError("env is not an object")
    env = {str(k): str(v) for k, v in raw_env.items()}
    step = "start"
    try:
        libc()
        os.setsid()
        if spec.get("tty"):
            step = "take its terminal"
            import fcntl

            fcntl.ioctl(0, TIOCSCTTY, 0)
        step = "confine it"
        me = str(os.getpid()).encode()
        for procs in _strings(spec, "cgroups"):
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, me)
            finally:
                os.close(fd)
        set_rlimits(_strings(spec, "rlimits"))
        for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):
            _signal.signal(sig, _signal.SIG_DFL)
        pid = int(str(spec.get("pid") or 0))
        if spec.get("netns"):
            step = "enter its network"
            _join(f"/proc/{pid}/ns/net", CLONE_NEWNET)
        if spec.get("mounts"):
            step = "enter its mounts"
            _join(f"/proc/{pid}/ns/mnt", CLONE_NEWNS)
        step = "make it its user"
        uid, gid = int(str(spec.get("uid", -1))), int(str(spec.get("gid", -1)))
        _become(uid, gid)
        cwd = str(spec.get("cwd") or "/")
        step = f"enter {cwd}"
        os.chdir(cwd)
    except BaseException as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        os.write(2, f"cannot {step}: {why}\n".encode(errors="replace"))
        os._exit(EXIT_CANNOT_ENTER)
    failed: OSError | None = None
    for path in exec_paths(argv[0], env):
        try:
            os.execve(path, argv, env)
        except OSError as exc:
            failed = failed if exc.errno == ENOENT and failed else exc
    failed = failed or OSError(ENOENT, "No such file or directory")
    os.write(2, f"cannot run {argv[0]!r}: {failed.strerror}\n".encode(errors="replace"))
    os._exit(EXIT_CANNOT_RUN if failed.errno == ENOENT else EXIT_CANNOT_ENTER)


def main() -> None:
    try:
        spec = _read_spec(int(sys.argv[1]))
    except (IndexError, OSError, ValueError) as exc:
        sys.stderr.write(f"cannot read what to run: {exc}\n")
        sys.exit(EXIT_CANNOT_ENTER)
    enter(spec)


if __name__ == "__main__":
    main()
