"""Real supplier and exchange processes for the property tests, driven from synchronous
hypothesis tests through an asyncio loop in a background thread (one NATS connection).

The market (tests/property/strategies.py): a supplier process hosting two workers of region
``REGION`` in two bid shards (``--bid-shards``), and one exchange process, on the session's
nats-server under a prefix of their own. At start-up one machine is placed on W1, so bad
requests also aim at a machine that exists (``MID`` in a payload is replaced by its id).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client as NATS

from bourse.nats.connection import connect
from bourse.runtime.launcher import Program, start_program
from bourse.wire.codec import decode, encode
from bourse.wire.messages import (
    Error,
    ListMachines,
    Machine,
    MachineList,
    MachineRequest,
    OrderReply,
    Placed,
    PlaceOrder,
    Resources,
    StatusRequest,
    WorkerStatus,
)
from tests.property.strategies import (
    BID_SHARDS,
    CAPACITY,
    LABELS,
    MID,
    PREFIX,
    REGION,
    SETUP_ORDER,
    SUBJECTS,
    W1,
    W2,
    WORKERS,
    Case,
)

T = TypeVar("T")
REPLY_TIMEOUT_S = 5.0

FLEET = "\n".join(
    f"""
[[worker]]
worker_id = "{w}"
region = "{REGION}"
capacity = {{ cpus = {CAPACITY["cpus"]}, memory_mb = {CAPACITY["memory_mb"]}, \
disk_mb = {CAPACITY["disk_mb"]}, gpus = {CAPACITY["gpus"]} }}
labels = {{ {", ".join(f'{k} = "{v}"' for k, v in LABELS.items())} }}
images = ["web"]
"""
    for w in WORKERS
)

# One reply-or-not per case: the raw reply, or why there is none.
# A log line of an unexpected exception: a handler that crashed, a task that died.
_FAILURE = re.compile(r"""\bevent=['"]?(handler_failed|task_failed)\b""")
NO_REPLY = "no reply expected"
TIMEOUT = "timeout"
NO_RESPONDERS = "no responders"


class Harness:
    def __init__(self, nats_url: str, workdir: Path) -> None:
        self.url = nats_url
        self.workdir = workdir
        self.subjects = SUBJECTS
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.procs: list[Program] = []
        self.nc: NATS | None = None
        self.machine_id = ""
        self.sent = 0  # cases sent, for the report

    # -- the loop ---------------------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self) -> Harness:
        self.run(self._start())
        return self

    async def _start(self) -> None:
        fleet = self.workdir / "fleet.toml"
        fleet.write_text(FLEET)
        common = ("--nats", self.url, "--prefix", PREFIX)
        self.supplier = await start_program(
            "supplier",
            "run",
            "--fleet",
            str(fleet),
            "--data-dir",
            str(self.workdir / "supplier"),
            "--bid-shards",
            str(BID_SHARDS),
            *common,
            log_path=self.workdir / "supplier.log",
            ready="supplier ready",
        )
        self.procs.append(self.supplier)
        self.exchange = await start_program(
            "exchange",
            "serve",
            *common,
            log_path=self.workdir / "exchange.log",
            ready="exchange ready",
        )
        self.procs.append(self.exchange)
        self.nc = await connect(self.url, name="property-tests", service=False)
        placed = await self.place(order_id=SETUP_ORDER, exclude_workers=[W2])
        assert isinstance(placed, Placed) and placed.worker_id == W1, placed
        self.machine_id = placed.machine_id
        assert len(self.machine_id) == len(MID)

    def close(self) -> None:
        self.run(self._close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _close(self) -> None:
        if self.nc is not None:
            await self.nc.close()
        for p in reversed(self.procs):
            await p.stop()

    # -- what the tests look at -------------------------------------------------------------
    def alive(self) -> dict[str, int | None]:
        """Exit codes of the processes (None: still running)."""

        async def codes() -> dict[str, int | None]:
            return {p.name: p.proc.returncode for p in self.procs}

        return self.run(codes())

    def failures_logged(self) -> list[str]:
        """Log lines of unexpected exceptions (a handler that crashed, a task that died)."""
        # the event name, not any mention: a generated subject may spell one of them (a
        # refused "machine.handler_failed" request is logged with its subject)
        return [
            line
            for p in self.procs
            for line in p.log.splitlines()
            if _FAILURE.search(line) or line.startswith("Traceback")
        ]

    # -- sending ----------------------------------------------------------------------------
    def with_machine_id(self, payload: bytes) -> bytes:
        return payload.replace(MID.encode(), self.machine_id.encode())

    async def send(self, case: Case) -> bytes | str:
        assert self.nc is not None
        data = self.with_machine_id(case.payload)
        if not case.reply:
            await self.nc.publish(case.subject, data)
            return NO_REPLY
        try:
            msg = await self.nc.request(case.subject, data, timeout=REPLY_TIMEOUT_S)
        except nats.errors.NoRespondersError:
            return NO_RESPONDERS
        except nats.errors.TimeoutError:
            return TIMEOUT
        return msg.data

    async def send_all(self, cases: Sequence[Case]) -> list[bytes | str]:
        """Send a batch at once (concurrently), then a barrier on every subscription that
        was sent something without a reply: per subscription a process handles messages in
        order, so once the barrier is answered the publishes before it were handled."""
        self.sent += len(cases)
        out = await asyncio.gather(*(self.send(c) for c in cases))
        await self.barrier({c.subject for c in cases if not c.reply})
        return list(out)

    async def barrier(self, subjects: set[str]) -> None:
        assert self.nc is not None
        s = self.subjects
        for subject in subjects:
            if subject.startswith(f"{s.root}.worker."):
                wid = subject.split(".")[s.root_tokens + 1]
                subject = s.worker_machine(wid, "list")  # the same subscription (worker.<id>.>)
                body = b""
            else:
                body = b"\x00"  # bad everywhere: answered with an Error by whoever listens
            reply = await self.nc.request(subject, body, timeout=REPLY_TIMEOUT_S)
            assert reply.data, subject

    def send_batch(self, cases: Sequence[Case]) -> list[bytes | str]:
        return self.run(self.send_all(cases))

    # -- market state -----------------------------------------------------------------------
    async def gather(self, subject: str, body: bytes, count: int) -> list[bytes]:
        """Scatter-gather: exactly ``count`` replies expected (we know how many workers)."""
        assert self.nc is not None
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            await self.nc.publish(subject, body, reply=inbox)
            return [(await sub.next_msg(REPLY_TIMEOUT_S)).data for _ in range(count)]
        finally:
            await sub.unsubscribe()

    async def status(self) -> dict[str, WorkerStatus]:
        replies = await self.gather(
            self.subjects.status(REGION), encode(StatusRequest()), len(WORKERS)
        )
        out = {}
        for data in replies:
            st = decode(data, WorkerStatus)
            out[st.worker_id] = st
        assert sorted(out) == sorted(WORKERS), out
        return out

    async def machines(self, worker_id: str) -> list[Machine]:
        """The worker's live machines (destroyed ones cannot change any more; and listing
        all of them would grow without bound over a session: see the report on paging)."""
        assert self.nc is not None
        msg = await self.nc.request(
            self.subjects.worker_machine(worker_id, "list"),
            encode(ListMachines(include_destroyed=False)),
            timeout=REPLY_TIMEOUT_S,
        )
        return decode(msg.data, MachineList).machines

    async def machine(self, machine_id: str) -> Machine | Error:
        assert self.nc is not None
        wid = machine_id.split("~")[0]
        msg = await self.nc.request(
            self.subjects.worker_machine(wid, "get"),
            encode(MachineRequest(machine_id=machine_id)),
            timeout=REPLY_TIMEOUT_S,
        )
        return decode(msg.data, Machine | Error)

    async def _snapshot(self) -> dict[str, Any]:
        """Everything a bad message could change on the supplier: per worker its status
        (committed, held, holds, machines, draining, images, …) and every machine."""
        out: dict[str, Any] = {}
        for wid, st in (await self.status()).items():
            out[wid] = {
                "status": msgspec.to_builtins(st),
                "machines": sorted(
                    (msgspec.to_builtins(m) for m in await self.machines(wid)),
                    key=lambda m: m["machine_id"],
                ),
            }
        return out

    def snapshot(self) -> dict[str, Any]:
        return self.run(self._snapshot())

    async def place(self, **kw: Any) -> Placed | Any:
        """A plain valid order through the exchange process."""
        assert self.nc is not None
        order = PlaceOrder(
            region=REGION, resources=Resources(cpus=1, memory_mb=64), image="web", **kw
        )
        msg = await self.nc.request(
            self.subjects.order(REGION), encode(order), timeout=order.deadline_ms / 1000 + 5
        )
        return decode(msg.data, OrderReply)

    async def machine_verb(self, verb: str, machine_id: str) -> Machine | Error:
        assert self.nc is not None
        msg = await self.nc.request(
            self.subjects.machine(verb),
            encode(MachineRequest(machine_id=machine_id)),
            timeout=REPLY_TIMEOUT_S,
        )
        return decode(msg.data, Machine | Error)

    def still_serves(self) -> Placed:
        """A valid order still places (then its machine is destroyed, capacity back)."""

        async def go() -> Placed:
            placed = await self.place()
            assert isinstance(placed, Placed), placed
            gone = await self.machine_verb("destroy", placed.machine_id)
            assert isinstance(gone, Machine) and gone.state == "destroyed", gone
            return placed

        return self.run(go())


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert after == before, msgspec.json.format(msgspec.json.encode([before, after])).decode()


def assert_still_serving(harness: Harness) -> None:
    assert harness.alive() == {"supplier": None, "exchange": None}
    assert harness.failures_logged() == [], harness.failures_logged()[:5]
    harness.still_serves()
