"""Machines that really run: the process driver (restart policies, stop grace, logs,
recovery after kill -9 of the supplier) and the sim driver (pulls, LRU image cache)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

from nats.aio.msg import Msg

from bourse.nats.connection import flush_all
from bourse.runtime.launcher import start_program as start
from bourse.wire.codec import decode
from bourse.wire.messages import Event, Machine, Placed, Unfilled
from supplier import heartbeat_command
from supplier.config import WorkerConfig
from supplier.machines.heartbeat import SCRIPT
from supplier.machines.runner import Runner
from tests.isolation import own_worker_id
from tests.market import Market, order, wait_until, worker

HEARTBEAT = ["{python}", SCRIPT, "web", "--every-s", "0.2"]
P1, K1 = own_worker_id("p1"), own_worker_id("k1")  # their cgroups are the host's


def _py(code: str) -> list[str]:
    return ["{python}", "-c", code]


def process_worker(wid: str = P1, **catalog: dict[str, object]) -> WorkerConfig:
    return worker(wid, driver="process", catalog=catalog or {"web": {"command": HEARTBEAT}})


async def _placed_and_started(market: Market, image: str = "web", **meta: str) -> Machine:
    buyer = await market.client()
    r = await buyer.place(order(image=image, metadata=meta))
    assert isinstance(r, Placed), r
    return await buyer.machine("start", r.machine_id)


def _driver(market: Market, wid: str = P1) -> Runner:
    d = market.hosts[0].workers[wid].driver
    assert isinstance(d, Runner)
    return d


def host_restarts(market: Market, machine_id: str, wid: str = P1) -> int:
    """How many times the worker restarted the machine (its record's count)."""
    return market.hosts[0].workers[wid].machines[machine_id].restarts


def _log_says(driver: Runner, machine_id: str, text: str) -> Callable[[], bool]:
    """Whether the machine's own log file (what it printed) has a line with ``text``."""

    def says() -> bool:
        path = driver.log_path(machine_id)
        return path.exists() and text in path.read_text(errors="replace")

    return says


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_process_machine_runs_writes_its_log_and_stops_gracefully(market: Market) -> None:
    await market.host(process_worker())
    await market.exchange()
    buyer = await market.client()
    m = await _placed_and_started(market)
    assert m.state == "started"
    pid = _driver(market).pid(m.machine_id)
    assert pid is not None and _alive(pid)

    async def log_has(text: str) -> bool:
        return any(text in line for line in (await buyer.logs(m.machine_id)).lines)

    await wait_until(_log_says(_driver(market), m.machine_id, f"web up on {m.machine_id}"))
    assert await log_has(f"web up on {m.machine_id}")  # the same line, read over NATS
    stopped = await buyer.machine("stop", m.machine_id)
    assert stopped.state == "stopped"
    assert not _alive(pid)
    assert await log_has("web stopping")  # it got SIGTERM and exited on its own


async def test_the_demo_program_runs_where_the_checkout_is_out_of_a_machines_reach(
    market: Market, tmp_path: Path
) -> None:
    """A root supplier's machine runs as its own user with a /tmp of its own: a checkout
    under /tmp (or a home of mode 700) is out of its reach, so the demo's catalog command
    carries its program in its arguments (heartbeat_command), needing no file of it."""
    hidden = tmp_path / "heartbeat.py"  # as a clone under /tmp would have it
    hidden.write_text(Path(SCRIPT).read_text())
    await market.host(
        process_worker(
            web={"command": heartbeat_command("web", every_s=0.2)},
            api={"command": ["{python}", str(hidden), "api"]},
        )
    )
    await market.exchange()
    m = await _placed_and_started(market)
    await wait_until(_log_says(_driver(market), m.machine_id, f"web up on {m.machine_id}"))
    if os.geteuid() == 0:  # the premise: a file of the checkout is not there for it
        api = await _placed_and_started(market, image="api")
        await wait_until(_log_says(_driver(market), api.machine_id, "can't open file"))


async def test_a_machine_stopped_and_started_again_runs_each_time(market: Market) -> None:
    """A stop ends the run and its end releases what the run held (as root: its network,
    by the machine's id); the next start must not take a network that release then removes
    (it did: "cannot enter its network", the stop's and the follower's ends racing)."""
    await market.host(process_worker())
    await market.exchange()
    buyer = await market.client()
    m = await _placed_and_started(market)
    for _ in range(5):
        assert (await buyer.machine("stop", m.machine_id)).state == "stopped"
        assert (await buyer.machine("start", m.machine_id)).state == "started"
        assert _driver(market).is_running(m.machine_id)


async def test_stop_kills_a_process_that_ignores_sigterm_after_the_grace(market: Market) -> None:
    stubborn = _py(
        "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        " print('ignoring TERM', flush=True); time.sleep(60)"  # runs until killed
    )
    await market.host(process_worker(web={"command": stubborn, "stop_grace_s": 0.3}))
    await market.exchange()
    buyer = await market.client()
    m = await _placed_and_started(market)
    pid = _driver(market).pid(m.machine_id)
    assert pid is not None
    # the handler is in place once it says so: stopping before would test nothing
    await wait_until(_log_says(_driver(market), m.machine_id, "ignoring TERM"))
    assert "ignoring TERM" in (await buyer.logs(m.machine_id)).lines
    t = asyncio.get_running_loop().time()
    assert (await buyer.machine("stop", m.machine_id)).state == "stopped"
    assert asyncio.get_running_loop().time() - t >= 0.3
    assert not _alive(pid)


async def test_on_failure_restarts_with_backoff_until_it_stays_up(
    market: Market, tmp_path: Path
) -> None:
    flaky = _py(  # counts its runs in its working directory (the one the test reaches too)
        "import pathlib,sys,time; p=pathlib.Path('runs');"
        " n=int(p.read_text()) if p.exists() else 0; p.write_text(str(n+1));"
        " sys.exit(1) if n < 2 else time.sleep(60)"  # the third run stays up
    )
    await market.host(process_worker(web={"command": flaky, "restart": "on-failure"}))
    await market.exchange()
    m = await _placed_and_started(market)
    d = _driver(market)
    counter = market.tmp_path / "supplier-0" / "work" / P1 / m.machine_id / "runs"
    await wait_until(
        lambda: counter.exists() and counter.read_text() == "3" and d.is_running(m.machine_id)
    )
    assert host_restarts(market, m.machine_id) == 2
    assert market.hosts[0].workers[P1].machines[m.machine_id].state == "started"


async def test_restart_policy_no_records_the_exit_as_stopped(market: Market) -> None:
    await market.host(process_worker(web={"command": _py("import sys; sys.exit(3)")}))
    await market.exchange()
    events: list[Event] = []

    async def on_event(msg: Msg) -> None:
        events.append(decode(msg.data, Event))

    spy = await market.connect("spy")
    await spy.subscribe(market.subjects.events(kind="stopped"), cb=on_event)
    await flush_all(spy)
    m = await _placed_and_started(market)
    w = market.hosts[0].workers[P1]
    await wait_until(lambda: w.machines[m.machine_id].state == "stopped")
    await wait_until(lambda: bool(events))
    assert events[0].machine_id == m.machine_id and events[0].detail == "exited with code 3"
    ops = [(op, state) for _, op, _, mid, state in w.store.oplog(P1) if mid == m.machine_id]
    assert ops[-1] == ("exited", "stopped")


async def test_restart_policy_always_restarts_clean_exits_and_metadata_can_override(
    market: Market,
) -> None:
    await market.host(process_worker(web={"command": _py("print('bye')"), "restart": "no"}))
    await market.exchange()
    m = await _placed_and_started(market, restart="always")  # order metadata wins
    await wait_until(lambda: host_restarts(market, m.machine_id) >= 2)


async def test_a_process_worker_only_offers_images_in_its_catalog(market: Market) -> None:
    await market.host(process_worker())
    await market.exchange()
    r = await (await market.client()).place(order(image="unknown-image", deadline_ms=200))
    assert isinstance(r, Unfilled) and r.reason == "no_offers"


async def test_sim_start_pulls_uncached_images_into_an_lru_cache(market: Market) -> None:
    sim = worker(
        "s1",
        catalog={"big": {"size_mb": 50}, "other": {"size_mb": 50}},
        image_cache_mb=60,
        pull_mb_per_s=1000,
    )
    host = await market.host(sim)
    await market.exchange()
    buyer = await market.client()
    pulls: list[Event] = []

    async def on_pull(msg: Msg) -> None:
        pulls.append(decode(msg.data, Event))

    await buyer.nc.subscribe(market.subjects.events(kind="pulled"), cb=on_pull)
    first = await buyer.place(order(image="big"))
    assert isinstance(first, Placed) and first.image_cached is False
    await buyer.machine("start", first.machine_id)
    second = await buyer.place(order(image="big"))
    assert isinstance(second, Placed) and second.image_cached is True  # pulled by the start
    assert second.score > first.score
    await wait_until(lambda: len(pulls) == 1)
    assert pulls[0].detail.startswith("big in 0.05")  # 50 MB at 1000 MB/s

    await buyer.machine("destroy", first.machine_id)
    third = await buyer.place(order(image="other"))
    assert isinstance(third, Placed)
    await buyer.machine("start", third.machine_id)
    assert list(host.workers["s1"].images) == ["other"]  # big evicted: 50 + 50 > 60


async def test_running_machines_come_back_after_kill_9_of_the_supplier(
    market: Market, tmp_path: Path
) -> None:
    fleet = tmp_path / "fleet.json"
    fleet.write_text(
        json.dumps(
            {
                "worker": [
                    {
                        "worker_id": K1,
                        "region": "mad",
                        "capacity": {"cpus": 4, "memory_mb": 4096},
                        "driver": "process",
                        "catalog": {"web": {"command": HEARTBEAT}},
                    }
                ]
            }
        )
    )
    args = (
        "run",
        "--fleet",
        str(fleet),
        "--data-dir",
        str(tmp_path / "data"),
        "--machines-stop-with-supplier",
        "--nats",
        market.url,
        "--prefix",
        market.subjects.prefix,
    )
    sup = await start("supplier", *args, log_path=tmp_path / "s.log", ready="supplier ready")
    buyer = await market.client(direct=True)
    r = await buyer.place(order())
    assert isinstance(r, Placed)
    start_reply = await buyer.nc.request(
        market.subjects.worker_machine(K1, "start"),
        json.dumps({"machine_id": r.machine_id}).encode(),
        timeout=10,
    )
    assert decode(start_reply.data, Machine).state == "started"
    log_file = tmp_path / "data" / "machines" / K1 / f"{r.machine_id}.log"
    await wait_until(lambda: log_file.exists() and "web up" in log_file.read_text())
    pid = int(log_file.read_text().split("(pid ")[1].split(")")[0])

    sup.kill9()
    await sup.proc.wait()
    await wait_until(lambda: not _alive(pid))  # the machine died with its supplier

    sup = await start("supplier", *args, log_path=tmp_path / "s.log", ready="supplier ready")
    try:
        await wait_until(lambda: log_file.read_text().count("web up") == 2)
        new_pid = int(log_file.read_text().rsplit("(pid ", 1)[1].split(")")[0])
        assert new_pid != pid and _alive(new_pid)
        listed = await buyer.machines(K1)
        assert [m.state for m in listed.machines] == ["started"]
    finally:
        assert await sup.stop() == 0
    await wait_until(lambda: not _alive(new_pid))  # a clean stop stops its machines too
    assert signal.SIGTERM  # (the driver sends SIGTERM; the heartbeat exits 0)
