"""A worker's machines' networks on the host (supplier/machines/host/network.py): its bridge,
rules and namespaces, as its supplier makes and removes them (root, nftables and pyroute2, or
the test is skipped saying which is missing)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from supplier.machines.host.claims import host_claims
from supplier.machines.host.confine import owner_of
from supplier.machines.host.netns import available
from supplier.machines.host.network import WorkerNetwork, bridge_mac
from tests.isolation import own_worker_id


@pytest.fixture
def network(tmp_path: Path) -> Iterator[WorkerNetwork]:
    if os.geteuid() != 0 or available():
        pytest.skip(f"machines cannot have networks of their own here: {available()}")
    owner = owner_of(tmp_path)
    host_claims().live(owner, tmp_path)
    net = WorkerNetwork(host_claims(), owner, own_worker_id("net"))
    net.setup()
    try:
        yield net
    finally:
        net.close()
        host_claims().gone(owner)


def test_a_bridge_keeps_its_address_as_machines_come_and_go(network: WorkerNetwork) -> None:
    """A bridge without an address of its own takes its ports' lowest, so a machine's start
    or end changed it and every other machine's gateway entry went stale: their
    connections were cut until it expired (tests/security/test_machine_attacks.py saw bob's
    web machine unreachable after alice's machine ended)."""
    address = Path(f"/sys/class/net/{network.bridge}/address")
    seen = {address.read_text().strip()}
    for i in range(4):
        network.take(f"m{i}")
        seen.add(address.read_text().strip())
    for i in range(4):
        network.release(f"m{i}")
        seen.add(address.read_text().strip())
    assert seen == {bridge_mac(network.bridge)}
