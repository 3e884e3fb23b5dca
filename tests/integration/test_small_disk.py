"""A supplier whose data dir is a small disk of its own (a tmpfs; the tests run as root, and
are skipped with the reason where mounting is not allowed): a machine printing in a loop
cannot fill it, since its output is capped and rotated (supplier/drivers/output.py); and a
store that did fill (a file takes the room) loses no machine's record: an exit meanwhile is
recorded once the room is back."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from bourse.client import BourseClient, ClientError
from bourse.wire.messages import Placed
from supplier.host import SupplierHost
from supplier.machines.runner import Runner
from supplier.machines.shim.logfiles import MIB
from tests.market import Market, order, worker

DISK_MB = 16
CATALOG = {
    "chatty": {"command": ["yes", "a machine that prints as fast as it can " * 2]},
    "quiet": {"command": ["sleep", "3600"], "stop_grace_s": 0.5},
}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of DISK_MB MiB, unmounted after the test (which stops its market first)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(disk)]
    done = subprocess.run(mount, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)


async def _until(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    """Ask until ``check`` holds (each ask is a real request to the supplier)."""
    end = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)  # the pace of the asking, not a synchronisation


async def _supplier(market: Market, disk: Path) -> tuple[SupplierHost, BourseClient]:
    host = await market.host(
        worker(
            "d1",
            driver="process",
            catalog=CATALOG,
            images=["chatty", "quiet"],
            machine_log_mb=1,
            worker_log_mb=3,
        ),
        data_dir=disk / "data",
    )
    return host, await market.client(direct=True)


async def _started(client: BourseClient, order_id: str, image: str) -> str:
    r = await client.place(order(order_id=order_id, image=image))
    assert isinstance(r, Placed), r
    assert (await client.machine("start", r.machine_id)).state == "started"
    return r.machine_id


def _used_mb(disk: Path) -> float:
    return shutil.disk_usage(disk).used / MIB


@pytest.mark.slow
async def test_a_machine_printing_in_a_loop_cannot_fill_its_suppliers_disk(
    small_disk: Path, market: Market
) -> None:
    _, client = await _supplier(market, small_disk)
    chatty = await _started(client, "chatty", "chatty")

    async def printed_twice_the_disk() -> bool:
        end = (await client.logs(chatty, tail=1)).end or 0
        print(f"printed {end / MIB:.1f} MiB; the disk holds {_used_mb(small_disk):.1f} MiB")
        return end > 2 * DISK_MB * MIB

    await _until("the machine to print twice what the disk holds", printed_twice_the_disk, 30)
    assert _used_mb(small_disk) < DISK_MB / 2  # 3 MiB of logs at most, and the store
    # the store still takes writes: the worker offers, places and starts another machine
    [status] = await client.status("mad")
    assert not status.draining, status.drain_reason
    assert await _started(client, "after", "quiet")
    # its logs read across the rotation: the last lines, and from an offset long gone
    last = await client.logs(chatty, tail=3)
    assert len(last.lines) == 3 and last.truncated
    said = CATALOG["chatty"]["command"][1]
    assert last.lines[:2] == [said, said] and said.startswith(last.lines[2])  # (still printed)
    gone = await client.logs(chatty, since=0)  # rotated away: left out, and said so
    assert gone.truncated and gone.lines and gone.end is not None
    follow = await client.logs(chatty, since=gone.end)  # and on from there, as --follow does
    assert follow.lines and follow.end is not None and follow.end > gone.end
    assert market.violations() == []


def _fill(disk: Path) -> Path:
    """Take every byte left on ``disk`` with one file (as another program would)."""
    fill = disk / "fill"
    with fill.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * MIB)
                f.flush()
        except OSError:
            pass
    return fill


async def test_an_exit_while_the_store_is_full_is_recorded_once_room_is_back(
    small_disk: Path, market: Market
) -> None:
    host, client = await _supplier(market, small_disk)
    quiet = await _started(client, "quiet", "quiet")
    driver = host.workers["d1"].driver
    assert isinstance(driver, Runner)
    pid = driver.pid(quiet)
    assert pid is not None
    fill = await asyncio.to_thread(_fill, small_disk)
    os.kill(pid, signal.SIGKILL)  # the machine ends while its record cannot be written

    async def drained() -> bool:
        [status] = await client.status("mad")
        return status.draining and "full" in status.drain_reason

    await _until("the worker to drain", drained, 10)
    assert (await client.machine("get", quiet)).state == "started"  # not recorded yet
    with pytest.raises(ClientError) as refused:  # refused before it touches the machine
        await client.machine("destroy", quiet)
    print(f"destroy while full: {refused.value}")
    assert "store refuses writes" in str(refused.value) and "again" in str(refused.value)
    fill.unlink()

    async def recorded() -> bool:
        return (await client.machine("get", quiet)).state == "failed"

    await _until("the exit to be recorded", recorded, 10)
    m = await client.machine("get", quiet)
    assert m.last_exit is not None and (m.last_exit.reason, m.last_exit.signal) == ("signal", 9)
    ops = [op for _, op, _, mid, _ in host.store.oplog("d1") if mid == quiet]
    assert ops == ["place", "start", "start", "failed"]  # once, in order
    [status] = await client.status("mad")
    assert not status.draining
    assert (await client.machine("destroy", quiet)).state == "destroyed"
    assert market.violations() == []
