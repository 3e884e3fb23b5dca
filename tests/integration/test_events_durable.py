"""Durable events (docs/protocol.md §8.1): the supplier's outbox publishes every event of a
committed change into the JetStream event stream exactly once; a watcher that was away
replays them; a server without JetStream still gets today's at-most-once events."""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import anyio
import pytest
import structlog
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from bourse.client import OVERLOADED_CODE, BourseClient, ClientError
from bourse.client.events import EventFeed, Since, StreamedEvent
from bourse.nats.connection import flush_all
from bourse.nats.embedded import EmbeddedNats
from bourse.nats.jetstream import EVENT_BYTES, EVENTS_PER_ORDER, stream_name
from bourse.runtime.launcher import Program, start_program
from bourse.runtime.metrics import SupplierMetrics
from bourse.wire.codec import decode
from bourse.wire.messages import Event, Placed
from bourse.wire.subjects import Subjects
from tests.market import Market, order, wait_until, worker


async def _collect(feed: EventFeed, n: int, timeout_s: float = 30.0) -> list[StreamedEvent]:
    got: list[StreamedEvent] = []
    with anyio.fail_after(timeout_s):
        async for item in feed:
            got.append(item)
            if len(got) == n:
                break
    return got


async def _place_many(client: BourseClient, region: str, n: int, width: int = 12) -> list[Placed]:
    placed: list[Placed] = []

    async def one(i: int) -> None:
        # On a busy machine an order may be refused (overloaded) or miss its deadline: the
        # same order id again (I3: never a second machine) until it is placed.
        for _ in range(20):
            try:
                r = await client.place(
                    order(region=region, order_id=f"o-{i:05d}", deadline_ms=2000)
                )
            except ClientError as exc:
                if exc.code != OVERLOADED_CODE:
                    raise
                await anyio.sleep(0.05)  # a pause before the retry an overloaded answer asks for
                continue
            if isinstance(r, Placed):
                placed.append(r)
                return
        raise AssertionError(f"order o-{i:05d} not placed after 20 tries: {r}")

    sem = asyncio.Semaphore(width)

    async def bounded(i: int) -> None:
        async with sem:
            await one(i)

    await asyncio.gather(*(bounded(i) for i in range(n)))
    return placed


async def test_watcher_away_during_1000_placements_gets_all_after(market: Market) -> None:
    fleet = [worker(f"mad-{i}", cpus=400, memory_mb=400 * 256) for i in range(3)]
    await market.host(*fleet)
    await market.exchange()
    client = await market.client()
    nc = await market.connect("watcher")

    # The watcher sees the first placements, notes the last sequence, and goes away.
    first = await _place_many(client, "mad", 5)
    async with EventFeed(nc, market.subjects, kind="placed", since=Since()) as feed:
        seen = await _collect(feed, 5)
    assert {e.event.order_id for e in seen} == {p.order_id for p in first}
    last = seen[-1].seq

    burst = [
        p
        for p in await _place_many(client, "mad", 1005)
        if p.order_id not in {f.order_id for f in first}
    ]
    # (order ids o-00000..o-00004 were placed already: I3 answers them with their machine)
    assert len(burst) == 1000

    async with EventFeed(nc, market.subjects, kind="placed", since=Since(seq=last + 1)) as feed:
        back = await _collect(feed, 1000)
    seqs = [e.seq for e in back]
    assert seqs == sorted(seqs) and len(set(seqs)) == 1000  # in order, none twice
    assert sorted(e.event.order_id for e in back) == sorted(p.order_id for p in burst)
    assert {e.event.machine_id for e in back} == {p.machine_id for p in burst}
    assert all(h.events.backlog == 0 for h in market.hosts)


async def test_a_worker_on_a_fresh_data_dir_gets_every_new_event_stored(
    market: Market, tmp_path: Path
) -> None:
    """A fresh data dir starts the outbox's row ids at 1 again: the events' message ids
    must still be new to the stream, or it drops them as duplicates (a live watcher sees
    them, a replay never would)."""
    data_dir = tmp_path / "fresh-1"
    await market.jetstream_init()  # the operator's set-up makes the event stream
    client = await market.client(direct=True)

    async def place(ids: range) -> list[Placed]:
        host = await market.host(worker("fresh-1", images=["web"]), data_dir=data_dir)
        placed = [await client.place(order(order_id=f"f-{i}")) for i in ids]
        assert all(isinstance(p, Placed) for p in placed), placed
        await wait_until(lambda: host.events.published == len(ids))  # all acknowledged
        await market.stop(host)
        market.stores.pop().close()
        return cast(list[Placed], placed)

    placed = await place(range(3))
    shutil.rmtree(data_dir)  # the operator gives the worker a new data dir
    placed += await place(range(3, 6))
    nc = await market.connect("watcher")
    async with EventFeed(nc, market.subjects, kind="placed", since=Since()) as feed:
        replayed = await _collect(feed, 6, timeout_s=5)
    assert [e.event.machine_id for e in replayed] == [p.machine_id for p in placed]


def _oplog_places(db: Path) -> list[str]:
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT machine_id FROM oplog WHERE op = 'place' ORDER BY seq")
        return [r[0] for r in rows]
    finally:
        conn.close()


def _outbox_rows(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("SELECT count(*) FROM outbox").fetchone()[0])
    finally:
        conn.close()


async def test_supplier_killed_mid_burst_publishes_every_committed_event_once(
    market: Market, tmp_path: Path
) -> None:
    data_dir = tmp_path / "k9"
    args = ["run", "--driver", "sim", "--worker-id", "k9-1", "--region", "kil", "--cpus", "4000"]
    args += ["--memory-mb", str(4000 * 256), "--image", "web", "--data-dir", str(data_dir)]
    args += ["--nats", market.url, "--prefix", market.subjects.prefix]

    async def supplier(log: str) -> Program:
        return await start_program(
            "supplier", *args, log_path=tmp_path / log, ready="supplier ready"
        )

    await market.jetstream_init()  # no exchange here to make the event stream
    proc = await supplier("s1.log")
    client = await market.client(direct=True)
    placed = 0
    sem = anyio.Semaphore(40)

    async def one(i: int) -> None:
        nonlocal placed
        try:
            r = await client.place(order(region="kil", order_id=f"k-{i:05d}", deadline_ms=2000))
        except ClientError:
            return  # in flight when the supplier died
        finally:
            sem.release()
        if isinstance(r, Placed):
            placed += 1
            if placed == 150:
                proc.kill9()  # mid-burst: commits and outbox publishes under way

    async with anyio.create_task_group() as tg:
        for i in range(600):
            await sem.acquire()
            tg.start_soon(one, i)
    await proc.proc.wait()

    db = data_dir / "supplier.db"
    committed = _oplog_places(db)
    assert len(committed) >= 150
    proc = await supplier("s2.log")  # republishes what was not acknowledged
    try:
        await wait_until(lambda: _outbox_rows(db) == 0, 20)
        nc = await market.connect("check")
        async with EventFeed(nc, market.subjects, kind="placed", since=Since()) as feed:
            events = await _collect(feed, len(committed))
        info = await nc.jetstream().stream_info(
            stream_name(market.subjects.prefix),
            subjects_filter=market.subjects.events(kind="placed"),
        )
    finally:
        await proc.stop()
    assert sorted(e.event.machine_id for e in events) == sorted(committed)  # every one ...
    assert info.state.messages >= len(committed)
    assert sum((info.state.subjects or {}).values()) == len(committed)  # ... and once


@pytest.fixture
async def core_only(tmp_path: Path, subjects: Subjects) -> AsyncIterator[Market]:
    srv = EmbeddedNats(workdir=tmp_path / "core-nats", jetstream=False).start()
    try:
        async with Market(srv.url, subjects, tmp_path) as m:
            yield m
    finally:
        srv.stop()


async def test_without_jetstream_events_flow_at_most_once_and_it_is_said_once(
    core_only: Market,
) -> None:
    market = core_only
    with structlog.testing.capture_logs() as logs:
        fleet = (worker(f"mad-{i}", cpus=32, memory_mb=32 * 256) for i in (1, 2))
        await market.host(*fleet, jetstream=False)  # the degraded mode: --no-jetstream
        await market.exchange(jetstream=False)
        spy = await market.connect("spy")
        got: list[Event] = []

        async def on_event(msg: Msg) -> None:
            got.append(decode(msg.data, Event))

        await spy.subscribe(market.subjects.events(kind="placed"), cb=on_event)
        await flush_all(spy)
        client = await market.client()
        placed = await _place_many(client, "mad", 20)
        await wait_until(lambda: len(got) == 20)
    assert sorted(e.machine_id for e in got) == sorted(p.machine_id for p in placed)
    warnings = [e for e in logs if e["event"] == "events_at_most_once"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
    assert market.hosts[0].events.durable is False
    with pytest.raises(Exception, match="needs JetStream"):
        async with EventFeed(spy, market.subjects, since=Since()):
            pass


async def _buyer(market: Market, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "buyer_cli",
        *args,
        "--prefix",
        market.subjects.prefix,
        "--nats",
        market.url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_buyer_watch_since_replays_with_stream_sequences(market: Market) -> None:
    await market.host(worker("mad-1"))
    await market.exchange()
    placed = await _place_many(await market.client(), "mad", 3)
    code, out, err = await _buyer(
        market, "watch", "--since", "all", "--kind", "placed", "--json", "--count", "3"
    )
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [e["seq"] for e in lines] == sorted(e["seq"] for e in lines)
    assert all(e["seq"] >= 1 and e["type"] == "Event" for e in lines)
    assert sorted(e["order_id"] for e in lines) == sorted(p.order_id for p in placed)
    # from the second one on: two events
    code, out, err = await _buyer(
        market,
        "watch",
        "--since",
        str(lines[1]["seq"]),
        "--kind",
        "placed",
        "--json",
        "--count",
        "2",
    )
    assert code == 0, err
    assert [json.loads(line)["seq"] for line in out.splitlines()] == [
        lines[1]["seq"],
        lines[2]["seq"],
    ]
    code, _, err = await _buyer(market, "watch", "--since", "yesterday")
    assert code == 1 and "error: --since 'yesterday': expected a stream sequence" in err


def _gauge(metrics: SupplierMetrics, name: str) -> float:
    text, _ = metrics.render()
    [sample] = [
        s
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if s.name == name
    ]
    return sample.value


async def test_events_wait_in_the_outbox_until_the_stream_is_made(market: Market) -> None:
    """A supplier makes no stream: started before any exchange (or the operator's set-up),
    its events wait in its outbox, said once in the log and by a metric, and are stored,
    every one, once the exchange's start has made the stream."""
    metrics = SupplierMetrics()
    with structlog.testing.capture_logs() as logs:
        host = await market.host(worker("mad-1", cpus=64, memory_mb=64 * 256), metrics=metrics)
        client = await market.client(direct=True)
        placed = await _place_many(client, "mad", 5)
        await wait_until(lambda: host.events.stream_missing)
        assert _gauge(metrics, "bourse_event_stream_missing") == 1
        assert host.events.backlog >= 5  # placed, each waiting

        await market.exchange()  # its start makes the stream
        await wait_until(lambda: host.events.backlog == 0, 15)
    assert not host.events.stream_missing and _gauge(metrics, "bourse_event_stream_missing") == 0
    told = ("event_stream_missing", "event_stream_created", "event_stream_found")
    assert [e["event"] for e in logs if e["event"] in told] == list(told)
    nc = await market.connect("watcher")
    async with EventFeed(nc, market.subjects, kind="placed", since=Since()) as feed:
        stored = await _collect(feed, 5)
    assert sorted(e.event.machine_id for e in stored) == sorted(p.machine_id for p in placed)


async def test_a_stored_event_takes_no_more_than_the_sizing_rule_says(market: Market) -> None:
    """EVENT_BYTES (the rule's bytes per event) against the stream's own count: machines
    placed, started, stopped and destroyed on a real supplier."""
    host = await market.host(worker("mad-1", cpus=64, memory_mb=64 * 256))
    await market.jetstream_init()
    client = await market.client(direct=True)
    placed = await _place_many(client, "mad", 20)
    for p in placed:
        for verb in ("start", "stop", "destroy"):
            await client.machine(verb, p.machine_id)
    await wait_until(lambda: host.events.backlog == 0, 15)
    nc = await market.connect("sizer")
    info = await nc.jetstream().stream_info(stream_name(market.subjects.prefix))
    assert info.state.messages >= 20 * EVENTS_PER_ORDER
    assert info.state.bytes / info.state.messages <= EVENT_BYTES
