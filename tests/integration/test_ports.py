"""Machines you can reach: real process machines given host ports by a real supplier, over a
real nats-server. Two copies of one server on one worker each get their own port (no
"Address already in use"), each sees PORT, BOURSE_PORT_<NAME>, BOURSE_ADDR_<NAME> and its
order's env, and answers at the address Placed names; a destroyed machine's port is free.
The worker's range is a default block claimed on the host, as ``supplier run`` claims it:
tests running at once (xdist's workers, another checkout's run) never share a port."""

from __future__ import annotations

import json
import urllib.request

import anyio

from bourse.wire.messages import Placed
from supplier.config import WorkerConfig
from supplier.host import SupplierHost
from supplier.ports import DEFAULT_BLOCK, PortClaims, PortRange
from tests.cli import buyer
from tests.isolation import own_worker_id
from tests.market import Market, order, worker

W1 = own_worker_id("ports1")

# Serves its environment's variables of interest as JSON on 0.0.0.0:$PORT.
SERVER = """
import http.server, json, os
keys = ("PORT", "BOURSE_PORT_HTTP", "BOURSE_ADDR_HTTP", "GREETING", "BOURSE_MACHINE_ID")
body = json.dumps({k: os.environ.get(k) for k in keys}).encode()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("0.0.0.0", int(os.environ["PORT"])), H).serve_forever()
"""


def server_worker() -> WorkerConfig:
    return worker(
        W1,
        driver="process",
        catalog={"srv": {"command": ["{python}", "-c", SERVER]}},
        advertise_host="127.0.0.1",
    )


async def server_host(market: Market) -> tuple[SupplierHost, PortRange]:
    """A supplier of the server's worker, and the block of ports its worker claimed."""
    host = await market.host(server_worker(), port_claims=PortClaims())
    port_range = host.workers[W1].ports.range
    assert port_range is not None
    return host, port_range


def port_in(port_range: PortRange, addr: str) -> bool:
    host, port = addr.rsplit(":", 1)
    return host == "127.0.0.1" and port_range.lo <= int(port) <= port_range.hi


def get(addr: str) -> dict[str, str] | None:
    """The server's JSON, or None while it is not answering yet."""
    try:
        with urllib.request.urlopen(f"http://{addr}/", timeout=1) as r:
            return dict(json.loads(r.read()))
    except OSError:
        return None


async def answer(addr: str, timeout_s: float = 10.0) -> dict[str, str]:
    """Ask until the server answers (it binds a moment after it starts)."""
    with anyio.fail_after(timeout_s):
        while True:
            got = await anyio.to_thread.run_sync(get, addr)
            if got is not None:
                return got
            await anyio.sleep(0.05)  # the next try, not a synchronisation


async def test_two_copies_of_a_server_each_get_a_port_and_answer_there(market: Market) -> None:
    host, port_range = await server_host(market)
    await market.exchange()
    buyer = await market.client()
    placed = []
    for i in range(2):
        r = await buyer.place(
            order(image="srv", ports=["http"], env={"GREETING": f"hi {i}"}, order_id=f"srv-{i}")
        )
        assert isinstance(r, Placed), r
        placed.append(r)
        m = await buyer.machine("start", r.machine_id)
        assert m.state == "started" and m.addresses == r.addresses
    a, b = (p.addresses["http"] for p in placed)
    assert a != b and port_in(port_range, a) and port_in(port_range, b)
    for i, (p, addr) in enumerate(zip(placed, (a, b), strict=True)):
        env = await answer(addr)
        port = addr.rsplit(":", 1)[1]
        assert env == {
            "PORT": port,
            "BOURSE_PORT_HTTP": port,
            "BOURSE_ADDR_HTTP": addr,
            "GREETING": f"hi {i}",
            "BOURSE_MACHINE_ID": p.machine_id,
        }
    [listed] = [
        m for m in (await buyer.machines(W1)).machines if m.machine_id == placed[0].machine_id
    ]
    assert listed.addresses == {"http": a} and listed.env_keys == ["GREETING"]
    [status] = await buyer.status("mad")
    assert (status.port_range, status.capacity.ports, status.committed.ports) == (
        str(port_range),
        DEFAULT_BLOCK,
        2,
    )
    assert status.advertise_host == "127.0.0.1"
    await buyer.machine("destroy", placed[0].machine_id)
    w = host.workers[W1]
    assert w.ledger.committed[4] == 1 and list(w.ports.allocator.of) == [placed[1].machine_id]
    assert market.violations() == []


async def test_the_cli_prints_addresses_and_env_keys_never_values(market: Market) -> None:
    _, port_range = await server_host(market)
    await market.exchange()
    place = ("place", "--region", "mad", "--cpus", "1", "--memory-mb", "64", "--image", "srv")
    code, out, err = await buyer(market, *place, "--port", "http", "--env", "TOKEN=s3cret")
    assert (code, err) == (0, ""), out + err
    [line] = [x for x in out.splitlines() if "addresses:" in x]
    addr = line.split("http=")[1].strip()
    assert port_in(port_range, addr)
    machine_id = out.split()[1]
    code, out, err = await buyer(market, "machines", "show", machine_id)
    assert code == 0, err
    assert f"addresses: http={addr}" in out and "env: TOKEN (values not shown)" in out
    assert "s3cret" not in out
    code, out, err = await buyer(market, "machines", "show", machine_id, "--json")
    assert "s3cret" not in out and json.loads(out)["machine"]["env_keys"] == ["TOKEN"]
