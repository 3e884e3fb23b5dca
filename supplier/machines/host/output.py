"""A machine's output as its supplier serves it: ``machines logs`` read from the log files
its shim writes (supplier/machines/shim/logfiles.py says how they are capped and rotated),
and a destroyed machine's logs deleted.

Offsets (``MachineLogs.end``, ``MachineRequest.since``) count bytes of the machine's output
stream from its start, across rotations (``<id>.log.base``). Reading looks at the files
alone, so it serves a stopped machine, and one from before a supplier restart, as well as
a running one; a line cut by the page (the byte budget of a reply) comes cut with a marker
(:data:`CUT_BEFORE`, :data:`CUT_AFTER`), never left out whole. A rotation under way is seen
whole or not at all (``.log`` is renamed to ``.log.1`` before ``.log.base`` moves: a reader
that meets the files between the two reads the older offset, and at worst a few lines
twice).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from supplier.machines.shim.logfiles import (
    DEFAULT_MACHINE_LOG_MB,
    DEFAULT_WORKER_LOG_MB,
    base_path,
    log_path,
    old_path,
    read_base,
    size_of,
)

# A reply's line cut by its byte budget: the beginning left out (the last lines of a log),
# or the rest following in the next page (``since``).
CUT_BEFORE = "[...] "
CUT_AFTER = " [...]"


@dataclass(frozen=True, slots=True)
class LogCaps:
    """How much of its machines' output a worker keeps: ``machine_mb`` in each of a
    machine's two files, ``worker_mb`` in all its machines' files together."""

    machine_mb: int = DEFAULT_MACHINE_LOG_MB
    worker_mb: int = DEFAULT_WORKER_LOG_MB


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
    """One worker's machine logs in ``log_dir``, as the supplier reads them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir

    def path(self, machine_id: str) -> Path:
        """The machine's current log file."""
        return Path(log_path(str(self.log_dir), machine_id))

    def remove(self, machine_id: str) -> None:
        """Delete the machine's logs (it was destroyed)."""
        path = str(self.path(machine_id))
        for p in (path, old_path(path), base_path(path)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def size(self, machine_id: str) -> int:
        path = str(self.path(machine_id))
        return size_of(path) + size_of(old_path(path))

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
        path = str(self.path(machine_id))
        snap = _Snapshot(read_base(path))
        for p in (old_path(path), path):
            with contextlib.suppress(FileNotFoundError):
                f = open(p, "rb")  # noqa: SIM115 - closed by the snapshot
                snap.files.append((f, os.fstat(f.fileno()).st_size))
        return snap
