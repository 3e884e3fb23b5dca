"""A command run inside a running machine (docs/protocol.md §4.24), the worker's side of
``buyer machines exec``: what it runs (:func:`command_of`: a process machine's command
or a container's through supplier/machines/shim/enter.py, with the machine's confinement
and nothing more), and the command as a process of the supplier
(:class:`Command`: its pipes or its terminal, read and written without blocking, its
terminal's size, its kill, its end). The session around it (flow control, the messages) is
supplier/execs.py's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import struct
import sys
import tempfile
import termios
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
import msgspec

from supplier.machines.api import Entry
from supplier.machines.oci.spec import Spec
from supplier.machines.shim import teardown
from supplier.machines.shim.client import MAIN
from supplier.machines.shim.contract import ContainerRun, ProcessRun
from supplier.machines.shim.spawn import SIGNAL_STATUS_BASE, SIGRTMAX

# The enter helper, run as the shim is: isolated, without site, its packages' __init__ unrun.
ENTER = [sys.executable, "-I", "-S", MAIN, "enter"]
# What a container's runtime runs with (asked for its container's first process).
RUNTIME_ENV = {"PATH": teardown.PATH}
# How long the output of a command that ended may take to be read to its end (a process it
# left in the background may hold its pipes).
DRAIN_S = 2.0


@dataclass(frozen=True, slots=True)
class Plan:
    """What the supplier starts: ``argv`` in ``env``, ``spec`` handed to the enter helper
    on an fd its last argument names."""

    argv: list[str]
    env: dict[str, str]
    spec: bytes = b""
    container: bool = False  # its exit status says a signal as 128 + N


def command_of(
    entry: Entry,
    command: list[str],
    env: Mapping[str, str],
    tty: bool,
    container: Container | None = None,
) -> Plan:
    """The process that runs ``command`` inside the machine whose run is ``entry``, with
    ``env`` over the machine's environment: supplier/machines/shim/enter.py, given what to
    enter (a container's: its runtime spec and first process, ``container``)."""
    run = entry.run
    if isinstance(run, ContainerRun):
        if container is None:
            raise OSError(f"the container {run.runtime_id} has no first process")
        spec = container_spec(container, run, command, env, tty)
        return Plan(ENTER, {}, spec=spec, container=True)
    spec = enter_spec(entry.pid, run, command, env, tty)
    return Plan(ENTER, {}, spec=spec)


@dataclass(frozen=True, slots=True)
class Container:
    """A running container as its runtime has it: its first process on the host and its
    runtime spec (the bundle's ``config.json``)."""

    pid: int
    spec: Spec


# The runtime spec's namespaces as /proc/<pid>/ns/ names (the user namespace apart).
NS_NAMES = {"pid": "pid", "mount": "mnt", "ipc": "ipc", "uts": "uts", "network": "net"}
NS_NAMES["cgroup"] = "cgroup"


def container_spec(
    c: Container, run: ContainerRun, command: list[str], env: Mapping[str, str], tty: bool
) -> bytes:
    """What supplier/machines/shim/enter.py takes to run ``command`` as the container's
    process runs: its namespaces, cgroups, rlimits, user, capabilities, no new privileges
    and seccomp filter, its environment (``env`` over it) and working directory."""
    p, linux = c.spec.process, c.spec.linux
    types = [n.type for n in linux.namespaces]
    own_env = dict(item.partition("=")[::2] for item in p.env)
    return msgspec.json.encode(
        {
            "container": True,
            "pid": c.pid,
            "argv": command,
            "env": {**own_env, **env},
            "cwd": p.cwd,
            "cgroups": [f"{d}/cgroup.procs" for d in run.cgroup_dirs],
            "rlimits": [f"{r.type.removeprefix('RLIMIT_')}={r.hard}" for r in p.rlimits],
            "namespaces": [NS_NAMES[t] for t in types if t in NS_NAMES],
            "userns": "user" in types,
            "uid": p.user.uid,
            "gid": p.user.gid,
            "groups": [str(g) for g in p.user.additional_gids],
            "caps": msgspec.to_builtins(p.capabilities),
            "nnp": p.no_new_privileges,
            "seccomp": msgspec.to_builtins(linux.seccomp) if linux.seccomp else None,
            "tty": tty,
        }
    )


async def container_of(run: ContainerRun) -> Container:
    """The container's first process (its runtime's ``state``) and its runtime spec."""
    argv = [run.runtime, "--root", run.state_root, "state", run.runtime_id]
    done = await anyio.run_process(argv, env=RUNTIME_ENV, check=False)
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
        raise OSError(f"{run.runtime} state {run.runtime_id}: {why}")
    pid = int(msgspec.json.decode(done.stdout).get("pid") or 0)
    if pid <= 0:
        raise OSError(f"the container {run.runtime_id} runs no process")
    config = await anyio.Path(run.bundle, "config.json").read_bytes()
    return Container(pid, msgspec.json.decode(config, type=Spec))


def enter_spec(
    pid: int, run: ProcessRun, command: list[str], env: Mapping[str, str], tty: bool
) -> bytes:
    """What supplier/machines/shim/enter.py takes: the machine's run, its process (whose
    namespaces it enters), the command and its environment."""
    return msgspec.json.encode(
        {
            "pid": pid,
            "argv": command,
            "env": {**run.env, **env},
            "cwd": run.cwd,
            "cgroups": run.cgroups,
            "rlimits": run.rlimits,
            "uid": run.uid,
            "gid": run.gid,
            "netns": bool(run.netns),
            "mounts": bool(run.tmp_mb > 0 or run.binds or run.hide),
            "tty": tty,
        }
    )


def exit_of(returncode: int, container: bool) -> tuple[int | None, int | None]:
    """(code, signal) of an ended command: a container's comes through the enter helper's
    parent (outside the container's pid namespace), which exits 128 + N for a command killed
    by signal N, as a runtime's exec does."""
    if returncode < 0:
        return None, -returncode
    if container and SIGNAL_STATUS_BASE < returncode <= SIGNAL_STATUS_BASE + SIGRTMAX:
        return None, returncode - SIGNAL_STATUS_BASE
    return returncode, None


def set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Command:
    """One command running in a machine, as the supplier holds it: its output (stdout and
    stderr apart, or one terminal), its input, its end."""

    def __init__(
        self,
        proc: anyio.abc.Process,
        plan: Plan,
        outputs: dict[str, int],
        stdin: int | None,
        terminal: int | None,
        scratch: Path,
    ) -> None:
        self.proc = proc
        self.plan = plan
        self.outputs = outputs  # "stdout" / "stderr" -> the fd it is read from
        self.stdin = stdin  # where input is written (the terminal's, or a pipe); None: none
        self.terminal = terminal
        self.scratch = scratch

    async def read(self, fd: int, size: int) -> bytes:
        """Up to ``size`` bytes of output; b"" at its end (a terminal none holds any more
        reads EIO)."""
        while True:
            try:
                return os.read(fd, size)
            except BlockingIOError:
                await anyio.wait_readable(fd)
            except OSError as exc:
                if exc.errno == errno.EIO:
                    return b""
                raise

    async def write(self, data: bytes) -> None:
        """``data`` written to the command's input (dropped once it closed its input)."""
        fd = self.stdin
        view = memoryview(data)
        while view and fd is not None:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                await anyio.wait_writable(fd)
            except (BrokenPipeError, OSError):
                return

    def close_input(self) -> None:
        """No more input: its stdin's end (on a terminal, an end-of-file character)."""
        if self.stdin is None:
            return
        if self.terminal is not None:
            with contextlib.suppress(OSError):
                os.write(self.terminal, b"\x04")
            return
        with contextlib.suppress(OSError):
            os.close(self.stdin)
        self.stdin = None

    def resize(self, rows: int, cols: int) -> None:
        if self.terminal is not None:
            with contextlib.suppress(OSError):
                set_size(self.terminal, rows, cols)

    def kill(self) -> None:
        """The command killed, with what it started in its session (the enter helper
        made one; a container's command is its child there)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def wait(self) -> tuple[int | None, int | None]:
        return exit_of(await self.proc.wait(), self.plan.container)

    def close(self) -> None:
        fds = {*self.outputs.values(), self.stdin, self.terminal}
        for fd in fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        teardown.remove_tree(str(self.scratch))


async def start(
    entry: Entry,
    command: list[str],
    env: Mapping[str, str],
    tty: bool,
    stdin: bool,
    size: tuple[int, int],
) -> Command:
    """``command`` started inside the machine (OSError when it could not be)."""
    run = entry.run
    container = await container_of(run) if isinstance(run, ContainerRun) else None
    plan = command_of(entry, command, env, tty, container)
    scratch = Path(await anyio.to_thread.run_sync(tempfile.mkdtemp, "", "bourse-exec-"))
    try:
        return await _start(plan, scratch, tty, stdin, size)
    except BaseException:
        teardown.remove_tree(str(scratch))
        raise


async def _start(
    plan: Plan, scratch: Path, tty: bool, stdin: bool, size: tuple[int, int]
) -> Command:
    """A process machine's command (or a container's without a terminal): pipes, or a
    terminal of the worker's as its stdin, stdout and stderr."""
    mine: list[int] = []  # the supplier's ends
    theirs: list[int] = []  # the command's ends, closed here once it started
    spec_r = -1
    try:
        if tty:
            master, slave = os.openpty()
            set_size(master, *size)
            mine.append(master)
            theirs.append(slave)
            child = (slave, slave, slave)
        else:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            mine += [out_r, err_r]
            theirs += [out_w, err_w]
            if stdin:
                in_r, in_w = os.pipe()
                mine.append(in_w)
                theirs.append(in_r)
            else:
                in_r = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                theirs.append(in_r)
            child = (in_r, out_w, err_w)
        argv: list[str] = plan.argv
        pass_fds: tuple[int, ...] = ()
        if plan.spec:
            spec_r = _spec_fd(scratch, plan.spec)
            argv, pass_fds = [*plan.argv, str(spec_r)], (spec_r,)
        proc = await anyio.open_process(
            argv,
            stdin=child[0],
            stdout=child[1],
            stderr=child[2],
            env=plan.env or None,
            pass_fds=pass_fds,
            start_new_session=not plan.spec,  # the enter helper makes a session of its own
        )
    except BaseException:
        for fd in mine:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
        if spec_r >= 0:
            os.close(spec_r)
    for fd in mine:
        os.set_blocking(fd, False)
    if tty:
        return Command(proc, plan, {"stdout": mine[0]}, mine[0], mine[0], scratch)
    outputs = {"stdout": mine[0], "stderr": mine[1]}
    return Command(proc, plan, outputs, mine[2] if stdin else None, None, scratch)


def _spec_fd(scratch: Path, spec: bytes) -> int:
    """``spec`` in a file of the scratch directory, open for reading, its name removed
    (a file: the machine's environment may be larger than a pipe holds)."""
    path = scratch / "spec"
    path.write_bytes(spec)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    path.unlink()
    return fd
