"""What lets tests run at the same time (pytest-xdist's workers, another checkout's run)
where a resource is the host's rather than the test's: the cgroups of a process-driver
worker, ``<cgroup>/bourse/<worker_id>/``, which a supplier's start and stop sweep (every
machine cgroup of its worker, whoever made it)."""

from __future__ import annotations

import fcntl
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
