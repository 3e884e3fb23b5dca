"""A test market on a real nats-server: suppliers (in-process hosts on their own NATS
connections and SQLite files), exchange instances and buyers.

A Market is an async context manager. Its services run exactly as in production: each
one's ``run()`` is a task of ONE task group the market owns, and leaving the ``async with``
cancels that group (every service cleans up as on SIGTERM), then closes what was built.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar

import anyio
import anyio.abc
import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bourse.auction.auctioneer import Auctioneer
from bourse.auction.claims import Claim
from bourse.auction.core import AuctionConfig
from bourse.client import BourseClient
from bourse.nats.connection import connect, flush_all
from bourse.nats.jetstream import EventStream
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Commit, Placed, PlaceOrder, Resources, Unfilled
from bourse.wire.subjects import Subjects
from exchange.service import ExchangeService
from ops.jetstream import set_up
from supplier.config import WorkerConfig
from supplier.host import SupplierHost
from supplier.store import Store

# A deadline for an order whose test is not about time (``order``'s unless a test gives
# one): on a busy machine (the suite twice at once, CPU burners beside it) the hops, the
# auctions and the commit's durable write can take longer than the protocol's default
# 500 ms. It lengthens no order that is placed, nor one nobody offers for.
T = TypeVar("T")

ROOMY_DEADLINE_MS = 10_000
# The same for how long an auction listens for a first offer (the quiet window, 100 ms by
# default; the market's exchanges' and direct buyers' unless a test gives one): a busy
# machine's supplier process answers later than that, and an auction that heard nothing
# then ends no_offers whatever its deadline. It lengthens only the auctions nobody offers
# in (and a retry's gathering).
ROOMY_QUIET_MS = 1000.0


def worker(
    worker_id: str,
    region: str = "mad",
    cpus: int = 8,
    memory_mb: int = 8192,
    **extra: Any,
) -> WorkerConfig:
    raw = {
        "worker_id": worker_id,
        "region": region,
        "capacity": {"cpus": cpus, "memory_mb": memory_mb, **extra.pop("capacity", {})},
        **extra,
    }
    return msgspec.convert(raw, WorkerConfig)


def order(
    region: str = "mad", cpus: int = 1, memory_mb: int = 256, image: str = "web", **kw: Any
) -> PlaceOrder:
    """An order for tests; its deadline ROOMY_DEADLINE_MS unless ``deadline_ms`` is given."""
    kw.setdefault("deadline_ms", ROOMY_DEADLINE_MS)
    return PlaceOrder(
        region=region, resources=Resources(cpus=cpus, memory_mb=memory_mb), image=image, **kw
    )


async def learn_processes(
    client: BourseClient, auctioneer: Auctioneer, region: str, processes: int
) -> None:
    """Orders nobody can fill until ``auctioneer`` (``client``'s own) knows ``processes``
    supplier processes in ``region``. An auction learns who answered it by its end: a placed
    order may end before a second process answers (it commits at its first offer's delay,
    a few ms, while no process is known); one nobody can fill listens for the quiet window,
    and one more is sent in the rare run where even that ended first."""
    for i in range(20):
        probe = await client.place(order(region, cpus=1000, order_id=f"probe-{i}"))
        assert isinstance(probe, Unfilled) and probe.reason == "no_offers", probe
        if len(auctioneer.expected_responders(region)) == processes:
            return
    known = auctioneer.expected_responders(region)
    raise AssertionError(f"{len(known)} of {processes} processes known in {region}")


def alive(pid: int) -> bool:
    """Process ``pid`` runs (not gone, not a zombie waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


# How often wait_until and wait_for look again.
POLL_S = 0.005


async def _attempts(timeout_s: float, failed: Callable[[], str]) -> AsyncIterator[None]:
    """One turn per look, POLL_S apart; AssertionError (``failed()`` says why) once
    ``timeout_s`` passed. The looks are the wait: whatever is waited for has no event of its
    own here (a process's state, another program's answer)."""
    end = time.monotonic() + timeout_s
    while True:
        yield
        if time.monotonic() > end:
            raise AssertionError(failed())
        await asyncio.sleep(POLL_S)  # the pace of looking again, not a synchronisation


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll a condition (not a sleep-as-sync: it returns as soon as the condition holds).
    ``timeout_s`` only bounds a test that is failing: generous, as a busy machine starts a
    machine's process, or answers, seconds later than an idle one."""
    async for _ in _attempts(timeout_s, lambda: "condition not met in time"):
        if predicate():
            return


async def wait_for(
    probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], timeout_s: float = 30.0
) -> T:
    """``probe``'s answer once ``done`` holds for it (a request asked again, as
    :func:`wait_until` polls a condition: it returns as soon as the answer is right)."""
    answer: list[T] = []  # the last one

    def failed() -> str:
        return f"not met in time; the last answer: {answer[0]!r}"

    async for _ in _attempts(timeout_s, failed):
        answer[:] = [await probe()]
        if done(answer[0]):
            return answer[0]
    raise AssertionError("unreachable")  # _attempts ends by raising


class Service(Protocol):
    """What the market runs: ExchangeService and SupplierHost."""

    def run(self, *, task_status: anyio.abc.TaskStatus[None] = ...) -> Awaitable[None]: ...


class Market:
    def __init__(self, url: str, subjects: Subjects, tmp_path: Path) -> None:
        self.url = url
        self.subjects = subjects
        self.tmp_path = tmp_path
        self.conns: list[NATS] = []
        self.hosts: list[SupplierHost] = []
        self.stores: list[Store] = []
        self.exchanges: list[ExchangeService] = []
        self.clients: list[BourseClient] = []
        self._tasks: anyio.abc.TaskGroup | None = None
        self._owner: asyncio.Task[None] | None = None
        self._running: dict[int, tuple[anyio.CancelScope, anyio.Event]] = {}

    async def __aenter__(self) -> Self:
        # One task owns the task group for the market's whole life: pytest-asyncio may run
        # a fixture's set-up and tear-down in different tasks, and a cancel scope must be
        # left in the task that entered it. The owner is awaited in __aexit__.
        ready = anyio.Event()
        self._owner = asyncio.get_running_loop().create_task(self._own(ready))
        await ready.wait()
        return self

    async def _own(self, ready: anyio.Event) -> None:
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            ready.set()
            await anyio.sleep_forever()

    async def serve(self, service: Service) -> None:
        """Run ``service.run()`` in the market's task group; returns once it is serving."""
        assert self._tasks is not None, "use the Market as `async with Market(...)`"
        await self._tasks.start(self._serve, service)

    async def _serve(self, service: Service, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.CancelScope() as scope:
            done = anyio.Event()
            self._running[id(service)] = (scope, done)
            try:
                await service.run(task_status=task_status)
            finally:
                done.set()

    async def stop(self, service: Service) -> None:
        """Stop one service as SIGTERM would (its run() is cancelled and cleans up)."""
        scope, done = self._running[id(service)]
        scope.cancel()
        await done.wait()

    async def connect(self, name: str = "test", **kw: Any) -> NATS:
        nc = await connect(self.url, name=name, service=False, **kw)
        self.conns.append(nc)
        return nc

    async def host(
        self, *workers: WorkerConfig, data_dir: Path | None = None, **options: Any
    ) -> SupplierHost:
        data_dir = data_dir or self.tmp_path / f"supplier-{len(self.hosts)}"
        store = Store(data_dir / "supplier.db")
        self.stores.append(store)
        host = SupplierHost(
            await self.connect("supplier"), list(workers), store, self.subjects, **options
        )
        await self.serve(host)
        self.hosts.append(host)
        return host

    async def exchange(self, jetstream: bool = True, **auction: Any) -> ExchangeService:
        """An exchange whose auctions have the config ``auction`` says (ROOMY_QUIET_MS for
        a quiet window it does not give)."""
        auction.setdefault("quiet_ms", ROOMY_QUIET_MS)
        svc = ExchangeService(
            await self.connect("exchange"),
            self.subjects,
            auction=AuctionConfig(**auction),
            jetstream=jetstream,
        )
        await self.serve(svc)
        self.exchanges.append(svc)
        return svc

    async def client(
        self, direct: bool = False, claims: bool = True, **auction: Any
    ) -> BourseClient:
        """A buyer; ``direct``: it runs the auctions itself, with the config ``auction``
        says (ROOMY_QUIET_MS for a quiet window it does not give)."""
        auction.setdefault("quiet_ms", ROOMY_QUIET_MS)
        c = BourseClient(
            await self.connect("buyer"),
            self.subjects,
            direct=direct,
            auction=AuctionConfig(**auction),
            claims=claims,
        )
        self.clients.append(c)
        return c

    async def jetstream_init(self) -> None:
        """The operator's set-up (``bourse jetstream init``): the market's streams and
        buckets, for a market whose events must be stored before an exchange starts."""
        nc = await self.connect("operator")
        await set_up(nc, self.subjects, EventStream.of(self.subjects), replicas=1)

    def violations(self) -> list[str]:
        return [v for h in self.hosts for v in h.check_invariants()]

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the clients, stop every service (all at once, each as on SIGTERM), then
        close the connections and stores. A service that failed raises here."""
        try:
            for c in self.clients:
                await c.close()
            if self._tasks is not None:
                self._tasks.cancel_scope.cancel()
            if self._owner is not None:
                await self._owner
        finally:
            for nc in self.conns:
                # close, not drain: a test's sync subscription may hold unread messages, and
                # drain would wait its 30 s timeout for them (graceful drain is tested on
                # the real processes in test_processes.py and test_signals.py).
                if not nc.is_closed:
                    await nc.close()
            for s in self.stores:
                s.close()


async def collect(nc: NATS, subject: str) -> list[Msg]:
    """Every message on ``subject`` from now on, in arrival order (the subscription is in
    place at the server when this returns)."""
    seen: list[Msg] = []

    async def keep(msg: Msg) -> None:
        seen.append(msg)

    await nc.subscribe(subject, cb=keep)
    await flush_all(nc)
    return seen


async def outcome_trail(
    sub: Subscription, bucket: str, release: str, answer_to: str = ""
) -> tuple[list[str], bytes]:
    """What a subscription to everything (``>``) saw of an order's end, in the order the
    server delivered it, up to the region ``release`` (and the answer on ``answer_to``,
    when given): the claim writes in ``bucket`` by state, "ack" for the acknowledgement of
    the ``placed`` write, "release", "answer"; and the answer's data."""
    seen: list[str] = []
    ack_to = ""
    answer = b""
    while "release" not in seen or (answer_to and "answer" not in seen):
        m = await sub.next_msg(5)
        if m.subject.startswith(f"$KV.{bucket}."):
            seen.append(msgspec.json.decode(m.data, type=Claim).state)
            if seen[-1] == "placed":
                ack_to = m.reply
        elif ack_to and m.subject == ack_to:
            seen.append("ack")
        elif m.subject == release:
            seen.append("release")
        elif answer_to and m.subject == answer_to:
            seen.append("answer")
            answer = m.data
    return seen, answer


def placed_for(c: Commit, machine_id: str, score: float, image_cached: bool = False) -> Placed:
    """A raw supplier's ``Placed`` answer to commit ``c`` (in region mad), in tests."""
    return Placed(
        order_id=c.order_id,
        machine_id=machine_id,
        worker_id=c.worker_id,
        region="mad",
        score=score,
        image_cached=image_cached,
        elapsed_ms=1.0,
    )


async def answer_commits(nc: NATS, subjects: Subjects, *worker_ids: str, score: float) -> None:
    """A raw supplier's commit side (an older or foreign one, in tests): every commit to
    ``worker_ids`` is answered Placed at once."""

    async def on_commit(msg: Msg) -> None:
        c = decode(msg.data, Commit)
        placed = placed_for(c, f"{c.worker_id}~01M80QESDH2NAZQ4Z9ASNWXSKR", score)
        await nc.publish(msg.reply, encode(placed))

    for w in worker_ids:
        await nc.subscribe(subjects.commit(w), cb=on_commit)
