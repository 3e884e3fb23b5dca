"""Start Bourse programs as child processes and wait for their readiness line.

Used by ``bourse demo`` (and the tests) to run real supplier and exchange processes.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from bourse.errors import BourseError

READY_TIMEOUT_S = 30.0
# On the way out, children get this long to stop by themselves (each bounds its own stop
# under it), then SIGKILL: the parent itself must be gone within 2 s of its SIGTERM.
STOP_CHILDREN_S = 1.6


class ProgramFailed(BourseError, RuntimeError):
    """A program exited before it said it was ready: one line, with the reason its log
    gives (``reason``: its last ``error: …`` line, else its last line) and the log's path."""

    def __init__(self, module: str, code: int | None, reason: str, log_path: Path) -> None:
        said = f": {reason}" if reason else ""
        super().__init__(f"{module} exited with code {code}{said} (its log: {log_path})")
        self.reason = reason


def last_reason(log: str) -> str:
    """What a program that exited said last: its last ``error: …`` line (without the
    prefix), else its last line that is not blank."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    return (errors or lines or [""])[-1]


class Program:
    def __init__(self, name: str, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        self.name = name
        self.proc = proc
        self.log_path = log_path
        self.ready_line = ""  # the stdout line that said it was ready

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill9(self) -> None:
        self.proc.kill()

    async def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        if self.proc.returncode is None:
            self.proc.terminate()
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            self.proc.kill()
            return await self.proc.wait()


async def stop_all(programs: Sequence[Program], timeout_s: float = STOP_CHILDREN_S) -> None:
    """SIGTERM every program at once, SIGKILL whichever still runs after ``timeout_s``, and
    reap them all. Shielded: safe in a ``finally`` of a program that is being cancelled."""
    with anyio.CancelScope(shield=True):
        running = [p for p in programs if p.proc.returncode is None]
        for p in running:
            p.proc.terminate()
        with anyio.move_on_after(timeout_s):
            for p in running:
                await p.proc.wait()
        for p in running:
            if p.proc.returncode is None:
                p.proc.kill()
                await p.proc.wait()


async def start_program(
    module: str,
    *args: str,
    log_path: Path,
    ready: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Program:
    """``python -m <module> args...`` (in ``cwd``: default, this process's), stderr to
    ``log_path``; returns once stdout says ``ready``. Raises ProgramFailed with what its log
    says last if it exits first."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bourse.runtime.reaper",  # the program dies with us, never lingers as an orphan
            "--",
            sys.executable,
            "-m",
            module,
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
    prog = Program(module, proc, log_path)
    assert proc.stdout is not None
    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)
            if not line:
                await proc.wait()
                raise ProgramFailed(module, proc.returncode, last_reason(prog.log), log_path)
            if ready in line.decode(errors="replace"):
                prog.ready_line = line.decode(errors="replace").strip()
                return prog
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
