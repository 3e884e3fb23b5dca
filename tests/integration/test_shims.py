"""A machine's shim (supplier/machines/shim/) on real processes: it holds the machine while no
supplier is attached, records its exit for the next one, stops it on request, and goes down
with its supplier in stop mode; a launch cut short leaves nothing running."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from supplier.machines.api import Exit
from supplier.machines.shim.client import ShimError, discover, launch
from supplier.machines.shim.contract import Plan, ProcessRun, read_state
from tests.containers import reap_kept
from tests.market import alive, wait_until

WAIT_S = 20.0
PATH = {"PATH": "/usr/bin:/bin"}


def _plan(
    tmp_path: Path, mid: str, script: str, supplier_pid: int = 0, grace_s: float = 5.0
) -> Plan:
    return Plan(
        machine_id=mid,
        run=ProcessRun(argv=["sh", "-c", script], env=PATH, cwd=str(tmp_path)),
        log_dir=str(tmp_path / "logs"),
        machine_log_mb=1,
        worker_log_mb=4,
        stop_grace_s=grace_s,
        supplier_pid=supplier_pid,
    )


def _log(tmp_path: Path, mid: str) -> str:
    path = tmp_path / "logs" / f"{mid}.log"
    return path.read_text() if path.exists() else ""


async def test_a_machine_runs_on_while_no_supplier_is_attached_and_is_found_again(
    tmp_path: Path,
) -> None:
    shims = tmp_path / "shims"
    script = "trap 'echo bye; exit 0' TERM; while :; do echo tick; sleep 0.05; done"
    shim = await launch(shims / "m1", _plan(tmp_path, "m1", script))
    pid = shim.pid
    assert pid is not None and alive(pid)
    await shim.detach()  # the supplier goes away
    before = _log(tmp_path, "m1").count("tick")
    await wait_until(lambda: _log(tmp_path, "m1").count("tick") > before + 3, WAIT_S)

    [(mid, again)] = (await discover(shims)).items()  # the next supplier
    assert mid == "m1" and again.attached and again.pid == pid
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(again.follow)
        how = await again.stop(5.0)
        await again.collect()
    assert how == Exit(code=0) and "bye" in _log(tmp_path, "m1")
    assert not (shims / "m1").exists() and not alive(pid)


async def test_an_exit_while_no_supplier_listens_is_recorded_for_the_next(
    tmp_path: Path,
) -> None:
    shims = tmp_path / "shims"
    shim = await launch(shims / "m2", _plan(tmp_path, "m2", "echo up; sleep 0.2; exit 3"))
    await shim.detach()

    def recorded() -> bool:
        state = read_state(shims / "m2")
        return state is not None and state.exit is not None

    await wait_until(recorded, WAIT_S)
    [found] = (await discover(shims)).values()
    assert found.ended.is_set() and found.exit() == Exit(code=3)
    assert found.exit().at_ms > 0
    await found.collect()
    assert not (shims / "m2").exists()


@pytest.mark.parametrize(
    ("script", "grace_s"),
    [
        ("echo up; exec sleep 60", 5.0),
        # its plan's grace longer than the wait: only the short grace of a machine whose
        # supplier died (server.py ORPHANED_GRACE_S) lets it end in time
        ("trap '' TERM; echo deaf; exec sleep 60", 10 * WAIT_S),
    ],
    ids=["listening", "deaf_to_sigterm"],
)
async def test_in_stop_mode_the_machine_goes_down_with_its_supplier(
    tmp_path: Path, script: str, grace_s: float
) -> None:
    shims = tmp_path / "shims"
    supplier = await anyio.open_process(["sleep", "60"])  # stands for the supplier
    try:
        plan = _plan(tmp_path, "m3", script, supplier_pid=supplier.pid, grace_s=grace_s)
        shim = await launch(shims / "m3", plan)
        pid = shim.pid
        assert pid is not None
        await shim.detach()
    finally:
        supplier.kill()
        await supplier.wait()
    await wait_until(lambda: not (shims / "m3").exists(), WAIT_S)
    assert not alive(pid)
    assert await discover(shims) == {}  # the next supplier starts it anew


async def test_a_shim_killed_with_its_machine_leaves_nothing_to_attach_to(
    tmp_path: Path,
) -> None:
    shims = tmp_path / "shims"
    shim = await launch(shims / "m4", _plan(tmp_path, "m4", "exec sleep 60"))
    assert shim.state is not None and shim.pid is not None
    await shim.detach()
    # the shim first: killed after its machine, it may record the machine's end before its
    # own (a record discover rightly returns: the machine ended, said by its shim)
    os.kill(shim.state.shim_pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):  # ended with its shim already
        os.kill(shim.pid, signal.SIGKILL)
    await wait_until(lambda: not alive(shim.state.shim_pid), WAIT_S)  # type: ignore[union-attr]
    assert await discover(shims) == {}
    assert not (shims / "m4").exists()


async def test_a_command_that_cannot_start_says_why(tmp_path: Path) -> None:
    plan = Plan(
        machine_id="m5",
        run=ProcessRun(argv=["/no/such/program"], env=PATH, cwd=str(tmp_path / "nowhere")),
        log_dir=str(tmp_path / "logs"),
        machine_log_mb=1,
        worker_log_mb=4,
        stop_grace_s=1.0,
    )
    with pytest.raises(ShimError, match="No such file or directory"):
        await launch(tmp_path / "shims" / "m5", plan)
    assert not (tmp_path / "shims" / "m5").exists()


@pytest.fixture(autouse=True)
def _reaped(tmp_path: Path) -> Iterator[None]:
    """Kept machines a failed test left are killed, not left running on the host."""
    yield
    reap_kept(tmp_path)


async def test_a_launch_cut_short_leaves_nothing_running(tmp_path: Path) -> None:
    """Cancelled while the shim starts the machine: the launch hears the shim's answer
    anyway and stops what it started, before the cancellation goes on."""
    shims = tmp_path / "shims"
    marker = f"sleep 61.{os.getpid()}"  # names this test's machine among the host's processes
    with anyio.CancelScope() as scope:
        scope.cancel()  # cancelled before the launch even began to wait
        await launch(shims / "m6", _plan(tmp_path, "m6", f"exec {marker}"))
    assert scope.cancelled_caught
    assert not (shims / "m6").exists()  # collected: the shim removed it, and ended
    assert _processes(marker) == [] and _processes(str(shims / "m6")) == []


def _processes(text: str) -> list[int]:
    """Live processes whose command line holds ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry.name))
    return found


async def test_a_shim_of_a_protocol_it_does_not_speak_is_stopped_not_adopted(
    tmp_path: Path,
) -> None:
    shims = tmp_path / "shims"
    shim = await launch(shims / "m7", _plan(tmp_path, "m7", "echo up; exec sleep 60"))
    pid = shim.pid
    assert pid is not None and shim.state is not None
    await shim.detach()
    state = shims / "m7" / "state.json"
    record = json.loads(state.read_text())
    state.write_text(json.dumps({**record, "protocol": 99}))  # a later shim's record
    assert await discover(shims) == {}
    assert not alive(pid)
