"""A test market on a real nats-server: suppliers (in-process hosts on their own NATS
connections and SQLite files), exchange instances and buyers. Everything built is closed
by ``close()``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from bourse.auction.driver import AuctionConfig
from bourse.client import BourseClient
from bourse.nats.connection import connect
from bourse.wire.messages import PlaceOrder, Resources
from bourse.wire.subjects import Subjects
from exchange.service import ExchangeService
from supplier.config import WorkerConfig
from supplier.host import SupplierHost
from supplier.store import Store


def worker(
    worker_id: str,
    region: str = "mad",
    cpus: int = 8,
    memory_mb: int = 8192,
    **extra: Any,
) -> WorkerConfig:
    raw = {
        "worker_id": worker_id,
        "region": region,
        "capacity": {"cpus": cpus, "memory_mb": memory_mb, **extra.pop("capacity", {})},
        **extra,
    }
    return msgspec.convert(raw, WorkerConfig)


def order(
    region: str = "mad", cpus: int = 1, memory_mb: int = 256, image: str = "web", **kw: Any
) -> PlaceOrder:
    return PlaceOrder(
        region=region, resources=Resources(cpus=cpus, memory_mb=memory_mb), image=image, **kw
    )


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll a condition (not a sleep-as-sync: it returns as soon as the condition holds)."""
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


class Market:
    def __init__(self, url: str, subjects: Subjects, tmp_path: Path) -> None:
        self.url = url
        self.subjects = subjects
        self.tmp_path = tmp_path
        self.conns: list[NATS] = []
        self.hosts: list[SupplierHost] = []
        self.stores: list[Store] = []
        self.exchanges: list[ExchangeService] = []
        self.clients: list[BourseClient] = []

    async def connect(self, name: str = "test", **kw: Any) -> NATS:
        nc = await connect(self.url, name=name, service=False, **kw)
        self.conns.append(nc)
        return nc

    async def host(
        self, *workers: WorkerConfig, data_dir: Path | None = None, **options: Any
    ) -> SupplierHost:
        data_dir = data_dir or self.tmp_path / f"supplier-{len(self.hosts)}"
        store = Store(data_dir / "supplier.db")
        self.stores.append(store)
        host = SupplierHost(
            await self.connect("supplier"), list(workers), store, self.subjects, **options
        )
        await host.start()
        self.hosts.append(host)
        return host

    async def exchange(self, **auction: Any) -> ExchangeService:
        svc = ExchangeService(
            await self.connect("exchange"), self.subjects, auction=AuctionConfig(**auction)
        )
        await svc.start()
        self.exchanges.append(svc)
        return svc

    async def client(self, direct: bool = False, **auction: Any) -> BourseClient:
        c = BourseClient(
            await self.connect("buyer"),
            self.subjects,
            direct=direct,
            auction=AuctionConfig(**auction) if auction else None,
        )
        self.clients.append(c)
        return c

    def violations(self) -> list[str]:
        return [v for h in self.hosts for v in h.check_invariants()]

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
        for svc in self.exchanges:
            await svc.stop()
        for h in self.hosts:
            await h.stop()
        for nc in self.conns:
            # close, not drain: a test's sync subscription may hold unread messages, and
            # drain would wait its 30 s timeout for them (graceful drain is tested on the
            # real processes in test_processes.py).
            if not nc.is_closed:
                await nc.close()
        for s in self.stores:
            s.close()
