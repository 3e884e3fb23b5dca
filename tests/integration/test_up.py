"""``bourse up``: the long-running demo market stops cleanly and resumes its machines."""

from __future__ import annotations

import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bourse.client import BourseClient
from bourse.images import ImageStore
from bourse.nats.connection import connect
from bourse.runtime.launcher import Program, start_program, stop_all
from bourse.wire.messages import Placed
from ops.hello import HELLO_REF, HELLO_RUN
from tests.cli import run_module
from tests.containers import need_runc
from tests.edgekit import Answer, get
from tests.isolation import ONE_DEMO_FLEET_AT_A_TIME
from tests.market import order, wait_for, wait_until

pytestmark = ONE_DEMO_FLEET_AT_A_TIME

# Metrics on free ports: `up`'s 9464 and up may be another test's at the same moment.
FREE_METRICS = ("--metrics-addr", "127.0.0.1:0")


async def _up(data_dir: Path, *extra: str) -> tuple[Program, str]:
    up = await start_program(
        "ops.cli",
        "up",
        "--port",
        "-1",
        "--data-dir",
        str(data_dir),
        *FREE_METRICS,
        *extra,
        log_path=data_dir.parent / "up.log",
        ready="BOURSE_NATS_URL=",
    )
    return up, up.ready_line.split("=", 1)[1]


@pytest.mark.slow
async def test_up_stops_cleanly_and_the_next_up_restarts_running_machines(
    tmp_path: Path,
) -> None:
    data = tmp_path / "up"
    up, url = await _up(data)
    try:
        nc = await connect(url, name="t", service=False)
        # the example app was pushed before up said it was ready
        hello = await (await ImageStore.open(nc, create=False)).inspect(HELLO_REF)
        assert (hello.cmd, hello.env) == (HELLO_RUN.cmd, HELLO_RUN.env)
        client = BourseClient(nc)
        r = await client.place(
            order(region="mad", image="web", cpus=1, memory_mb=256, ports=["http"])
        )
        assert isinstance(r, Placed)
        started = await client.machine("start", r.machine_id)
        assert started.state == "started"
        # a local market's machines are reached on loopback, not the host's outward address
        assert started.addresses["http"].startswith("127.0.0.1:")
        log = data / "data" / "mad" / "machines" / r.worker_id / f"{r.machine_id}.log"
        # its program is up (a SIGTERM before its handler is installed would just kill it)
        await wait_until(lambda: "web up" in log.read_text())
        await nc.close()
        # up runs an edge (port 8080, or a free one), its address in its log
        said = (data / "logs" / "edge.log").read_text()
        address = re.search(r"event='edge_serving' address='([^']+)'", said)
        assert address is not None, said
        got = await get(address.group(1), host="nope.localhost")
        assert got.status == 404 and got.body.startswith(b"no app 'nope' at this edge")
        # ... and its page, on a listener of its own: every worker of the fleet
        page = re.search(r"event='admin_serving' address='([^']+)'", said)
        assert page is not None, said

        # once its view has heard them (a view follows the state stream by a moment)
        def heard_all(fleet: Answer) -> bool:
            assert fleet.status == 200, fleet.body
            workers = fleet.json()["workers"]
            assert isinstance(workers, list)
            return {w["worker_id"] for w in workers} >= {"mad-1", "fra-1", "sjc-1"}

        address = page.group(1)
        await wait_for(lambda: get(address, path="/api/fleet", host=address), heard_all)
    finally:
        assert await up.stop() == 0  # SIGTERM: everything stops, state is kept
    await wait_until(lambda: "web stopping" in log.read_text())  # stopped gracefully

    up, url = await _up(data)
    try:
        nc = await connect(url, name="t", service=False)
        # pushed again: the same files, the same digest
        again = await (await ImageStore.open(nc, create=False)).inspect(HELLO_REF)
        assert again.digest == hello.digest
        client = BourseClient(nc)
        assert (await client.machine("get", r.machine_id)).state == "started"
        await wait_until(lambda: log.read_text().count("web up") == 2)  # running again
        await nc.close()
    finally:
        assert await up.stop() == 0


def test_up_with_its_port_busy_says_so_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "ops.cli", "up", "--port", str(port), "--data-dir", "up"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert (out.returncode, out.stderr) == (
        1,
        f"error: port {port} is in use: pass --port -1 for a free one, or --nats URL\n",
    )


async def test_up_never_picks_up_bourse_nats_url(tmp_path: Path) -> None:
    """The walk-through exports BOURSE_NATS_URL; a later `up` still starts its own server
    instead of joining whatever that variable names (here: nothing listens there)."""
    dead = "nats://127.0.0.1:1"
    up = await start_program(
        "ops.cli",
        *("up", "--port", "-1", "--data-dir", str(tmp_path / "up"), *FREE_METRICS),
        log_path=tmp_path / "up.log",
        ready="BOURSE_NATS_URL=",
        env={"BOURSE_NATS_URL": dead},
    )
    try:
        assert up.ready_line.split("=", 1)[1] != dead
    finally:
        await stop_all([up])


async def _hints(up: Program) -> list[list[str]]:
    """The commands `up` printed after its ready line, as argv (the `buyer` ones)."""
    assert up.proc.stdout is not None
    hints = []
    while not (line := (await up.proc.stdout.readline()).decode()).startswith("Ctrl-C"):
        assert line, "up ended before it printed its hints"
        if line.startswith("  buyer "):
            hints.append(shlex.split(line))
    return hints


async def _hints_work(up: Program, url: str, *shown: str) -> None:
    """Every `buyer place` and `buyer fleet` that `up` printed exits 0 on its market (watch
    follows until Ctrl-C: not run here); the places print ``shown``."""
    hints = [h for h in await _hints(up) if h[1] in ("place", "fleet")]
    assert [h[1] for h in hints].count("place") == len(shown)
    for argv, said in zip(hints, [*shown, ""], strict=False):
        code, out, err = await run_module("buyer_cli", *argv[1:], "--nats", url, timeout_s=120)
        assert (code, err) == (0, ""), (argv, out, err)
        assert said in out, (argv, out)


@pytest.mark.slow
async def test_up_prints_commands_that_work_on_its_market(tmp_path: Path) -> None:
    """Its process workers run the demo catalog and the example app, pushed by up."""
    up, url = await _up(tmp_path / "up")
    try:
        await _hints_work(up, url, "is started", "is started, its checks passing")
    finally:
        assert await up.stop() == 0


@pytest.mark.slow
async def test_up_driver_oci_makes_the_demo_fleet_container_workers(tmp_path: Path) -> None:
    """Its workers run containers, and what it suggests is the busybox example, which it
    built and pushed (a container has no python3 to run the example app with)."""
    need_runc()
    data = tmp_path / "up"
    up, url = await _up(data, "--driver", "oci")
    try:
        nc = await connect(url, name="t", service=False)
        statuses = await BourseClient(nc).status("mad")
        assert statuses and {(s.driver, s.runtime.split()[0]) for s in statuses} == {
            ("oci", "runc")
        }
        await nc.close()
        if shutil.which("busybox") is None:
            pytest.skip("the busybox example needs busybox-static")
        await _hints_work(up, url, "is started, its checks passing")
    finally:
        assert await up.stop() == 0
