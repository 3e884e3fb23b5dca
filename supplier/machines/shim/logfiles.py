"""A machine's log files as its shim writes them: capped, rotated, held to the worker's
budget; and the layout its supplier reads (supplier/machines/host/output.py).

Standard library only, cheap to import (the shim's start path). A machine's stdout and
stderr are one pipe that its shim reads and appends to ``<log_dir>/<machine_id>.log``, so
what the output takes on disk is bounded and can never fill the disk the store needs:

- per machine: ``<id>.log`` holds at most ``file_bytes``; a full one becomes ``<id>.log.1``
  (the previous ``.log.1`` is deleted) and a new ``<id>.log`` begins: at most twice
  ``file_bytes`` per machine;
- a line longer than ``file_bytes`` is cut there, with :data:`LINE_CUT` after it, and the
  rest of it left out (:class:`LineCutter`);
- per worker: its machines' logs together at most ``worker_bytes``; output past that first
  costs the printing machine its ``.log.1``, then it is left out; so is output the disk
  refuses (a full disk). A line ``[... N bytes of output left out: why]`` says so, written
  once there is room again. Each writer counts the directory again before it would leave
  output out and after every :data:`RECOUNT_BYTES` it wrote, so the writers of a worker
  together overshoot the budget by at most that much each;
- a machine's output is copied at most :data:`RATE_BYTES_S` a second (after a burst of
  :data:`BURST_BYTES`, :class:`Rate`): past that its shim reads the pipe no faster, the
  pipe fills and the machine's writes wait.

Offsets (``MachineLogs.end``) count bytes of the machine's output stream from its start,
across rotations: ``<id>.log.base`` holds the offset at which the oldest file kept begins
(none: 0).
"""

from __future__ import annotations

import errno
import os

MIB = 1024 * 1024
DEFAULT_MACHINE_LOG_MB = 10
DEFAULT_WORKER_LOG_MB = 1024
RATE_BYTES_S = 8 * MIB
BURST_BYTES = 2 * MIB
# A writer counts what its worker's logs take again after writing this much (the other
# machines' writers are other processes).
RECOUNT_BYTES = MIB
# Stored after the part of a line longer than a log file that is kept.
LINE_CUT = b" [... line cut: longer than the log file]\n"


def log_path(log_dir: str, machine_id: str) -> str:
    """The machine's current log file."""
    return os.path.join(log_dir, machine_id + ".log")


def old_path(path: str) -> str:
    return path + ".1"


def base_path(path: str) -> str:
    return path + ".base"


def size_of(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def read_base(path: str) -> int:
    try:
        with open(base_path(path), "rb") as f:
            return int(f.read() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def write_base(path: str, base: int) -> None:
    """Write the offset file anew (a reader sees the old or the new one, never half). On a
    full disk it keeps the old offset: a reader's offsets are then off by what the rotation
    dropped, and no output is lost for it."""
    tmp = path + ".base.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(str(base).encode())
        os.replace(tmp, base_path(path))
    except OSError:
        pass


def left_out_line(n: int, why: str) -> bytes:
    """The line stored where output was left out."""
    return f"[... {n} bytes of output left out: {why}]\n".encode()


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


class Rate:
    """A token bucket: how many bytes of output may be copied now (``RATE_BYTES_S`` a
    second after a burst of ``BURST_BYTES``); ``pause_s`` says how long to stop reading
    once it is spent. Clock injected (monotonic seconds)."""

    __slots__ = ("at", "burst", "per_s", "tokens")

    def __init__(self, now: float, per_s: float = RATE_BYTES_S, burst: float = BURST_BYTES):
        self.per_s = per_s
        self.burst = burst
        self.tokens = burst
        self.at = now

    def spend(self, n: int, now: float) -> float:
        """Take ``n`` bytes; the seconds to wait before reading again (0: at once)."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_s) - n
        self.at = now
        return 0.0 if self.tokens >= 0 else -self.tokens / self.per_s


class LogWriter:
    """One machine's log files in ``log_dir`` (its shim's alone: one writer a machine)."""

    def __init__(self, log_dir: str, machine_id: str, file_bytes: int, worker_bytes: int) -> None:
        self.log_dir = log_dir
        self.machine_id = machine_id
        self.file_bytes = file_bytes
        self.worker_bytes = worker_bytes
        self.path = log_path(log_dir, machine_id)
        self.cutter = LineCutter(file_bytes)
        self.base = read_base(self.path)  # the output offset at which the oldest file begins
        self.size = size_of(self.path)
        self.old = size_of(old_path(self.path))
        self.fd = -1  # <id>.log, open for appending
        self.ends_line = True  # the last byte stored is a newline (or nothing is)
        self.left_out = 0  # bytes of output left out and not yet said
        self.why = ""  # why they were
        self.total = 0  # bytes of every machine log in log_dir (as last counted, + writes)
        self._unrecounted = 0
        os.makedirs(log_dir, exist_ok=True)
        self.count()

    def count(self) -> None:
        """Count what the worker's logs take (the other machines' and earlier runs')."""
        total = 0
        try:
            with os.scandir(self.log_dir) as entries:
                for e in entries:
                    if e.name.endswith((".log", ".1")):
                        try:
                            total += e.stat().st_size
                        except FileNotFoundError:
                            pass  # another writer rotated or removed it meanwhile
        except FileNotFoundError:
            pass
        self.total = total
        self._unrecounted = 0

    def write(self, data: bytes) -> None:
        """Store what ``data`` keeps (over-long lines cut), within the caps."""
        kept = self.cutter.feed(data)
        if self.left_out:
            note = left_out_line(self.left_out, self.why)
            if not self._store(note if self.ends_line else b"\n" + note):
                self.left_out += len(kept)
                return
            self.left_out = 0
        if kept and not self._store(kept):
            self.left_out += len(kept)

    def _store(self, data: bytes) -> bool:
        """Append ``data``, rotating whenever the file is full; False (and ``why``) when
        the worker's budget or the disk cannot take it all."""
        if self._unrecounted >= RECOUNT_BYTES or self.total + len(data) > self.worker_bytes:
            self.count()
        if self.total + len(data) > self.worker_bytes and self.old:
            self._drop_old()  # the printing machine's older output goes first
        if self.total + len(data) > self.worker_bytes:
            self.why = f"the worker's machine logs are at their {self.worker_bytes // MIB} MiB"
            return False
        while data:
            if self.size >= self.file_bytes:
                self._rotate()
            part = data[: self.file_bytes - self.size]
            try:
                if self.fd < 0:
                    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
                    self.fd = os.open(self.path, flags, 0o600)
                written = os.write(self.fd, part)
            except OSError as exc:
                self.why = exc.strerror or str(exc)
                return False
            self.size += written
            self.total += written
            self._unrecounted += written
            if written:
                self.ends_line = part[written - 1 : written] == b"\n"
            if written < len(part):  # the disk took only part of it
                self.why = os.strerror(errno.ENOSPC)
                return False
            data = data[written:]
        return True

    def _rotate(self) -> None:
        """``.log`` becomes ``.log.1`` (the older one deleted), a new ``.log`` begins."""
        self.close()
        self.base += self.old
        self.total -= self.old
        try:
            os.replace(self.path, old_path(self.path))
            self.old = self.size
        except FileNotFoundError:  # removed by hand: what both files held is gone
            try:
                os.unlink(old_path(self.path))
            except FileNotFoundError:
                pass
            self.base += self.size
            self.total -= self.size
            self.old = 0
        self.size = 0
        write_base(self.path, self.base)

    def _drop_old(self) -> None:
        try:
            os.unlink(old_path(self.path))
        except FileNotFoundError:
            pass
        self.base += self.old
        self.total -= self.old
        self.old = 0
        write_base(self.path, self.base)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
