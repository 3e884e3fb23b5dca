"""The supplier's side of its fork server (supplier/machines/shim/forkserver.py): one per
data dir (``<data_dir>/forkserver/``), shared by the drivers of its workers. The first
driver that runs adopts the fork server an earlier supplier left (its protocol and shim
code the same as this supplier's) or starts one (stopping one it does not adopt: another
protocol, other shim code, or not answering); a launch asks it for the shim
(supplier/machines/shim/client.py ``launch``). When the last driver ends, a fork server
whose machines all stop with the supplier is stopped; else it is left to wait
:data:`LINGER_S` for the next supplier (a supplier killed -9 leaves it the same: it knows
its supplier is gone when the connection drops).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import ClassVar

import anyio
import anyio.abc
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from supplier.machines.shim import contract, forkserver, teardown
from supplier.machines.shim.forkserver import ForkState

log = structlog.get_logger("bourse.forkserver")

MAIN = str(Path(__file__).with_name("main.py"))
# How long a fork server left by a supplier that keeps its machines waits for the next one.
LINGER_S = 60.0
# How long a fork server may take to start, or to answer.
ANSWER_S = 10.0
# How long one that is replaced may take to end before it is killed.
GOING_DOWN_S = 5.0


class ForkServerError(OSError):
    """The fork server could not be started, or did not answer."""


class ForkServer:
    """A data dir's fork server as its supplier holds it (see the module doc)."""

    _of: ClassVar[dict[Path, ForkServer]] = {}

    @classmethod
    def of(cls, directory: Path) -> ForkServer:
        """The one handle of this process on the fork server of ``directory``."""
        key = directory.absolute()
        found = cls._of.get(key)
        if found is None:
            found = cls._of[key] = cls(key)
        return found

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.state: ForkState | None = None
        self._stream: anyio.abc.UNIXSocketStream | None = None
        self._lines: BufferedByteReceiveStream | None = None
        self._lock = anyio.Lock()  # one request (or opening) at a time
        self._holders: list[bool] = []  # each driver that runs: whether it keeps its machines
        self._kept = False  # a driver that ended kept its machines
        self._linger_s = -1.0  # what the fork server was told
        self.code = forkserver.code()

    @property
    def linger_s(self) -> float:
        """How long it waits for the next supplier: 0 when every driver's machines stop
        with this one."""
        return LINGER_S if self._kept or any(self._holders) else 0.0

    @contextlib.asynccontextmanager
    async def held(self, keep_machines: bool) -> AsyncIterator[ForkServer]:
        """A driver's use of the fork server while it runs: opened at its start (a failure
        is logged: its shims are then started by their command); at the last driver's end
        left to linger or stopped (see the module doc)."""
        self._holders.append(keep_machines)
        try:
            with anyio.CancelScope(shield=True):
                try:
                    await self.open()
                except ForkServerError as exc:
                    log.warning("fork_server_unavailable", error=str(exc))
            yield self
        finally:
            self._holders.remove(keep_machines)
            self._kept = self._kept or keep_machines
            if not self._holders:
                with anyio.CancelScope(shield=True):
                    await self.close(stop=not self._kept)
                self._kept = False

    async def open(self) -> None:
        """Adopt the fork server of the directory, or start one (ForkServerError)."""
        async with self._lock:
            await self._ensure()

    async def _ensure(self) -> None:
        """Connected to a fork server (adopted or started), told how long to linger."""
        if self._stream is None:
            try:
                with anyio.fail_after(ANSWER_S + GOING_DOWN_S):
                    await self._adopt() or await self._start()
            except (TimeoutError, contract.ContractError) as exc:
                await self._drop()
                raise ForkServerError(f"no fork server: {exc!r}") from None
        await self._linger()

    async def spawn(self, directory: Path, first: socket.socket) -> None:
        """Ask for the shim of ``directory`` (its plan written), its first connection
        ``first`` (the caller then reads the shim's first notice on its end, as after the
        shim's command): ShimError-like ForkServerError when it could not be asked or
        refused. A fork server that dies after the request leaves the caller's read to say
        whether the shim came."""
        async with self._lock:
            await self._ensure()
            assert self._stream is not None and self._lines is not None
            request = contract.line({"op": "spawn", "dir": str(directory)})
            try:
                await self._stream.send_fds(request, [first.fileno()])
            except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
                await self._drop()
                raise ForkServerError(f"the fork server did not take the request: {exc}") from None
            try:
                with anyio.fail_after(ANSWER_S):
                    answer = contract.parse(
                        await self._lines.receive_until(b"\n", contract.MAX_LINE)
                    )
            except (TimeoutError, OSError, anyio.EndOfStream, anyio.IncompleteRead) as exc:
                log.warning("fork_server_gone", error=repr(exc))
                await self._drop()
                return
            except contract.ContractError as exc:
                raise ForkServerError(f"the fork server said nonsense: {exc}") from None
        if "error" in answer:
            raise ForkServerError(str(answer["error"]))

    async def close(self, stop: bool) -> None:
        """Let go of the fork server (it lingers for the next supplier) or stop it."""
        async with self._lock:
            if self._stream is None:
                return
            if stop:
                await self._send({"op": "stop"})
            else:
                await self._linger()
            state = self.state
            await self._drop()
            if stop and state is not None:
                await _gone(state, ANSWER_S)
            log.info("fork_server_" + ("stopped" if stop else "left"), pid=getattr(state, "pid", 0))

    # -- the connection ----------------------------------------------------------------------
    async def _adopt(self) -> bool:
        """Connect to the fork server the directory has, if it is one to adopt; stop one that
        is not (it runs other code, or does not answer)."""
        state = forkserver.read_state(str(self.directory))
        if state is None or not state.alive():
            return False
        if state.protocol == contract.FORK_PROTOCOL and state.code == self.code:
            try:
                await self._connect()
                if self.state is not None and self.state.pid == state.pid:
                    log.info("fork_server_adopted", pid=state.pid)
                    return True
            except (OSError, contract.ContractError, anyio.EndOfStream) as exc:
                log.warning("fork_server_not_answering", pid=state.pid, error=repr(exc))
            await self._drop()
        log.warning("fork_server_replaced", pid=state.pid, protocol=state.protocol, code=state.code)
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.pid, signal.SIGTERM)  # its shims run on: they are not its children
        await _gone(state, GOING_DOWN_S)
        return False

    async def _connect(self) -> None:
        # A unix socket's path is at most 107 bytes: reach it through a directory handle.
        dirfd = os.open(self.directory, os.O_PATH | os.O_DIRECTORY)
        try:
            stream = await anyio.connect_unix(f"/proc/self/fd/{dirfd}/{contract.SOCKET}")
        finally:
            os.close(dirfd)
        await self._take(stream)

    async def _take(self, stream: anyio.abc.UNIXSocketStream) -> None:
        """Read the fork server's first line on ``stream``: its state."""
        self._stream = stream
        self._lines = BufferedByteReceiveStream(stream)
        with anyio.fail_after(ANSWER_S):
            said = contract.parse(await self._lines.receive_until(b"\n", contract.MAX_LINE))
        self.state = ForkState.of(said.get("state"))
        self._linger_s = -1.0

    async def _start(self) -> bool:
        """Start a fork server in the directory (its launcher forks it and exits)."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [sys.executable, "-I", "-S", MAIN, "fork-server", str(self.directory)]
        argv += [str(self.linger_s), str(theirs.fileno())]
        try:
            proc = await anyio.open_process(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
                env={"PATH": teardown.PATH},
            )
        except OSError as exc:
            ours.close()
            raise ForkServerError(f"cannot start a fork server: {exc}") from None
        finally:
            theirs.close()
        try:
            await self._take(await anyio.abc.UNIXSocketStream.from_socket(ours))
            self._linger_s = self.linger_s  # as its command said
        except (OSError, TimeoutError, anyio.EndOfStream, anyio.IncompleteRead) as exc:
            await self._drop()
            said = b""
            if proc.stderr is not None:
                with anyio.move_on_after(ANSWER_S), contextlib.suppress(anyio.EndOfStream):
                    while True:
                        said += await proc.stderr.receive()
            why = said.decode(errors="replace").strip().splitlines()
            raise ForkServerError(
                f"the fork server did not start: {why[-1] if why else repr(exc)}"
            ) from None
        finally:
            with anyio.move_on_after(ANSWER_S, shield=True):
                await proc.wait()
            await proc.aclose()
        assert self.state is not None
        log.info("fork_server_started", pid=self.state.pid, directory=str(self.directory))
        return True

    async def _linger(self) -> None:
        wanted = self.linger_s
        if self._linger_s != wanted and await self._send({"op": "linger", "linger_s": wanted}):
            self._linger_s = wanted

    async def _send(self, request: dict[str, object]) -> bool:
        if self._stream is None:
            return False
        try:
            await self._stream.send(contract.line(request))
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self._drop()
            return False
        return True

    async def _drop(self) -> None:
        stream, self._stream, self._lines = self._stream, None, None
        if stream is not None:
            with contextlib.suppress(OSError):
                await stream.aclose()


async def _gone(state: ForkState, wait_s: float) -> None:
    """Wait (bounded) for a fork server to end, then kill it."""
    try:
        fd = os.pidfd_open(state.pid)
    except ProcessLookupError:
        return
    try:
        if not state.alive():
            return
        with anyio.move_on_after(wait_s):
            await anyio.wait_readable(fd)
            return
        log.error("fork_server_killed", pid=state.pid, reason="it did not end")
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.pid, signal.SIGKILL)
    finally:
        os.close(fd)
