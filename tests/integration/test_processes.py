"""Real processes: the supplier and exchange commands, and durability under kill -9 (I2)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bourse.runtime.launcher import Program
from bourse.runtime.launcher import start_program as start
from bourse.wire.messages import Placed
from supplier.cli import app as supplier
from tests.cli import run_cli
from tests.market import Market, order

SUPPLIER_ARGS = (
    "run",
    "--driver",
    "sim",
    "--worker-id",
    "dur-1",
    "--region",
    "dur",
    "--cpus",
    "8",
    "--memory-mb",
    "8192",
    "--image",
    "web",
    "--label",
    "disk=ssd",
)


async def _supplier(market: Market, data_dir: Path, tmp_path: Path) -> Program:
    return await start(
        "supplier",
        *SUPPLIER_ARGS,
        "--data-dir",
        str(data_dir),
        "--nats",
        market.url,
        "--prefix",
        market.subjects.prefix,
        log_path=tmp_path / "supplier.log",
        ready="supplier ready",
    )


async def test_i2_placed_survives_kill_9_right_after(market: Market, tmp_path: Path) -> None:
    data_dir = tmp_path / "dur-1"
    proc = await _supplier(market, data_dir, tmp_path)
    buyer = await market.client(direct=True)
    r = await buyer.place(order(region="dur", cpus=3, memory_mb=1024, order_id="durable-1"))
    proc.kill9()  # the very moment Placed arrived
    await proc.proc.wait()
    assert isinstance(r, Placed)

    proc = await _supplier(market, data_dir, tmp_path)
    try:
        listed = await buyer.machines("dur-1")
        assert [(m.machine_id, m.order_id, m.state) for m in listed.machines] == [
            (r.machine_id, "durable-1", "reserved")
        ]
        [status] = await buyer.status("dur")
        assert (status.committed.cpus, status.committed.memory_mb) == (3, 1024)
        assert status.labels == {"disk": "ssd"}
        # I3 across the restart: the retry finds the machine instead of making another.
        again = await buyer.place(order(region="dur", cpus=3, memory_mb=1024, order_id="durable-1"))
        assert isinstance(again, Placed) and again.machine_id == r.machine_id and again.existing
    finally:
        assert await proc.stop() == 0


async def test_exchange_and_supplier_processes_serve_orders_and_machine_verbs(
    market: Market, tmp_path: Path
) -> None:
    sup = await _supplier(market, tmp_path / "d", tmp_path)
    ex = await start(
        "exchange",
        "serve",
        "--nats",
        market.url,
        "--prefix",
        market.subjects.prefix,
        log_path=tmp_path / "exchange.log",
        ready="exchange ready",
    )
    try:
        buyer = await market.client()
        r = await buyer.place(order(region="dur", image="web"))
        assert isinstance(r, Placed) and r.image_cached
        m = await buyer.machine("start", r.machine_id)
        assert m.state == "started"
        m = await buyer.machine("destroy", r.machine_id)
        assert m.state == "destroyed"
        [status] = await buyer.status("dur")
        assert status.committed.cpus == 0 and status.machines == 0
    finally:
        assert await ex.stop() == 0
        assert await sup.stop() == 0
    assert "exchange_stopped" in ex.log
    assert "order_id=" in sup.log and "machine_placed" in sup.log


def test_supplier_refuses_bad_flags_with_one_clear_line(tmp_path: Path) -> None:
    code, _, err = run_cli(
        supplier,
        *("run", "--worker-id", "Bad_Id", "--region", "x", "--cpus", "1", "--memory-mb", "1"),
        *("--nats", "nats://127.0.0.1:1", "--data-dir", str(tmp_path)),
    )
    assert code == 1
    assert "invalid worker" in err and "$.worker_id" in err


async def test_supplier_stops_promptly_on_sigterm_even_when_nats_is_gone(tmp_path: Path) -> None:
    from bourse.nats.embedded import EmbeddedNats

    srv = EmbeddedNats(workdir=tmp_path / "nats").start()
    try:
        sup = await start(
            "supplier",
            *SUPPLIER_ARGS,
            "--data-dir",
            str(tmp_path / "d"),
            "--nats",
            srv.url,
            log_path=tmp_path / "s.log",
            ready="supplier ready",
        )
    finally:
        srv.stop()  # the server goes away under the running supplier
    t = asyncio.get_running_loop().time()
    assert await sup.stop(timeout_s=10) == 0  # SIGTERM; would be -9 if it had to be killed
    assert asyncio.get_running_loop().time() - t < 5
