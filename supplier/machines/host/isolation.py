"""What a machine gets of its own on its worker's host, whatever kind it is: its users (a
block of ids: supplier/machines/host/ids.py) and its network (a namespace with a private
address, its ports published: supplier/machines/host/network.py). Both kinds of machine
(supplier/machines/process.py, supplier/machines/oci/kind.py) take them here before a run
and give them back after it, so that the rules are written once."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog

from bourse.wire.messages import IsolationLevel, Machine
from supplier.machines.api import DriverError, Pause
from supplier.machines.host.ids import UidBlocks
from supplier.machines.host.netns import NetworkError, available
from supplier.machines.host.network import MachineNet, WorkerNetwork
from supplier.machines.host.nftables import NftError

log = structlog.get_logger("bourse.isolation")

# What Bourse keeps on the host outside data dirs (claims, containers' bundles, roots and
# layers): a mount point of its own (:func:`own_mount_point`), so that a machine's mount
# namespace drops all below it at once.
RUN_DIR = Path("/run/bourse")


def own_mount_point(path: Path = RUN_DIR) -> None:
    """``path`` made a mount point of its own (bound onto itself) and shared, unless it is
    one: a process machine detaches it from its copy of the host's mounts, with every
    container's root and layer below it, and a mount namespace made as the host's slave (a
    systemd service's, for one) sees them unmounted when the host unmounts them: no copy
    holds a machine's mounts, and its loop device, past its end (blocking; idempotent;
    RuntimeError naming mount's words)."""
    path.mkdir(parents=True, exist_ok=True)
    with open("/proc/self/mountinfo") as f:
        rows = [row.split(" ") for row in f if row.count(" ") > 6]
    mine = [row for row in rows if row[4] == str(path)]
    steps = []
    if not mine:
        steps.append(["mount", "--bind", str(path), str(path)])
    if not mine or not any(tag.startswith("shared:") for tag in mine[-1][6:]):
        steps.append(["mount", "--make-shared", str(path)])
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"cannot make {path} a shared mount point: {done.stderr.strip()}")


def keep_private(data_dir: Path) -> None:
    """The supplier's data dir is root's alone: its store (every machine's env), the
    machines' logs, the shims' sockets and states, the image cache. Nothing of a machine
    runs from it as the machine's user (its image and working directory are bound where it
    sees them before it becomes its user; a container's bundle is outside it)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    data_dir.chmod(0o700)


@dataclass(frozen=True, slots=True)
class Entered:
    """A machine's run's own: its ids' first (-1: the supplier's), its network namespace
    ("" : the host's network) and private address, and the resolv.conf it sees."""

    ids: int = -1
    netns: str = ""
    address: str = ""
    resolv: str = ""


class Isolation:
    """One worker's machines' users and networks (either may be off: None)."""

    def __init__(
        self,
        ids: UidBlocks | None = None,
        network: WorkerNetwork | None = None,
        resolv: Path | None = None,
    ) -> None:
        self.ids = ids
        self.network = network
        self.resolv = resolv
        self.wanted = anyio.Event()  # a namespace was taken: make another ahead
        self.pause: Pause | None = None  # a test's, once a start's network is taken (api.py)
        # machine id -> how long its last start took to enter its network, ms (the start's
        # log line says it: Runner.start takes it)
        self.entered_ms: dict[str, float] = {}

    def describe(self) -> IsolationLevel:
        """``users,network``, ``users`` or ``none`` (a worker's status says it)."""
        if self.ids is None:
            return "none"
        return "users" if self.network is None else "users,network"

    def reserve(self, machine_id: str, kept: str = "") -> str:
        """The machine's private address, from its commit to its destroy ("" when its
        machines share the host's network, or none is left)."""
        return self.network.reserve(machine_id, kept) if self.network is not None else ""

    async def enter(self, m: Machine) -> Entered:
        """The machine's ids (kept from its first start to its destroy) and a network for
        this run at its address, its ports published (DriverError naming what failed)."""
        ids = -1 if self.ids is None else self.ids.base(m.machine_id)
        if self.network is None:
            return Entered(ids=ids)
        address = self.network.reserve(m.machine_id, m.private_address)
        if not address:
            raise DriverError(
                f"cannot give {m.machine_id} a network: no private address left in "
                f"{self.network.subnet} (each machine keeps its own until destroyed)"
            )
        began = time.perf_counter()
        try:
            net = await anyio.to_thread.run_sync(self.network.take, m.machine_id, address)
            self.wanted.set()
            await anyio.to_thread.run_sync(self.network.publish, m.machine_id, m.addresses)
            if self.pause is not None:
                await self.pause("network", m.machine_id)
        except (NetworkError, NftError) as exc:
            await self.leave(m.machine_id)
            raise DriverError(f"cannot give {m.machine_id} a network: {exc}") from None
        self.entered_ms[m.machine_id] = (time.perf_counter() - began) * 1000
        resolv = str(self.resolv) if self.resolv is not None else ""
        return Entered(ids=ids, netns=net.path, address=net.address, resolv=resolv)

    async def leave(self, machine_id: str) -> None:
        """The run ended: its network goes (its ids stay with the machine)."""
        if self.network is not None:
            await anyio.to_thread.run_sync(self.network.release, machine_id)

    async def forget(self, machine_id: str) -> None:
        """The machine is destroyed: its network, its address and then its ids go back
        (nothing of its users left running)."""
        await self.leave(machine_id)
        if self.network is not None:
            self.network.give_back(machine_id)
        if self.ids is not None:
            await anyio.to_thread.run_sync(self.ids.give_back, machine_id)

    async def start(self) -> None:
        """The worker's part made (its subnet claimed, its bridge, its rules; /run/bourse a
        mount point): before any machine's (pyroute2 runs an event loop of its own: never on
        ours). A host without what it takes (supplier/machines/host/netns.py ``available``)
        gives machines its own network, and the log says why."""
        if self.ids is not None:
            await anyio.to_thread.run_sync(own_mount_point)
        if self.network is None:
            return
        why = await anyio.to_thread.run_sync(available)
        if why:
            worker_id = self.network.worker_id
            log.warning("machines_share_the_hosts_network", worker_id=worker_id, why=why)
            self.network = None
            return
        await anyio.to_thread.run_sync(self.network.setup)

    async def keep(self, runs: dict[str, str]) -> list[str]:
        """At a supplier's start: the networks of the runs that go on (machine id -> its
        namespace's path) are theirs again; the rest an earlier run left is removed."""
        if self.network is None:
            return []
        network = self.network

        def keep() -> list[str]:
            for mid, path in runs.items():
                if path:
                    network.adopt(mid, MachineNet.of_path(path))
            return network.sweep({Path(p).name for p in runs.values() if p})

        return await anyio.to_thread.run_sync(keep)

    def private(self, machine_id: str) -> str:
        return self.network.private(machine_id) if self.network is not None else ""

    async def background(self) -> None:
        """Namespaces made ahead, after every take, until cancelled."""
        if self.network is None:
            return
        network = self.network
        try:
            while True:
                self.wanted = anyio.Event()
                await anyio.to_thread.run_sync(network.fill, abandon_on_cancel=True)
                await self.wanted.wait()
        finally:
            self.wanted = anyio.Event()

    async def close(self) -> None:
        """The worker ends (its machines stopped, or let go of): nothing of its networks
        is left but what kept machines use."""
        if self.network is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.network.close)
