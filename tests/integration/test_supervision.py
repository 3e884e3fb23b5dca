"""A supplier host owns everything its machines need: after it stops, no machine process and
no follower or lifecycle task is left (supplier/machines/keeper.py, supplier/machines/runner.py)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from bourse.wire.messages import Machine, Placed
from supplier.config import WorkerConfig
from supplier.host import STOP_S
from supplier.machines.heartbeat import SCRIPT
from supplier.machines.runner import Runner
from tests.isolation import own_worker_id
from tests.market import Market, order, wait_until, worker

HEARTBEAT = ["{python}", SCRIPT, "web", "--every-s", "0.2"]
P1 = own_worker_id("p1")  # its cgroups are the host's
# Ignores SIGTERM, and its grace outlasts the host's whole stop: the driver's end kills it.
STUBBORN = [
    "{python}",
    "-c",
    "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    " print('ignoring TERM', flush=True); time.sleep(60)",
]
# Exits at once and is restarted: its supervisor spends its life in the restart backoff.
FLAPPING = ["{python}", "-c", "print('bye')"]


def _worker() -> WorkerConfig:
    catalog = {
        "web": {"command": HEARTBEAT},
        "stubborn": {"command": STUBBORN, "stop_grace_s": 30},
        "flap": {"command": FLAPPING, "restart": "always"},
    }
    return worker(P1, cpus=8, memory_mb=8192, driver="process", catalog=catalog)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # a zombie (exited, not reaped) still answers
    except ProcessLookupError:
        return False
    return True


def _machine_processes(machine_ids: set[str]) -> list[int]:
    """Live processes started for these machines (found by the id in their environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ids = {e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"BOURSE_MACHINE_ID=")}
        if ids & machine_ids:
            found.append(int(entry.name))
    return found


def _owned_tasks() -> list[str]:
    """Tasks of the machines' owners still alive: supervisors and lifecycle work."""
    names = []
    for t in asyncio.all_tasks():
        name = t.get_name()
        if name.startswith("follow ") or "Machines._" in name:
            names.append(name)
    return names


async def test_a_stopped_host_leaves_no_machine_process_and_no_supervisor(
    market: Market,
) -> None:
    host = await market.host(_worker())
    await market.exchange()
    buyer = await market.client()
    d = host.workers[P1].driver
    assert isinstance(d, Runner)

    started: list[Machine] = []
    for image in ("web", "stubborn", "flap"):
        r = await buyer.place(order(image=image, cpus=1, memory_mb=256))
        assert isinstance(r, Placed), r
        started.append(await buyer.machine("start", r.machine_id))
    web, stubborn, flap = started
    assert all(m.state == "started" for m in started)
    pids = [d.pid(web.machine_id), d.pid(stubborn.machine_id)]
    assert None not in pids
    # the stubborn one has its handler in place; the flapping one was restarted
    await wait_until(lambda: "ignoring TERM" in d.logs(stubborn.machine_id, 10, 4096)[0])
    w = host.workers[P1]
    await wait_until(lambda: w.machines[flap.machine_id].restarts >= 1)
    # one follower per machine's run, named for it (the flapping one's may be between runs)
    assert len([t for t in _owned_tasks() if t.startswith("follow ")]) >= 2

    t0 = time.monotonic()
    await market.stop(host)  # as on SIGTERM: returns once run() has ended
    took = time.monotonic() - t0

    assert _owned_tasks() == []
    assert not any(_alive(pid) for pid in pids if pid is not None)  # stopped and reaped
    assert _machine_processes({m.machine_id for m in started}) == []
    assert not d.is_running(web.machine_id) and not d.is_running(stubborn.machine_id)
    assert took < STOP_S + 1.0  # the stubborn one's 30 s grace did not hold the stop up
    # their recorded state still says started: a restart of the supplier resumes them
    assert [w.machines[m.machine_id].state for m in started] == ["started"] * 3
