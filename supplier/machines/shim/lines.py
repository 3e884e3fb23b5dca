"""The socket side a shim and the fork server share: an epoll loop of handlers by
descriptor, a listening unix socket, and connections that speak the contract's lines (one
JSON object a line, supplier/machines/shim/contract.py; descriptors passed along with a
line kept with its connection until a request takes them).

Standard library only, cheap to import: a shim's start path.
"""

from __future__ import annotations

import _socket
import os
import select
import sys
import time
from _collections_abc import Callable  # loaded with os: no import cost

from supplier.machines.shim import contract

TYPE_CHECKING = False  # typing costs the shim an import: mypy reads this name alike
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal

CHUNK = 64 * 1024
# Descriptors one read may bring (a spawn passes one).
MAX_FDS = 4
_INT_BYTES = 4


def say(text: str) -> None:
    """A line of the process's own log (its stderr: a shim's ``shim.log``, the fork
    server's ``forkserver.log``)."""
    os.write(2, f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {text}\n".encode(errors="replace"))


class Conn:
    __slots__ = ("buf", "fds", "sock")

    def __init__(self, sock: _socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.fds: list[int] = []  # passed along, not yet taken by a request


class Lines:
    """The loop and the connections; a subclass answers each request (:meth:`request`),
    may greet a connection (:meth:`greet`), hears when the last one went (:meth:`alone`)
    and, once it :meth:`catches_signals`, a SIGTERM or SIGINT (:meth:`signalled`)."""

    def __init__(self) -> None:
        self.ep = select.epoll()
        self.handlers: dict[int, Callable[[int], None]] = {}
        self.conns: dict[int, Conn] = {}
        self.listener: _socket.socket | None = None

    # -- what a subclass does ------------------------------------------------------------------
    def greet(self, fd: int) -> None:
        """A connection came (or was handed over)."""

    def request(self, fd: int, conn: Conn, op: object, request: dict[str, object]) -> None:
        """One request of ``conn`` (its descriptors passed along in ``conn.fds``); an op
        it does not know is refused here."""
        self.tell(fd, {"error": f"unknown op {op!r}"})

    def signalled(self) -> None:
        """A SIGTERM or SIGINT came."""

    def alone(self) -> None:
        """The last connection went."""

    # -- the loop ------------------------------------------------------------------------------
    def watch(self, fd: int, handler: Callable[[int], None]) -> None:
        self.handlers[fd] = handler
        self.ep.register(fd, select.EPOLLIN)

    def unwatch(self, fd: int) -> None:
        if self.handlers.pop(fd, None) is not None:
            self.ep.unregister(fd)

    def poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds (< 0: for ever) and run the handlers of what came."""
        for fd, _ in self.ep.poll(timeout):
            handler = self.handlers.get(fd)
            if handler is not None:
                handler(fd)

    def catches_signals(self) -> None:
        """SIGTERM and SIGINT told through the loop (:meth:`signalled`), not as they come."""
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        _signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for sig in (_signal.SIGTERM, _signal.SIGINT):
            _signal.signal(sig, lambda signum, frame: None)  # the wake-up fd says which
        self.watch(r, self._signals)

    def _signals(self, fd: int) -> None:
        try:
            got = os.read(fd, 64)
        except BlockingIOError:
            return
        if any(s in (_signal.SIGTERM, _signal.SIGINT) for s in got):
            self.signalled()

    # -- the socket ----------------------------------------------------------------------------
    def listen(self, name: str) -> None:
        """Listen on the unix socket ``name`` (relative: the process runs in its directory;
        mode 0600)."""
        listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(name)
        finally:
            os.umask(old)
        listener.listen(64)
        listener.setblocking(False)
        self.listener = listener
        self.watch(listener.fileno(), self._accept)

    def stop_listening(self, name: str) -> None:
        """No new connection: the socket closed and its name removed."""
        if self.listener is not None:
            self.unwatch(self.listener.fileno())
            self.listener.close()
            self.listener = None
            try:
                os.unlink(name)
            except FileNotFoundError:
                return  # gone already

    def _accept(self, fd: int) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener._accept()  # type: ignore[attr-defined]
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        self.add(_socket.socket(fileno=conn))

    # -- the connections -----------------------------------------------------------------------
    def add(self, sock: _socket.socket) -> None:
        sock.setblocking(False)
        fd = sock.fileno()
        self.conns[fd] = Conn(sock)
        self.watch(fd, self._read)
        self.greet(fd)

    def drop(self, fd: int) -> None:
        conn = self.conns.pop(fd, None)
        if conn is None:
            return
        self.unwatch(fd)
        for passed in conn.fds:
            os.close(passed)
        conn.sock.close()
        if not self.conns:
            self.alone()

    def tell(self, fd: int, message: dict[str, object]) -> None:
        conn = self.conns.get(fd)
        if conn is None:
            return
        try:
            conn.sock.send(contract.line(message))
        except OSError:  # gone, or not reading: it asks again when it connects
            self.drop(fd)

    def tell_all(self, message: dict[str, object]) -> None:
        for fd in list(self.conns):
            self.tell(fd, message)

    def _read(self, fd: int) -> None:
        conn = self.conns[fd]
        try:
            data, ancillary, _, _ = conn.sock.recvmsg(CHUNK, _socket.CMSG_LEN(MAX_FDS * _INT_BYTES))
        except BlockingIOError:
            return
        except OSError:
            data, ancillary = b"", []
        for level, kind, passed in ancillary:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                whole = len(passed) - len(passed) % _INT_BYTES
                conn.fds += [
                    int.from_bytes(passed[i : i + _INT_BYTES], sys.byteorder)
                    for i in range(0, whole, _INT_BYTES)
                ]
        if not data:
            self.drop(fd)  # the peer went away
            return
        conn.buf += data
        while b"\n" in conn.buf:
            raw, conn.buf = conn.buf.split(b"\n", 1)
            try:
                request = contract.parse(raw)
            except contract.ContractError as exc:
                self.tell(fd, {"error": str(exc)})
            else:
                self.request(fd, conn, request.get("op"), request)
            if fd not in self.conns:
                return
        if len(conn.buf) > contract.MAX_LINE:
            say("a request longer than a line: dropped")
            self.drop(fd)
