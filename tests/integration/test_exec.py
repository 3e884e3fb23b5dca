"""``machines exec`` (docs/protocol.md §4.24) on an in-process market without keys: the shared
buyer's session through the exchange on a process machine, its ``exec`` event, its time
limit, a client that goes away (its command ends on the worker), a stopped machine and a
sim worker's refused with why, and direct mode (the worker asked by the client itself)."""

from __future__ import annotations

import os

import anyio
import pytest
from nats.aio.msg import Msg

from bourse.client import BourseClient, ClientError
from bourse.client.execs import Ended
from bourse.nats.connection import flush_all
from bourse.wire.codec import decode
from bourse.wire.messages import Event, ExecRequest, Machine, Placed
from supplier.config import WorkerConfig
from supplier.machines.heartbeat import SCRIPT
from supplier.machines.runner import Runner
from tests.isolation import own_worker_id
from tests.leftovers import processes_with
from tests.market import Market, order, wait_until, worker

P1, S1 = own_worker_id("xp1"), own_worker_id("xs1")
HEARTBEAT = ["{python}", SCRIPT, "web", "--every-s", "5"]


def process_worker() -> WorkerConfig:
    return worker(P1, driver="process", catalog={"web": {"command": HEARTBEAT}})


async def started(buyer: BourseClient, **overrides: object) -> Machine:
    placed = await buyer.place(order(image="web", **overrides))
    assert isinstance(placed, Placed), placed
    return await buyer.machine("start", placed.machine_id)


async def run(
    buyer: BourseClient, machine_id: str, *command: str, **fields: object
) -> tuple[Ended, bytes]:
    out: list[bytes] = []

    async def output(stream: str, data: bytes) -> None:
        out.append(data)

    req = ExecRequest(machine_id=machine_id, command=list(command), **fields)  # type: ignore[arg-type]
    with anyio.fail_after(30):
        ended = await buyer.exec(req, output)
    return ended, b"".join(out)


async def test_a_command_in_a_process_machine_and_its_event(market: Market) -> None:
    """Its user is its machine's, its output comes back, an ``exec`` event names who ran
    what (the first word only); through the exchange and in direct mode alike."""
    await market.host(process_worker())
    await market.exchange()
    buyer = await market.client()
    m = await started(buyer)
    driver = market.hosts[0].workers[P1].driver
    assert isinstance(driver, Runner)
    pid = driver.pid(m.machine_id)
    assert pid is not None
    events: list[Event] = []
    nc = await market.connect("watcher")

    async def took(msg: Msg) -> None:
        events.append(decode(msg.data, Event))

    await nc.subscribe(market.subjects.events(kind="exec"), cb=took)
    await flush_all(nc)
    ended, out = await run(buyer, m.machine_id, "id", "-u", "--secret-argument")
    assert ended.code == 1  # id refuses the argument: the command's own code
    ended, out = await run(buyer, m.machine_id, "id", "-u")
    assert (ended.code, out.decode().strip()) == (0, str(os.stat(f"/proc/{pid}").st_uid))
    await wait_until(lambda: len(events) == 2)
    assert {(e.kind, e.machine_id, e.detail) for e in events} == {
        ("exec", m.machine_id, "exchange: id")
    }
    direct = await market.client(direct=True)
    ended, out = await run(direct, m.machine_id, "sh", "-c", "echo $BOURSE_MACHINE_ID")
    assert (ended.code, out.decode().strip()) == (0, m.machine_id)


async def test_the_time_limit_and_a_client_that_goes_away(market: Market) -> None:
    """A command past its time limit is killed and says so; a client cut short cancels its
    command: nothing of it is left on the worker."""
    await market.host(process_worker())
    await market.exchange()
    buyer = await market.client()
    m = await started(buyer)
    marker = f"BOURSE_MACHINE_ID={m.machine_id}"
    alone = processes_with(marker)
    ended, _ = await run(buyer, m.machine_id, "sleep", "30", timeout_s=1)
    assert (ended.signal, ended.status, ended.detail) == (9, 137, "timeout: 1 s")
    assert processes_with(marker) == alone
    up = anyio.Event()

    async def output(stream: str, data: bytes) -> None:
        up.set()

    req = ExecRequest(machine_id=m.machine_id, command=["sh", "-c", "echo up; exec sleep 30"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(buyer.exec, req, output)
        with anyio.fail_after(30):
            await up.wait()
        assert len(processes_with(marker)) > len(alone)
        tg.cancel_scope.cancel()
    await wait_until(lambda: processes_with(marker) == alone)


async def test_machines_that_cannot_be_entered(market: Market) -> None:
    """A stopped machine, a sim worker's, a machine of another worker's id: each refused
    with why."""
    await market.host(process_worker(), worker(S1))
    await market.exchange()
    buyer = await market.client()
    m = await started(buyer, exclude_workers=[S1])
    await buyer.machine("stop", m.machine_id)
    with pytest.raises(ClientError, match=f"machine {m.machine_id} is stopped: exec needs a"):
        await run(buyer, m.machine_id, "id")
    sim = await started(buyer, exclude_workers=[P1])
    with pytest.raises(ClientError, match=r"runs nothing to enter \(its worker's driver is sim"):
        await run(buyer, sim.machine_id, "id")


async def test_a_terminal_follows_the_clients_size(market: Market) -> None:
    """A size the client sends (ExecResize) is the command's terminal's: the kernel tells
    the command (SIGWINCH), which prints it."""
    await market.host(process_worker())
    await market.exchange()
    buyer = await market.client()
    m = await started(buyer)
    script = 'trap "stty size; exit 0" WINCH; echo ready; while :; do sleep 0.05; done'
    req = ExecRequest(
        machine_id=m.machine_id, command=["sh", "-c", script], tty=True, rows=24, cols=80
    )
    send, sizes = anyio.create_memory_object_stream[tuple[int, int]](1)
    out = b""

    async def output(stream: str, data: bytes) -> None:
        nonlocal out
        out += data
        if b"ready" in out and send.statistics().open_send_streams:  # the trap is set
            await send.send((50, 132))
            await send.aclose()

    with sizes, anyio.fail_after(30):
        ended = await buyer.exec(req, output, None, sizes)
    assert ended.code == 0 and b"50 132" in out, (ended, out)
