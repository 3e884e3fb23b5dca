"""The edge's data plane, end to end: a real ``edge serve`` program (a subprocess) in front
of real upstream servers on loopback ports of their own (tests/edgekit.py), driven by a raw
HTTP client. Routing by Host, keep-alive on both sides, streamed bodies both ways, a
WebSocket echo through Upgrade, the X-Forwarded headers, retries, bad input (404, 400, 408,
413, 429, 502), raw TCP services, metrics, SIGTERM mid-request, and the market's machine
listing as the route source. Every wait is on an event: a line, an answer, a connection."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bourse.wire.messages import Placed
from tests.edgekit import HOST, Conn, Upstream, answered, edge, get, port, routes_file
from tests.integration.test_metrics import ascrape, value
from tests.isolation import own_worker_id
from tests.market import Market, order, worker


@pytest.fixture
async def ups() -> AsyncIterator[dict[str, Upstream]]:
    """Four machines: a, b, c serving, and `gone` (a port nothing listens on)."""
    servers = {n: await Upstream(n).start() for n in ("a", "b", "c")}
    yield servers | {"gone": Upstream("gone", port())}
    for s in servers.values():
        await s.close()


def http(u: Upstream) -> tuple[str, dict[str, str]]:
    return (u.name, {"http": u.address})


async def test_routes_by_host_tenant_apps_apart_with_the_machines_header(
    tmp_path: Path, ups: dict[str, Upstream]
) -> None:
    routes = routes_file(
        tmp_path / "r.json",
        {"web": [http(ups["a"])], "web.acme": [http(ups["b"])], "api": [http(ups["c"])]},
    )
    async with edge(tmp_path, "--routes", str(routes)) as e:
        for host, machine in (
            ("web.localhost", "a"),
            ("web.acme.localhost", "b"),
            ("API.localhost:8080", "c"),  # case and port do not matter
        ):
            got = await get(e.address, host=host)
            assert (got.status, got.body, got.headers["bourse-machine"]) == (
                200,
                machine.encode(),
                machine,
            )


async def test_keep_alive_both_sides_one_upstream_connection(
    tmp_path: Path, ups: dict[str, Upstream]
) -> None:
    routes = routes_file(tmp_path / "r.json", {"web": [http(ups["a"])]})
    async with edge(tmp_path, "--routes", str(routes)) as e:
        conn = await Conn.open(e.address)
        for _ in range(5):
            conn.request()
            got = await conn.answer()
            assert (got.status, got.body) == (200, b"a")
        await conn.close()
        assert (ups["a"].connections, ups["a"].requests) == (1, 5)


async def test_bodies_are_streamed_both_ways(tmp_path: Path, ups: dict[str, Upstream]) -> None:
    routes = routes_file(tmp_path / "r.json", {"web": [http(ups["a"])]})
    async with edge(tmp_path, "--routes", str(routes)) as e:
        # a chunked response: its first chunk reaches the client while the upstream still
        # holds the last one back (it is released only once the client has the first)
        conn = await Conn.open(e.address)
        conn.request("/stream")
        status, headers = await conn.head()
        assert (status, headers["transfer-encoding"]) == (200, "chunked")
        assert await conn.reader.readuntil(b"first\n\r\n") == b"6\r\nfirst\n\r\n"
        ups["a"].release.set()
        assert await conn.reader.readuntil(b"0\r\n\r\n") == b"5\r\nlast\n\r\n0\r\n\r\n"
        # a chunked request body of 3 MiB, and one of 1 MiB by Content-Length, on the
        # same connection
        chunk = b"x" * 65536
        conn.send(
            b"POST /upload HTTP/1.1\r\nHost: web.localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(48):
            conn.send(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            await conn.writer.drain()
        conn.send(b"0\r\n\r\n")
        got = await conn.answer()
        assert (got.status, got.json()) == (200, {"bytes": 48 * 65536, "by": "a"})
        body = b"y" * (1024 * 1024)
        conn.send(
            b"PUT /upload HTTP/1.1\r\nHost: web.localhost\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        conn.send(body)
        got = await conn.answer()
        assert (got.status, got.json()) == (200, {"bytes": len(body), "by": "a"})
        await conn.close()


async def test_websocket_echo_through_upgrade(tmp_path: Path, ups: dict[str, Upstream]) -> None:
    routes = routes_file(tmp_path / "r.json", {"web": [http(ups["a"])]})
    async with edge(tmp_path, "--routes", str(routes)) as e:
        conn = await Conn.open(e.address)
        conn.request("/ws", extra="Connection: Upgrade\r\nUpgrade: websocket\r\n")
        status, headers = await conn.head()
        assert (status, headers["upgrade"], headers["connection"]) == (101, "websocket", "Upgrade")
        assert headers["bourse-machine"] == "a"
        for message in (b"ping", b"\x00\x01binary\xff", b"z" * 100_000):
            conn.send(message)
            assert await conn.reader.readexactly(len(message)) == message
        await conn.close()


async def test_forwarded_headers_replace_what_the_client_sent(
    tmp_path: Path, ups: dict[str, Upstream]
) -> None:
    routes = routes_file(tmp_path / "r.json", {"web": [http(ups["a"])]})
    async with edge(tmp_path, "--routes", str(routes)) as e:
        spoof = "X-Forwarded-For: 6.6.6.6\r\nX-Forwarded-Proto: https\r\nX-Custom: kept\r\n"
        got = await get(e.address, "/echo", extra=spoof)
        seen = got.json()["headers"]
        assert isinstance(seen, dict)
        assert (seen["x-forwarded-for"], seen["x-forwarded-proto"]) == (HOST, "http")
        assert (seen["x-custom"], seen["host"]) == ("kept", "web.localhost")
        assert "connection" not in seen  # hop by hop: the edge's own


async def test_retries_on_a_refused_machine_then_skips_it(
    tmp_path: Path, ups: dict[str, Upstream]
) -> None:
    routes = routes_file(tmp_path / "r.json", {"web": [http(ups["gone"]), http(ups["a"])]})
    async with edge(tmp_path, "--routes", str(routes), "--metrics-addr", f"{HOST}:0") as e:
        answers = [await get(e.address) for _ in range(6)]
        assert [(g.status, g.body) for g in answers] == [(200, b"a")] * 6
        lines = [json_line for json_line in e.log.splitlines() if "event='request'" in json_line]
        retried = [line for line in lines if "attempts=2" in line]
        # the refused machine was tried once, then skipped until a probe passes
        assert len(retried) == 1 and "connect to gone: connection refused" in retried[0]
        url = "http://" + e.ready_line.split("metrics on http://")[1].strip()
        samples = await ascrape(url)
        assert value(samples, "bourse_edge_retries_total", app="web") == 1
        assert value(samples, "bourse_edge_upstream_errors_total", app="web") == 1
        assert value(samples, "bourse_edge_requests_total", app="web", code="2xx") == 6
        # the machine comes back: a probe passes and it takes requests again
        await ups["gone"].start()
        await answered(e.address, "web.localhost", lambda got: got.body == b"gone")
        await ups["gone"].close()


async def test_an_idempotent_request_is_retried_when_no_answer_came_back(
    tmp_path: Path, ups: dict[str, Upstream]
) -> None:
    closer_port = port()

    async def close_at_once(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _r.readuntil(b"\r\n\r\n")
        w.close()  # read the request, answer nothing

    closer = await asyncio.start_server(close_at_once, HOST, closer_port)
    try:
        routes = routes_file(
            tmp_path / "r.json",
            {
                "web": [("closer", {"http": f"{HOST}:{closer_port}"}), http(ups["a"])],
                "post": [("closer-2", {"http": f"{HOST}:{closer_port}"})],
                "put": [("closer-3", {"http": f"{HOST}:{closer_port}"}), http(ups["b"])],
            },
        )
        async with edge(tmp_path, "--routes", str(routes)) as e:
            for _ in range(3):
                got = await get(e.address)
                assert (got.status, got.body) == (200, b"a")
            # a PUT's body is kept and sent again (the first machine of an app is tried
            # first: the closer here)
            conn = await Conn.open(e.address)
            conn.send(b"PUT /upload HTTP/1.1\r\nHost: put.localhost\r\nContent-Length: 5\r\n\r\n")
            conn.send(b"hello")
            got = await conn.answer()
            assert (got.status, got.json()) == (200, {"bytes": 5, "by": "b"})
            assert (got.headers["bourse-machine"], ups["b"].requests) == ("b", 1)
            await conn.close()
            conn = await Conn.open(e.address)
            conn.send(b"POST / HTTP/1.1\r\nHost: post.localhost\r\nContent-Length: 2\r\n\r\nhi")
            got = await conn.answer()
            assert got.status == 502
            assert got.body == b"closer-2 closed the connection before answering\n"
            # (the PUT's line was written before the POST was read)
            assert "app='put' machine='b' attempts=2" in e.log
            await conn.close()
    finally:
        closer.close()


async def test_bad_input_gets_its_status(tmp_path: Path, ups: dict[str, Upstream]) -> None:
    routes = routes_file(
        tmp_path / "r.json", {"web": [http(ups["a"])], "dead": [http(ups["gone"])]}
    )
    args = ("--routes", str(routes), "--max-body-mb", "0.001", "--header-timeout-s", "0.3")
    async with edge(tmp_path, *args, "--max-conns-per-ip", "8") as e:
        got = await get(e.address, host="nope.localhost")
        assert got.status == 404
        assert got.body == (
            b"no app 'nope' at this edge: apps are reached at <app>.localhost or "
            b"<app>.<tenant>.localhost\n"
        )
        got = await get(e.address, host="example.com")
        assert got.status == 404 and b"<app>.<tenant>.localhost" in got.body
        # control characters in Host (refused by the parser or by the edge: 400 either way),
        # or two Host headers
        for raw in (b"web\x01.localhost", b"web\x7f.localhost", b"web.localhost\r\nHost: x"):
            conn = await Conn.open(e.address)
            conn.send(b"GET / HTTP/1.1\r\nHost: " + raw + b"\r\n\r\n")
            got = await conn.answer()
            assert got.status == 400, got
            await conn.close()
        # a body past --max-body-mb (1 KiB here), by its Content-Length, then streamed
        conn = await Conn.open(e.address)
        conn.send(b"POST /upload HTTP/1.1\r\nHost: web.localhost\r\nContent-Length: 5000\r\n\r\n")
        got = await conn.answer()
        assert (got.status, got.body) == (413, b"request body larger than 1048 bytes\n")
        await conn.close()
        conn = await Conn.open(e.address)
        conn.send(
            b"POST /upload HTTP/1.1\r\nHost: web.localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        conn.send(b"800\r\n" + b"z" * 2048 + b"\r\n")
        status, _ = await conn.head()
        assert status == 413
        await conn.close()
        # an upstream that refuses: 502 with a short reason
        got = await get(e.address, host="dead.localhost")
        assert (got.status, got.body) == (502, b"connect to gone: connection refused\n")
        # a head not finished within --header-timeout-s: 408 and the connection closed
        conn = await Conn.open(e.address)
        conn.send(b"GET / HTTP/1.1\r\nHost: web.loc")
        got = await conn.answer()
        assert (got.status, got.headers["connection"]) == (408, "close")
        await conn.close()
        # a client holding more connections than --max-conns-per-ip: 429
        held = [await Conn.open(e.address) for _ in range(8)]
        extra = await Conn.open(e.address)
        got = await extra.answer()
        assert (got.status, got.body) == (429, b"too many connections from your address\n")
        for c in [*held, extra]:
            await c.close()


async def test_two_edges_share_one_port(tmp_path: Path, ups: dict[str, Upstream]) -> None:
    """SO_REUSEPORT: a second edge listens on the port the first was given, and each
    connection is served by one of them (the kernel spreads them)."""
    routes = routes_file(tmp_path / "r.json", {"web": [http(ups["a"])]})
    async with edge(tmp_path, "--routes", str(routes)) as first:
        host, shared = first.address.rsplit(":", 1)
        async with edge(tmp_path, "--routes", str(routes), "--listen", f"{host}:{shared}") as e2:
            assert e2.address == first.address
            for _ in range(8):
                got = await get(first.address)
                assert (got.status, got.body) == (200, b"a")
            code, _ = await first.stop()
            assert code == 0
            got = await get(e2.address)  # the second serves on alone
            assert (got.status, got.body) == (200, b"a")


async def test_a_raw_tcp_service(tmp_path: Path) -> None:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(b"pg:" + data)
        w.close()

    db_port = port()
    server = await asyncio.start_server(echo, HOST, db_port)
    try:
        routes = routes_file(tmp_path / "r.json", {"db": [("db1", {"pg": f"{HOST}:{db_port}"})]})
        async with edge(tmp_path, "--routes", str(routes), "--tcp", f"{HOST}:0=db:pg") as e:
            where = e.ready_line.split("db:pg on ")[1].split(";")[0].split()[0]
            conn = await Conn.open(where)
            conn.send(b"select 1")
            assert await conn.reader.readexactly(11) == b"pg:select 1"
            await conn.close()
    finally:
        server.close()


async def test_sigterm_mid_request_stops_at_once(tmp_path: Path, ups: dict[str, Upstream]) -> None:
    routes = routes_file(tmp_path / "r.json", {"web": [http(ups["a"])]})
    async with edge(tmp_path, "--routes", str(routes)) as e:
        conn = await Conn.open(e.address)
        conn.request("/hang")
        await ups["a"].hanging.wait()
        code, took = await e.stop(signal.SIGTERM)
        assert code == 0 and took < 2.0, e.log[-2000:]
        assert await conn.closed()
        assert "cut_short=1" in e.log
        await conn.close()


async def test_the_market_listing_routes_to_started_app_machines(
    market: Market, tmp_path: Path
) -> None:
    """The listing source: an app's machine placed on a sim worker (nothing runs there),
    a test server on the address the worker gave its port: the edge finds it by name."""
    w = own_worker_id("edge1")
    await market.host(worker(w, ports="29540-29549", advertise_host=HOST))
    await market.exchange()
    buyer = await market.client()
    placed = await buyer.place(order(image="web", ports=["http"], metadata={"app": "shop"}))
    assert isinstance(placed, Placed), placed
    upstream = Upstream("shop-1", port=int(placed.addresses["http"].rsplit(":", 1)[1]))
    await upstream.start()
    try:
        args = ("--nats", market.url, "--prefix", market.subjects.prefix, "--source", "listing")
        args += ("--refresh-s", "0.1", "--no-auto-start")
        async with edge(tmp_path, *args) as e:
            got = await get(e.address, host="shop.localhost")
            assert (got.status, got.body) == (
                503,
                b"no machine of app 'shop' can take it (1 not started)\n",
            )
            await buyer.machine("start", placed.machine_id)
            got = await answered(e.address, "shop.localhost", lambda got: got.status == 200)
            assert (got.body, got.headers["bourse-machine"]) == (b"shop-1", placed.machine_id)
    finally:
        await upstream.close()
