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


_libc = None


def _prctl_pdeathsig(sig: int) -> None:
    """Die by ``sig`` when the shim (this process's parent) ends."""
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    _libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def spawn(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    output: int,
    cgroups: list[str] | tuple[str, ...] = (),
    rlimits: list[str] | tuple[str, ...] = (),
) -> int:
    """Fork and execute ``argv`` in a session of its own, confined (its cgroups joined,
    its rlimits set) before its first instruction, its stdin ``/dev/null`` and its stdout
    and stderr ``output``; its pid. A command that cannot be executed raises StartFailed
    with the reason (told through a close-on-exec pipe: nothing is left running)."""
    _prctl_pdeathsig(0)  # ctypes loaded before the fork, not in the child
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
            if rlimits:
                import resource

                for spec in rlimits:
                    name, _, value = spec.partition("=")
                    res = getattr(resource, "RLIMIT_" + name)
                    hard = resource.getrlimit(res)[1]
                    n = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
                    resource.setrlimit(res, (n, n))
            for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):  # Python ignores them: not the machine
                _signal.signal(sig, _signal.SIG_DFL)
            step = "connect its output"
            os.dup2(null, 0)
            os.dup2(output, 1)
            os.dup2(output, 2)
            step = f"enter {cwd}"
            os.chdir(cwd)
            step = f"run {argv[0]!r}"
            os.execvpe(argv[0], argv, env)
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
