"""A supplier's rows in the state stream (docs/protocol.md §4.21, supplier/rows.py), on a
real nats-server: a machine's row after each change, its worker's row, one heartbeat for the
process naming its workers; a destroyed machine's row leaves by its TTL; every row again
after the stream was purged; a supplier that could not publish keeps its machines and
catches up with their current rows; the stream's epoch, written once by its makers."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import anyio
import nats.js.errors
from nats.aio.client import Client as NATS

from bourse.nats.state import (
    HEADER_TTL,
    RETENTION_S,
    StateStream,
    make_state_stream,
    state_stream_name,
    write_epoch,
)
from bourse.runtime.metrics import SupplierMetrics
from bourse.wire.codec import decode
from bourse.wire.messages import Heartbeat, StateEpoch, WorkerRow
from bourse.wire.subjects import Subjects
from tests.integration.test_events_durable import _gauge
from tests.market import Market, order, wait_until, worker
from tests.views import published


async def last(nc: NATS, subjects: Subjects, subject: str) -> nats.aio.msg.Msg | None:
    try:
        return await nc.jetstream().get_last_msg(state_stream_name(subjects.prefix), subject)
    except nats.js.errors.NotFoundError:
        return None


async def worker_row(
    nc: NATS, subjects: Subjects, wid: str, holds: Callable[[WorkerRow], bool]
) -> WorkerRow:
    """The worker's row once the stream holds one for which ``holds`` (each look a round
    trip to the server)."""
    end = time.monotonic() + 5.0
    while time.monotonic() < end:
        got = await last(nc, subjects, subjects.state_worker("mad", wid))
        if got is not None and holds(row := decode(got.data, WorkerRow)):
            return row
    raise AssertionError(f"no such row of worker {wid} in 5 s")


async def test_a_machine_its_worker_and_the_process_have_their_rows(
    market: Market, subjects: Subjects
) -> None:
    await market.exchange()
    await market.host(worker("mad-1"), worker("mad-2", cpus=4))
    nc = await market.connect("reader")
    c = await market.client()
    placed = await c.place(order(cpus=2))
    m = await c.machine("get", placed.machine_id)
    row = await published(nc, subjects, m.machine_id, "reserved")
    assert row == m  # the row is the machine as its worker answers machine.get

    started = await c.machine("start", m.machine_id)
    assert (
        await published(nc, subjects, m.machine_id, "started")
    ).updated_at_ms == started.updated_at_ms

    # its worker's row, at its next heartbeat: 2 of its 8 cpus committed
    wrow = await worker_row(nc, subjects, placed.worker_id, lambda w: w.free.cpus == 6)
    assert (wrow.region, wrow.capacity.cpus, wrow.machines) == ("mad", 8, 1)
    said = {w.worker_id: w for w in await c.status("mad")}[wrow.worker_id]
    assert wrow.isolation == said.isolation != ""  # as its status says it
    beat = await last(nc, subjects, subjects.state_beat("mad", wrow.beat))
    assert beat is not None
    hb = decode(beat.data, Heartbeat)
    assert hb.workers == ["mad-1", "mad-2"] and hb.beat == "mad-1"
    assert beat.headers is not None and beat.headers[HEADER_TTL] == str(RETENTION_S)

    await c.machine("destroy", m.machine_id)
    await published(nc, subjects, m.machine_id, "destroyed")
    got = await last(nc, subjects, subjects.state_machine("_", "mad", m.worker_id, m.machine_id))
    assert got is not None and got.headers is not None
    assert 0 < int(got.headers[HEADER_TTL]) <= RETENTION_S  # it leaves after the window


async def test_every_row_comes_back_after_the_stream_is_purged(
    market: Market, subjects: Subjects
) -> None:
    await market.exchange()
    await market.host(worker("mad-1"))
    nc = await market.connect("reader")
    c = await market.client()
    m = await c.machine("get", (await c.place(order())).machine_id)
    await published(nc, subjects, m.machine_id, "reserved")
    await nc.jetstream().purge_stream(state_stream_name(subjects.prefix))
    # the next heartbeat finds the one before it gone and sends every row again
    await published(nc, subjects, m.machine_id, "reserved", timeout_s=5.0)
    assert await last(nc, subjects, subjects.state_worker("mad", "mad-1")) is not None


async def test_a_supplier_that_cannot_publish_catches_up_with_current_rows(
    market: Market, subjects: Subjects, tmp_path: Path
) -> None:
    """No stream takes the rows (deleted under the supplier): its machines go on, their
    changes wait, and once the stream is made again the current rows are there."""
    await market.exchange()
    metrics = SupplierMetrics()
    host = await market.host(worker("mad-1"), metrics=metrics)
    nc = await market.connect("reader")
    c = await market.client()
    m = await c.machine("get", (await c.place(order())).machine_id)
    await published(nc, subjects, m.machine_id, "reserved")
    js = nc.jetstream()
    await js.delete_stream(state_stream_name(subjects.prefix))
    assert (await c.machine("start", m.machine_id)).state == "started"  # it keeps going
    await wait_until(lambda: host.rows is not None and host.rows.stream_missing)
    assert _gauge(metrics, "bourse_state_stream_missing") == 1  # what an operator alerts on
    await js.add_stream(StateStream.of(subjects).config())
    row = await published(nc, subjects, m.machine_id, "started", timeout_s=10.0)
    assert row == await c.machine("get", m.machine_id)
    await wait_until(lambda: _gauge(metrics, "bourse_state_stream_missing") == 0)


async def test_the_streams_epoch_is_written_once_by_whoever_makes_it(
    market: Market, subjects: Subjects
) -> None:
    """The exchange's start writes it; a maker finding one leaves it; of makers at once on a
    stream without one (purged), one writes it; it has no TTL."""
    await market.exchange()
    nc = await market.connect("reader")
    stream = StateStream.of(subjects)
    first = await last(nc, subjects, subjects.state_epoch)
    assert first is not None and HEADER_TTL not in (first.headers or {})
    epoch = decode(first.data, StateEpoch).epoch
    assert not await make_state_stream(nc.jetstream(), stream)  # there: neither made nor written
    assert await write_epoch(nc.jetstream(), stream) == ""
    again = await last(nc, subjects, subjects.state_epoch)
    assert again is not None and (again.seq, again.data) == (first.seq, first.data)

    await nc.jetstream().purge_stream(stream.name)
    makers = [await market.connect(f"maker-{n}") for n in range(4)]
    written: list[str] = []

    async def make(conn: NATS) -> None:
        written.append(await write_epoch(conn.jetstream(), stream))

    async with anyio.create_task_group() as tg:
        for conn in makers:
            tg.start_soon(make, conn)
    assert len([e for e in written if e]) == 1 and written.count("") == 3
    now = await last(nc, subjects, subjects.state_epoch)
    assert now is not None and decode(now.data, StateEpoch).epoch == max(written) != epoch
