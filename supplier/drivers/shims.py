"""A machine's shim as its supplier sees it: what a shim runs (:class:`Plan`), what it
records (:class:`State`), the control protocol on its socket, and the supplier's handle on
one shim (:class:`Shim`: launch, attach, wait, stop, collect, detach).

Every machine, process or container, runs under a shim of its own
(supplier/drivers/shim.py): a small process in a session of its own, not a child of the
supplier, so that the machine outlives a supplier that stops or dies. The supplier and its
shims meet in a directory per machine, ``<shims_dir>/<machine_id>/`` (mode 0700):

- ``plan.json``: the supplier's, written before the shim starts: what to run, where its
  output goes, the stop grace, and, when the machine stops with its supplier, the
  supplier's pid;
- ``state.json``: the shim's, written anew atomically (temporary file, fsync, rename) when
  the machine started and when it ended: the shim's pid and start time, the machine's pid,
  when it started, and its exit (code or signal, OOM, when) once it ended;
- ``sock``: the shim's control socket (a unix stream socket);
- ``shim.log``: the shim's own log lines.

The protocol on the socket is one JSON object a line. The shim says ``{"state": …}`` to
each connection at once and again when the machine ended; the supplier asks
``{"op": "stop", "grace_s": G}`` (SIGTERM, then SIGKILL after G seconds; the exit follows)
and, once it recorded the exit, ``{"op": "collect"}``: the shim removes its directory,
answers ``{"collected": true}`` and ends. A shim stays until it is collected, so an exit
that happens while no supplier listens is kept in ``state.json`` for the next one.

A supplier that starts finds its shims (:func:`discover`): a live shim is attached to
(the machine ran on meanwhile); a dead one that recorded an exit is an exit to apply; a
dead one without (its host rebooted, or it was killed) leaves nothing to attach to.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Literal

import anyio
import anyio.abc
import msgspec
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from bourse.errors import BourseError
from supplier.drivers.bundle import Spec
from supplier.drivers.confine import Exit

log = structlog.get_logger("bourse.driver.shim")

PLAN = "plan.json"
STATE = "state.json"
SOCKET = "sock"
SHIM_LOG = "shim.log"
# The longest line either side sends (a state is a few hundred bytes).
MAX_LINE = 64 * 1024
# How long a launch may take (a container's layer is made and mounted first).
LAUNCH_S = 60.0
# How long a shim has to answer: a stop, past its grace; a collect; a connection.
ANSWER_S = 10.0
# A shim going down with its supplier (stop mode) is waited for this long at the next
# supplier's start, then killed.
GOING_DOWN_S = 15.0
# The shim's own environment: nothing of the supplier's (a process machine could read it
# in /proc); PYTHONPATH, where the supplier has one, so that it finds the same code.
SHIM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ShimError(BourseError, RuntimeError):
    """A shim could not be started, or did not answer."""


# -- the formats ----------------------------------------------------------------------------
class ProcessRun(msgspec.Struct, frozen=True, kw_only=True, tag="process"):
    """A process machine: its command, environment and working directory; the
    ``cgroup.procs`` files it joins and the rlimits it gets (the exec wrapper's
    ``--cgroup``/``--rlimit``); its cgroup directories (emptied and removed when it ended)
    and the file counting its OOM kills ("": none)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    cgroups: list[str] = []
    rlimits: list[str] = []
    cgroup_dirs: list[str] = []
    oom_file: str = ""


class ContainerRun(msgspec.Struct, frozen=True, kw_only=True, tag="container"):
    """A container machine: the runtime and the owner's containers
    (supplier/drivers/oci_runtime.py ``Containers``), its spec, its image root and disk."""

    runtime: str
    runtime_path: str
    runtime_version: str
    directory: str
    owner: str
    subtree: str
    cgroup_parent: str = ""
    spec: Spec
    image_root: str
    disk_mb: int


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """``plan.json``: what a shim runs, where its output goes (the caps of
    supplier/drivers/output.py), how long a stop waits after SIGTERM, and the supplier's
    pid when the machine stops with its supplier (0: it does not)."""

    machine_id: str
    run: ProcessRun | ContainerRun
    log_dir: str
    machine_log_mb: int
    worker_log_mb: int
    stop_grace_s: float
    supplier_pid: int = 0


class Ended(msgspec.Struct, frozen=True, kw_only=True):
    """How the machine ended (supplier/drivers/confine.py ``Exit``), and when."""

    code: int | None = None
    signal: int | None = None
    oom: bool = False
    at_ms: int

    @classmethod
    def of(cls, how: Exit, at_ms: int) -> Ended:
        return cls(code=how.code, signal=how.signal, oom=how.oom, at_ms=at_ms)

    def exit(self) -> Exit:
        return Exit(code=self.code, signal=self.signal, oom=self.oom, at_ms=self.at_ms)


class State(msgspec.Struct, frozen=True, kw_only=True):
    """``state.json``: the shim (pid, and its start time in clock ticks since boot, which
    tells it from a later process of the same pid), the machine's first process (a process
    machine's own pid; a container's runtime process), when it started; its exit once it
    ended."""

    shim_pid: int
    shim_started: int
    pid: int
    started_at_ms: int
    exit: Ended | None = None


class Request(msgspec.Struct, frozen=True, kw_only=True):
    op: Literal["stop", "collect"]
    grace_s: float = 0.0


class Notice(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    state: State | None = None
    collected: bool = False
    error: str = ""


def encode_line(message: msgspec.Struct) -> bytes:
    return msgspec.json.encode(message) + b"\n"


def read_state(directory: Path) -> State | None:
    """The shim's record, or None where it has none (it died before it wrote one)."""
    try:
        return msgspec.json.decode((directory / STATE).read_bytes(), type=State)
    except (OSError, msgspec.DecodeError):
        return None


def write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole or its old content, also across a crash."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def started_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the name, in parentheses, may hold spaces
    return int(fields[19]) if len(fields) > 19 else None


def alive(state: State) -> bool:
    """The shim that wrote ``state`` still runs (the same process, not a later one)."""
    return started_ticks(state.shim_pid) == state.shim_started


def remove_dir(directory: Path) -> None:
    """A shim's directory, gone (its socket, plan, state and log)."""
    for name in (SOCKET, PLAN, STATE, STATE + ".tmp", SHIM_LOG):
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
    with contextlib.suppress(FileNotFoundError, OSError):
        directory.rmdir()


# -- the supplier's handle on one shim ------------------------------------------------------
class Shim:
    """One machine's shim, as its supplier holds it: attached (a connection whose
    notices :meth:`follow` reads), or a dead shim's record (an exit to apply)."""

    def __init__(self, machine_id: str, directory: Path, state: State | None = None) -> None:
        self.machine_id = machine_id
        self.directory = directory
        self.state = state
        self.ended = anyio.Event()  # the machine ended (the exit is in self.state), or the
        self.lost = False  # shim went away without saying how it ended
        self.collected = anyio.Event()
        self._stream: anyio.abc.SocketStream | None = None
        self._lines: BufferedByteReceiveStream | None = None
        self.log = log.bind(machine_id=machine_id)
        if state is not None and state.exit is not None:
            self.ended.set()

    @property
    def attached(self) -> bool:
        return self._stream is not None

    @property
    def pid(self) -> int | None:
        """The machine's first process while it runs."""
        if self.state is None or self.ended.is_set():
            return None
        return self.state.pid

    def exit(self) -> Exit:
        """How the machine ended (a lost shim: as if killed)."""
        if self.state is not None and self.state.exit is not None:
            return self.state.exit.exit()
        return Exit(signal=signal.SIGKILL)

    async def attach(self) -> None:
        """Connect to the shim and read its first notice (its state). OSError when it does
        not listen (it is gone, or going)."""
        # A unix socket's path is at most 107 bytes: reach it through a directory handle.
        dirfd = os.open(self.directory, os.O_PATH | os.O_DIRECTORY)
        try:
            with anyio.fail_after(ANSWER_S):
                stream = await anyio.connect_unix(f"/proc/self/fd/{dirfd}/{SOCKET}")
        except TimeoutError:
            raise OSError(f"the shim of {self.machine_id} did not accept in time") from None
        finally:
            os.close(dirfd)
        self._stream = stream
        self._lines = BufferedByteReceiveStream(stream)
        try:
            with anyio.fail_after(ANSWER_S):
                await self._receive()
        except (TimeoutError, anyio.EndOfStream, anyio.IncompleteRead, OSError) as exc:
            await self.detach()
            raise OSError(f"the shim of {self.machine_id} did not say its state: {exc!r}") from None

    async def _receive(self) -> None:
        """Read one notice and take it in."""
        assert self._lines is not None
        try:
            line = await self._lines.receive_until(b"\n", MAX_LINE)
        except anyio.IncompleteRead:
            raise anyio.EndOfStream from None
        notice = msgspec.json.decode(line, type=Notice)
        if notice.state is not None:
            self.state = notice.state
            if notice.state.exit is not None:
                self.ended.set()
        if notice.collected:
            self.collected.set()
        if notice.error:
            self.log.warning("shim_refused", error=notice.error)

    async def follow(self) -> None:
        """Read the shim's notices until it closes the connection (collected, or gone) or
        this handle is detached. A shim gone before the machine's exit is ``lost``."""
        try:
            while self._lines is not None:
                await self._receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, OSError, msgspec.DecodeError):
            pass
        finally:
            if self._stream is not None and not self.collected.is_set():
                await self.detach()
            if not self.ended.is_set() and not self.collected.is_set():
                self.lost = True
                self.ended.set()

    async def _send(self, request: Request) -> bool:
        if self._stream is None:
            return False
        try:
            await self._stream.send(encode_line(request))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return False
        return True

    async def stop(self, grace_s: float) -> Exit:
        """SIGTERM, then SIGKILL after ``grace_s`` (the shim does it); how it ended. A shim
        that does not answer in time is killed (what it held is then the sweep's)."""
        if not self.ended.is_set() and await self._send(Request(op="stop", grace_s=grace_s)):
            with anyio.move_on_after(grace_s + ANSWER_S):
                await self.ended.wait()
        if not self.ended.is_set():
            self.log.error("shim_not_answering", waited_s=grace_s + ANSWER_S)
            self.kill()
            self.lost = True
            self.ended.set()
        return self.exit()

    def kill(self) -> None:
        """SIGKILL the shim itself (if it is still the process that wrote the state)."""
        if self.state is not None and alive(self.state):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.state.shim_pid, signal.SIGKILL)

    async def collect(self) -> None:
        """The machine ended and its exit is recorded: the shim may go (it removes its
        directory). A dead shim's directory is removed here, and a shim that does not answer
        is killed first."""
        if await self._send(Request(op="collect")):
            with anyio.move_on_after(ANSWER_S):
                await self.collected.wait()
        await self.detach()
        if not self.collected.is_set():
            self.kill()  # a shim that would not go (its machine has ended)
            await anyio.to_thread.run_sync(remove_dir, self.directory)
            self.collected.set()

    async def detach(self) -> None:
        """Let go of the shim (it runs on, its machine too)."""
        stream, self._stream, self._lines = self._stream, None, None
        if stream is not None:
            with contextlib.suppress(OSError):
                await stream.aclose()


class ShimRun:
    """A run of a machine held by its shim, as a driver's supervisor sees a run
    (supplier/drivers/process.py ``Running``); someone must :meth:`Shim.follow` it."""

    def __init__(self, shim: Shim) -> None:
        self.shim = shim

    @property
    def pid(self) -> int:
        return self.shim.pid or 0

    @property
    def running(self) -> bool:
        return not self.shim.ended.is_set()

    async def wait(self) -> Exit:
        await self.shim.ended.wait()
        return self.shim.exit()

    async def stop(self, grace_s: float) -> None:
        await self.shim.stop(grace_s)

    async def release(self) -> None:
        """The shim removed what the machine held when it ended: let it go."""
        with anyio.CancelScope(shield=True):
            if not self.shim.ended.is_set():
                await self.shim.stop(0.0)
            await self.shim.collect()


async def launch(directory: Path, plan: Plan) -> Shim:
    """Start a shim for ``plan`` in ``directory`` (anything left there is removed first)
    and return it attached once the machine runs; ShimError says why it could not."""
    await anyio.to_thread.run_sync(_prepare, directory, plan)
    env = {"PATH": SHIM_PATH}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    try:
        with anyio.fail_after(LAUNCH_S):
            done = await anyio.run_process(
                [sys.executable, "-P", "-m", "supplier.drivers.shim", str(directory)],
                check=False,
                stdin=subprocess.DEVNULL,
                env=env,
            )
    except TimeoutError:
        raise ShimError(f"the shim of {plan.machine_id} did not start in {LAUNCH_S:.0f}s") from None
    if done.returncode != 0:
        said = (done.stdout + done.stderr).decode(errors="replace").strip()
        await anyio.to_thread.run_sync(remove_dir, directory)
        raise ShimError(said.splitlines()[-1] if said else f"the shim exited {done.returncode}")
    shim = Shim(plan.machine_id, directory)
    try:
        await shim.attach()
    except OSError as exc:
        raise ShimError(str(exc)) from None
    return shim


def _prepare(directory: Path, plan: Plan) -> None:
    if directory.exists():
        remove_dir(directory)
    directory.mkdir(parents=True, mode=0o700, exist_ok=True)
    write_atomically(directory / PLAN, msgspec.json.encode(plan))


async def discover(shims_dir: Path) -> dict[str, Shim]:
    """The shims an earlier run of the supplier left in ``shims_dir``: attached where they
    live, their record where they died after the machine ended. A shim going down (with
    its supplier: it no longer listens) is waited for; one that died without a record is
    forgotten (its machine's cgroups and container are then the sweep's)."""
    found: dict[str, Shim] = {}
    for directory in await anyio.to_thread.run_sync(_directories, shims_dir):
        shim = await _found(directory)
        if shim is not None:
            found[shim.machine_id] = shim
        else:
            await anyio.to_thread.run_sync(remove_dir, directory)
    return found


def _directories(shims_dir: Path) -> list[Path]:
    return sorted(shims_dir.iterdir()) if shims_dir.is_dir() else []


async def _found(directory: Path) -> Shim | None:
    state = read_state(directory)
    shim = Shim(directory.name, directory, state)
    if state is not None and alive(state):
        try:
            await shim.attach()
            return shim
        except OSError:
            await _going_down(shim, state)
            state = shim.state = read_state(directory)
    if state is not None and state.exit is not None:
        return shim
    return None


async def _going_down(shim: Shim, state: State) -> None:
    """Wait for a shim that does not listen to end (bounded), then kill it."""
    try:
        fd = os.pidfd_open(state.shim_pid)
    except ProcessLookupError:
        return
    try:
        with anyio.move_on_after(GOING_DOWN_S):
            await anyio.wait_readable(fd)
            return
        shim.log.error("shim_killed", reason="it neither listens nor ends")
        shim.kill()
    finally:
        os.close(fd)
