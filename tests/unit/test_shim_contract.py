"""The shim's contract and its pure parts (supplier/machines/shim/): plans and states round
trip, the lines a shim writes without the json module are JSON, how a run ended is read
from its wait status, OOM kills are counted from the cgroup files, versions adopt; the fork
server's state round trips and it lingers only for a supplier that keeps its machines."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from supplier.machines.api import Exit
from supplier.machines.shim import contract, forkserver
from supplier.machines.shim.client import exit_of
from supplier.machines.shim.contract import (
    ContainerRun,
    ContractError,
    Ended,
    Plan,
    ProcessRun,
    State,
)
from supplier.machines.shim.forks import LINGER_S, ForkServer
from supplier.machines.shim.forkserver import ForkState
from supplier.machines.shim.logfiles import Rate
from supplier.machines.shim.spawn import ended_of
from supplier.machines.shim.teardown import mounts_below, oom_kills


def _process_plan() -> Plan:
    run = ProcessRun(["sh", "-c", "echo é"], {"PATH": "/bin"}, "/tmp", ["/x/cgroup.procs"])
    return Plan("w~1", run, "/logs", 10, 1024, 2.5, supplier_pid=42)


def test_a_plan_round_trips_both_kinds() -> None:
    plan = Plan.load(_process_plan().dump())
    assert isinstance(plan.run, ProcessRun)
    assert (plan.machine_id, plan.stop_grace_s, plan.supplier_pid) == ("w~1", 2.5, 42)
    assert (plan.run.argv, plan.run.cgroups, plan.run.rlimits) == (
        ["sh", "-c", "echo é"],
        ["/x/cgroup.procs"],
        [],
    )
    box = ContainerRun("/usr/sbin/runc", "/s", "w.1", "/b/bundle", "/b", ["/cg"], ["/cg/e"])
    again = Plan.load(Plan("w~1", box, "/logs", 10, 1024, 10.0).dump())
    assert isinstance(again.run, ContainerRun)
    assert (again.run.runtime_id, again.run.cgroup_dirs) == ("w.1", ["/cg"])


def test_a_plan_that_is_not_one_is_refused_by_name() -> None:
    with pytest.raises(ContractError, match="not a shim plan"):
        Plan.load(b"garbage")


@pytest.mark.parametrize(
    "value",
    [
        {"a": None, "b": True, "c": False, "d": 3, "e": 2.5, "f": 'x"y\\z\n\t\x01\x7fé'},
        {"nested": {"list": [1, "two", {"three": None}]}},
        {"state": State(1, 2, 3, 4, Ended(5, signal=9, oom=True)).to_dict()},
    ],
)
def test_lines_are_json(value: dict[str, object]) -> None:
    raw = contract.line(value)
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    assert json.loads(raw) == value
    assert contract.parse(raw) == value


def test_a_state_says_its_protocol_and_one_without_is_the_first() -> None:
    state = State(10, 20, 30, 40)
    assert State.of(state.to_dict()).protocol == contract.PROTOCOL
    old = {"shim_pid": 1, "shim_started": 2, "pid": 3, "started_at_ms": 4, "exit": None}
    assert State.of(old).protocol == 1
    assert contract.adoptable(State.of(old))
    assert not contract.adoptable(State(1, 2, 3, 4, protocol=contract.PROTOCOL + 1))
    with pytest.raises(ContractError, match=r"state\.pid"):
        State.of({**old, "pid": "3"})


@pytest.mark.parametrize(
    ("status", "container", "oom", "expected"),
    [
        (0 << 8, False, False, Exit(code=0)),
        (3 << 8, False, True, Exit(code=3)),  # an oom of a child: still exit 3
        (signal.SIGKILL, False, True, Exit(signal=9, oom=True)),
        (signal.SIGKILL, False, False, Exit(signal=9)),
        (signal.SIGTERM, False, True, Exit(signal=15)),  # not an OOM kill
        # a container's runtime exits with the container's code, or 128 + its signal
        (7 << 8, True, False, Exit(code=7)),
        (128 << 8, True, False, Exit(code=128)),
        ((128 + 9) << 8, True, False, Exit(signal=9)),
        ((128 + 9) << 8, True, True, Exit(signal=9, oom=True)),
        ((128 + 64) << 8, True, False, Exit(signal=64)),
        (255 << 8, True, False, Exit(code=255)),
        (signal.SIGKILL, True, False, Exit(signal=9)),  # the runtime itself was killed
    ],
)
def test_how_a_run_ended_is_read_from_its_wait_status(
    status: int, container: bool, oom: bool, expected: Exit
) -> None:
    ended = ended_of(status, container, oom)
    assert exit_of(ended) == expected and ended.at_ms > 0


def test_oom_kills_are_counted_from_v1_and_v2_files(tmp_path: Path) -> None:
    v1, v2 = tmp_path / "oom_control", tmp_path / "events"
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    v2.write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\noom_group_kill 0\n")
    assert oom_kills([str(v1)]) == 2
    assert oom_kills([str(v2)]) == 1
    assert oom_kills([str(v1), str(v2), str(tmp_path / "absent")]) == 2
    assert oom_kills([]) == 0


def test_mounts_below_a_directory_deepest_first() -> None:
    info = (
        "1 0 0:1 / / rw - ext4 /dev/x rw\n"
        "2 1 0:2 / /data/box rw - ext4 /dev/loop0 rw\n"
        "3 2 0:3 / /data/box/bundle/root\\040fs rw - overlay overlay rw\n"
        "4 1 0:4 / /data/boxer rw - tmpfs tmpfs rw\n"
    )
    assert mounts_below("/data/box", info) == ["/data/box/bundle/root fs", "/data/box"]


def test_output_past_its_rate_waits_in_proportion() -> None:
    rate = Rate(0.0, per_s=100.0, burst=50.0)
    assert rate.spend(50, 0.0) == 0.0  # the burst
    assert rate.spend(20, 0.0) == pytest.approx(0.2)  # 20 bytes over: 0.2 s at 100/s
    assert rate.spend(0, 0.2) == 0.0  # paid back


def test_a_directory_is_written_owner_only_and_removed_whole(tmp_path: Path) -> None:
    d = tmp_path / "m"
    contract.write_plan(d, _process_plan())
    assert (os.stat(d).st_mode & 0o777, os.stat(d / contract.PLAN).st_mode & 0o777) == (
        0o700,
        0o600,
    )
    contract.write_state(d, State(1, 2, 3, 4))
    assert contract.read_state(d) is not None
    contract.remove_dir(d)
    assert not d.exists()


# -- the fork server's state and lingering ------------------------------------------------------
def test_a_fork_servers_state_round_trips_and_refuses_what_is_not_one() -> None:
    state = ForkState(4242, 987654, "abc123", contract.FORK_PROTOCOL)
    back = ForkState.of(contract.parse(contract.line(state.to_dict())))
    assert (back.pid, back.started, back.code, back.protocol) == (4242, 987654, "abc123", 1)
    for raw in ([], {"pid": 1, "started": 2}, {"pid": "1", "started": 2, "protocol": 1}):
        with pytest.raises(ContractError):
            ForkState.of(raw)


def test_a_fork_server_is_alive_only_as_the_process_that_wrote_its_state() -> None:
    me = os.getpid()
    ticks = contract.started_ticks(me)
    assert ticks is not None
    assert ForkState(me, ticks, "", 1).alive()
    assert not ForkState(me, ticks + 1, "", 1).alive()  # a later process of the same pid


def test_the_shim_codes_fingerprint_is_of_its_files() -> None:
    assert forkserver.code() == forkserver.code()
    assert len(forkserver.code()) == 16


async def test_a_fork_server_lingers_only_for_a_supplier_that_keeps_machines(
    tmp_path: Path,
) -> None:
    """Its linger follows the drivers that hold it: none kept (0: it ends with its
    supplier), one kept among them (it waits for the next supplier)."""
    forks = ForkServer(tmp_path / "forkserver")
    forks._holders = [False, False]
    assert forks.linger_s == 0.0
    forks._holders = [False, True]
    assert forks.linger_s == LINGER_S
    forks._holders, forks._kept = [False], True  # a keeping driver ended: still kept
    assert forks.linger_s == LINGER_S


async def test_a_shim_whose_line_was_reset_is_lost_not_an_error(tmp_path: Path) -> None:
    """A shim killed with a request of ours unread resets its end of the line (Linux: a unix
    socket closed with data in it). The supplier's reader takes that as the line's end, as
    it takes an orderly close: the shim is lost, nothing raises (CI: a stop of a start cut
    short raised BrokenResourceError out of the launch)."""
    import socket

    import anyio
    from anyio.abc import SocketStream

    from supplier.machines.shim.client import Shim

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    state = State(shim_pid=os.getpid(), shim_started=0, pid=os.getpid(), started_at_ms=1)
    theirs.sendall(contract.line({"state": state.to_dict()}))
    shim = Shim("w~m", tmp_path)
    await shim._take(await SocketStream.from_socket(ours))
    assert await shim._send({"op": "collect"})  # left unread by the shim
    with anyio.fail_after(5):
        await anyio.wait_readable(theirs)  # the request is at the other end
    theirs.close()  # with our request in it: a reset
    with anyio.fail_after(5):
        await shim.follow()
    assert shim.lost and shim.ended.is_set()
