"""How a shim starts its machine's first process: forked from the shim, in a session of its
own, confined (its cgroups joined, its rlimits set) before its command runs, tied to the shim
(SIGTERM when the shim dies), its output into a pipe the shim reads; and how its end is read.

Standard library only, cheap to import: this is every machine's start path (the one place
where what a machine is allowed is applied before its first instruction).
"""

from __future__ import annotations

import fcntl
import os
import time
from errno import ENOENT

from supplier.machines.shim import contract

TYPE_CHECKING = False  # typing costs the shim an import: mypy reads this name alike
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal

# The machine's output pipe is asked to be this big (a burst waits there; default 64 KiB).
PIPE_BYTES = 1024 * 1024
PR_SET_PDEATHSIG = 1
# ``run`` exits with 128 + N when the container's process was killed by signal N.
SIGNAL_STATUS_BASE = 128
SIGRTMAX = 64
EXIT_CANNOT_RUN = 127


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class StartFailed(Exception):
    """The machine could not be started (the reason goes to the supplier)."""


PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE = 16384, 1 << 18
MNT_DETACH = 2
O_PATH = 0o10000000

_libc = None


def libc() -> object:
    """The C library (ctypes, loaded once, before a fork: never in the child)."""
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _try(name: str, *args: object) -> bool:
    """A libc call that may fail: whether it succeeded."""
    return bool(getattr(libc(), name)(*args) == 0)


def _call(name: str, *args: object) -> None:
    """A libc call that must succeed (OSError with its errno otherwise)."""
    import ctypes

    if getattr(libc(), name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def _prctl_pdeathsig(sig: int) -> None:
    """Die by ``sig`` when the shim (this process's parent) ends."""
    _call("prctl", PR_SET_PDEATHSIG, sig, 0, 0, 0)


# The host's directories any user may write: a machine of its own user gets each as a tmpfs
# of its own, so that it writes nothing on the host (no file another machine reads, none
# left for the next machine of its user ids, no disk of the host filled).
SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


def _own_mounts(tmp_mb: int, binds: list[list[str]], hide: list[str]) -> None:
    """A mount namespace of its own: each ``hide`` path an empty read-only tmpfs that its
    user may pass, not list (what the host mounted there and below detached first: this
    copy of the host's mounts holds no other machine's root, layer or network namespace
    after their end), each bind (source, target, ro|rw) where it sees it (its sources
    opened first: one may be hidden), each of :data:`SHARED_DIRS` the host has a tmpfs of
    its own (``tmp_mb`` each: another machine's files, and the host's, are not there) and
    a /proc that shows its own user's processes only (another machine's command line may
    carry a secret)."""
    _call("unshare", CLONE_NEWNS)
    _call("mount", b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    sources = [os.open(source, O_PATH | os.O_CLOEXEC) for source, _, _ in binds]
    flat = MS_NOSUID | MS_NODEV | MS_NOEXEC
    for path in hide:
        if os.path.isdir(path):
            _try("umount2", path.encode(), MNT_DETACH)  # fails where it is no mount point
            _call("mount", b"tmpfs", path.encode(), b"tmpfs", flat, b"mode=0711,size=64k")
    for fd, (_, target, mode) in zip(sources, binds, strict=True):
        source = f"/proc/self/fd/{fd}"
        if os.path.isdir(source):
            os.makedirs(target, mode=0o755, exist_ok=True)
        elif not os.path.exists(target):  # a file's mount point, in a hidden path's tmpfs
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        _call("mount", source.encode(), target.encode(), None, MS_BIND | MS_REC, None)
        if mode == "ro":
            flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
            _call("mount", b"none", target.encode(), None, flags, None)
        os.close(fd)
    for path in hide:
        if os.path.isdir(path):
            _call("mount", b"none", path.encode(), None, MS_REMOUNT | MS_RDONLY | flat, None)
    if tmp_mb > 0:
        options = f"mode=1777,size={tmp_mb}m".encode()
        for shared in SHARED_DIRS:
            if os.path.isdir(shared):
                _call("mount", b"tmpfs", shared.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options)
        if _proc_options_per_mount():  # before 5.8 they were the pid namespace's: the host's
            flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
            _call("mount", b"proc", b"/proc", b"proc", flags, b"hidepid=invisible")


def _proc_options_per_mount() -> bool:
    """Whether a mount of /proc has options of its own (Linux 5.8 and later)."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 8)


def set_rlimits(rlimits: list[str] | tuple[str, ...]) -> None:
    """Each ``NAME=VALUE`` as this process's soft and hard limit (never above its hard one)."""
    if not rlimits:
        return
    import resource

    for spec in rlimits:
        name, _, value = spec.partition("=")
        res = getattr(resource, "RLIMIT_" + name)
        hard = resource.getrlimit(res)[1]
        n = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
        resource.setrlimit(res, (n, n))


def _join_network(path: str) -> None:
    """The network namespace made for the machine (it sees none of the host's)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _call("setns", fd, CLONE_NEWNET)
    finally:
        os.close(fd)


def _become(uid: int, gid: int) -> None:
    """The machine's own user and group, nothing else, and no new privileges (a setuid
    program of the host gives it none)."""
    _call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if uid >= 0:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)


def spawn(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    output: int,
    cgroups: list[str] | tuple[str, ...] = (),
    rlimits: list[str] | tuple[str, ...] = (),
    uid: int = -1,
    gid: int = -1,
    tmp_mb: int = 0,
    binds: list[list[str]] | tuple[list[str], ...] = (),
    netns: str = "",
    hide: list[str] | tuple[str, ...] = (),
) -> int:
    """Fork and execute ``argv`` in a session of its own, confined (its cgroups joined,
    its rlimits set, a /tmp (and the host's other shared directories) of its own of
    ``tmp_mb`` when > 0, its user ``uid``:``gid``
    when >= 0, no new privileges) before its first instruction, its stdin ``/dev/null``
    and its stdout and stderr ``output``; its pid. A command that cannot be executed
    raises StartFailed with the reason (told through a close-on-exec pipe: nothing is left
    running)."""
    libc()  # ctypes loaded before the fork, not in the child
    paths = exec_paths(argv[0], env)
    r, w = os.pipe()  # close-on-exec: EOF when the exec succeeded
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: nothing here may return
        step = "start"
        try:
            os.close(r)
            os.setsid()
            step = "tie it to its shim"
            _prctl_pdeathsig(_signal.SIGTERM)
            if os.getppid() != parent:
                os._exit(EXIT_CANNOT_RUN)
            step = "confine it"
            me = str(os.getpid()).encode()
            for procs in cgroups:
                fd = os.open(procs, os.O_WRONLY)
                try:
                    os.write(fd, me)
                finally:
                    os.close(fd)
            set_rlimits(rlimits)
            for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):  # Python ignores them: not the machine
                _signal.signal(sig, _signal.SIG_DFL)
            if netns:
                step = "enter its network"
                _join_network(netns)
            if tmp_mb > 0 or binds or hide:
                step = "give it mounts of its own"
                _own_mounts(tmp_mb, list(binds), list(hide))
            step = "make it its own user"
            _become(uid, gid)
            step = "connect its output"
            os.dup2(null, 0)
            os.dup2(output, 1)
            os.dup2(output, 2)
            step = f"enter {cwd}"
            os.chdir(cwd)
            step = f"run {argv[0]!r}"
            failed: OSError | None = None
            for path in paths:  # as execvpe, without the imports it makes (the stdlib may
                try:  # be out of this user's reach)
                    os.execve(path, argv, env)
                except OSError as exc:
                    failed = failed if exc.errno == ENOENT and failed else exc
            raise failed or OSError(ENOENT, "No such file or directory")
        except BaseException as exc:
            why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            try:
                os.write(w, f"cannot {step}: {why}".encode(errors="replace"))
            finally:
                os._exit(EXIT_CANNOT_RUN)
    os.close(w)
    os.close(null)
    why = b""
    while chunk := os.read(r, 4096):
        why += chunk
    os.close(r)
    if why:
        os.waitpid(pid, 0)
        raise StartFailed(why.decode(errors="replace"))
    return pid


def exec_paths(command: str, env: dict[str, str]) -> list[str]:
    """Where to look for ``command``: itself when it names a path, else each directory of
    the machine's ``PATH`` (its own, not the shim's)."""
    if "/" in command:
        return [command]
    path = env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    return [os.path.join(d or ".", command) for d in path.split(":")]


def output_pipe() -> tuple[int, int]:
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        pass  # a bigger pipe absorbs a burst; not essential
    os.set_blocking(r, False)
    return r, w


def ended_of(status: int, container: bool, oom: bool) -> contract.Ended:
    """How the machine ended from its first process's wait status: a process's exit code
    or signal; a container's runtime exits with the container's code, or 128 + the signal
    that killed it (a program that exits 137 itself reads as killed, as in a shell)."""
    code = os.waitstatus_to_exitcode(status)
    if container and SIGNAL_STATUS_BASE < code <= SIGNAL_STATUS_BASE + SIGRTMAX:
        code = SIGNAL_STATUS_BASE - code
    if code < 0:
        return contract.Ended(now_ms(), signal=-code, oom=oom and -code == _signal.SIGKILL)
    return contract.Ended(now_ms(), code=code)
