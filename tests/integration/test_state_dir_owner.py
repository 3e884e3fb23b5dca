"""One owner per state directory, through the real programs: a second `supplier run` or
`bourse up` on a directory in use exits at once (exit 1, one line naming the directory and
the pid that holds it), and a kill -9 of the owner leaves nothing that stops the next one."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from bourse.nats.embedded import EmbeddedNats
from tests.integration.test_signals import (
    READY_S,
    assert_gone,
    children_of,
    program,
    supplier_args,
    up_args,
)
from tests.isolation import ONE_DEMO_FLEET_AT_A_TIME


async def second_run(*args: str) -> tuple[int, str]:
    """Run a program to its end (it must end by itself): its exit code and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), READY_S)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


def refusal(directory: Path, pid: int) -> str:
    return (
        f"error: state directory {directory} is in use by pid {pid}: stop it first, or pass"
        " another --data-dir\n"
    )


async def test_a_second_supplier_on_one_data_dir_exits_at_once(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    data = tmp_path / "mad-1"
    args = supplier_args(nats_server.url, "own", data)
    async with program("supplier", *args, log_path=tmp_path / "first.log") as first:
        await first.ready("supplier ready")
        # another worker id, same directory: refused before it touches the state file
        other = supplier_args(nats_server.url, "own", data, worker_id="mad-2")
        assert await second_run("supplier", *other) == (1, refusal(data, first.proc.pid))
        first.proc.send_signal(signal.SIGKILL)
        await first.proc.wait()
    # kill -9 left no stale lock: the next supplier owns the directory and serves
    async with program("supplier", *args, log_path=tmp_path / "next.log") as after:
        await after.ready("supplier ready")


@pytest.mark.slow
@ONE_DEMO_FLEET_AT_A_TIME
async def test_a_second_up_on_one_data_dir_exits_at_once(tmp_path: Path) -> None:
    async with program(
        "ops.cli", *up_args(tmp_path, "--port", "-1"), log_path=tmp_path / "up.log"
    ) as first:
        await first.ready("Bourse is up")
        code, err = await second_run("ops.cli", *up_args(tmp_path, "--port", "-1"))
        assert (code, err) == (1, refusal(tmp_path / "up", first.proc.pid))
        children = children_of(first.proc.pid)
        first.proc.send_signal(signal.SIGKILL)
        await first.proc.wait()
        assert_gone(children)  # its suppliers die with it (and give up their directories)
    async with program(
        "ops.cli", *up_args(tmp_path, "--port", "-1"), log_path=tmp_path / "again.log"
    ) as again:
        await again.ready("Bourse is up")
