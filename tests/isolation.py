"""What lets tests run at the same time (pytest-xdist's workers, another checkout's run)
where a resource is the host's rather than the test's: the cgroups of a process-driver
worker, ``<cgroup>/bourse/<worker_id>/``, which a supplier's start and stop sweep (every
machine cgroup of its worker, whoever made it)."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_THIS_RUN = uuid.uuid4().hex[:8]


def own_worker_id(name: str) -> str:
    """``name`` made this test process's own, for a worker whose machines run in cgroups:
    two suppliers of one worker id at once would kill each other's machines."""
    return f"{name}-{_THIS_RUN}"


# The lock has the cgroups' scope: the host.
_DEMO_FLEET_LOCK = Path(tempfile.gettempdir()) / "bourse-tests-demo-fleet.lock"


@pytest.fixture
def demo_fleet_alone() -> Iterator[None]:
    """Waits until no other test on this host runs the demo fleet, and holds that off
    until this test ends. The demo fleet's worker ids (mad-1 …) are fixed and nothing in
    `bourse up` or `bourse demo` lets a test choose them or the cgroup parent, so its own
    worker ids are no way out here."""
    with _DEMO_FLEET_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


ONE_DEMO_FLEET_AT_A_TIME = pytest.mark.usefixtures("demo_fleet_alone")


# -- the host's claims: a directory of this session's own, and a slice of the user ids ------
SESSIONS_DIR = Path(tempfile.gettempdir()) / "bourse-test-sessions"
SLICE_BLOCKS = 256  # user id blocks a session's machines draw from
SLICES = 100  # sessions at once on a host (the second octet of a session's machine network)
# default port blocks (of 127) a session draws from: the demo fleet's 9 workers and the tests
# beside it (8 could never start the demo); 3 sessions at once before two share a slice
SLICE_PORT_BLOCKS = 40


def pytest_configure(config: pytest.Config) -> None:
    """Once per session (in the controller; xdist's workers inherit the environment): the
    suppliers of this session claim the host's ports, subnets and user ids in a directory
    of its own, and draw user ids, machines' networks and default port blocks from a slice
    no other session on the host uses (held for the session's life: its claim's owner lock
    is this process's)."""
    if hasattr(config, "workerinput") or os.environ.get("BOURSE_CLAIMS_DIR"):
        return
    import supplier.machines.host.ids as ids
    from supplier.machines.host.claims import Claim, HostClaims
    from supplier.ports import DEFAULT_BLOCKS

    os.environ["BOURSE_CLAIMS_DIR"] = tempfile.mkdtemp(prefix="bourse-claims-")
    sessions = HostClaims(SESSIONS_DIR)
    owner = f"session-{os.getpid()}-{_THIS_RUN}"
    sessions.live(owner)
    with sessions.locked():
        taken = {int(c.key) for c in sessions.standing("slice")}
        free = next(i for i in range(SLICES) if i not in taken)
        sessions.take(Claim("slice", str(free), owner, owner))
    first = ids.FIRST_BLOCK + free * SLICE_BLOCKS
    os.environ["BOURSE_UID_BLOCKS"] = f"{first}-{first + SLICE_BLOCKS - 1}"
    os.environ["BOURSE_MACHINE_NET"] = f"10.{100 + free}.0.0/16"
    ports = (free % (DEFAULT_BLOCKS // SLICE_PORT_BLOCKS)) * SLICE_PORT_BLOCKS
    os.environ["BOURSE_PORT_BLOCKS"] = f"{ports}-{ports + SLICE_PORT_BLOCKS - 1}"
    config._bourse_sessions = sessions  # type: ignore[attr-defined]  # its lock lives on


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session ends (in the controller): what its suppliers' machines' networks left on
    the host (a supplier a test killed, its data dir then removed) is removed, as the next
    supplier to claim their subnets would; then the session's claims."""
    if not hasattr(config, "_bourse_sessions"):
        return
    from supplier.machines.host.claims import HostClaims
    from supplier.machines.host.netns import available
    from supplier.machines.host.network import KIND, remove_leftovers

    directory = Path(os.environ["BOURSE_CLAIMS_DIR"])
    if not available():
        claims = HostClaims(directory)
        with claims.locked():
            for c in claims.all(KIND):
                remove_leftovers(c.owner, c.holder)
    shutil.rmtree(directory, ignore_errors=True)
