"""A stop leaves nothing behind: `bourse up` (its suppliers run with
--machines-stop-with-supplier) told SIGTERM right after a container was asked to start, in
whatever state that start is, exits within 2 s and leaves no process, mount, loop device,
cgroup, runtime state, network namespace, veth, nftables table or claim on the host; a
supplier stopped with a machine in each state (reserved, started, restarting, stopping)
the same, and one told SIGTERM while its workers' drivers start. Real `bourse up`, real
runc, a real busybox root; the host is looked at afterwards (tests/leftovers.py
``left_below``: what names the data dir, and each worker's things by their names)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

import anyio
import msgspec
import pytest

from bourse.client import BourseClient
from bourse.images import ImageStore, RunSpec
from bourse.nats.connection import connect
from bourse.runtime.launcher import Program, start_program, stop_all
from bourse.wire.messages import Placed, PlaceOrder, Resources
from tests.containers import busybox_root, need_runc
from tests.integration.test_signals import assert_stopped, program, slowdown
from tests.isolation import ONE_DEMO_FLEET_AT_A_TIME, own_worker_id
from tests.leftovers import left_below
from tests.market import ROOMY_DEADLINE_MS, Market, wait_until, worker

STOP_BOUND_S = 2.0
# As PID 1 of its namespace a shell gets SIGTERM only if it handles it.
SERVE = "trap 'exit 0' TERM; httpd -f -p $PORT -h /; echo up; while :; do sleep 1; done"
RUNS = 3  # in CI; the closing note's 20 come from the same test with BOURSE_STOP_RUNS=20
# Workers of one supplier whose drivers start one after the other (a network each): the
# signal lands while one of them starts.
WORKERS_STARTING = 6


async def _up_oci(data: Path) -> tuple[Program, str]:
    up = await start_program(
        "ops.cli",
        *("up", "--port", "-1", "--data-dir", str(data), "--driver", "oci"),
        *("--metrics-addr", "127.0.0.1:0"),
        log_path=data.parent / f"{data.name}.log",
        ready="BOURSE_NATS_URL=",
    )
    return up, up.ready_line.split("=", 1)[1]


def _runs() -> int:
    return int(os.environ.get("BOURSE_STOP_RUNS", RUNS))


@pytest.mark.slow
@ONE_DEMO_FLEET_AT_A_TIME
async def test_sigterm_right_after_a_container_start_leaves_nothing(tmp_path: Path) -> None:
    need_runc()
    root = busybox_root(tmp_path / "root")
    (root / "bin" / "httpd").symlink_to("busybox")
    took: list[float] = []
    for i in range(_runs()):
        data = tmp_path / f"up{i}"
        up, url = await _up_oci(data)
        try:
            nc = await connect([url], name="t", service=False)
            store = await ImageStore.open(nc, "bourse")
            await store.push_directory(root, "bb:1", RunSpec(cmd=("sh", "-c", SERVE)))
            client = BourseClient(nc)
            order = PlaceOrder(
                region="mad",
                resources=Resources(cpus=1, memory_mb=64, disk_mb=16),
                image="bb:1",
                ports=["http"],
                deadline_ms=ROOMY_DEADLINE_MS,
            )
            placed = await client.place(order)
            assert isinstance(placed, Placed), placed
            # the start in flight, and SIGTERM at once: a little later each run, so that
            # the runs together catch it at each of its steps
            start = asyncio.ensure_future(client.machine("start", placed.machine_id))
            await anyio.sleep(0.02 * i)  # where in the start the signal lands: not a wait
            began = time.monotonic()
            up.proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(10):
                code = await up.proc.wait()
            took.append(time.monotonic() - began)
            start.cancel()
            await nc.close()
        finally:
            await stop_all([up])
        assert code == 0
        left = left_below(data)
        print(
            f"run {i}: SIGTERM {0.02 * i:.2f}s into the start, exit in {took[-1]:.2f}s, left {left}"
        )
        assert left == [], f"run {i} left things behind"
        shutil.rmtree(data)  # its stopped machine's claims (ports, ids) go stale with it
    # 2 s on an idle machine, as much longer as it is busy now (test_signals.py's rule)
    assert max(took) < STOP_BOUND_S * slowdown(), took


@pytest.mark.parametrize("driver", ["process", "oci"])
async def test_a_supplier_stopping_with_a_machine_in_each_state_leaves_nothing(
    market: Market, tmp_path: Path, driver: str
) -> None:
    """reserved, started, restarting (a run that ends at once, policy always), stopping (a
    run that ignores SIGTERM, its stop under way): the supplier stops with all of them."""
    if driver == "oci":
        need_runc()
    root = busybox_root(tmp_path / "root")
    await market.jetstream_init()
    store = await ImageStore.open(await market.connect("images"), market.subjects.prefix)
    scripts = {
        "up": "trap 'exit 0' TERM; echo up; while :; do sleep 1; done",
        "flap": "echo bye",
        "deaf": "trap '' TERM; echo deaf; while :; do sleep 1; done",
    }
    for name, script in scripts.items():
        await store.push_directory(root, f"{name}:1", RunSpec(cmd=("sh", "-c", script)))
    data = tmp_path / "data"
    wid = own_worker_id(f"s{driver[0]}1")  # its cgroups are the host's
    w = worker(
        wid, cpus=8, memory_mb=4096, capacity={"disk_mb": 4096}, driver=driver, keep_machines=False
    )
    host = await market.host(w, data_dir=data)
    await market.exchange()  # it resolves the tags pushed above
    buyer = await market.client()

    async def placed(image: str, restart: str = "") -> str:
        order = PlaceOrder(
            region="mad",
            resources=Resources(cpus=1, memory_mb=64, disk_mb=16),
            image=image,
            restart=restart,
            deadline_ms=ROOMY_DEADLINE_MS,
        )
        r = await buyer.place(order)
        assert isinstance(r, Placed), r
        return r.machine_id

    await placed("up:1")  # reserved
    started = await placed("up:1")
    assert (await buyer.machine("start", started)).state == "started"
    flapping = await placed("flap:1", restart="always")
    await buyer.machine("start", flapping)
    deaf = await placed("deaf:1")
    await buyer.machine("start", deaf)
    machines = host.workers[wid].machines
    await wait_until(lambda: machines[flapping].restarts >= 1)
    stopping = asyncio.ensure_future(buyer.machine("stop", deaf))  # its grace is 10 s
    await wait_until(lambda: machines[deaf].state == "stopping")
    began = time.monotonic()
    await market.stop(host)
    assert time.monotonic() - began < STOP_BOUND_S + 1.0
    stopping.cancel()
    assert left_below(data) == []


@pytest.mark.parametrize("driver", ["process", "oci"])
async def test_sigterm_while_its_workers_start_leaves_nothing(
    market: Market, tmp_path: Path, driver: str
) -> None:
    """A supplier told SIGTERM while its workers' drivers start (each makes its network,
    sweeps what an earlier run left) exits within the stop's bound and leaves nothing: a
    worker's keeper cut short while it started never waited for a close that would not
    come (its supplier, stopped in its start, never went on to its stop)."""
    if driver == "oci":
        need_runc()
    fleet = tmp_path / "fleet.json"
    workers = [
        {
            "worker_id": own_worker_id(f"sw{driver[0]}{i}"),
            "region": "mad",
            "driver": driver,
            "capacity": {"cpus": 2, "memory_mb": 1024},
        }
        for i in range(WORKERS_STARTING)
    ]
    fleet.write_bytes(msgspec.json.encode({"worker": workers}))
    data = tmp_path / "data"
    args = ["run", "--fleet", str(fleet), "--data-dir", str(data), "--nats", market.url]
    args += ["--prefix", market.subjects.prefix, "--machines-stop-with-supplier"]
    async with program("supplier", *args, log_path=tmp_path / "supplier.log") as supplier:
        await supplier.logged("event='confinement'")  # the first worker's driver starts
        code, took = await supplier.stop()
    assert_stopped(code, took, supplier.log)
    assert "supplier_started" not in supplier.log  # the signal came while it started
    assert left_below(data) == []
