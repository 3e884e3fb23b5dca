"""The fork server: one per supplier data dir (``<data_dir>/forkserver/``), started as
``python -I -S supplier/machines/shim/main.py fork-server DIR LINGER_S [FD]``
(supplier/machines/shim/forks.py). It imports the shim's modules once, freezes what they
made (``gc.freeze``: a forked shim then shares those pages with it and with every other
shim, and no collection copies them), and forks a shim for each machine its supplier
starts: no interpreter starts, and nothing is imported, on a machine's start path.

Like a shim it is a session of its own, not its supplier's child: it outlives a supplier
that stops or dies, and the next supplier on the data dir adopts it (or stops it, when it
speaks another protocol or runs other shim code, and starts its own). The shims it forks
are not its children either (each is forked twice, as the shim's command does): they run
on whatever becomes of it. When no supplier is connected it waits ``LINGER_S`` seconds for
one (0: it ends at once: the machines of a supplier that stops with them), then ends.

Its directory: ``state.json`` (:class:`ForkState`, written at its start), ``pid`` (its pid,
for an operator), ``sock`` (its socket, mode 0600), ``forkserver.log`` (its own lines).
The protocol (one JSON line each way, as the shims'; supplier/machines/shim/contract.py):

- it says ``{"state": STATE}`` to each connection at once;
- ``{"op": "spawn", "dir": SHIM_DIR}`` with one descriptor passed along (SCM_RIGHTS: the
  shim's first connection, as a launch hands the shim's command its ``FD``): it forks the
  shim of ``SHIM_DIR`` (its plan written there) and answers ``{"spawned": PID}`` (the
  process that forked the shim, gone by then) or ``{"error": "..."}``; the shim itself says
  on its first connection that its machine runs, or why not, as when started by its command;
- ``{"op": "linger", "linger_s": S}``: how long to wait for a supplier from now on;
- ``{"op": "stop"}``: it ends (its shims run on).

Standard library only; what it imports, every shim it forks has loaded.
"""

from __future__ import annotations

import _socket
import gc
import hashlib
import os
import sys
import time

from supplier.machines.shim import command, contract
from supplier.machines.shim.lines import Conn, Lines, say

TYPE_CHECKING = False  # typing costs an import: mypy reads this name alike
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal

PID = "pid"
LOG = "forkserver.log"
# The shim's modules, whose source the code fingerprint is made of (a supplier adopts a
# fork server only if it would fork the shim the supplier's own files make).
SHIM_MODULES = (
    "command.py",
    "contract.py",
    "forkserver.py",
    "logfiles.py",
    "main.py",
    "server.py",
    "spawn.py",
    "teardown.py",
)


def code() -> str:
    """A fingerprint of the shim's code and the interpreter that runs it."""
    h = hashlib.sha256(sys.version.encode() + b"\0" + sys.executable.encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for name in SHIM_MODULES:
        with open(os.path.join(here, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


class ForkState:
    """``state.json``: the fork server (its pid, and its start in clock ticks since boot:
    not a later process of the same pid), the protocol it speaks and the shim code it forks."""

    __slots__ = ("code", "pid", "protocol", "started")

    def __init__(self, pid: int, started: int, code: str, protocol: int) -> None:
        self.pid = pid
        self.started = started
        self.code = code
        self.protocol = protocol

    def to_dict(self) -> dict[str, object]:
        return {
            "protocol": self.protocol,
            "pid": self.pid,
            "started": self.started,
            "code": self.code,
        }

    @classmethod
    def of(cls, raw: object) -> ForkState:
        if not isinstance(raw, dict):
            raise contract.ContractError("a fork server's state is not an object")
        pid, started, protocol = raw.get("pid"), raw.get("started"), raw.get("protocol")
        if not (isinstance(pid, int) and isinstance(started, int) and isinstance(protocol, int)):
            raise contract.ContractError("a fork server's state lacks its pid or protocol")
        return cls(pid, started, str(raw.get("code", "")), protocol)

    def alive(self) -> bool:
        """The fork server that wrote this still runs."""
        return contract.started_ticks(self.pid) == self.started


def read_state(directory: str) -> ForkState | None:
    try:
        with open(os.path.join(directory, contract.STATE), "rb") as f:
            return ForkState.of(contract.parse(f.read()))
    except (OSError, contract.ContractError):
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return  # gone already


class ForkServer(Lines):
    """The server's loop (see the module doc); :meth:`run` returns when it ends."""

    def __init__(self, directory: str, linger_s: float, first: int) -> None:
        super().__init__()
        self.directory = directory
        self.linger_s = linger_s
        self.alone_since = time.monotonic()  # no supplier connected since then (0: one is)
        self.done = False
        me = os.getpid()
        self.state = ForkState(me, contract.started_ticks(me) or 0, code(), contract.FORK_PROTOCOL)
        self.first = first

    def run(self) -> None:
        _unlink(contract.SOCKET)
        self.listen(contract.SOCKET)
        self.catches_signals()
        contract.write_atomically(contract.STATE, contract.line(self.state.to_dict()))
        contract.write_atomically(PID, f"{self.state.pid}\n".encode())
        if self.first >= 0:
            self.add(_socket.socket(fileno=self.first))
        st = self.state
        say(f"fork server {st.pid} ready (protocol {st.protocol}, code {st.code})")
        while not self.done:
            timeout = -1.0
            if self.alone_since:
                timeout = max(0.0, self.alone_since + self.linger_s - time.monotonic())
            self.poll(timeout)
            if self.alone_since and time.monotonic() >= self.alone_since + self.linger_s:
                say(f"no supplier for {self.linger_s}s: ending")
                self.done = True
        say("fork server ends")
        for name in (contract.SOCKET, PID, contract.STATE):
            _unlink(name)

    def signalled(self) -> None:
        say("stop asked by a signal")
        self.done = True

    def greet(self, fd: int) -> None:
        self.alone_since = 0.0
        self.tell(fd, {"state": self.state.to_dict()})

    def alone(self) -> None:
        self.alone_since = time.monotonic()

    def request(self, fd: int, conn: Conn, op: object, request: dict[str, object]) -> None:
        if op == "spawn":
            directory = request.get("dir")
            if not conn.fds or not isinstance(directory, str):
                self.tell(fd, {"error": "a spawn names a directory and passes a descriptor"})
                return
            first = conn.fds.pop(0)
            try:
                self.tell(fd, {"spawned": self._spawn(directory, first)})
            except OSError as exc:
                self.tell(fd, {"error": f"cannot fork a shim: {exc.strerror or exc}"})
            finally:
                os.close(first)
        elif op == "linger":
            linger = request.get("linger_s")
            if isinstance(linger, int | float) and linger >= 0:
                self.linger_s = float(linger)
        elif op == "stop":
            say("stop asked by a supplier")
            self.done = True
        else:
            super().request(fd, conn, op, request)

    def _spawn(self, directory: str, first: int) -> int:
        """Fork the shim of ``directory``, its first connection ``first``: a child that
        forks the shim and ends (reaped here at once), so the shim is nobody's child here."""
        gc.freeze()  # what this process made so far: shared with the shim, never collected
        pid = os.fork()
        if pid == 0:
            try:
                self._child(directory, first)
            finally:
                os._exit(contract.START_FAILED)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            say(f"the shim of {directory} was not forked: status {status}")
        return pid

    def _child(self, directory: str, first: int) -> None:
        """In the forked child: nothing of the fork server's kept, the shim's plan read,
        and the shim forked (command.go_alone). Never returns."""
        _signal.set_wakeup_fd(-1)
        self.ep.close()  # and the sockets let go of, not closed by a collection later: their
        for conn in self.conns.values():  # numbers are the shim's to reuse
            conn.sock.detach()
        if self.listener is not None:
            self.listener.detach()
        for sig in (_signal.SIGTERM, _signal.SIGINT):
            _signal.signal(sig, _signal.SIG_DFL)
        command.close_all_but(first)
        try:
            plan = contract.read_plan(directory)
        except contract.ContractError as exc:
            os.write(first, contract.line({"error": str(exc)}))
            os._exit(contract.START_FAILED)
        command.go_alone(directory, plan, first)


def _preload() -> None:
    """What a shim would load later, loaded once here (shared with every shim): the C
    library (its machine's confinement), ``json`` (its requests), ``resource`` (rlimits)."""
    import json  # noqa: F401
    import resource  # noqa: F401

    from supplier.machines.shim import spawn

    spawn.libc()
    gc.collect()


def main(argv: list[str]) -> None:
    if len(argv) not in (2, 3):
        sys.stderr.write(
            "usage: python -I -S supplier/machines/shim/main.py fork-server DIR LINGER_S [FD]\n"
        )
        raise SystemExit(2)
    directory = os.path.abspath(argv[0])
    linger_s = float(argv[1])
    first = int(argv[2]) if len(argv) == 3 else -1
    command.close_all_but(first)
    if os.fork():  # the launcher: the fork server goes on alone, not the supplier's child
        os._exit(0)
    os.setsid()
    command.own_output(directory, LOG)
    os.chdir(directory)
    if first >= 0:
        os.set_inheritable(first, False)
    _preload()
    ForkServer(directory, linger_s, first).run()
    os._exit(0)
