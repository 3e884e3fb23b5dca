"""Prometheus metrics: scrape each program's endpoint over HTTP after a known number of
orders (some unfilled for a known reason) and check the counters equal it exactly.

In-process (the market's services with their metrics and endpoints, as the programs build
them) for the full set; one real-process run for the flags (`--metrics-addr`, the ready
line, SIGTERM stopping the endpoint); the address parser and its one-line errors."""

from __future__ import annotations

import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bourse.nats.connection import stats_of
from bourse.runtime.endpoint import MetricsAddrError, MetricsServer, parse_addr
from bourse.runtime.launcher import start_program
from bourse.runtime.metrics import ExchangeMetrics, SupplierMetrics
from bourse.wire.messages import Placed, Unfilled
from exchange.cli import app as exchange
from exchange.service import ExchangeService
from supplier.host import SupplierHost
from supplier.ledger import Hold
from supplier.store import Store
from tests.cli import run_cli
from tests.market import Market, order, wait_until, worker

MIB = 1024 * 1024
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """GET the endpoint; every sample by (name, labels)."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def ascrape(url: str) -> Samples:
    return await anyio.to_thread.run_sync(scrape, url)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over the series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


async def test_counters_equal_the_orders_placed_in_process(market: Market, tmp_path: Path) -> None:
    # Two workers of 4 cpus in mad; nobody in fra.
    sm = SupplierMetrics()
    store = Store(tmp_path / "s" / "supplier.db")
    market.stores.append(store)
    snc = await market.connect("metrics-supplier")
    sm.watch_connection(stats_of(snc))
    host = SupplierHost(
        snc, [worker("m-1", cpus=4), worker("m-2", cpus=4)], store, market.subjects, metrics=sm
    )
    await market.serve(host)
    market.hosts.append(host)
    em = ExchangeMetrics()
    enc = await market.connect("metrics-exchange")
    em.watch_connection(stats_of(enc))
    svc = ExchangeService(enc, market.subjects, metrics=em)
    await market.serve(svc)
    s_end, e_end = MetricsServer(sm, "127.0.0.1", 0), MetricsServer(em, "127.0.0.1", 0)
    await market.serve(s_end)
    await market.serve(e_end)

    buyer = await market.client()
    placed = [await buyer.place(order(cpus=1, memory_mb=256)) for _ in range(5)]
    too_big = [await buyer.place(order(cpus=64)) for _ in range(3)]
    nobody = [await buyer.place(order(region="fra")) for _ in range(2)]
    bad = await buyer.nc.request(market.subjects.order("mad"), b"{not json", timeout=2)
    assert all(isinstance(r, Placed) for r in placed)
    assert {r.reason for r in too_big if isinstance(r, Unfilled)} == {"no_offers"}
    assert {r.reason for r in nobody if isinstance(r, Unfilled)} == {"no_workers"}
    assert b"bad_request" in bad.data
    # Holds of the losing offers are released at the end of each auction.
    await wait_until(lambda: all(not w.ledger.holds for w in host.workers.values()))

    ex = await ascrape(e_end.url)
    assert value(ex, "bourse_orders_total", region="mad", outcome="placed", reason="") == 5
    assert (
        value(ex, "bourse_orders_total", region="mad", outcome="unfilled", reason="no_offers") == 3
    )
    assert (
        value(ex, "bourse_orders_total", region="fra", outcome="unfilled", reason="no_workers") == 2
    )
    assert (
        value(ex, "bourse_orders_total", region="mad", outcome="refused", reason="overloaded") == 0
    )
    assert total(ex, "bourse_orders_total") == 10
    assert value(ex, "bourse_auction_duration_seconds_count", region="mad") == 8
    assert value(ex, "bourse_auction_duration_seconds_count", region="fra") == 2
    assert value(ex, "bourse_auction_offers_count", region="mad") == 8
    # The three that were too big got no offer; every placed one at least one.
    assert value(ex, "bourse_auction_offers_bucket", region="mad", le="0.0") == 3
    assert value(ex, "bourse_auction_offers_sum", region="mad") >= 5
    assert value(ex, "bourse_requests_total", service="exchange") == 11
    assert value(ex, "bourse_request_errors_total", service="exchange", code="bad_request") == 1
    assert value(ex, "bourse_nats_reconnects_total", program="exchange") == 0
    assert value(ex, "bourse_nats_slow_consumer_drops_total", program="exchange") == 0
    assert value(ex, "bourse_auctions_inflight") == 0

    sup = await ascrape(s_end.url)
    for wid in ("m-1", "m-2"):
        assert value(sup, "bourse_worker_capacity", worker=wid, region="mad", resource="cpus") == 4
        assert value(
            sup, "bourse_worker_capacity", worker=wid, region="mad", resource="memory_bytes"
        ) == (8192 * MIB)
        assert value(sup, "bourse_worker_holds_active", worker=wid, region="mad") == 0
        assert value(sup, "bourse_worker_draining", worker=wid, region="mad") == 0
    assert total(sup, "bourse_worker_committed", resource="cpus") == 5
    assert total(sup, "bourse_worker_committed", resource="memory_bytes") == 5 * 256 * MIB
    assert total(sup, "bourse_worker_held") == 0
    assert store.writes == 5  # one durable commit per placed order...
    assert value(sup, "bourse_store_commit_duration_seconds_count") == store.batches  # ...timed
    assert value(sup, "bourse_outbox_backlog", outbox="publish") == 0
    assert value(sup, "bourse_bids_shed_total") == 0
    assert value(sup, "bourse_requests_total", service="supplier") >= 8  # bids, commits

    # A hold shows while an auction is under way: one taken by hand, seen at once.
    w = max(host.workers.values(), key=lambda w: w.ledger.free[0])
    assert w.ledger.hold(Hold("o-held", (500, 256, 0, 0, 0), 1e12, 0.5, {}, True, "a-1"))
    sup = await ascrape(s_end.url)
    assert value(sup, "bourse_worker_holds_active", worker=w.worker_id, region="mad") == 1
    assert (
        value(sup, "bourse_worker_held", worker=w.worker_id, region="mad", resource="cpus") == 0.5
    )
    assert total(sup, "bourse_worker_held", resource="memory_bytes") == 256 * MIB
    w.ledger.drop("o-held")


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_endpoint_answers_only_get_metrics(market: Market) -> None:
    server = MetricsServer(ExchangeMetrics(), "127.0.0.1", 0)
    await market.serve(server)
    base = f"http://{server.address}"
    assert await anyio.to_thread.run_sync(_get, base + "/metrics") == 200
    assert await anyio.to_thread.run_sync(_get, base + "/nothing") == 404
    # A client that connects and hangs up at once does not end the server.
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))):
        pass
    assert await anyio.to_thread.run_sync(_get, base + "/") == 200
    await market.stop(server)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).close()


def _metrics_url(ready_line: str) -> str:
    return ready_line.partition("metrics on ")[2].strip()


async def test_programs_serve_metrics_on_metrics_addr(market: Market, tmp_path: Path) -> None:
    common = ("--nats", market.url, "--prefix", market.subjects.prefix)
    sup = await start_program(
        "supplier",
        "run",
        "--driver",
        "sim",
        "--worker-id",
        "pm-1",
        "--region",
        "pm",
        "--cpus",
        "8",
        "--memory-mb",
        "8192",
        "--data-dir",
        str(tmp_path / "pm-1"),
        "--metrics-addr",
        "127.0.0.1:0",
        *common,
        log_path=tmp_path / "supplier.log",
        ready="supplier ready",
    )
    ex = await start_program(
        "exchange",
        "serve",
        "--metrics-addr",
        "127.0.0.1:0",
        *common,
        log_path=tmp_path / "exchange.log",
        ready="exchange ready",
    )
    try:
        sup_url, ex_url = _metrics_url(sup.ready_line), _metrics_url(ex.ready_line)
        assert sup_url.startswith("http://127.0.0.1:") and sup_url.endswith("/metrics")
        buyer = await market.client()
        results = [await buyer.place(order(region="pm", cpus=2)) for _ in range(3)]
        results.append(await buyer.place(order(region="pm", cpus=9)))
        assert [type(r).__name__ for r in results] == ["Placed"] * 3 + ["Unfilled"]
        ex_s = await ascrape(ex_url)
        assert value(ex_s, "bourse_orders_total", region="pm", outcome="placed", reason="") == 3
        assert (
            value(ex_s, "bourse_orders_total", region="pm", outcome="unfilled", reason="no_offers")
            == 1
        )
        assert value(ex_s, "bourse_nats_reconnects_total", program="exchange") == 0
        sup_s = await ascrape(sup_url)
        committed = value(
            sup_s, "bourse_worker_committed", worker="pm-1", region="pm", resource="cpus"
        )
        assert committed == 6
        assert value(sup_s, "bourse_store_commit_duration_seconds_count") >= 1
        assert value(sup_s, "bourse_nats_disconnects_total", program="supplier") == 0
    finally:
        t0 = time.monotonic()
        assert await ex.stop() == 0
        assert await sup.stop() == 0
        assert time.monotonic() - t0 < 4.0  # SIGTERM: each within 2 s, endpoint and all
    # The endpoints stopped with their programs.
    for url in (sup_url, ex_url):
        with pytest.raises(urllib.error.URLError):
            await ascrape(url)


def test_parse_addr() -> None:
    assert parse_addr("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_addr("[::1]:0") == ("::1", 0)
    assert parse_addr("0.0.0.0:9464") == ("0.0.0.0", 9464)
    for off in ("", "off", "OFF", None):
        assert parse_addr(off) is None
    for bad in ("9464", "localhost", "host:port", ":9464", "h:70000"):
        with pytest.raises(MetricsAddrError, match="expected HOST:PORT"):
            parse_addr(bad)


BAD_ADDR = ("--metrics-addr", "nope")


def test_bad_metrics_addr_is_one_line_error() -> None:
    code, _, err = run_cli(exchange, "serve", "--nats", "nats://127.0.0.1:1", *BAD_ADDR)
    assert code == 1
    assert err.strip().splitlines() == [
        "error: --metrics-addr 'nope': expected HOST:PORT (e.g. 127.0.0.1:9464, port 0 for any "
        "free one) or 'off'"
    ]


async def test_metrics_port_in_use_is_one_line_error(market: Market, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = await anyio.run_process(
            [
                *(
                    sys.executable,
                    "-m",
                    "supplier",
                    "run",
                    "--driver",
                    "sim",
                    "--worker-id",
                    "busy-1",
                ),
                *("--region", "busy", "--cpus", "1", "--memory-mb", "64"),
                *("--data-dir", str(tmp_path / "b"), "--metrics-addr", f"127.0.0.1:{port}"),
                *("--nats", market.url, "--prefix", market.subjects.prefix),
            ],
            check=False,
        )
    assert proc.returncode == 1
    last = proc.stderr.decode().strip().splitlines()[-1]
    assert last.startswith(f"error: --metrics-addr 127.0.0.1:{port}: cannot listen: ")


async def test_a_demo_program_whose_picked_port_was_taken_meanwhile_takes_the_next(
    market: Market, tmp_path: Path
) -> None:
    """`bourse up` picks its programs' metrics ports when it starts them; another process
    (a second `up` starting at the same moment) may bind one first. The program is then
    started again on the next free port, not the market's end in a traceback of lines."""
    from bourse.runtime.endpoint import free_port
    from ops.market import MetricsPorts, metrics_url, start_serving

    ports = MetricsPorts(("127.0.0.1", free_port("127.0.0.1", 29700)))
    picked = ports.pick()
    host, port = picked.rsplit(":", 1)
    with socket.socket() as thief:
        thief.bind((host, int(port)))
        thief.listen()
        ex = await start_serving(
            ports,
            picked,
            "exchange",
            "serve",
            *("--nats", market.url, "--prefix", market.subjects.prefix),
            log_path=tmp_path / "exchange.log",
            ready="exchange ready",
        )
    try:
        url = metrics_url(ex)
        assert url.startswith("http://127.0.0.1:") and url != f"http://{picked}/metrics"
        assert value(await ascrape(url), "bourse_nats_reconnects_total", program="exchange") == 0
        assert f"{picked}: cannot listen" in (tmp_path / "exchange.log").read_text()
    finally:
        assert await ex.stop() == 0
