"""The fork server (supplier/machines/shim/forkserver.py): real supplier processes, its
machines forked through it as users of their own in namespaces of their own, killed -9 and
started again (the fork server adopted), a fork server of other code replaced, and one of a
supplier whose machines stop with it gone with it."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from bourse.wire.messages import Placed
from supplier.machines.shim import contract
from supplier.machines.shim.forkserver import ForkState, read_state
from tests.containers import reap_kept
from tests.integration.test_outlive import TICKER, fleet_file, supplier_process
from tests.isolation import own_worker_id
from tests.leftovers import namespace_of, uid_of
from tests.market import Market, alive, order, wait_until

WAIT_S = 20.0


def _forkserver(tmp_path: Path) -> ForkState:
    state = read_state(str(tmp_path / "data" / "forkserver"))
    assert state is not None and state.alive(), state
    return state


def _machine_pid(tmp_path: Path, wid: str, mid: str) -> int:
    path = tmp_path / "data" / "machines" / wid / f"{mid}.log"
    text = path.read_text() if path.exists() else ""
    return int(text.split("pid ")[1].split()[0]) if "pid " in text else 0


def _shim_pid(tmp_path: Path, wid: str, mid: str) -> int:
    state = contract.read_state(tmp_path / "data" / "shims" / wid / mid)
    assert state is not None
    return state.shim_pid


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


async def _started(market: Market, tmp_path: Path, wid: str, order_id: str) -> tuple[str, int]:
    buyer = await market.client(direct=True)
    r = await buyer.place(order(order_id=order_id))
    assert isinstance(r, Placed), r
    assert (await buyer.machine("start", r.machine_id)).state == "started"
    await wait_until(lambda: _machine_pid(tmp_path, wid, r.machine_id) > 0, WAIT_S)
    return r.machine_id, _machine_pid(tmp_path, wid, r.machine_id)


async def test_a_machine_forked_through_the_fork_server_is_its_own_and_outlives_a_kill_9(
    market: Market, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("a machine of its own user and network needs a root supplier")
    wid = own_worker_id("fork-1")
    fleet = fleet_file(tmp_path, TICKER, wid, keep=True)
    sup = await supplier_process(market, tmp_path, fleet)
    first = _forkserver(tmp_path)
    assert (tmp_path / "data" / "forkserver" / "pid").read_text() == f"{first.pid}\n"
    mid, pid = await _started(market, tmp_path, wid, "a")
    # its shim was forked by the fork server (its command line is the fork server's), and
    # the machine is a user of its own in a network and mounts of its own
    assert "fork-server" in _cmdline(_shim_pid(tmp_path, wid, mid))
    assert uid_of(pid) != 0
    assert namespace_of(pid).startswith("bn")
    assert os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino

    sup.kill9()
    await sup.proc.wait()
    assert alive(pid) and first.alive()  # neither was the supplier's to take with it

    sup = await supplier_process(market, tmp_path, fleet)
    machines = [mid]
    try:
        assert _forkserver(tmp_path).pid == first.pid  # adopted, not started again
        assert "fork_server_adopted" in (tmp_path / "s.log").read_text()
        buyer = await market.client(direct=True)
        assert (await buyer.machine("get", mid)).state == "started" and alive(pid)
        other, other_pid = await _started(market, tmp_path, wid, "b")  # through the adopted one
        machines.append(other)
        assert "fork-server" in _cmdline(_shim_pid(tmp_path, wid, other))
        assert uid_of(other_pid) not in (0, uid_of(pid))
    finally:
        buyer = await market.client(direct=True)
        for machine in machines:
            await buyer.machine("destroy", machine)
        assert await sup.stop() == 0
    assert first.alive()  # it waits for the next supplier (keep mode): ended by the fixture


async def test_a_fork_server_of_other_code_is_replaced(market: Market, tmp_path: Path) -> None:
    """A live process whose state says other shim code (a fork server an older supplier
    started) is told SIGTERM and a new one started in its place."""
    wid = own_worker_id("fork-2")
    directory = tmp_path / "data" / "forkserver"
    directory.mkdir(parents=True)
    older = await anyio.open_process(["sleep", "600"])
    try:
        ticks = contract.started_ticks(older.pid)
        assert ticks is not None
        stale = ForkState(older.pid, ticks, "older-code", contract.FORK_PROTOCOL)
        (directory / contract.STATE).write_bytes(contract.line(stale.to_dict()))
        fleet = fleet_file(tmp_path, TICKER, wid, keep=False)
        sup = await supplier_process(market, tmp_path, fleet)
        try:
            with anyio.fail_after(WAIT_S):
                assert await older.wait() == -signal.SIGTERM
            assert _forkserver(tmp_path).pid != older.pid
            assert "fork_server_replaced" in (tmp_path / "s.log").read_text()
            await _started(market, tmp_path, wid, "c")
        finally:
            assert await sup.stop() == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            older.kill()
        await older.aclose()


async def test_the_fork_server_of_machines_that_stop_with_their_supplier_ends_with_it(
    market: Market, tmp_path: Path
) -> None:
    """SIGTERM: stopped by its supplier; kill -9: it ends once its supplier's connection
    drops (it lingers for none)."""
    wid = own_worker_id("fork-3")
    fleet = fleet_file(tmp_path, TICKER, wid, keep=False)
    for how in ("sigterm", "kill9"):
        sup = await supplier_process(market, tmp_path, fleet)
        server = _forkserver(tmp_path)
        _, pid = await _started(market, tmp_path, wid, f"o-{how}")
        if how == "sigterm":
            assert await sup.stop() == 0
        else:
            sup.kill9()
            await sup.proc.wait()
        await wait_until(lambda s=server: not s.alive(), WAIT_S)
        await wait_until(lambda p=pid: not alive(p), WAIT_S)  # its machine with it
        assert not (tmp_path / "data" / "forkserver" / "pid").exists()


async def test_a_fork_server_killed_costs_no_start(market: Market, tmp_path: Path) -> None:
    """Its supplier's next start finds the connection gone: that shim is started by its
    command, and the start after it is forked by a new fork server."""
    wid = own_worker_id("fork-4")
    sup = await supplier_process(market, tmp_path, fleet_file(tmp_path, TICKER, wid, keep=False))
    try:
        first = _forkserver(tmp_path)
        os.kill(first.pid, signal.SIGKILL)
        await wait_until(lambda: not alive(first.pid), WAIT_S)
        mid, _ = await _started(market, tmp_path, wid, "k1")
        assert "fork-server" not in _cmdline(_shim_pid(tmp_path, wid, mid))  # its command
        assert "fork_server_failed" in (tmp_path / "s.log").read_text()
        mid, _ = await _started(market, tmp_path, wid, "k2")
        assert "fork-server" in _cmdline(_shim_pid(tmp_path, wid, mid))
        assert _forkserver(tmp_path).pid != first.pid
    finally:
        assert await sup.stop() == 0


@pytest.fixture(autouse=True)
def _reaped(tmp_path: Path) -> Iterator[None]:
    """Kept machines and the fork server a test left are killed, not left on the host."""
    yield
    reap_kept(tmp_path)
