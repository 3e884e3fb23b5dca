"""The ``oci`` driver (supplier/machines/runner.py with the container kind,
supplier/machines/oci/kind.py) on real parts: runc, loop devices, overlayfs, cgroups, a root
made from busybox; and what every driver gives a machine of the supplier's environment
(nothing). Container tests skip, naming what to install, where runc or root is missing."""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from bourse.images import ImageStore, RunSpec
from bourse.images.oci import RunConfig
from bourse.runtime.launcher import Program, start_program
from bourse.wire.messages import Machine, Resources
from supplier.cli import app as supplier
from supplier.config import ImageSpec
from supplier.machines.api import DriverError, Exit, ImageRun
from supplier.machines.host.confine import Confiner, owner_of
from supplier.machines.oci.kind import ContainerKind, hostname
from supplier.machines.oci.runtime import Runtime
from supplier.machines.process import ProcessKind
from supplier.machines.runner import Runner
from tests.cli import run_cli
from tests.containers import busybox_root, need_runc, reap_kept
from tests.images import place
from tests.market import Market, alive, order, wait_until, worker

WAIT_S = 30.0
# As PID 1 of its namespace, a shell gets SIGTERM only if it handles it.
TRAP = "trap 'echo bye; exit 0' TERM"
RES = Resources(cpus=1, memory_mb=64, disk_mb=16)


def test_a_hostname_is_a_label_of_the_machine_id() -> None:
    assert hostname("w-1~ABC") == "w-1-ABC"
    assert len(hostname("a" * 63 + "~" + "B" * 64)) == 63


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return need_runc()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return busybox_root(tmp_path_factory.mktemp("image") / "root")


@pytest.fixture
async def driver(runtime: Runtime, tmp_path: Path) -> AsyncIterator[Runner]:
    """A worker's oci driver, run for the test (a task of its own: a fixture's set-up and
    tear-down are not one task); when it ended nothing of its machines may be left."""
    data = tmp_path / "data"
    owner = owner_of(data)
    wid = f"w{uuid.uuid4().hex[:8]}"
    confiner, _ = Confiner.probe("auto", wid, owner=owner)
    kind = ContainerKind.make(runtime, data, owner, confiner, "")
    d = Runner(kind, confiner, data / "machines" / wid, data / "shims" / wid, keep_machines=False)
    stop, ended = anyio.Event(), anyio.Event()

    async def run() -> None:
        async with anyio.create_task_group() as tasks:
            await tasks.start(d.run)
            started.set()
            await stop.wait()
            tasks.cancel_scope.cancel()
        ended.set()

    started = anyio.Event()
    task = asyncio.get_running_loop().create_task(run())
    await started.wait()
    yield d
    stop.set()
    await ended.wait()
    await task
    assert _leftovers(d) == []
    assert not any(w.exists() for w in _worker_cgroups(d))  # the worker's subtree too


def _boxes(d: Runner) -> Any:
    assert isinstance(d.kind, ContainerKind)
    return d.kind.containers


def _worker_cgroups(d: Runner) -> set[Path]:
    """The worker's cgroup directory in every hierarchy runc uses."""
    some = _boxes(d).cgroups_path(f"{d.confiner.worker_id}~X")
    return {p.parent for p in _boxes(d).cgroups(some).values()}


def _leftovers(d: Runner) -> list[str]:
    """Mounts, loop devices, cgroups (every hierarchy), runtime state of the driver's
    containers."""
    home = str(_boxes(d).home)
    left = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if home in line]
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout
    left += [line for line in loops.splitlines() if home in line]
    for subtree in _worker_cgroups(d):
        if subtree.is_dir():
            left += [str(p) for p in subtree.iterdir() if p.is_dir()]
    for sub in (_boxes(d).state, _boxes(d).machines):
        if sub.is_dir():
            left += [str(p) for p in sub.iterdir()]
    return left


def _machine(d: Runner, restart: str = "no", resources: Resources = RES) -> Machine:
    wid = d.confiner.worker_id
    return Machine(
        machine_id=f"{wid}~{uuid.uuid4().hex.upper()}",
        order_id=f"o-{uuid.uuid4().hex[:8]}",
        worker_id=wid,
        region="mad",
        state="started",
        resources=resources,
        image="box",
        metadata={"restart": restart},
        image_digest="sha256:" + "0" * 64,
    )


def _image(root: Path, *script: str, env: tuple[str, ...] = ()) -> ImageRun:
    return ImageRun(root, RunConfig(cmd=["sh", "-c", "\n".join(script)], env=list(env)))


async def _logged(d: Runner, machine_id: str, text: str) -> list[str]:
    def has() -> bool:
        return any(text in line for line in d.logs(machine_id, 1000, 1 << 20)[0])

    await wait_until(has, WAIT_S)
    return d.logs(machine_id, 1000, 1 << 20)[0]


async def test_a_container_runs_its_image_with_the_run_env_and_nothing_of_the_suppliers(
    driver: Runner, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUPPLIER_ONLY", "secret")
    m = _machine(driver)
    image = _image(
        root,
        'echo "greeting=$GREETING who=$WHO id=$BOURSE_MACHINE_ID host=$(hostname)"',
        'echo "supplier=${SUPPLIER_ONLY:-none} uid=$(id -u)"',
        "exit 3",
        env=("GREETING=image", "WHO=image"),
    )
    await driver.start(m, image, {"WHO": "order", "BOURSE_MACHINE_ID": "forged"})
    with anyio.fail_after(WAIT_S):
        assert await driver.wait(m.machine_id) == Exit(code=3)
    lines = driver.logs(m.machine_id, 100, 1 << 20)[0]
    assert f"greeting=image who=order id={m.machine_id} host={hostname(m.machine_id)}" in lines
    assert "supplier=none uid=0" in lines
    assert not driver.is_running(m.machine_id)
    assert _leftovers(driver) == []  # its end removed what the run held
    await driver.destroy(m)
    assert driver.logs(m.machine_id, 100, 1 << 20)[0] == []


async def test_a_stop_ends_it_and_a_destroy_leaves_nothing(driver: Runner, root: Path) -> None:
    m = _machine(driver)
    await driver.start(m, _image(root, TRAP, "echo up", "sleep 60 & wait"))
    await _logged(driver, m.machine_id, "up")
    assert driver.is_running(m.machine_id) and driver.usage_ns(m.machine_id) is not None
    assert _leftovers(driver) != []  # its mount, loop device, cgroups, state
    assert await driver.stop(m.machine_id) == Exit(code=0)
    assert not driver.is_running(m.machine_id)
    assert "bye" in driver.logs(m.machine_id, 100, 1 << 20)[0]
    assert _leftovers(driver) == []
    await driver.start(m, _image(root, TRAP, "echo again", "sleep 60 & wait"))
    await _logged(driver, m.machine_id, "again")
    await driver.destroy(m)
    assert not driver.is_running(m.machine_id) and _leftovers(driver) == []


async def test_a_memory_hog_fails_oom(driver: Runner, root: Path) -> None:
    m = _machine(driver, resources=Resources(cpus=1, memory_mb=32, disk_mb=8))
    hog = "awk 'BEGIN { while (1) a[i++] = sprintf(\"%100000s\", i) }'"
    await driver.start(m, _image(root, hog))
    with anyio.fail_after(WAIT_S):
        how = await driver.wait(m.machine_id)
    assert how.oom and how.failed, how
    await driver.destroy(m)


async def test_each_run_of_a_container_begins_from_its_image(driver: Runner, root: Path) -> None:
    m = _machine(driver, restart="on-failure")
    # its layer is new at each run: the file it leaves is gone the next time
    script = ("if [ -e /tmp/ran ]; then echo again; fi", "touch /tmp/ran; echo run; exit 1")
    for _ in range(2):
        await driver.start(m, _image(root, *script))
        with anyio.fail_after(WAIT_S):
            assert await driver.wait(m.machine_id) == Exit(code=1)
    await driver.destroy(m)
    lines = [x for x in driver.logs(m.machine_id, 100, 1 << 20)[0] if not x.startswith("---")]
    assert "again" not in lines


async def test_a_catalog_image_or_one_without_a_command_is_refused(
    driver: Runner, root: Path
) -> None:
    assert not driver.can_run("web")
    assert driver.runtime_version.startswith("runc ")
    m = _machine(driver)
    with pytest.raises(DriverError, match="only images pushed"):
        await driver.start(m)
    with pytest.raises(DriverError, match="no command"):
        await driver.start(m, ImageRun(root, RunConfig()))
    with pytest.raises(DriverError, match="env key"):
        await driver.start(m, _image(root, "true"), {"NOT A NAME": "x"})
    assert _leftovers(driver) == []


async def test_a_process_machine_sees_the_run_env_and_nothing_of_the_suppliers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUPPLIER_ONLY", "secret")
    show = "import os; print(sorted(os.environ.items()), flush=True)"
    spec = ImageSpec(command=["{python}", "-c", show], env={"SPEC": "spec", "WHO": "spec"})
    catalog = {"py": spec}
    confiner = Confiner("none", "w")
    kind = ProcessKind(confiner, catalog, tmp_path / "work")
    d = Runner(kind, confiner, tmp_path / "logs", tmp_path / "shims", keep_machines=False)
    m = Machine(
        machine_id="w~A",
        order_id="o1",
        worker_id="w",
        region="mad",
        state="started",
        resources=RES,
        image="py",
    )
    async with anyio.create_task_group() as tasks:
        await tasks.start(d.run)
        await d.start(m, None, {"WHO": "order"})
        with anyio.fail_after(WAIT_S):
            assert await d.wait("w~A") == Exit(code=0)
        tasks.cancel_scope.cancel()
    [_, line] = d.logs("w~A", 10, 1 << 20)[0]
    env = dict(ast.literal_eval(line))
    env.pop("LC_CTYPE", None)  # Python's own locale coercion (PEP 538), not the supplier's
    assert env.pop("PATH") and "SUPPLIER_ONLY" not in env
    assert env == {
        "SPEC": "spec",
        "WHO": "order",
        "BOURSE_MACHINE_ID": "w~A",
        "BOURSE_ORDER_ID": "o1",
    }


async def test_a_pushed_root_is_placed_on_an_oci_worker_and_runs_as_a_container(
    runtime: Runtime, root: Path, market: Market, tmp_path: Path
) -> None:
    await market.jetstream_init()
    store = await ImageStore.open(await market.connect("images"), market.subjects.prefix)
    script = f"{TRAP}; echo up in $(hostname) as $(id -u); sleep 60 & wait"
    await store.push_directory(root, "box:v1", RunSpec(cmd=("sh", "-c", script)))
    info = await store.inspect("box:v1")
    data_dir = tmp_path / "supplier"
    host = await market.host(worker("w1", driver="oci"), data_dir=data_dir)
    d = host.workers["w1"].driver
    assert isinstance(d, Runner)
    buyer = await market.client(direct=True)
    [status] = await buyer.status("mad")
    assert (status.driver, status.runtime) == ("oci", runtime.describe())

    placed = await place(buyer.nc, market.subjects, info, "o1", image="box:v1")
    m = await buyer.machine("start", placed.machine_id)
    assert m.state == "started", m
    await _logged(d, m.machine_id, "up in")
    logs = await buyer.logs(m.machine_id)
    assert f"up in {hostname(m.machine_id)} as 0" in logs.lines
    assert (await buyer.machine("stop", m.machine_id)).state == "stopped"
    assert _leftovers(d) == []
    assert (await buyer.machine("destroy", m.machine_id)).state == "destroyed"
    assert _leftovers(d) == []

    # a catalog image: not offered by an oci worker, and the reason says why
    why = await buyer.explain(order(image="web"))
    [verdict] = [v for v in why.verdicts if v.worker_id == "w1"]
    assert [r.code for r in verdict.reasons] == ["image_not_runnable"]


def test_an_oci_worker_on_a_host_without_its_runtime_refuses_to_start(
    tmp_path: Path,
) -> None:
    need_runc()
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        '[[worker]]\nworker_id = "w1"\nregion = "mad"\ndriver = "oci"\noci_runtime = "crun"\n'
        "[worker.capacity]\ncpus = 1\nmemory_mb = 64\n"
    )
    args = ("run", "--fleet", str(fleet), "--data-dir", str(tmp_path), "--nats", "nats://x:1")
    code, out, err = run_cli(supplier, *args)  # refused before it connects
    # crun is not installed here, or cannot work with this host's cgroups: either way the
    # one line names what to install
    assert code == 1 and not out, (out, err)
    [line] = err.strip().splitlines()
    assert line.startswith("error: worker w1: driver oci: ") and "apt-get install runc" in line


async def test_supplier_run_driver_oci_serves_a_container_worker(
    runtime: Runtime, market: Market, tmp_path: Path
) -> None:
    args = ("run", "--worker-id", "c1", "--region", "mad", "--cpus", "2", "--memory-mb", "512")
    args += ("--driver", "oci", "--data-dir", str(tmp_path / "d"))
    args += ("--nats", market.url, "--prefix", market.subjects.prefix)
    log = tmp_path / "s.log"
    sup = await start_program("supplier", *args, log_path=log, ready="supplier ready")
    try:
        buyer = await market.client(direct=True)
        [status] = await buyer.status("mad")
        said = (status.worker_id, status.driver, status.runtime)
        assert said == ("c1", "oci", runtime.describe())
    finally:
        assert await sup.stop() == 0


async def test_a_kept_container_runs_on_through_a_kill_9_of_its_supplier(
    runtime: Runtime, root: Path, market: Market, tmp_path: Path
) -> None:
    await market.jetstream_init()
    store = await ImageStore.open(await market.connect("images"), market.subjects.prefix)
    script = f"{TRAP}; echo pid $$; while :; do echo tick; sleep 0.1; done"
    await store.push_directory(root, "box:v1", RunSpec(cmd=("sh", "-c", script)))
    info = await store.inspect("box:v1")
    fleet = tmp_path / "fleet.json"
    w = {"worker_id": "k1", "region": "mad", "capacity": {"cpus": 2, "memory_mb": 1024}}
    fleet.write_text(json.dumps({"worker": [{**w, "driver": "oci", "keep_machines": True}]}))
    data = tmp_path / "d"
    args = ("run", "--fleet", str(fleet), "--data-dir", str(data), "--nats", market.url)
    args += ("--prefix", market.subjects.prefix)

    async def supplier() -> Program:
        log = tmp_path / "s.log"
        return await start_program("supplier", *args, log_path=log, ready="supplier ready")

    def output() -> str:
        path = data / "machines" / "k1" / f"{placed.machine_id}.log"
        return path.read_text() if path.exists() else ""

    sup = await supplier()
    buyer = await market.client(direct=True)
    placed = await place(buyer.nc, market.subjects, info, "o1", image="box:v1")
    assert (await buyer.machine("start", placed.machine_id)).state == "started"
    await wait_until(lambda: "tick" in output(), WAIT_S)
    runtime_pid = (await _shim_state(data, placed.machine_id))["pid"]

    sup.kill9()
    await sup.proc.wait()
    ticks = output().count("tick")
    await wait_until(lambda: output().count("tick") > ticks + 3, WAIT_S)  # no supplier
    assert alive(runtime_pid)
    sup = await supplier()
    try:
        assert (await buyer.machine("get", placed.machine_id)).state == "started"
        assert output().count("pid ") == 1 and alive(runtime_pid)  # adopted: the same run
        assert (await buyer.machine("destroy", placed.machine_id)).state == "destroyed"
        assert not alive(runtime_pid)
        boxes = data / "containers" / "k1"
        assert not any((boxes / "machines").iterdir()) and not any((boxes / "state").iterdir())
        assert str(boxes) not in Path("/proc/self/mountinfo").read_text()
    finally:
        assert await sup.stop() == 0


async def _shim_state(data: Path, machine_id: str) -> dict[str, int]:
    state = data / "shims" / "k1" / machine_id / "state.json"
    return dict(json.loads(await anyio.Path(state).read_text()))


@pytest.fixture(autouse=True)
def _reaped(tmp_path: Path) -> Iterator[None]:
    """Kept machines a failed test left are killed, not left running on the host."""
    yield
    reap_kept(tmp_path)
