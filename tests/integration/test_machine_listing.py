"""``buyer machines list`` across the fleet (docs/protocol.md §4.17) on a real nats-server
with real suppliers: filters applied at the workers, sorting, every region by default, a
region that does not answer, and a worker with 10,000 machines listed completely (in pages,
and page by page through the exchange)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bourse.wire.messages import ListMachines, Machine, Placed, Resources, new_machine_id
from bourse.wire.paging import PAGE_BYTES
from supplier.oplog import Op
from supplier.store import Store
from tests.cli import buyer
from tests.market import Market, order, worker

BIG = 10_000


async def shop_market(market: Market) -> dict[str, Placed]:
    """mad-1, mad-2 (one process) and fra-1: shop machines in both regions, a blog one."""
    await market.host(worker("mad-1", cpus=16), worker("mad-2", cpus=16))
    await market.host(worker("fra-1", region="fra", cpus=16))
    await market.exchange()
    c = await market.client()
    placed: dict[str, Placed] = {}
    for name, region, app, exclude in [
        ("shop-mad-a", "mad", "shop", ["mad-2"]),
        ("shop-mad-b", "mad", "shop", ["mad-1"]),
        ("blog-mad", "mad", "blog", ["mad-2"]),
        ("shop-fra", "fra", "shop", []),
        ("shop-mad-c", "mad", "shop", ["mad-2"]),
    ]:
        r = await c.place(
            order(
                region=region,
                order_id=name,
                metadata={"app": app, "tier": "web" if app == "shop" else "misc"},
                exclude_workers=exclude,
                deadline_ms=2000,
            )
        )
        assert isinstance(r, Placed), r
        placed[name] = r
    await c.machine("start", placed["shop-mad-c"].machine_id)
    return placed


async def test_filters_sorting_and_every_region_by_default(market: Market) -> None:
    placed = await shop_market(market)
    c = await market.client()

    every = await c.list_machines()
    assert every.complete and every.missing == [] and every.regions == ["fra", "mad"]
    order_ids = [m.order_id for m in every.machines]
    # sorted by region, worker, creation
    assert order_ids == ["shop-fra", "shop-mad-a", "blog-mad", "shop-mad-c", "shop-mad-b"]

    shop = await c.list_machines(request=ListMachines(app="shop"))
    assert [m.order_id for m in shop.machines] == [
        "shop-fra", "shop-mad-a", "shop-mad-c", "shop-mad-b",
    ]  # fmt: skip
    in_mad = await c.list_machines(["mad"], ListMachines(app="shop"))
    assert {m.region for m in in_mad.machines} == {"mad"} and len(in_mad.machines) == 3
    started = await c.list_machines(request=ListMachines(states=["started"]))
    assert [m.order_id for m in started.machines] == ["shop-mad-c"]
    labelled = await c.list_machines(request=ListMachines(labels={"tier": "misc"}))
    assert [m.order_id for m in labelled.machines] == ["blog-mad"]

    # destroyed machines only when asked for
    gone = placed["shop-fra"].machine_id
    await c.machine("destroy", gone)
    assert gone not in {m.machine_id for m in (await c.list_machines()).machines}
    with_gone = await c.list_machines(request=ListMachines(include_destroyed=True))
    assert gone in {m.machine_id for m in with_gone.machines}
    only_gone = await c.list_machines(request=ListMachines(states=["destroyed"]))
    assert [m.machine_id for m in only_gone.machines] == [gone]
    # "fra" still answers (its worker is there) although it has no live machine now
    fra = await c.list_machines(["fra"])
    assert (fra.machines, fra.regions, fra.complete) == ([], ["fra"], True)


async def test_the_cli_lists_sorted_with_whole_ids_and_exits_2_for_a_silent_region(
    market: Market,
) -> None:
    placed = await shop_market(market)
    code, out, err = await buyer(market, "machines", "list", "--app", "shop")
    assert (code, err) == (0, ""), err
    header, *rows = out.splitlines()
    assert header.split() == [
        "machine", "worker", "region", "state", "cpus", "memory", "MiB", "image", "age",
        "restarts", "health", "addresses", "app",
    ]  # fmt: skip
    ids = [placed[n].machine_id for n in ("shop-fra", "shop-mad-a", "shop-mad-c", "shop-mad-b")]
    assert [r.split()[0] for r in rows] == ids
    assert rows[2].split()[1:4] == [placed["shop-mad-c"].worker_id, "mad", "started"]
    assert all(r.split()[-1] == "shop" for r in rows)

    code, out, err = await buyer(market, "machines", "list", "--state", "started", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["complete"] is True and doc["missing"] == []
    assert [m["machine_id"] for m in doc["machines"]] == [placed["shop-mad-c"].machine_id]

    code, out, err = await buyer(market, "machines", "list", "--label", "tier=misc", "--json")
    assert [m["order_id"] for m in json.loads(out)["machines"]] == ["blog-mad"]

    code, out, err = await buyer(market, "machines", "list", "--region", "mad", "--region", "sjc")
    assert code == 2 and err == "no worker answers in region 'sjc'\n"
    assert len(out.splitlines()) == 1 + 4  # mad's machines are still listed

    code, _, err = await buyer(market, "machines", "list", "--state", "running")
    assert code == 1 and err == (
        "error: unknown state 'running': use one of reserved, starting, started, stopping, "
        "stopped, failed, destroyed\n"
    )
    code, out, err = await buyer(market, "machines", "list", "--worker", "mad-2", "--json")
    assert code == 0 and [m["order_id"] for m in json.loads(out)["machines"]] == ["shop-mad-b"]


async def test_no_region_answers(market: Market) -> None:
    code, out, err = await buyer(market, "machines", "list", "--fresh")
    assert (code, out, err) == (2, "", "no worker answers in any region\n")
    # no exchange has made the state stream: the view says so, and what to do
    code, out, err = await buyer(market, "machines", "list")
    assert (code, out) == (1, "") and err.startswith("error: no state stream ")
    assert err.endswith("--fresh asks the workers instead\n")


async def fill_store(data_dir: Path, worker_id: str, region: str, n: int) -> list[Machine]:
    """``n`` stopped machines written straight into a supplier's store (its own API), as
    if placed and stopped there: the supplier that starts on it recovers them."""
    store = Store(data_dir / "supplier.db")
    t0 = int(time.time() * 1000) - n
    ms = [
        Machine(
            machine_id=new_machine_id(worker_id),
            order_id=f"bulk-{i:05d}",
            worker_id=worker_id,
            region=region,
            state="stopped",
            resources=Resources(cpus=1, memory_mb=64),
            image="web",
            metadata={"app": "bulk" if i % 2 else "other", "note": f"machine number {i}"},
            created_at_ms=t0 + i,
            updated_at_ms=t0 + i,
        )
        for i in range(n)
    ]
    try:
        for i in range(0, n, 1000):
            await store.write(*(Op("place", m) for m in ms[i : i + 1000]))
    finally:
        store.close()
    return ms


async def test_a_worker_with_ten_thousand_machines_lists_completely(
    market: Market, tmp_path: Path
) -> None:
    """10,000 machines on one worker (about 3 MB of machines: far past one NATS message)
    list completely: in pages on the fan-out, and page by page (a cursor) for --worker
    through the exchange; the CLI's --json has every one. The times are printed."""
    data_dir = tmp_path / "big"
    ms = await fill_store(data_dir, "big-1", "mad", BIG)
    await market.host(worker("big-1", memory_mb=1 << 20), data_dir=data_dir)
    await market.host(worker("mad-2"))
    await market.exchange()
    c = await market.client()
    want = [m.machine_id for m in ms]

    t0 = time.perf_counter()
    got = await c.list_machines()
    fanout_s = time.perf_counter() - t0
    assert got.complete and got.missing == []
    assert [m.machine_id for m in got.machines] == want  # sorted by creation
    bulk = await c.list_machines(request=ListMachines(app="bulk"))
    assert [m.machine_id for m in bulk.machines] == want[1::2]

    t0 = time.perf_counter()
    one = await c.machines("big-1")
    cursor_s = time.perf_counter() - t0
    assert sorted(m.machine_id for m in one.machines) == sorted(want)

    t0 = time.perf_counter()
    code, out, err = await buyer(market, "machines", "list", "--json")
    cli_s = time.perf_counter() - t0
    assert code == 0, err
    assert len(out) > 2 * 1024 * 1024 > 30 * PAGE_BYTES  # what paging made possible
    assert [m["machine_id"] for m in json.loads(out)["machines"]] == want
    print(
        f"\n10,000 machines: fan-out gather {fanout_s * 1000:.0f} ms, per-worker pages "
        f"through the exchange {cursor_s * 1000:.0f} ms, `buyer machines list --json` "
        f"(its gather and the JSON) {cli_s * 1000:.0f} ms"
    )
