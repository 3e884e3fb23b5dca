"""Commands kept for a worker that was away (docs/protocol.md §4.20, I9): a stop or destroy
asked while the worker does not answer is kept in the command stream and applied by the
worker when it is back, before it resumes its machines; after a partition too; a command
naming another worker's machine is dropped."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from nats.aio.msg import Msg

from bourse.client import BourseClient
from bourse.client.policy import failover
from bourse.nats.commands import (
    CommandNotKept,
    CommandStream,
    command_for,
    command_stream_name,
    keep,
    make_command_stream,
    probe_or_keep,
)
from bourse.nats.connection import connect
from bourse.wire.codec import decode
from bourse.wire.messages import Event, Machine, MachineCommand, Placed
from supplier.host import SupplierHost
from supplier.store import Store
from tests.market import Market, collect, order, wait_until, worker
from tests.topology.programs import supplier


async def _started(client: BourseClient, region: str = "mad", **kw: object) -> Placed:
    placed = await client.place(order(region=region, **kw))  # type: ignore[arg-type]
    assert isinstance(placed, Placed), placed
    assert (await client.machine("start", placed.machine_id)).state == "started"
    return placed


def _events(seen: list[Msg], machine_id: str) -> list[tuple[str, str]]:
    out = []
    for msg in seen:
        e = decode(msg.data, Event)
        if e.machine_id == machine_id:
            out.append((e.kind, e.detail))
    return out


async def _kept(market: Market) -> int:
    js = (await market.connect("inspect")).jetstream()
    info = await js.stream_info(command_stream_name(market.subjects.prefix))
    return info.state.messages


async def _host(market: Market, data_dir: Path, url: str | None = None) -> SupplierHost:
    """A supplier of worker k1 on ``data_dir`` (its store), connected to ``url``."""
    if url is None:
        return await market.host(worker("k1"), data_dir=data_dir)
    nc = await connect(url, name="supplier", service=True)  # reconnects as a daemon
    market.conns.append(nc)
    store = Store(data_dir / "supplier.db")
    host = SupplierHost(nc, [worker("k1")], store, market.subjects)
    market.stores.append(store)
    await market.serve(host)
    market.hosts.append(host)
    return host


async def test_probe_or_keep_keeps_a_command_only_for_a_worker_that_does_not_answer(
    market: Market,
) -> None:
    """The one probe-else-keep (the exchange's queue_if_away and a direct buyer's): the
    worker's answer to a get when it answers; else the command kept for it."""
    nc = await market.connect("keeper")
    s = market.subjects
    away = "k9~01J00000000000000000000000"
    await make_command_stream(nc.jetstream(), CommandStream.of(s))
    kept = await probe_or_keep(nc, s, "destroy", away, "operator")
    assert isinstance(kept, MachineCommand)
    assert (kept.worker_id, kept.machine_id, kept.verb, kept.requested_by) == (
        "k9",
        away,
        "destroy",
        "operator",
    )
    assert await _kept(market) == 1

    await market.host(worker("k1"))
    placed = await (await market.client(direct=True)).place(order())
    assert isinstance(placed, Placed)
    shown = await probe_or_keep(nc, s, "stop", placed.machine_id, "operator")
    assert isinstance(shown, bytes)
    assert decode(shown, Machine).machine_id == placed.machine_id
    assert await _kept(market) == 1  # the worker answered: nothing more kept


async def test_a_stop_kept_while_the_worker_was_down_is_applied_before_it_resumes(
    market: Market, tmp_path: Path
) -> None:
    await market.exchange()
    data_dir = tmp_path / "k1"
    host = await _host(market, data_dir)
    client = await market.client()
    replaced = await _started(client)
    control = await _started(client)  # no command for it: it is resumed as always
    await market.stop(host)
    await host.nc.close()

    got = await client.machine_or_kept("stop", replaced.machine_id)
    assert isinstance(got, MachineCommand)
    assert (got.worker_id, got.verb, got.requested_by) == ("k1", "stop", "exchange")
    assert await _kept(market) == 1

    watcher = await market.connect("watcher")
    seen = await collect(watcher, market.subjects.event("mad", "k1", "*"))
    await _host(market, data_dir)  # the worker is back
    await wait_until(lambda: ("started", "resumed") in _events(seen, control.machine_id))
    trail = _events(seen, replaced.machine_id)
    # stopped by the command before the start-up resumed anything; never started again
    assert [k for k, _ in trail] == ["stopped", "command"], trail
    assert trail[1][1] == "stop applied (exchange: stop asked while worker k1 did not answer)"
    assert (await client.machine("get", replaced.machine_id)).state == "stopped"
    assert await _kept(market) == 0  # acknowledged: gone from the stream


async def test_a_command_that_comes_while_the_worker_runs_is_applied_at_once(
    market: Market,
) -> None:
    # the suppliers start before the command stream is made (by the exchange): they open
    # their consumers once it is there
    await market.host(worker("k1"))
    await market.host(worker("k2"))
    await market.exchange()
    client = await market.client()
    mine = await _started(client, exclude_workers=["k2"])
    theirs = await _started(client, exclude_workers=["k1"])
    watcher = await market.connect("watcher")
    seen = await collect(watcher, market.subjects.event("mad", "*", "*"))
    js = watcher.jetstream()

    # a command on k1's subject that names k2's machine: k1 drops it, k2's machine runs on
    forged = command_for("destroy", theirs.machine_id, "operator")
    forged = MachineCommand(**{**_fields(forged), "worker_id": "k1"})
    await keep(js, market.subjects, forged)
    await wait_until(lambda: any(k == "command" for k, _ in _events(seen, theirs.machine_id)))
    assert _events(seen, theirs.machine_id) == [
        ("command", f"destroy dropped: names worker k1's machine {theirs.machine_id}, not k1's")
    ]
    assert (await client.machine("get", theirs.machine_id)).state == "started"

    # the operator's destroy of k1's machine, while k1 runs: applied at once
    await keep(js, market.subjects, command_for("destroy", mine.machine_id, "operator"))
    await wait_until(lambda: len(_events(seen, mine.machine_id)) == 2)
    assert [k for k, _ in _events(seen, mine.machine_id)] == ["destroyed", "command"]
    # again (the stream keeps one copy of one id; a new id is a new command): nothing to do
    await keep(js, market.subjects, command_for("destroy", mine.machine_id, "operator"))
    await wait_until(lambda: len(_events(seen, mine.machine_id)) == 3)
    assert _events(seen, mine.machine_id)[2] == (
        "command",
        f"destroy: nothing to do (no live machine {mine.machine_id} here)",
    )
    await wait_until(lambda: market.hosts[0].commands.counts["drop"] == 1)
    assert await _kept(market) == 0


def _fields(m: MachineCommand) -> dict[str, object]:
    return {f: getattr(m, f) for f in m.__struct_fields__}


class Link:
    """A TCP proxy to a server: every connection through it can be cut at once (and new
    ones refused) until it is healed: a partition of the connections that use it."""

    def __init__(self) -> None:
        self.up = True
        self.pipes: set[asyncio.StreamWriter] = set()
        self.every: list[asyncio.StreamWriter] = []  # every end opened, to be waited for
        self.tasks: set[asyncio.Task[None]] = set()

    def cut(self) -> None:
        self.up = False
        for w in self.pipes:
            w.close()
        self.pipes.clear()

    def heal(self) -> None:
        self.up = True

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    async def _serve(self, target: str, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.every.append(cw)
        if not self.up:
            cw.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        t = urlsplit(target)
        sr, sw = await asyncio.open_connection(t.hostname, t.port)
        self.every.append(sw)
        self.pipes.update((cw, sw))
        await asyncio.gather(self._pump(cr, sw), self._pump(sr, cw))

    async def close(self) -> None:
        """Cut every connection, end its pumps, and wait until every end is closed."""
        self.cut()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for w in self.every:
            w.close()
            with contextlib.suppress(ConnectionError, OSError):
                await w.wait_closed()


@asynccontextmanager
async def _proxy(target: str) -> AsyncIterator[tuple[str, Link]]:
    """A :class:`Link` to the server at ``target``, and its URL."""
    link = Link()
    server = await asyncio.start_server(lambda r, w: link._serve(target, r, w), "127.0.0.1", 0)
    try:
        yield f"nats://127.0.0.1:{server.sockets[0].getsockname()[1]}", link
    finally:
        server.close()
        await link.close()
        await server.wait_closed()


# A connection cut under a client leaves one of the cut connection's stream writers to the
# garbage collector (closed, and collected before its close completed): a ResourceWarning
# from asyncio that says nothing about what is tested here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_stop_kept_during_a_partition_is_applied_when_the_worker_is_back(
    market: Market, tmp_path: Path
) -> None:
    await market.exchange()
    client = await market.client()
    async with _proxy(market.url) as (url, link):
        host = await _host(market, tmp_path / "k1", url)
        placed = await _started(client)
        link.cut()  # the partition: the supplier's connection is cut, and stays cut
        await wait_until(lambda: not host.nc.is_connected)
        got = await client.machine_or_kept("stop", placed.machine_id)
        assert isinstance(got, MachineCommand) and got.worker_id == "k1"
        assert await _kept(market) == 1
        link.heal()  # the partition heals: the supplier reconnects by itself
        await wait_until(lambda: host.nc.is_connected, 10)
        await wait_until(
            lambda: host.workers["k1"].machines[placed.machine_id].state == "stopped", 15
        )
        shown = await client.machine("get", placed.machine_id)
        assert isinstance(shown, Machine) and shown.state == "stopped"
        assert await _kept(market) == 0
        await market.stop(host)  # before the link goes


async def test_failover_queues_the_stop_and_the_returning_worker_never_resumes_the_primary(
    market: Market, tmp_path: Path
) -> None:
    """The worker of an app's primary is a real supplier process, killed with -9; failover
    starts the spare and queues the primary's stop; the worker started again stops the old
    primary before it would resume it: two primaries never run."""
    await market.exchange()
    await market.host(worker("s1", images=["web"]), worker("s2", images=["web"]))
    client = await market.client()
    root = tmp_path / "programs"
    proc = await supplier([market.url], market.subjects.prefix, root, "p1", "mad", 2)
    try:
        app = {"app": "api", "slot": "0"}
        watcher = await market.connect("watcher")
        seen = await collect(watcher, market.subjects.event("mad", "p1", "*"))
        # a deadline that a loaded machine meets: the test is about what follows
        primary = await _started(
            client,
            image="web",
            deadline_ms=3000,
            exclude_workers=["s1", "s2"],
            metadata={**app, "role": "primary"},
        )
        spare = await client.place(
            order(
                image="web",
                deadline_ms=3000,
                exclude_workers=["p1", "s2"],
                metadata={**app, "role": "spare"},
            )
        )
        assert isinstance(spare, Placed) and primary.worker_id == "p1"
        await wait_until(lambda: ("started", "") in _events(seen, primary.machine_id), 10)

        proc.kill9()  # the primary's worker is gone, its machine recorded as started
        await proc.proc.wait()
        done = await failover(
            client, app="api", regions=["mad"], machine_id=primary.machine_id, deadline_ms=3000
        )
        assert done.started.machine_id == spare.machine_id and done.started.state == "started"
        assert done.queued is not None and done.queued.worker_id == "p1"
        assert await _kept(market) == 1

        proc = await supplier([market.url], market.subjects.prefix, root, "p1", "mad", 2)

        # The kept stop was applied at the start, and nothing started it again. (The old
        # start's event may come once more: a kill -9 can beat the outbox's delete of its
        # row, and the restarted outbox sends it again, which the event stream drops but a
        # plain subscriber sees. A start by the restarted worker would say "resumed".)
        def since_restart() -> list[str]:
            trail = _events(seen, primary.machine_id)
            return [
                k for k, d in trail[trail.index(("started", "")) + 1 :] if (k, d) != ("started", "")
            ]

        await wait_until(lambda: len(since_restart()) >= 2, 10)
        assert since_restart() == ["stopped", "command"]
        assert (await client.machine("get", primary.machine_id)).state == "stopped"
        assert await _kept(market) == 0
    finally:
        await proc.stop()


async def test_a_command_for_a_market_without_its_command_stream_says_so(market: Market) -> None:
    """No command stream (nobody ran bourse jetstream init, no exchange made it): the keep
    is refused with the one line that says what to do, whichever error nats-py raises."""
    nc = await market.connect("keeper")
    away = "k9~01J00000000000000000000000"
    with pytest.raises(CommandNotKept, match=r"the command stream is not there \(bourse jetstream"):
        await probe_or_keep(nc, market.subjects, "stop", away, "operator")
