"""Machines that outlive their supplier (``keep_machines``): real supplier processes killed
and started again, real shims and machines."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from bourse.runtime.launcher import Program, start_program
from bourse.wire.messages import Placed
from tests.containers import reap_kept
from tests.market import Market, alive, order, wait_until

WID = "keep-1"
TICKER = "echo pid $$; while :; do echo tick; sleep 0.1; done"
WAIT_S = 20.0


def fleet_file(tmp_path: Path, command: str, worker_id: str = WID, keep: bool = True) -> Path:
    """One process worker whose catalog image ``web`` runs ``command``."""
    fleet = tmp_path / "fleet.json"
    worker = {
        "worker_id": worker_id,
        "region": "mad",
        "capacity": {"cpus": 4, "memory_mb": 4096},
        "driver": "process",
        "keep_machines": keep,
        "catalog": {"web": {"command": ["sh", "-c", command], "stop_grace_s": 2}},
    }
    fleet.write_text(json.dumps({"worker": [worker]}))
    return fleet


async def supplier_process(market: Market, tmp_path: Path, fleet: Path) -> Program:
    """``supplier run`` of ``fleet`` on ``tmp_path/data``, ready."""
    args = ("run", "--fleet", str(fleet), "--data-dir", str(tmp_path / "data"))
    args += ("--nats", market.url, "--prefix", market.subjects.prefix)
    return await start_program(
        "supplier", *args, log_path=tmp_path / "s.log", ready="supplier ready"
    )


def _log(tmp_path: Path, machine_id: str) -> str:
    path = tmp_path / "data" / "machines" / WID / f"{machine_id}.log"
    return path.read_text() if path.exists() else ""


async def test_a_machine_runs_on_through_a_kill_9_and_a_sigterm_of_its_supplier(
    market: Market, tmp_path: Path
) -> None:
    fleet = fleet_file(tmp_path, TICKER)
    sup = await supplier_process(market, tmp_path, fleet)
    buyer = await market.client(direct=True)
    r = await buyer.place(order())
    assert isinstance(r, Placed)
    assert (await buyer.machine("start", r.machine_id)).state == "started"
    mid = r.machine_id
    await wait_until(lambda: "pid " in _log(tmp_path, mid), WAIT_S)
    pid = int(_log(tmp_path, mid).split("pid ")[1].split()[0])

    sup.kill9()
    await sup.proc.wait()
    ticks = _log(tmp_path, mid).count("tick")
    await wait_until(lambda: _log(tmp_path, mid).count("tick") > ticks + 3, WAIT_S)
    assert alive(pid)  # no supplier: the machine ran on, its output kept flowing

    sup = await supplier_process(market, tmp_path, fleet)
    m = await buyer.machine("get", mid)
    assert m.state == "started" and alive(pid)
    assert _log(tmp_path, mid).count("pid ") == 1  # the same run: adopted, not restarted

    assert await sup.stop() == 0  # SIGTERM: keep mode leaves it running
    assert alive(pid)
    sup = await supplier_process(market, tmp_path, fleet)
    try:
        assert (await buyer.machine("stop", mid)).state == "stopped"
        assert not alive(pid)
        assert (await buyer.machine("destroy", mid)).state == "destroyed"
        assert not (tmp_path / "data" / "shims" / WID / mid).exists()
    finally:
        assert await sup.stop() == 0


async def test_an_exit_while_away_is_recorded_and_a_lost_machine_starts_again(
    market: Market, tmp_path: Path
) -> None:
    # the first run ends when told to (a file in its working directory, the one place of
    # the host a machine of its own user and the test both reach), the later ones run on
    script = "echo pid $$; while [ ! -e end-now ]; do sleep 0.05; done; rm end-now; exit 3"
    fleet = fleet_file(tmp_path, script)
    sup = await supplier_process(market, tmp_path, fleet)
    buyer = await market.client(direct=True)
    a = await buyer.place(order(order_id="a"))
    b = await buyer.place(order(order_id="b"))
    assert isinstance(a, Placed) and isinstance(b, Placed)
    for r in (a, b):
        assert (await buyer.machine("start", r.machine_id)).state == "started"
        await wait_until(lambda r=r: "pid " in _log(tmp_path, r.machine_id), WAIT_S)
    sup.kill9()
    await sup.proc.wait()

    (tmp_path / "data" / "work" / WID / a.machine_id / "end-now").touch()  # a's machine exits
    # while no supplier runs
    state = tmp_path / "data" / "shims" / WID / a.machine_id / "state.json"
    await wait_until(lambda: '"exit"' in state.read_text(), WAIT_S)
    # b's shim and machine are killed (a reboot, say)
    b_dir = tmp_path / "data" / "shims" / WID / b.machine_id
    shim_state = json.loads((b_dir / "state.json").read_text())
    b_pid = int(_log(tmp_path, b.machine_id).split("pid ")[1].split()[0])
    os.kill(shim_state["shim_pid"], signal.SIGKILL)
    os.kill(b_pid, signal.SIGKILL)
    await wait_until(lambda: not alive(b_pid), WAIT_S)

    sup = await supplier_process(market, tmp_path, fleet)
    try:
        with anyio.fail_after(WAIT_S):  # its exit is recorded once the supplier adopted it
            while (ma := await buyer.machine("get", a.machine_id)).state != "stopped":  # noqa: ASYNC110 - a poll of the supplier (as wait_until polls)
                await anyio.sleep(0.05)  # the poll's pace, not a synchronisation
        assert ma.last_exit is not None and ma.last_exit.code == 3, ma
        await wait_until(lambda: _log(tmp_path, b.machine_id).count("pid ") == 2, WAIT_S)
        assert (await buyer.machine("get", b.machine_id)).state == "started"
    finally:
        for r in (a, b):  # keep mode: nothing may run on after the test
            await buyer.machine("destroy", r.machine_id)
        assert await sup.stop() == 0


@pytest.fixture(autouse=True)
def _reaped(tmp_path: Path) -> Iterator[None]:
    """Kept machines a failed test left are killed, not left running on the host."""
    yield
    reap_kept(tmp_path)
