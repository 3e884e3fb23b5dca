"""A machine's shim as its supplier sees it: :func:`launch` one, :func:`discover` the ones
an earlier supplier left, and the handle on one (:class:`Shim`: attach, follow, stop,
collect, detach). The contract (the plan, the state, the lines) is contract.py beside
this; the shim itself is server.py.

A supplier that starts finds its shims (:func:`discover`): a live shim of a protocol it
speaks is attached to (the machine ran on meanwhile); one of a protocol it does not is
stopped (SIGTERM: the shim stops its machine and ends); a dead one that recorded an exit is
an exit to apply; a dead one without (its host rebooted, or it was killed) leaves nothing to
attach to (its machine's cgroups and container are then the sweep's).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import anyio.abc
import anyio.lowlevel
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from bourse.errors import BourseError
from supplier.machines.api import Exit, Pause
from supplier.machines.shim import contract, teardown
from supplier.machines.shim.contract import Ended, Plan, State
from supplier.machines.shim.forks import ForkServer, ForkServerError

log = structlog.get_logger("bourse.shim")

MAIN = str(Path(__file__).with_name("main.py"))
# How long a launch may take (the machine is started before the shim answers).
LAUNCH_S = 60.0
# How long a shim has to answer: a stop, past its grace; a collect; a connection.
ANSWER_S = 10.0
# A shim going down with its supplier (stop mode) is waited for this long at the next
# supplier's start, then killed.
GOING_DOWN_S = 15.0


class ShimError(BourseError, RuntimeError):
    """A shim could not be started, or did not answer."""


def exit_of(ended: Ended) -> Exit:
    return Exit(code=ended.code, signal=ended.signal, oom=ended.oom, at_ms=ended.at_ms)


class Shim:
    """One machine's shim, as its supplier holds it: attached (a connection whose notices
    :meth:`follow` reads), or a dead shim's record (an exit to apply)."""

    def __init__(self, machine_id: str, directory: Path, state: State | None = None) -> None:
        self.machine_id = machine_id
        self.directory = directory
        self.state = state
        self.ended = anyio.Event()  # the machine ended (the exit is in self.state), or the
        self.lost = False  # shim went away without saying how it ended
        self.collected = anyio.Event()
        self.let_go = False  # its supplier let go of it on purpose (it runs on)
        self._reading = anyio.Lock()  # one reader of its notices at a time
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

    @property
    def started_at_ms(self) -> int:
        return self.state.started_at_ms if self.state is not None else 0

    def exit(self) -> Exit:
        """How the machine ended (a lost shim: as if killed)."""
        if self.state is not None and self.state.exit is not None:
            return exit_of(self.state.exit)
        return Exit(signal=signal.SIGKILL)

    async def _take(self, stream: anyio.abc.SocketStream) -> None:
        """Read the shim's first notice on ``stream`` (its state); OSError when there is
        none in time (the shim is gone, or going), ShimError with the shim's refusal."""
        self._stream = stream
        self._lines = BufferedByteReceiveStream(stream)
        try:
            with anyio.fail_after(ANSWER_S):
                await self._receive()
        except (
            TimeoutError,
            anyio.EndOfStream,
            anyio.IncompleteRead,
            anyio.BrokenResourceError,  # the shim's end of the line reset (it was killed)
            OSError,
        ) as exc:
            await self._close()
            raise OSError(f"the shim of {self.machine_id} did not say its state: {exc!r}") from None
        except ShimError:
            await self._close()
            raise

    async def attach(self) -> None:
        """Connect to the shim and read its first notice (its state). OSError when it does
        not listen (it is gone, or going)."""
        # A unix socket's path is at most 107 bytes: reach it through a directory handle.
        dirfd = os.open(self.directory, os.O_PATH | os.O_DIRECTORY)
        try:
            with anyio.fail_after(ANSWER_S):
                stream = await anyio.connect_unix(f"/proc/self/fd/{dirfd}/{contract.SOCKET}")
        except TimeoutError:
            raise OSError(f"the shim of {self.machine_id} did not accept in time") from None
        finally:
            os.close(dirfd)
        await self._take(stream)

    async def _receive(self) -> None:
        """Read one notice and take it in (a refusal on the launch's line: ShimError)."""
        assert self._lines is not None
        try:
            raw = await self._lines.receive_until(b"\n", contract.MAX_LINE)
        except anyio.IncompleteRead:
            raise anyio.EndOfStream from None
        try:
            notice = contract.parse(raw)
            state = notice.get("state")
            if state is not None:
                self.state = State.of(state)
        except contract.ContractError as exc:
            self.log.warning("shim_said_nonsense", error=str(exc))
            return
        if self.state is not None and self.state.exit is not None:
            self.ended.set()
        if notice.get("collected"):
            self.collected.set()
        error = notice.get("error")
        if error:
            if self.state is None:  # nothing runs: the start's answer
                raise ShimError(str(error))
            self.log.warning("shim_refused", error=str(error))

    async def follow(self) -> None:
        """Read the shim's notices until it closes the connection (collected, or gone) or
        this handle is detached. A shim gone before the machine's exit is ``lost``. Cut
        short, it leaves the connection as it is (a stop or collect reads on)."""
        await self._read_until(None)

    async def _read_until(self, event: anyio.Event | None) -> None:
        """Read notices until ``event`` is set (None: until the connection ends). Readers
        take turns, a notice each: whoever waits for what a notice says gets it, whether
        the follower runs or not (a supplier's end cancels it; a launch has none yet)."""
        try:
            while self._lines is not None and (event is None or not event.is_set()):
                async with self._reading:
                    if self._lines is None or (event is not None and event.is_set()):
                        return
                    await self._receive()
        except (
            anyio.EndOfStream,
            anyio.ClosedResourceError,
            anyio.BrokenResourceError,  # the shim's end of the line reset (it was killed)
            OSError,
            ShimError,
        ):
            if self._stream is not None and not self.collected.is_set():
                await self._close()
            if not (self.ended.is_set() or self.collected.is_set() or self.let_go):
                self.lost = True
                self.ended.set()

    async def _await(self, event: anyio.Event, timeout_s: float) -> None:
        """Wait (bounded) for ``event``, which a notice sets."""
        with anyio.move_on_after(timeout_s):
            await self._read_until(event)

    async def _send(self, request: dict[str, object]) -> bool:
        if self._stream is None:
            return False
        try:
            await self._stream.send(contract.line(request))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return False
        return True

    async def stop(self, grace_s: float) -> Exit:
        """SIGTERM, then SIGKILL after ``grace_s`` (the shim does it); how it ended. A shim
        that does not answer in time is killed (what it held is then the sweep's)."""
        if not self.ended.is_set():
            if await self._send({"op": "stop", "grace_s": grace_s}):
                await self._await(self.ended, grace_s + ANSWER_S)
            elif self.state is not None and contract.alive(self.state):
                os.kill(self.state.shim_pid, signal.SIGTERM)  # not attached: as a signal
                await _gone(self, self.state, grace_s + ANSWER_S)
        if not self.ended.is_set():
            self.log.error("shim_not_answering", waited_s=grace_s + ANSWER_S)
            self.kill()
            self.lost = True
            self.ended.set()
        return self.exit()

    def kill(self) -> None:
        """SIGKILL the shim itself (if it is still the process that wrote the state)."""
        if self.state is not None and contract.alive(self.state):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.state.shim_pid, signal.SIGKILL)

    async def collect(self) -> None:
        """The machine ended and its exit is recorded: the shim may go (it removes its
        directory). A dead shim's directory is removed here, and a shim that does not answer
        is killed first."""
        if await self._send({"op": "collect"}):
            await self._await(self.collected, ANSWER_S)
            with anyio.move_on_after(ANSWER_S):  # until it closes the line: it ended
                await self._read_until(None)
        await self._close()
        if not self.collected.is_set():
            self.kill()  # a shim that would not go (its machine has ended)
            contract.remove_dir(self.directory)
            self.collected.set()

    async def detach(self) -> None:
        """Let go of the shim (it runs on, its machine too)."""
        self.let_go = True
        await self._close()

    async def _close(self) -> None:
        stream, self._stream, self._lines = self._stream, None, None
        if stream is not None:
            with contextlib.suppress(OSError):
                await stream.aclose()


async def launch(
    directory: Path, plan: Plan, pause: Pause | None = None, forks: ForkServer | None = None
) -> Shim:
    """Start a shim for ``plan`` in ``directory`` (anything left there is removed first)
    and return it attached once the machine runs; ShimError says why it could not. The
    shim is forked by ``forks`` (the supplier's fork server), else (none, or it failed:
    logged) started by its command. The shim's answer is awaited even when this is
    cancelled (it comes in milliseconds): a machine it started is then stopped and
    collected before the cancellation goes on. ``pause``: a test's, at the shim spawned
    and at the machine running (api.py)."""
    contract.write_plan(directory, plan)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    shim = Shim(plan.machine_id, directory)
    with anyio.CancelScope(shield=True):
        try:
            proc = await _spawn(directory, theirs, forks)
        except OSError as exc:
            ours.close()
            contract.remove_dir(directory)
            raise ShimError(f"cannot start a shim: {exc}") from None
        finally:
            theirs.close()
        try:
            if pause is not None:
                await pause("shim", plan.machine_id)
            with anyio.fail_after(LAUNCH_S):
                await shim._take(await anyio.abc.SocketStream.from_socket(ours))
                if proc is not None and await proc.wait() != 0:  # the launcher, which forked
                    raise ShimError(await _said(proc))  # the shim and went
            if pause is not None:
                await pause("running", plan.machine_id)
        except TimeoutError:
            shim.kill()
            contract.remove_dir(directory)
            raise ShimError(
                f"the shim of {plan.machine_id} did not start in {LAUNCH_S:.0f}s"
            ) from None
        except OSError as exc:
            contract.remove_dir(directory)
            raise ShimError((await _said(proc) if proc else "") or str(exc)) from None
        except ShimError:
            contract.remove_dir(directory)
            raise
        finally:
            if proc is not None:
                await _reap(proc)
    try:
        await anyio.lowlevel.checkpoint()  # a cancellation that came meanwhile
    except BaseException:
        with anyio.CancelScope(shield=True):
            await shim.stop(0.0)
            await shim.collect()
        raise
    return shim


async def _spawn(
    directory: Path, first: socket.socket, forks: ForkServer | None
) -> anyio.abc.Process | None:
    """The shim of ``directory`` forked by the fork server (None), or its command started
    (the launcher's process, which forks the shim and exits)."""
    if forks is not None:
        try:
            await forks.spawn(directory, first)
            return None
        except ForkServerError as exc:
            log.warning("fork_server_failed", machine_id=directory.name, error=str(exc))
    return await anyio.open_process(
        [sys.executable, "-I", "-S", MAIN, str(directory), str(first.fileno())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=(first.fileno(),),
        env={"PATH": teardown.PATH},
    )


async def _said(proc: anyio.abc.Process) -> str:
    """What the shim's launcher printed before it failed (its last line)."""
    if proc.stderr is None:
        return ""
    with anyio.move_on_after(ANSWER_S):
        said = b""
        with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError):
            while True:
                said += await proc.stderr.receive()
        lines = said.decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""
    return ""


async def _reap(proc: anyio.abc.Process) -> None:
    with anyio.move_on_after(ANSWER_S, shield=True):
        await proc.wait()
    await proc.aclose()


async def discover(shims_dir: Path) -> dict[str, Shim]:
    """The shims an earlier run of the supplier left in ``shims_dir``: attached where they
    live, their record where they died after the machine ended. A shim going down (with
    its supplier: it no longer listens) is waited for; a shim of a protocol this supplier
    does not speak is stopped; one that died without a record is forgotten."""
    found: dict[str, Shim] = {}
    for directory in await anyio.to_thread.run_sync(_directories, shims_dir):
        shim = await _found(directory)
        if shim is not None:
            found[shim.machine_id] = shim
        else:
            await anyio.to_thread.run_sync(contract.remove_dir, directory)
    return found


def _directories(shims_dir: Path) -> list[Path]:
    return sorted(shims_dir.iterdir()) if shims_dir.is_dir() else []


async def _found(directory: Path) -> Shim | None:
    state = contract.read_state(directory)
    shim = Shim(directory.name, directory, state)
    if state is not None and contract.alive(state):
        if not contract.adoptable(state):
            shim.log.warning("shim_protocol_unknown", protocol=state.protocol)
            with contextlib.suppress(ProcessLookupError):
                os.kill(state.shim_pid, signal.SIGTERM)  # it stops its machine
            await _gone(shim, state, GOING_DOWN_S)
            return None
        try:
            await shim.attach()
            return shim
        except (OSError, ShimError):
            await _gone(shim, state, GOING_DOWN_S)
            state = shim.state = contract.read_state(directory)
    if state is not None and state.exit is not None:
        return shim
    return None


async def _gone(shim: Shim, state: State, wait_s: float) -> None:
    """Wait for a shim to end (bounded), then kill it."""
    try:
        fd = os.pidfd_open(state.shim_pid)
    except ProcessLookupError:
        return
    try:
        with anyio.move_on_after(wait_s):
            await anyio.wait_readable(fd)
            return
        shim.log.error("shim_killed", reason="it neither listens nor ends")
        shim.kill()
    finally:
        os.close(fd)
