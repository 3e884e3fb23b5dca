"""A process machine's output: its log files, capped and rotated, the thread that copies the
output into them, and the reader that serves ``machines logs``.

A machine's stdout and stderr are one pipe; a :class:`Pump` (one thread, in the machine's
shim: supplier/drivers/shim.py) reads it and appends to ``<log_dir>/<machine_id>.log``, so
what the output takes on disk is bounded and can never fill the disk the store needs:

- per machine: ``<id>.log`` holds at most ``file_bytes``; a full one becomes ``<id>.log.1``
  (the previous ``.log.1`` is deleted) and a new ``<id>.log`` begins: at most twice
  ``file_bytes`` per machine;
- a line longer than ``file_bytes`` is cut there, with ``LINE_CUT`` after it, and the rest
  of it left out (:class:`LineCutter`);
- per worker: its machines' logs together at most ``worker_bytes``; output past that first
  costs the printing machine its ``.log.1``, then it is left out; so is output the disk
  refuses (a full disk). A line ``[... N bytes of output left out: why]`` says so, written
  once there is room again. Each machine's writer (its shim) counts the directory again
  before it would leave output out and after every ``RECOUNT_BYTES`` it wrote, so the
  writers of a worker together overshoot the budget by at most that much each;
- a machine's output is copied at most RATE_BYTES_S a second (after a burst of
  BURST_BYTES): past that the pump reads its pipe no faster, the pipe fills and the
  machine's writes wait. The copying costs the supplier's CPU, which a machine printing in a
  loop must not take.

Offsets (``MachineLogs.end``, ``MachineRequest.since``) count bytes of the machine's output
stream from its start, across rotations: ``<id>.log.base`` holds the offset at which the
oldest file kept begins (none: 0). Reading (:meth:`Logs.read`) looks at the files alone, so
it serves a stopped machine, and one from before a supplier restart, as well as a running
one; a line cut by the page (the byte budget of a reply) comes cut with a marker
(``CUT_BEFORE``, ``CUT_AFTER``), never left out whole.

A destroyed machine's logs are deleted (:meth:`Pump.remove`): they count against the
worker's budget until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import queue
import selectors
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import anyio
import structlog

log = structlog.get_logger("bourse.driver.output")

MIB = 1024 * 1024
DEFAULT_MACHINE_LOG_MB = 10
DEFAULT_WORKER_LOG_MB = 1024
# What a pipe read takes at most; and how big the pipes are asked to be (a burst of output
# waits there while the pump catches up; the kernel's default is 64 KiB).
CHUNK = 64 * 1024
PIPE_BYTES = 1024 * 1024
RATE_BYTES_S = 8 * MIB
BURST_BYTES = 2 * MIB
# A writer counts what its worker's logs take again after writing this much (the other
# machines' writers are other processes).
RECOUNT_BYTES = MIB
# Stored after the part of a line longer than a log file that is kept.
LINE_CUT = b" [... line cut: longer than the log file]\n"
# A reply's line cut by its byte budget: the beginning left out (the last lines of a log),
# or the rest following in the next page (``since``).
CUT_BEFORE = "[...] "
CUT_AFTER = " [...]"


# -- pure: over-long lines -------------------------------------------------------------------
class LineCutter:
    """What of a machine's output is stored: everything, except that a line longer than
    ``max_line`` bytes is cut there, ``LINE_CUT`` after it, and the rest of it (up to its
    newline) left out. Fed the output in pieces, as it comes."""

    __slots__ = ("cutting", "line", "max_line")

    def __init__(self, max_line: int) -> None:
        if max_line < 1:
            raise ValueError(f"max_line must be at least 1, not {max_line}")
        self.max_line = max_line
        self.line = 0  # bytes of the current line (no newline yet) already fed
        self.cutting = False  # the rest of an over-long line is being left out

    def feed(self, data: bytes) -> bytes:
        """The part of ``data`` to store. Each step takes a run that ends at the last
        newline within what the current line may still take, so a piece of many short
        lines costs a search or two, not one step a line."""
        out: list[bytes] = []
        p, n = 0, len(data)
        while p < n:
            if self.cutting:
                nl = data.find(b"\n", p)
                if nl < 0:
                    break
                p, self.cutting, self.line = nl + 1, False, 0
                continue
            room = self.max_line - self.line  # bytes the current line may still take
            nl = data.rfind(b"\n", p, min(n, p + room + 1))
            if nl >= 0:  # every line ending up to there fits
                out.append(data[p : nl + 1])
                p, self.line = nl + 1, 0
            elif n - p <= room:  # the piece ends first: the line goes on in the next one
                out.append(data[p:])
                self.line += n - p
                break
            else:
                out.append(data[p : p + room] + LINE_CUT)
                p, self.line, self.cutting = p + room, 0, True
        return b"".join(out)


def left_out_line(n: int, why: str) -> bytes:
    """The line stored where output was left out."""
    return f"[... {n} bytes of output left out: {why}]\n".encode()


# -- pure: replies from the bytes read ----------------------------------------------------------
def tail_lines(data: bytes, start: int, cut_first: bool, tail: int) -> tuple[list[str], bool, int]:
    """The last ``tail`` lines of ``data``, the output from offset ``start`` on, whether
    some were left out, and the offset just past the last complete line. ``cut_first``:
    ``data`` begins inside a line, whose end comes marked (``CUT_BEFORE``), not left out."""
    end = start + data.rfind(b"\n") + 1 if b"\n" in data else start
    lines = data.decode(errors="replace").splitlines()
    truncated = start > 0  # output before the window was left out (or rotated away)
    if cut_first and lines:
        lines[0] = CUT_BEFORE + lines[0]
    if len(lines) > tail:
        lines, truncated = lines[-tail:], True
    return lines, truncated, end


def lines_after(data: bytes, since: int, max_bytes: int) -> tuple[list[str], bool, int]:
    """The complete lines of ``data`` (read from offset ``since``, at most ``max_bytes``),
    and the offset just past them (the rest comes with the next call). A line longer than
    ``max_bytes`` comes cut (``CUT_AFTER``: the rest follows), as ``truncated``."""
    cut = data.rfind(b"\n") + 1
    truncated = False
    if cut == 0 and len(data) >= max_bytes:  # one over-long line: hand it over cut
        cut, truncated = len(data), True
    lines = data[:cut].decode(errors="replace").splitlines()
    if truncated and lines:
        lines[-1] += CUT_AFTER
    return lines, truncated, since + cut


# -- the files ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LogCaps:
    """How much of its machines' output a worker keeps: ``machine_mb`` in each of a
    machine's two files, ``worker_mb`` in all its machines' files together."""

    machine_mb: int = DEFAULT_MACHINE_LOG_MB
    worker_mb: int = DEFAULT_WORKER_LOG_MB


@dataclass(slots=True)
class _Machine:
    """The pump's state of one machine's log (the pump thread's alone)."""

    path: Path
    cutter: LineCutter
    base: int = 0  # the output offset at which the oldest file kept begins
    size: int = 0  # of <id>.log
    old: int = 0  # size of <id>.log.1 (0: none)
    file: BinaryIO | None = None  # <id>.log, open for appending
    ends_line: bool = True  # the last byte stored is a newline (or nothing is)
    left_out: int = 0  # bytes of output left out and not yet said
    why: str = ""  # why they were


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """A machine's log files as a reader found them: where they begin, and each open with
    the size it had (the current file grows meanwhile; the reader stops there)."""

    base: int
    files: list[tuple[BinaryIO, int]] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.base + sum(size for _, size in self.files)

    def read(self, start: int, stop: int) -> bytes:
        """Output bytes from offset ``start`` to ``stop`` (within the snapshot)."""
        out: list[bytes] = []
        at = self.base
        for f, size in self.files:
            lo, hi = max(start, at), min(stop, at + size)
            if lo < hi:
                f.seek(lo - at)
                out.append(f.read(hi - lo))
            at += size
        return b"".join(out)

    def close(self) -> None:
        for f, _ in self.files:
            f.close()


class Logs:
    """One worker's machine logs in ``log_dir``: written by its pump's thread, read by the
    event loop (a lock keeps a reader from seeing a rotation half done)."""

    def __init__(self, log_dir: Path, caps: LogCaps) -> None:
        self.log_dir = log_dir
        self.file_bytes = caps.machine_mb * MIB
        self.worker_bytes = caps.worker_mb * MIB
        self.total = 0  # bytes of every machine log in log_dir (as last counted, + writes)
        self.left_out = 0  # bytes left out since then (over the worker's budget, disk full)
        self._unrecounted = 0  # bytes written since the last count
        self._lock = threading.Lock()
        self._machines: dict[str, _Machine] = {}

    def path(self, machine_id: str) -> Path:
        """The machine's current log file."""
        return self.log_dir / f"{machine_id}.log"

    def count(self) -> None:
        """Count what the logs take (the other machines' and earlier runs' files)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        total = 0
        for p in self.log_dir.iterdir():
            if p.name.endswith((".log", ".1")):
                total += _size(p)  # another writer may rotate or remove it meanwhile
        self.total = total
        self._unrecounted = 0

    # -- writing (the pump's thread) -------------------------------------------------------------
    def write(self, machine_id: str, data: bytes) -> None:
        """Store what ``data`` keeps (over-long lines cut), within the caps."""
        m = self._machine(machine_id)
        kept = m.cutter.feed(data)
        if m.left_out:
            note = left_out_line(m.left_out, m.why)
            if not self._store(m, note if m.ends_line else b"\n" + note):
                self._leave_out(machine_id, m, len(kept))
                return
            m.left_out = 0
        if kept and not self._store(m, kept):
            self._leave_out(machine_id, m, len(kept))

    def _leave_out(self, machine_id: str, m: _Machine, n: int) -> None:
        """``n`` bytes of output are left out (``m.why``): said once per stretch here, and
        in the log once there is room again."""
        if not m.left_out:
            log.warning("machine_output_left_out", machine_id=machine_id, reason=m.why)
        m.left_out += n
        self.left_out += n

    def _machine(self, machine_id: str) -> _Machine:
        m = self._machines.get(machine_id)
        if m is None:
            path = self.path(machine_id)
            m = _Machine(path, LineCutter(self.file_bytes), base=_read_base(path))
            m.size = _size(path)
            m.old = _size(_old(path))
            self._machines[machine_id] = m
        return m

    def _store(self, m: _Machine, data: bytes) -> bool:
        """Append ``data`` to the machine's log, rotating it whenever it is full; False (and
        ``m.why``) when the worker's budget or the disk cannot take it all."""
        if self._unrecounted >= RECOUNT_BYTES or self.total + len(data) > self.worker_bytes:
            self.count()
        if self.total + len(data) > self.worker_bytes and m.old:
            self._drop_old(m)  # the printing machine's older output goes first
        if self.total + len(data) > self.worker_bytes:
            m.why = f"the worker's machine logs are at their {self.worker_bytes // MIB} MiB"
            return False
        while data:
            if m.size >= self.file_bytes:
                self._rotate(m)
            part = data[: self.file_bytes - m.size]
            try:
                if m.file is None:
                    m.file = m.path.open("ab", buffering=0)
                written = m.file.write(part) or 0
            except OSError as exc:
                m.why = exc.strerror or str(exc)
                return False
            m.size += written
            self.total += written
            self._unrecounted += written
            m.ends_line = part[written - 1 : written] == b"\n" if written else m.ends_line
            if written < len(part):  # the disk took only part of it
                m.why = os.strerror(errno.ENOSPC)
                return False
            data = data[written:]
        return True

    def _rotate(self, m: _Machine) -> None:
        """``.log`` becomes ``.log.1`` (the older one deleted), a new ``.log`` begins."""
        if m.file is not None:
            m.file.close()
            m.file = None
        with self._lock:
            m.base += m.old
            self.total -= m.old
            try:
                os.replace(m.path, _old(m.path))
                m.old = m.size
            except FileNotFoundError:  # removed by hand: what both files held is gone
                _old(m.path).unlink(missing_ok=True)
                m.base += m.size
                self.total -= m.size
                m.old = 0
            m.size = 0
            _write_base(m.path, m.base)

    def _drop_old(self, m: _Machine) -> None:
        with self._lock:
            _old(m.path).unlink(missing_ok=True)
            m.base += m.old
            self.total -= m.old
            m.old = 0
            _write_base(m.path, m.base)

    def finished(self, machine_id: str) -> None:
        """The machine's pipe ended: close its file (its state is read back if it prints
        again)."""
        m = self._machines.pop(machine_id, None)
        if m is not None and m.file is not None:
            m.file.close()

    def close(self) -> None:
        """Close every log file still open (the pump's end)."""
        for machine_id in list(self._machines):
            self.finished(machine_id)

    def remove(self, machine_id: str) -> None:
        """Delete the machine's logs (it was destroyed)."""
        self.finished(machine_id)
        path = self.path(machine_id)
        with self._lock:
            for p in (path, _old(path)):
                self.total -= _size(p)
                p.unlink(missing_ok=True)
            _base(path).unlink(missing_ok=True)

    # -- reading (the event loop) ----------------------------------------------------------------
    def read(
        self, machine_id: str, tail: int, max_bytes: int, since: int = -1
    ) -> tuple[list[str], bool, int]:
        """The last ``tail`` lines (within ``max_bytes``), or with ``since`` >= 0 the complete
        lines after that offset (within ``max_bytes``); whether some were left out; and the
        offset just past the last complete line read (docs/protocol.md §4.13)."""
        snap = self._snapshot(machine_id)
        try:
            if since >= 0:
                start = min(max(since, snap.base), snap.end)
                lines, truncated, end = lines_after(
                    snap.read(start, start + max_bytes), start, max_bytes
                )
                return lines, truncated or since < snap.base, end
            start = max(snap.base, snap.end - max_bytes)
            cut = start > snap.base and snap.read(start - 1, start) != b"\n"
            return tail_lines(snap.read(start, snap.end), start, cut, tail)
        finally:
            snap.close()

    def _snapshot(self, machine_id: str) -> _Snapshot:
        path = self.path(machine_id)
        with self._lock:
            snap = _Snapshot(_read_base(path))
            for p in (_old(path), path):
                with contextlib.suppress(FileNotFoundError):
                    f = p.open("rb")
                    snap.files.append((f, os.fstat(f.fileno()).st_size))
        return snap


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def _base(path: Path) -> Path:
    return path.with_name(path.name + ".base")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _read_base(path: Path) -> int:
    try:
        return int(_base(path).read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _write_base(path: Path, base: int) -> None:
    """Write the offset file anew (a reader sees the old or the new one, never half). On a
    full disk it keeps the old offset: a reader's offsets are then off by what the rotation
    dropped, and no output is lost for it."""
    tmp = path.with_name(path.name + ".base.tmp")
    try:
        tmp.write_text(str(base))
        os.replace(tmp, _base(path))
    except OSError as exc:
        log.warning("log_offset_not_written", path=str(path), error=exc.strerror)


# -- the pump -------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Pipe:
    """One machine's pipe, as the pump reads it: its budget of bytes (a token bucket)."""

    machine_id: str
    tokens: float = BURST_BYTES
    at: float = 0.0  # when tokens was counted (monotonic)
    resume_at: float = 0.0  # > 0: paused (over its rate) until then


Command = Callable[[], None]


class Pump:
    """One worker's thread that copies its machines' output from their pipes into their
    logs (:class:`Logs`): the event loop never waits on the disk, and a machine that prints
    in a loop costs the supplier a bounded share of a core (RATE_BYTES_S)."""

    def __init__(self, logs: Logs) -> None:
        self.logs = logs
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._pipes: dict[int, _Pipe] = {}  # fd -> its pipe (the thread's)
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._thread: threading.Thread | None = None
        self._stop_by: float | None = None  # stopping: read what is left until then

    # -- the event loop's side --------------------------------------------------------------------
    def start(self) -> None:
        """Count the logs already there and start the thread."""
        self.logs.count()
        self._thread = threading.Thread(
            target=self._run, name=f"output:{self.logs.log_dir}", daemon=True
        )
        self._thread.start()

    def pipe(self, machine_id: str, header: bytes) -> int:
        """A new pipe for the machine's output (stdout and stderr of its next process):
        returns its write end, for the process; the pump reads the other end, after
        ``header`` (stored first)."""
        r, w = os.pipe()
        with contextlib.suppress(OSError):  # a bigger pipe absorbs a burst; not essential
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        os.set_blocking(r, False)
        self._call(lambda: self._attach(machine_id, r, header))
        return w

    def remove(self, machine_id: str) -> None:
        """Delete the machine's logs, and what its pipes still hold (it was destroyed)."""
        self._call(lambda: self._remove(machine_id))

    async def drained(self, machine_id: str, timeout_s: float) -> None:
        """Until every pipe of the machine has ended and its output is stored (at most
        ``timeout_s``: a process the machine left behind may hold its pipe open)."""
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._call(lambda: self._watch(machine_id, loop, done))
        with anyio.move_on_after(timeout_s):
            await done.wait()

    def close(self, timeout_s: float) -> None:
        """Stop the thread: what the pipes still hold is read first, for at most
        ``timeout_s`` (their processes are gone by now, so they end at once)."""
        if self._thread is None:
            return
        self._call(lambda: self._stop(timeout_s))
        self._thread.join(timeout_s + 0.1)
        self._thread = None

    def _call(self, command: Command) -> None:
        self._commands.put(command)
        with contextlib.suppress(BlockingIOError):  # full: the thread is woken already
            os.write(self._wake_w, b"x")

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped():
                for key, _ in self._selector.select(self._timeout()):
                    if key.fd == self._wake_r:
                        self._commands_due()
                    else:
                        self._read(key.fd)
                self._resume_due()
        except Exception as exc:  # never silently: every machine's output stops here
            log.error("output_pump_failed", log_dir=str(self.logs.log_dir), error=repr(exc))
        finally:
            for fd in list(self._pipes):
                self._end(fd)
            self.logs.close()
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _stopped(self) -> bool:
        if self._stop_by is None:
            return False
        return not self._pipes or time.monotonic() >= self._stop_by

    def _timeout(self) -> float | None:
        """Until the first paused pipe may be read again, or the stop's bound."""
        due = [p.resume_at for p in self._pipes.values() if p.resume_at]
        if self._stop_by is not None:
            due.append(self._stop_by)
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _commands_due(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception as exc:  # one failed step must not stop every machine's output
                log.error("output_pump_failed", step=repr(command), error=repr(exc))

    def _attach(self, machine_id: str, fd: int, header: bytes) -> None:
        self.logs.write(machine_id, header)
        self._pipes[fd] = _Pipe(machine_id, at=time.monotonic())
        self._selector.register(fd, selectors.EVENT_READ)

    def _watch(self, machine_id: str, loop: asyncio.AbstractEventLoop, done: asyncio.Event) -> None:
        if any(p.machine_id == machine_id for p in self._pipes.values()):
            self._waiters.setdefault(machine_id, []).append((loop, done))
        else:
            loop.call_soon_threadsafe(done.set)

    def _stop(self, timeout_s: float) -> None:
        self._stop_by = time.monotonic() + timeout_s

    def _remove(self, machine_id: str) -> None:
        for fd in [fd for fd, p in self._pipes.items() if p.machine_id == machine_id]:
            self._end(fd)
        self.logs.remove(machine_id)

    def _read(self, fd: int) -> None:
        pipe = self._pipes[fd]
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        except OSError as exc:
            log.warning("output_pipe_failed", machine_id=pipe.machine_id, error=exc.strerror)
            data = b""
        if not data:
            self._end(fd)
            return
        try:
            self.logs.write(pipe.machine_id, data)
        except Exception as exc:  # one machine's failure must not stop the others' output
            log.error("output_pump_failed", machine_id=pipe.machine_id, error=repr(exc))
            self._end(fd)
            return
        now = time.monotonic()
        pipe.tokens = min(BURST_BYTES, pipe.tokens + (now - pipe.at) * RATE_BYTES_S)
        pipe.tokens -= len(data)
        pipe.at = now
        if pipe.tokens < 0:  # over its rate: its pipe is read again once it has earned it
            pipe.resume_at = now - pipe.tokens / RATE_BYTES_S
            self._selector.unregister(fd)

    def _resume_due(self) -> None:
        now = time.monotonic()
        for fd, pipe in self._pipes.items():
            if pipe.resume_at and pipe.resume_at <= now:
                pipe.resume_at = 0.0
                self._selector.register(fd, selectors.EVENT_READ)

    def _end(self, fd: int) -> None:
        pipe = self._pipes.pop(fd)
        if not pipe.resume_at:
            self._selector.unregister(fd)
        os.close(fd)
        if any(p.machine_id == pipe.machine_id for p in self._pipes.values()):
            return
        self.logs.finished(pipe.machine_id)
        for loop, done in self._waiters.pop(pipe.machine_id, ()):
            loop.call_soon_threadsafe(done.set)
