"""The omniscient centralized oracle: the placement-quality ceiling.

It replays the same trace in trace time with perfect, instant knowledge of every worker:
each order goes to the best-scoring worker that fits in its region (same Pricer, same
image caches and budgets as the suppliers), machines leave after their lifetime, and an
image a placed machine needs enters that worker's cache at once. No holds, no latency, no
races: whatever Bourse fills less than this is the price of being decentralized.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

import msgspec

from bourse.wire.resources import ZERO, Vec, add, leq, sub, vec
from loadtest.workload import Profile, TraceOrder, fleet, image_sizes
from supplier import CatalogCache, Pricer, WorkerConfig


@dataclass
class OracleResult:
    orders: int
    placed: int
    image_hits: int
    chosen: dict[str, str]  # order id -> worker id

    @property
    def fill_rate(self) -> float:
        return self.placed / self.orders if self.orders else 0.0

    @property
    def image_hit_rate(self) -> float:
        return self.image_hits / self.placed if self.placed else 0.0


class _W:
    __slots__ = ("cache", "capacity", "in_use", "pricer", "used", "worker_id")

    def __init__(self, cfg: WorkerConfig, sizes: dict[str, int]) -> None:
        self.worker_id = cfg.worker_id
        self.capacity = vec(cfg.capacity)
        self.used: Vec = ZERO
        self.pricer = Pricer(cfg.pricing)
        self.cache = CatalogCache(cfg.image_budget_mb, cfg.images, lambda i: sizes.get(i, 0))
        self.in_use: Counter[str] = Counter()

    def uses(self, image: str) -> bool:
        """Whether a machine placed here runs ``image`` (the cache never evicts it then)."""
        return self.in_use[image] > 0


def run_oracle(profile: Profile, orders: list[TraceOrder]) -> OracleResult:
    sizes = image_sizes(profile)
    by_region: dict[str, list[_W]] = {}
    for raw in fleet(profile):
        cfg = msgspec.convert(raw, WorkerConfig)
        by_region.setdefault(cfg.region, []).append(_W(cfg, sizes))
    leaving: list[tuple[float, int, _W, Vec, str]] = []
    placed = hits = 0
    chosen: dict[str, str] = {}
    for n, t in enumerate(orders):
        while leaving and leaving[0][0] <= t.due_s:
            _, _, w, want, image = heapq.heappop(leaving)
            w.used = sub(w.used, want)
            w.in_use[image] -= 1
        want = vec(t.order.resources)
        image = t.order.image
        best: tuple[float, _W] | None = None
        for w in by_region.get(t.order.region, ()):
            if not leq(add(w.used, want), w.capacity):
                continue
            score, _ = w.pricer.price(w.capacity, w.used, want, image in w.cache)
            if best is None or score > best[0]:
                best = (score, w)
        if best is None:
            continue
        w = best[1]
        placed += 1
        chosen[t.order.order_id] = w.worker_id
        if image in w.cache:
            hits += 1
            w.cache.touch(image)
        elif profile.start_machines:
            w.cache.add(image, w.uses)
        w.used = add(w.used, want)
        w.in_use[image] += 1
        heapq.heappush(leaving, (t.due_s + t.lifetime_s, n, w, want, image))
    return OracleResult(len(orders), placed, hits, chosen)
