"""Start Bourse programs as child processes and wait for their readiness line.

Used by ``bourse demo`` (and the tests) to run real supplier and exchange processes.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

READY_TIMEOUT_S = 30.0


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


async def start_program(
    module: str,
    *args: str,
    log_path: Path,
    ready: str,
    env: dict[str, str] | None = None,
) -> Program:
    """``python -m <module> args...``, stderr to ``log_path``; returns once stdout says
    ``ready``. Raises RuntimeError with the log's tail if it exits first."""
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
        )
    prog = Program(module, proc, log_path)
    assert proc.stdout is not None
    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)
            if not line:
                await proc.wait()
                tail = "\n".join(prog.log.splitlines()[-5:])
                raise RuntimeError(f"{module} exited with code {proc.returncode}:\n{tail}")
            if ready in line.decode(errors="replace"):
                prog.ready_line = line.decode(errors="replace").strip()
                return prog
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
