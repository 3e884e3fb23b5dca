"""The example app (examples/hello-http), as the demo pushes it: an image of its files only,
placed by its tag on a real supplier (process driver), started as a process from its own
files with the host's python3, answering HTTP on its named port's published address (the
machine listens in a network of its own where the host allows)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import anyio
import pytest

from bourse.client.follow import follow_logs
from bourse.images import ImageStore
from bourse.wire.messages import Placed
from ops.hello import HELLO_DIR, HELLO_RUN
from tests.market import Market, order, worker


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.status, reply.read()


@pytest.mark.parametrize(
    "keep_machines", [False, True], ids=["held by the supplier", "held by a shim"]
)
async def test_the_example_app_runs_from_its_image_and_answers_http(
    market: Market, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep_machines: bool
) -> None:
    await market.jetstream_init()
    store = await ImageStore.open(await market.connect("images"), market.subjects.prefix)
    # the demo's image: the app listens on PORT, its named port's
    pushed = await store.push_directory(HELLO_DIR, "hello:test", HELLO_RUN)
    # a data dir named relative to the supplier's directory, as `bourse up`'s .bourse/up
    monkeypatch.chdir(tmp_path)
    w1 = worker("w1", driver="process", keep_machines=keep_machines)
    await market.host(w1, data_dir=Path("supplier"))
    buyer = await market.client(direct=True)
    placed = await buyer.place(order(image="hello:test", ports=["web"], order_id="o1"))
    assert isinstance(placed, Placed), placed
    machine = await buyer.machine("start", placed.machine_id)
    assert (machine.state, machine.image_digest) == ("started", pushed.digest)
    address = machine.addresses["web"]
    port = int(address.rsplit(":", 1)[1])
    try:
        with anyio.fail_after(10):  # its first line says it listens: then it answers
            async for got in follow_logs(buyer, placed.machine_id, tail=10, every_s=0.02):
                if any(f"listening on port {port}" in line for line in got.lines):
                    break
        status, body = await anyio.to_thread.run_sync(_get, f"http://{address}/")
        assert status == 200
        said = json.loads(body)
        assert said["machine_id"] == placed.machine_id
        assert (said["image_digest"], said["version"]) == (pushed.digest, "1")
        assert said["hostname"]
        health = await anyio.to_thread.run_sync(_get, f"http://{address}/healthz")
        assert health == (200, b"ok\n")
    finally:
        await buyer.machine("destroy", placed.machine_id)
