"""A command entered into a running machine (``buyer machines exec``, docs/protocol.md §4.24):
run by its worker's supplier as the shim is (``python -I -S .../shim/main.py enter FD``), it
takes exactly what the machine's own process took before its first instruction, then
executes the command. A process machine's (supplier/machines/shim/spawn.py ``spawn``):

- a session of its own (a terminal's: its stdin made its controlling terminal);
- the machine's cgroups joined and its rlimits set;
- the machine's network and mount namespaces entered (``/proc/<pid>/ns/…`` of the
  machine's process: its /tmp, its image and working directory where it sees them, the
  supplier's data dir hidden, a /proc of its own user's processes);
- its user and group, no supplementary groups and no new privileges;
- its working directory and environment (as the supplier hands them over).

A container's (its runtime spec's ``process`` and namespaces, :func:`_into_container`): its
cgroups and rlimits, every namespace of its first process (its user namespace last), its
root, its process's user, groups, capabilities, no new privileges and seccomp filter.

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
    PR_SET_PDEATHSIG,
    SIGNAL_STATUS_BASE,
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
PR_SET_DUMPABLE = 4
CLONE_NEWUSER = 0x10000000
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


def _into_container(spec: dict[str, object], pid: int, uid: int, gid: int) -> None:
    """A container's namespaces entered as nsenter enters them (all others first, as the
    host's root, then its user namespace: runc 1.1's exec joins the user namespace first and
    may then not join a network namespace the host's owns), its root made this process's,
    then (in a child: the pid namespace counts from there) its process's groups, user,
    capabilities, no new privileges and seccomp filter (privileges.py). The parent waits
    and exits as the child did (128 + N: killed by signal N), as a runtime's exec does."""
    from supplier.machines.shim.privileges import Privileges

    raw_seccomp, raw_caps = spec.get("seccomp"), spec.get("caps")
    seccomp = raw_seccomp if isinstance(raw_seccomp, dict) else None
    caps = {str(k): [str(c) for c in v] for k, v in (raw_caps or {}).items()}  # type: ignore[attr-defined]
    privileges = Privileges(seccomp=seccomp is not None)
    # Not dumpable while it holds the host's privileges inside the container: no process
    # of the container may ptrace it or read its /proc (runc's exec does the same).
    _call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
    fds = [_ns_fd(pid, name) for name in _strings(spec, "namespaces")]
    user = _ns_fd(pid, "user") if spec.get("userns") else -1
    root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for fd in fds:
        _call("setns", fd, 0)
        os.close(fd)
    if user >= 0:
        _call("setns", user, CLONE_NEWUSER)
        os.close(user)
    os.fchdir(root)
    os.chroot(".")
    os.close(root)
    child = os.fork()
    if child:
        _exit_as(child)
    _call("prctl", PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)
    nnp = bool(spec.get("nnp"))
    if seccomp and not nnp:  # loaded while it may (it holds CAP_SYS_ADMIN in its userns)
        privileges.load_seccomp(seccomp)
    privileges.drop_bounding(caps.get("bounding", []))
    privileges.keep_caps(True)
    os.setgroups([int(g) for g in _strings(spec, "groups")])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    privileges.keep_caps(False)
    privileges.set_capabilities(caps)
    if nnp:
        privileges.no_new_privileges()
    if seccomp and nnp:
        privileges.load_seccomp(seccomp)


def _ns_fd(pid: int, name: str) -> int:
    return os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)


def _exit_as(child: int) -> None:
    """Wait for ``child``, then end as it ended (never returns)."""
    for sig in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP):
        _signal.signal(sig, _signal.SIG_IGN)  # the child's to take; a kill takes both
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            os._exit(EXIT_CANNOT_ENTER)
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else SIGNAL_STATUS_BASE - code)


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
        uid, gid = int(str(spec.get("uid", -1))), int(str(spec.get("gid", -1)))
        if spec.get("container"):
            step = "enter its container"
            _into_container(spec, pid, uid, gid)
        else:
            if spec.get("netns"):
                step = "enter its network"
                _join(f"/proc/{pid}/ns/net", CLONE_NEWNET)
            if spec.get("mounts"):
                step = "enter its mounts"
                _join(f"/proc/{pid}/ns/mnt", CLONE_NEWNS)
                step = "make it its user"
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


def main(argv: list[str]) -> None:
    try:
        spec = _read_spec(int(argv[0]))
    except (IndexError, OSError, ValueError) as exc:
        sys.stderr.write(f"cannot read what to run: {exc}\n")
        sys.exit(EXIT_CANNOT_ENTER)
    enter(spec)
