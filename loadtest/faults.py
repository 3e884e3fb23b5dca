"""What a fault is done with: a real program that can be killed (SIGKILL), stalled
(SIGSTOP/SIGCONT) and started again, a supplier's capped state file filled up from outside
and freed again, and the malformed requests the bad-input fault sends
(loadtest/chaos.py ``ChaosRun`` does the faults under load).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
from pathlib import Path

from bourse.runtime.launcher import Program
from loadtest.runner import Spec

# Bad input sent by the bad-input fault: (subject kind, payload). Every one is a request.
GARBAGE: list[tuple[str, bytes]] = [
    ("order", b"{nope"),
    ("order", b'{"type":"PlaceOrder","region":"r0","resources":{"cpus":"2"},"image":"x"}'),
    ("order", b"\xff\xfe" * 40),
    ("commit", b'{"type":"Commit"}'),
    ("commit", b"[]"),
    ("machine", b'{"type":"MachineRequest","machine_id":""}'),
    ("status", b'{"type":"Bid"}'),
]


class Managed:
    """One program that faults may kill, stall and restart."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.prog: Program | None = None
        self.starts = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        assert self.prog is not None, f"{self.name} is not running"
        return self.prog.proc.pid

    @property
    def alive(self) -> bool:
        return self.prog is not None and self.prog.proc.returncode is None

    async def start(self) -> None:
        self.prog = await self.spec.start()
        self.starts += 1

    async def kill9(self) -> None:
        if self.prog is not None and self.alive:
            self.prog.kill9()
            await self.prog.proc.wait()

    def stall(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def wake(self) -> None:
        """SIGCONT if it runs: a stalled program cannot handle the SIGTERM that stops it."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)

    async def stop(self) -> int | None:
        """SIGTERM (SIGKILL if it does not exit in time); its exit code, None if never
        started."""
        if self.prog is None:
            return None
        self.wake()
        return await self.prog.stop()


def fill_store(path: Path, cap_mb: int) -> None:
    """Take the room left in a supplier's capped state file (from another connection)."""
    conn = sqlite3.connect(path, timeout=10, isolation_level=None)
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS chaos_filler (data BLOB)")
        size = conn.execute("PRAGMA page_count").fetchone()[0]
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        room = max(0, cap_mb * 1024 * 1024 - size * page)
        conn.execute("INSERT INTO chaos_filler VALUES (zeroblob(?))", (room + 1024 * 1024,))
    finally:
        conn.close()


def free_store(path: Path) -> None:
    """Give back what :func:`fill_store` took."""
    conn = sqlite3.connect(path, timeout=10, isolation_level=None)
    try:
        conn.execute("DROP TABLE IF EXISTS chaos_filler")
    finally:
        conn.close()
