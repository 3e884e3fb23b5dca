"""What the edge's connections share (:class:`Proxy`): the router, the upstream pools, the
config, metrics, the tasks that connect, and every client connection (to close them at a
stop); and how the proxy treats clients and upstreams (:class:`EdgeConfig`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from bourse.runtime.tasks import TaskSet
from edge.hosts import app_of
from edge.routing import Router

if TYPE_CHECKING:
    from bourse.runtime.metrics import EdgeMetrics
    from edge.starts import Starts
    from edge.upstream import Upstream

HOSTS_KEPT = 4096


class Abortable(Protocol):
    """A connection the stop closes at once (an HTTP client's, a TCP service's)."""

    def abort(self) -> None: ...

    def cut(self, dead: Collection[str]) -> None:
        """Its upstream to a machine of ``dead`` closed (a request not yet answered goes
        to another machine, as any lost upstream's)."""


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    """How the proxy treats clients and upstreams (``edge serve``'s options)."""

    domain: str = "localhost"
    max_body_bytes: int = 10 * 1024 * 1024
    header_timeout_s: float = 10.0  # a request's head, from its first byte
    idle_timeout_s: float = 60.0  # a kept-alive client connection between requests
    max_conns_per_ip: int = 256
    connect_timeout_s: float = 2.0
    attempts: int = 3  # machines a request may be sent to, in all
    pool_idle_s: float = 1.0  # an idle upstream connection is not reused after this long
    pool_max: int = 64  # idle upstream connections kept per machine address
    access_log: bool = True


class Proxy:
    """What the connections share: the router, the upstream pools, the config, metrics,
    the tasks that connect, and every client connection (to close them at a stop)."""

    def __init__(
        self, router: Router, config: EdgeConfig, metrics: EdgeMetrics | None = None
    ) -> None:
        self.router = router
        self.config = config
        self.metrics = metrics
        self.starts: Starts | None = None  # requests held while a machine starts
        self.tasks = TaskSet("edge-connect")
        self.pools: dict[tuple[str, int], deque[Upstream]] = {}
        self.clients: set[Abortable] = set()
        self.per_ip: dict[str, int] = {}
        self.in_flight = 0
        self._idle: asyncio.Event | None = None  # made by wait_idle, set at 0
        self.loop = asyncio.get_running_loop()
        self.period = min(config.header_timeout_s, config.idle_timeout_s)
        self.hosts: dict[bytes, str] = {}  # Host -> app key, as app_of said

    def take(self, address: tuple[str, int]) -> Upstream | None:
        """An idle pooled connection to ``address`` still fit for a request, or None."""
        pool = self.pools.get(address)
        if not pool:
            return None
        oldest = time.monotonic() - self.config.pool_idle_s
        while pool:
            up = pool.pop()  # the most recently used: the likeliest still open
            if not up.closed and up.idle_since >= oldest:
                return up
            up.close()
        return None

    def drop_pool(self, address: tuple[str, int]) -> None:
        """Close every idle connection kept to ``address``."""
        for up in self.pools.pop(address, ()):
            up.close()

    def give(self, address: tuple[str, int], up: Upstream) -> None:
        """Keep ``up`` for the next request to ``address`` (or close it: pool full)."""
        pool = self.pools.get(address)
        if pool is None:
            pool = self.pools[address] = deque()
        if len(pool) >= self.config.pool_max:
            up.close()
            return
        up.idle_since = time.monotonic()
        pool.append(up)

    def busy(self, delta: int) -> None:
        self.in_flight += delta
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def wait_idle(self) -> None:
        """Until no request is in flight."""
        if self.in_flight:
            self._idle = self._idle or asyncio.Event()
            await self._idle.wait()

    def app_of(self, host: bytes) -> str:
        """edge/hosts.py ``app_of``, remembered per Host (a few thousand at most)."""
        key = self.hosts.get(host)
        if key is None:
            key = app_of(host, self.config.domain)
            if len(self.hosts) >= HOSTS_KEPT:
                self.hosts.clear()
            self.hosts[host] = key
        return key

    def cut(self, dead: Collection[str]) -> None:
        """The connections to the machines in ``dead`` (ended, or their worker gone) closed:
        a request under way there gets no answer and no reset when the machine's network is
        gone with it, so it is not waited for (retried elsewhere when it may be)."""
        for client in list(self.clients):
            client.cut(dead)

    def close(self) -> None:
        """Every connection, client and upstream, closed at once (the stop's last step)."""
        for client in list(self.clients):
            client.abort()
        for pool in self.pools.values():
            for up in pool:
                up.close()
        self.pools.clear()
