"""Machines confined to what was sold (supplier/drivers/confine.py), on real cgroups where
this host lets the supplier write them (skipped with the reason where not), and the rlimit
path forced by the worker's ``confine`` setting."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import pytest
from nats.aio.msg import Msg

from bourse.nats.connection import flush_all
from bourse.nats.embedded import EmbeddedNats
from bourse.runtime.launcher import start_program as start
from bourse.wire.codec import decode
from bourse.wire.messages import Event, Machine, Placed, Unfilled
from bourse.wire.subjects import Subjects
from supplier.config import ConfigError, WorkerConfig, check_workers
from supplier.machines.heartbeat import SCRIPT
from supplier.machines.host.confine import CGROUP_MECHANISMS, Confiner, owner_of
from supplier.machines.runner import Runner
from tests.isolation import own_worker_id
from tests.market import Market, order, wait_until, worker

HEARTBEAT = ["{python}", SCRIPT, "web", "--every-s", "0.2"]
# Touches 1 MiB more every step until far past any limit of these tests.
HOG = [
    "{python}",
    "-c",
    "import time\nkeep = []\nfor i in range(1024):\n    keep.append(b'x' * (1 << 20))\n"
    "print('survived', flush=True)\ntime.sleep(60)",
]
# Two busy loops: two cores' worth of demand.
BURNER = ["sh", "-c", "while :; do :; done & while :; do :; done"]
# Forks sleepers until the kernel refuses, says how many, then waits.
BOMB = [
    "{python}",
    "-c",
    "import os, time\nn = 0\ntry:\n    while n < 10000:\n        if os.fork() == 0:\n"
    "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
    "except OSError as e:\n    print(f'fork refused after {n}: errno {e.errno}', flush=True)\n"
    "time.sleep(60)",
]
CATALOG = {
    "web": {"command": HEARTBEAT},
    "hog": {"command": HOG},
    "burn": {"command": BURNER, "stop_grace_s": 0.5},
    "bomb": {"command": BOMB, "stop_grace_s": 0.5},
}
PIDS_MAX = 32
C1, K1 = own_worker_id("c1"), own_worker_id("k1")  # their cgroups are the host's


def _cgroups_or_skip() -> str:
    """The cgroup mechanism this host offers, or skip saying why there is none."""
    try:
        c, offer = Confiner.probe("auto", "probe", owner="")
    except Exception as exc:  # a host without /proc: no cgroups either
        pytest.skip(f"cannot probe cgroups: {exc}")
    if c.mechanism not in CGROUP_MECHANISMS:
        pytest.skip(f"no writable cgroups: cgroup2: {offer.cgroup2}; cgroup1: {offer.cgroup1}")
    return c.mechanism


def _worker(wid: str = C1, **extra: object) -> WorkerConfig:
    return worker(wid, driver="process", catalog=CATALOG, pids_max=PIDS_MAX, **extra)


def _driver(market: Market, wid: str = C1) -> Runner:
    d = market.hosts[0].workers[wid].driver
    assert isinstance(d, Runner)
    return d


async def _started(market: Market, image: str, cpus: int = 1, memory_mb: int = 256) -> Machine:
    buyer = await market.client()
    r = await buyer.place(order(image=image, cpus=cpus, memory_mb=memory_mb))
    assert isinstance(r, Placed), r
    return await buyer.machine("start", r.machine_id)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan of a killed machine waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _in_cgroups(pid: int) -> dict[str, str]:
    """controller(s) -> path, from /proc/<pid>/cgroup."""
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        out[controllers or "cgroup2"] = path
    return out


async def test_a_machine_past_its_memory_is_killed_and_recorded_failed_oom(
    market: Market,
) -> None:
    _cgroups_or_skip()
    host = await market.host(_worker())
    await market.exchange()
    events: list[Event] = []

    async def on_event(msg: Msg) -> None:
        events.append(decode(msg.data, Event))

    spy = await market.connect("spy")
    await spy.subscribe(market.subjects.events(kind="failed"), cb=on_event)
    await flush_all(spy)
    m = await _started(market, "hog", memory_mb=64)
    w = host.workers[C1]
    await wait_until(lambda: w.machines[m.machine_id].state == "failed", timeout_s=10)
    await wait_until(lambda: bool(events))
    got = w.machines[m.machine_id]
    print(f"OOM case: state={got.state} last_exit={got.last_exit} event={events[0]}")
    assert got.last_exit is not None
    assert (got.last_exit.reason, got.last_exit.signal) == ("oom", 9)
    assert events[0].machine_id == m.machine_id
    assert events[0].detail == "oom: killed at its memory limit"
    ops = [(op, st) for _, op, _, mid, st in w.store.oplog(C1) if mid == m.machine_id]
    assert ops[-1] == ("failed", "failed")  # durable, like any transition
    assert "survived" not in _driver(market).log_path(m.machine_id).read_text()
    # a client sees it too, and a stop of a failed machine has nothing to do
    buyer = await market.client()
    shown = await buyer.machine("get", m.machine_id)
    assert shown.state == "failed" and shown.last_exit == got.last_exit
    assert (await buyer.machine("stop", m.machine_id)).state == "failed"


async def test_one_cpu_holds_a_two_core_burner_to_one_core(market: Market) -> None:
    _cgroups_or_skip()
    await market.host(_worker())
    await market.exchange()
    d = _driver(market)
    m = await _started(market, "burn", cpus=1)
    await wait_until(lambda: (d.usage_ns(m.machine_id) or 0) > 50_000_000)  # both loops run
    used0, t0 = d.usage_ns(m.machine_id), time.monotonic()
    await anyio.sleep(2.0)  # a pace: the measuring window, not a synchronisation
    used1, t1 = d.usage_ns(m.machine_id), time.monotonic()
    assert used0 is not None and used1 is not None
    share = (used1 - used0) / 1e9 / (t1 - t0)
    print(f"1-CPU burner used {share:.3f} cores over {t1 - t0:.2f}s (cgroup usage counter)")
    assert share <= 1.1
    assert share > 0.05  # it did burn (how much depends on the other work on the host)
    quota = d.confiner.dirs(m.machine_id).get("cpu")
    if quota is not None:  # cgroup1: the quota the arithmetic gave for 1000 millicores
        assert (quota / "cpu.cfs_quota_us").read_text().split() == ["100000"]


async def test_a_fork_bomb_stops_at_the_process_limit_and_destroy_leaves_no_cgroup(
    market: Market,
) -> None:
    _cgroups_or_skip()
    await market.host(_worker())
    await market.exchange()
    d = _driver(market)
    m = await _started(market, "bomb")
    log = d.log_path(m.machine_id)
    await wait_until(lambda: "fork refused after" in log.read_text(), timeout_s=10)
    forked = int(log.read_text().split("fork refused after ")[1].split(":")[0])
    assert forked < PIDS_MAX  # the bomb itself is one of the PIDS_MAX
    pids = d.confiner.pids(m.machine_id)
    assert PIDS_MAX - 2 <= len(pids) <= PIDS_MAX
    dirs = list(d.confiner.dirs(m.machine_id).values())
    assert dirs and all(p.is_dir() for p in dirs)

    buyer = await market.client()
    assert (await buyer.machine("destroy", m.machine_id)).state == "destroyed"
    assert not any(p.exists() for p in dirs)  # no cgroup left behind
    await wait_until(lambda: not any(_running(pid) for pid in pids))  # nor a process of it


async def test_status_says_the_confinement_and_tiny_memory_is_declined(market: Market) -> None:
    mech = _cgroups_or_skip()
    await market.host(_worker(), worker("s1", region="sim"))
    await market.exchange()
    buyer = await market.client()
    [status] = await buyer.status("mad")
    assert status.confinement == mech
    [sim] = await buyer.status("sim")
    assert sim.confinement == "none"
    r = await buyer.place(order(image="web", memory_mb=3))
    assert isinstance(r, Unfilled) and r.reason == "no_offers", r
    why = await buyer.explain(order(image="web", memory_mb=3))
    [verdict] = [v for v in why.verdicts if v.worker_id == C1]
    assert [x.code for x in verdict.reasons] == ["too_small_to_confine"]
    assert "below the 4 MiB" in verdict.reasons[0].detail


async def test_after_a_supplier_restart_running_machines_are_in_their_cgroups(
    market: Market, tmp_path: Path
) -> None:
    _cgroups_or_skip()
    fleet = tmp_path / "fleet.json"
    cfg = {
        "worker_id": K1,
        "region": "mad",
        "capacity": {"cpus": 4, "memory_mb": 4096},
        "driver": "process",
        "catalog": {"web": {"command": HEARTBEAT}},
    }
    fleet.write_text(json.dumps({"worker": [cfg]}))
    args = ("run", "--fleet", str(fleet), "--data-dir", str(tmp_path / "data"))
    args += ("--machines-stop-with-supplier", "--nats", market.url)
    args += ("--prefix", market.subjects.prefix)
    sup = await start("supplier", *args, log_path=tmp_path / "s.log", ready="supplier ready")
    buyer = await market.client(direct=True)
    r = await buyer.place(order())
    assert isinstance(r, Placed)
    assert (await buyer.machine("start", r.machine_id)).state == "started"
    log_file = tmp_path / "data" / "machines" / K1 / f"{r.machine_id}.log"

    def pid_of_run(n: int) -> int:
        return int(log_file.read_text().split("(pid ")[n].split(")")[0])

    await wait_until(lambda: log_file.exists() and "web up" in log_file.read_text())
    first = _in_cgroups(pid_of_run(1))
    owner = owner_of(tmp_path / "data")
    leaf = f"/bourse/{owner}/{K1}/{r.machine_id}"
    assert all(first[c].endswith(leaf) for c in first if c in ("cpu", "memory", "pids")), first

    sup.kill9()
    await sup.proc.wait()
    sup = await start("supplier", *args, log_path=tmp_path / "s.log", ready="supplier ready")
    try:
        await wait_until(lambda: log_file.read_text().count("web up") == 2)
        again = _in_cgroups(pid_of_run(2))
        assert {c: again[c] for c in first if first[c].endswith(leaf)} == {
            c: p for c, p in first.items() if p.endswith(leaf)
        }
        assert leaf in again.get("memory", again.get("cgroup2", ""))
    finally:
        assert await sup.stop() == 0
    # a supplier's stop removes its (empty) cgroups: the machine's and the worker's
    c, _ = Confiner.probe("auto", K1, owner=owner)
    assert c.bases and not any(b.exists() for b in c.bases.values())
    assert not any(b.parent.exists() for b in c.bases.values())  # nor the supplier's


async def test_a_supplier_of_another_market_with_the_same_worker_id_kills_no_machine(
    market: Market, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """A supplier's start sweeps the cgroups its own earlier run left: one started on the
    same host with the same worker id under another prefix and data dir (another market)
    must leave the first one's running machine alone, at its start and at its stop."""
    _cgroups_or_skip()
    await market.host(_worker(), data_dir=tmp_path / "first")
    await market.exchange()
    m = await _started(market, "web")
    pid = _driver(market).pid(m.machine_id)
    assert pid is not None
    prefix = f"{market.subjects.prefix}o"
    async with Market(nats_server.url, Subjects(prefix), tmp_path / "other") as other:
        await other.host(_worker(), data_dir=tmp_path / "second")  # serving: it has swept
        assert _running(pid)
        await other.exchange()
        theirs = await _started(other, "web")  # and it confines its own machines beside
        await _up(market, m)
        await _up(other, theirs)
        mine, its = _in_cgroups(pid), _in_cgroups(_driver(other).pid(theirs.machine_id) or 0)
        assert mine["memory"].endswith(f"/{C1}/{m.machine_id}")
        assert its["memory"].endswith(f"/{C1}/{theirs.machine_id}")
        assert mine["memory"].rsplit("/", 2)[0] != its["memory"].rsplit("/", 2)[0]
    assert _running(pid)
    assert market.hosts[0].workers[C1].machines[m.machine_id].state == "started"


async def _up(market: Market, m: Machine) -> None:
    """Until the heartbeat says it is up (so it has joined its cgroups: the exec wrapper
    joins them before it runs the command)."""
    log = _driver(market).log_path(m.machine_id)
    await wait_until(lambda: log.exists() and "web up" in log.read_text())


# -- the rlimit path (forced: works on any Linux host) ------------------------------------------
def _limits(pid: int) -> dict[str, str]:
    """'Max data size' -> its soft limit, from /proc/<pid>/limits."""
    out = {}
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]:
        name, soft = line[:26].strip(), line[26:].split()[0]
        out[name] = soft
    return out


async def test_rlimit_path_sets_data_and_process_limits(market: Market) -> None:
    host = await market.host(_worker("r1", confine="rlimit"))
    await market.exchange()
    buyer = await market.client()
    [status] = await buyer.status("mad")
    assert status.confinement == "rlimit"
    d = _driver(market, "r1")
    m = await _started(market, "web", memory_mb=256)
    pid = d.pid(m.machine_id)
    assert pid is not None
    await wait_until(lambda: "web up" in d.log_path(m.machine_id).read_text())
    limits = _limits(pid)
    assert limits["Max data size"] == str(256 * 1024 * 1024)
    assert int(limits["Max processes"]) >= PIDS_MAX  # the user's count now + the allowance
    assert d.confiner.dirs(m.machine_id) == {}  # no cgroup on this path
    assert host.workers["r1"].machines[m.machine_id].state == "started"


async def test_rlimit_path_fails_an_allocation_past_memory(market: Market) -> None:
    host = await market.host(_worker("r1", confine="rlimit"))
    await market.exchange()
    m = await _started(market, "hog", memory_mb=64)
    w = host.workers["r1"]
    await wait_until(lambda: w.machines[m.machine_id].state == "stopped", timeout_s=10)
    got = w.machines[m.machine_id]
    assert got.last_exit is not None and (got.last_exit.reason, got.last_exit.code) == ("exit", 1)
    text = _driver(market, "r1").log_path(m.machine_id).read_text()
    assert "MemoryError" in text and "survived" not in text


def test_a_forced_mechanism_the_host_lacks_is_one_clear_config_error() -> None:
    _, offer = Confiner.probe("auto", "probe", owner="")
    if not offer.cgroup2:
        pytest.skip("this host offers cgroup2: nothing to refuse")
    with pytest.raises(ConfigError) as err:
        check_workers([_worker("x1", confine="cgroup2")])
    assert str(err.value) == f"worker x1: confine = cgroup2 is not usable here: {offer.cgroup2}"
    print(err.value)


def test_a_suppliers_end_leaves_bourses_own_directory_to_the_others(tmp_path: Path) -> None:
    """Bourse's directory above every supplier's is the host's: a supplier's stop removes its
    own (empty) directories and never that one, which another supplier may be making its
    machines' directories below at that moment (removed, its make failed ENOENT)."""
    _cgroups_or_skip()
    wid = own_worker_id("sh")
    a, _ = Confiner.probe("auto", wid, owner=owner_of(tmp_path / "a"))
    b, _ = Confiner.probe("auto", wid, owner=owner_of(tmp_path / "b"))
    machine = f"{wid}~01"
    resources = order(image="web").resources
    a.prepare(machine, resources)
    a.sweep(remove_base=True)
    try:
        assert not any(d.parent.exists() for d in a.bases.values())  # the supplier's is gone
        assert all(d.parent.parent.is_dir() for d in a.bases.values())  # bourse's stays
        procs, _ = b.prepare(machine, resources)
        assert procs and all(Path(p).exists() for p in procs)
    finally:
        b.sweep(remove_base=True)
