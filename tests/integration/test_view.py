"""The view (bourse/view) on a real market: built from the state stream, followed, resumed
from its last sequence, rebuilt when it was away too long or the stream was made again;
workers gone and their machines unknown; forged rows dropped and counted; it survives the
stream being purged and the nats-server restarting; two views agree once writes stop."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec

from bourse.nats.embedded import EmbeddedNats
from bourse.nats.state import RETENTION_S, StateStream, make_state_stream, state_stream_name
from bourse.view import View, open_view
from bourse.view.rows import FOREIGN, MALFORMED
from bourse.wire.codec import encode
from bourse.wire.messages import now_ms
from bourse.wire.subjects import Subjects
from supplier.host import SupplierHost
from supplier.store import Store
from tests.market import Market, order, wait_until, worker
from tests.views import published


def rows(view: View, sql: str) -> list[tuple[object, ...]]:
    return view.db.db.execute(sql).fetchall()


def states(view: View) -> dict[str, str]:
    return dict(rows(view, "SELECT machine_id, state FROM machines"))


async def until(view: View, holds: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Follow the view until ``holds()`` (checked after each batch it applies)."""
    if holds():
        return
    with anyio.fail_after(timeout_s):
        async for _ in view.follow():
            if holds():
                return


async def test_built_followed_and_resumed_from_its_last_sequence(
    market: Market, subjects: Subjects, tmp_path: Path
) -> None:
    await market.exchange()
    await market.host(worker("mad-1"), worker("fra-1", region="fra"))
    c = await market.client()
    nc = await market.connect("view")
    first = await c.place(order())
    await published(nc, subjects, first.machine_id, "reserved")
    path = tmp_path / "view.sqlite"
    async with open_view(nc, subjects, path) as view:
        assert states(view) == {first.machine_id: "reserved"}
        assert rows(view, "SELECT worker_id, gone_since_ms FROM workers ORDER BY 1") == [
            ("fra-1", None),
            ("mad-1", None),
        ]
        f = view.freshness()
        assert f.seq > 0 and f.age_ms < 1000 and str(f).startswith(f"as of seq {f.seq}, ")
        await c.machine("start", first.machine_id)
        await until(view, lambda: states(view)[first.machine_id] == "started")
        seq = view.freshness().seq

    second = await c.place(order(region="fra"))
    await published(nc, subjects, second.machine_id, "reserved")
    async with open_view(nc, subjects, path) as again:  # resumed: no rebuild
        assert again.rebuilds == 0
        assert states(again) == {first.machine_id: "started", second.machine_id: "reserved"}
        assert again.freshness().seq > seq
        got = rows(again, "SELECT region, count(*) FROM machines GROUP BY region ORDER BY 1")
        assert got == [("fra", 1), ("mad", 1)]


async def test_a_stopped_supplier_makes_its_workers_gone_and_machines_unknown(
    market: Market, subjects: Subjects
) -> None:
    await market.exchange()
    gone_host = await market.host(worker("mad-1"))
    await market.host(worker("mad-2"))
    c = await market.client()
    nc = await market.connect("view")
    placed = [await c.place(order(exclude_workers=[w])) for w in ("mad-2", "mad-1")]
    for p in placed:
        await published(nc, subjects, p.machine_id, "reserved")
    async with open_view(nc, subjects) as view:
        await market.stop(gone_host)
        stopped = time.time() * 1000
        await until(
            view, lambda: rows(view, "SELECT count(*) FROM workers WHERE gone_since_ms")[0][0] == 1
        )
        [(since,)] = rows(view, "SELECT gone_since_ms FROM workers WHERE worker_id = 'mad-1'")
        assert stopped - 2000 <= since <= stopped  # its last heartbeat (or row)
        unknown = rows(view, "SELECT machine_id, state, worker_gone_since_ms FROM machines")
        assert sorted(unknown) == sorted(
            [
                (placed[0].machine_id, "reserved", since),  # the state stays the last one
                (placed[1].machine_id, "reserved", None),
            ]
        )
        # the question of the issue answers at once, the gone worker's machine included
        assert rows(view, "SELECT region, count(*) FROM machines GROUP BY region") == [("mad", 2)]


async def test_forged_rows_are_dropped_and_counted(market: Market, subjects: Subjects) -> None:
    """Without auth anyone can publish here: the view's own checks (grants keep a real
    supplier's key to its own workers' subjects: tests/security/test_state_grants.py)."""
    await market.exchange()
    await market.host(worker("mad-1"))
    c = await market.client()
    nc = await market.connect("view")
    placed = await c.place(order())
    real = await published(nc, subjects, placed.machine_id, "reserved")
    js = nc.jetstream()
    forged = msgspec.structs.replace(real, state="destroyed")
    # another worker's subject, another owner's, a payload that is no machine
    await js.publish(subjects.state_machine("_", "mad", "mad-9", real.machine_id), encode(forged))
    await js.publish(subjects.state_machine("eve", "mad", "mad-1", real.machine_id), encode(forged))
    await js.publish(subjects.state_machine("_", "mad", "mad-1", "mad-1~X"), b"\x00garbage")
    async with open_view(nc, subjects) as view:
        assert states(view) == {real.machine_id: "reserved"}
        assert view.dropped == {FOREIGN: 2, MALFORMED: 1}
        assert view.db.counts() == {FOREIGN: 2, MALFORMED: 1}


async def test_it_survives_a_purge_and_rebuilds_after_the_stream_is_made_again(
    market: Market, subjects: Subjects, tmp_path: Path
) -> None:
    await market.exchange()
    await market.host(worker("mad-1"))
    c = await market.client()
    nc = await market.connect("view")
    p = await c.place(order())
    await published(nc, subjects, p.machine_id, "reserved")
    js = nc.jetstream()
    stream = state_stream_name(subjects.prefix)
    path = tmp_path / "view.sqlite"
    async with open_view(nc, subjects, path) as view:
        epoch = view.db.get("epoch")
        assert epoch  # the stream's, written by the exchange's start, read with the rows
        await js.purge_stream(stream)  # the epoch goes too: a purged stream has none
        await c.machine("start", p.machine_id)  # the supplier sends every row again
        await until(view, lambda: states(view) == {p.machine_id: "started"})
        assert view.rebuilds == 0
    async with open_view(nc, subjects, path) as resumed:  # no epoch: not made again
        assert resumed.rebuilds == 0 and resumed.db.get("epoch") == epoch

    # made again, as an exchange's start or `bourse jetstream init` makes it: its sequences
    # start over and the suppliers' rows and heartbeats soon pass the old ones; its epoch
    # is another
    await js.delete_stream(stream)
    assert await make_state_stream(js, StateStream.of(subjects))
    await published(nc, subjects, p.machine_id, "started", timeout_s=10.0)
    async with open_view(nc, subjects, path) as again:
        assert again.rebuilds == 1  # told at its start, whatever the sequences say
        await until(again, lambda: states(again) == {p.machine_id: "started"})
        assert again.db.get("epoch") not in ("", epoch)


async def test_a_view_away_longer_than_the_retention_window_rebuilds(
    market: Market, subjects: Subjects, tmp_path: Path
) -> None:
    await market.exchange()
    await market.host(worker("mad-1"))
    nc = await market.connect("view")
    path = tmp_path / "view.sqlite"
    async with open_view(nc, subjects, path) as view:
        assert view.rebuilds == 0
        await until(view, lambda: rows(view, "SELECT worker_id FROM workers") == [("mad-1",)])
        view.db.put("synced_ms", str(now_ms() - RETENTION_S * 1000 - 1))  # as if long away
    async with open_view(nc, subjects, path) as again:
        assert again.rebuilds == 1
        assert rows(again, "SELECT worker_id FROM workers") == [("mad-1",)]


async def test_it_follows_across_a_nats_server_restart(subjects: Subjects, tmp_path: Path) -> None:
    server = EmbeddedNats(workdir=tmp_path / "nats").start()
    again = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.1}
    try:
        async with Market(server.url, subjects, tmp_path / "m") as market:
            await market.exchange()
            store = Store(tmp_path / "supplier" / "supplier.db")
            market.stores.append(store)
            host = SupplierHost(
                await market.connect("supplier", **again), [worker("mad-1")], store, subjects
            )
            await market.serve(host)
            nc = await market.connect("view", **again)
            p = await (await market.client()).place(order())
            await published(nc, subjects, p.machine_id, "reserved")
            async with open_view(nc, subjects, tmp_path / "view.sqlite") as view:
                port = server.port
                server.stop()
                server = EmbeddedNats(workdir=tmp_path / "nats", port=port or -1)
                await anyio.to_thread.run_sync(server.start)
                await wait_until(lambda: host.nc.is_connected and nc.is_connected, 10.0)
                await host.workers["mad-1"].transition("start", p.machine_id)
                await until(view, lambda: states(view) == {p.machine_id: "started"}, 20.0)
    finally:
        server.stop()


async def test_two_views_agree_once_writes_stop(market: Market, subjects: Subjects) -> None:
    await market.exchange()
    await market.host(*(worker(f"mad-{i}") for i in range(4)))
    c = await market.client()
    nc = await market.connect("view")
    async with open_view(nc, subjects) as one:
        placed = [await c.place(order()) for _ in range(8)]
        for p in placed[:4]:
            await c.machine("start", p.machine_id)
        await c.machine("destroy", placed[0].machine_id)
        last = await published(nc, subjects, placed[0].machine_id, "destroyed")
        assert last.state == "destroyed"
        sql = "SELECT machine_id, state, updated_at_ms FROM machines ORDER BY 1"
        async with open_view(nc, subjects) as two:  # built now, in memory
            want = rows(two, sql)
            assert len(want) == 8
            await until(one, lambda: rows(one, sql) == want)  # within seconds, generously
