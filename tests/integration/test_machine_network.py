"""Each machine a network of its own (docs/protocol.md §6.8e), on a real root supplier's
process and oci workers: a private address given at its commit and kept across its runs
until its destroy, said by Placed, the machine and its events; its named port answers at
the published address (loopback, DNAT) and at the private one; a stopped machine holds no
namespace and no published port; a destroyed one leaves nothing of its network."""

from __future__ import annotations

import ipaddress
import os
import shlex
import subprocess
import urllib.request
from pathlib import Path

import anyio
import pytest

from bourse.images import ImageStore, RunSpec
from bourse.wire.codec import decode
from bourse.wire.messages import Event, Placed
from ops.hello import HELLO_DIR, HELLO_RUN
from supplier.machines.host.claims import host_claims
from supplier.machines.host.confine import owner_of
from supplier.machines.host.netns import available
from supplier.machines.host.network import Names, WorkerNetwork, bridge_mac
from tests.containers import busybox_root, need_runc
from tests.isolation import own_worker_id
from tests.market import Market, collect, order, wait_until, worker

BOX_CMD = 'sh -c "exec httpd -f -p $PORT -h /www"'
WAIT_S = 20.0


def _need_networks() -> None:
    if os.geteuid() != 0:
        pytest.skip("machines' networks need a root supplier")
    why = available()
    if why:
        pytest.skip(f"machines share the host's network here: {why}")


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=2) as reply:
        return int(reply.status)


async def _answers(url: str) -> None:
    """The machine's server answers at ``url`` (polled: it listens a moment after its start)."""
    with anyio.fail_after(WAIT_S):
        while True:
            try:
                if await anyio.to_thread.run_sync(_get, url) == 200:
                    return
            except OSError:
                pass
            await anyio.sleep(0.02)  # the poll's pace, not a synchronisation


def _published(table: str) -> str:
    done = subprocess.run(
        ["nft", "list", "map", "ip", table, "ports"], capture_output=True, text=True, check=False
    )
    return done.stdout


@pytest.mark.parametrize("driver", ["process", "oci"])
async def test_a_machine_keeps_its_private_address_from_commit_to_destroy(
    market: Market, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, driver: str
) -> None:
    _need_networks()
    await market.jetstream_init()
    store = await ImageStore.open(await market.connect("images"), market.subjects.prefix)
    if driver == "oci":
        need_runc()
        root = busybox_root(tmp_path / "root")
        (root / "www").mkdir()
        (root / "www" / "index.html").write_text("box\n")
        await store.push_directory(root, "net:v1", RunSpec(cmd=tuple(shlex.split(BOX_CMD))))
    else:
        await store.push_directory(HELLO_DIR, "net:v1", HELLO_RUN)
    monkeypatch.chdir(tmp_path)
    wid = own_worker_id("net")
    await market.host(worker(wid, driver=driver, keep_machines=False), data_dir=Path("supplier"))
    names = Names.of(owner_of(Path("supplier").absolute()), wid)
    buyer = await market.client(direct=True)

    placed = await buyer.place(order(image="net:v1", ports=["web"], memory_mb=64))
    assert isinstance(placed, Placed), placed
    private = placed.private_address
    subnet = ipaddress.IPv4Network(os.environ.get("BOURSE_MACHINE_NET", "10.77.0.0/16"))
    assert ipaddress.IPv4Address(private) in subnet  # the session's own machine network
    host_port = placed.addresses["web"]
    port = host_port.rsplit(":", 1)[1]
    try:
        for run in range(2):  # a stop and a start again: the same address
            m = await buyer.machine("start", placed.machine_id)
            assert (m.state, m.private_address) == ("started", private), run
            await _answers(f"http://{host_port}/")  # published: loopback, through DNAT
            await _answers(f"http://{private}:{port}/")  # its own address, from the host
            assert f"{port} : {private}" in _published(names.table)
            stopped = await buyer.machine("stop", placed.machine_id)
            assert (stopped.state, stopped.private_address) == ("stopped", private)
            # a stopped machine holds no namespace and no published port
            assert f"{port} : {private}" not in _published(names.table)
            listing = (await buyer.machines(wid)).machines
            assert [x.private_address for x in listing] == [private]
    finally:
        gone = await buyer.machine("destroy", placed.machine_id)
    assert gone.state == "destroyed"
    assert f": {private}" not in _published(names.table)


async def test_placed_and_started_events_say_the_private_address(
    market: Market, tmp_path: Path
) -> None:
    _need_networks()
    await market.jetstream_init()
    store = await ImageStore.open(await market.connect("images"), market.subjects.prefix)
    await store.push_directory(HELLO_DIR, "net:v1", HELLO_RUN)
    wid = own_worker_id("nev")
    await market.host(worker(wid, driver="process", keep_machines=False))
    buyer = await market.client(direct=True)
    got = await collect(await market.connect("watch"), market.subjects.events())
    placed = await buyer.place(order(image="net:v1", ports=["web"], memory_mb=64))
    assert isinstance(placed, Placed) and placed.private_address

    def said(kind: str) -> list[Event]:
        every = [decode(e.data, Event) for e in got]
        return [e for e in every if e.kind == kind and e.machine_id == placed.machine_id]

    try:
        await buyer.machine("start", placed.machine_id)
        await wait_until(lambda: bool(said("placed")) and bool(said("started")))
        assert said("placed")[0].private_address == placed.private_address
        assert said("started")[0].private_address == placed.private_address
    finally:
        await buyer.machine("destroy", placed.machine_id)


def test_a_bridge_keeps_its_address_as_machines_come_and_go(tmp_path: Path) -> None:
    """A bridge without an address of its own takes its ports' lowest, so a machine's start
    or end changed it and every other machine's gateway entry went stale: their
    connections were cut until it expired (tests/security/test_machine_attacks.py saw bob's
    web machine unreachable after alice's machine ended)."""
    _need_networks()
    owner = owner_of(tmp_path)
    host_claims().live(owner, tmp_path)
    network = WorkerNetwork(host_claims(), owner, own_worker_id("net"))
    network.setup()
    try:
        address = Path(f"/sys/class/net/{network.bridge}/address")
        seen = {address.read_text().strip()}
        for i in range(4):
            network.take(f"m{i}", network.reserve(f"m{i}"))
            seen.add(address.read_text().strip())
        for i in range(4):
            network.release(f"m{i}")
            network.give_back(f"m{i}")
            seen.add(address.read_text().strip())
        assert seen == {bridge_mac(network.bridge)}
    finally:
        network.close()
        host_claims().gone(owner)
