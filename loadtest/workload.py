"""Seeded workloads: the fleet to simulate and the trace of orders to send.

Same profile and seed, same fleet and same trace (order by order), so two runs, or a run
and the oracle, see exactly the same demand.
"""

from __future__ import annotations

import math
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from bourse.auction.admission import DEFAULT_TARGET_MS
from bourse.auction.core import AuctionConfig
from bourse.wire.messages import PlaceOrder
from bourse.wire.resources import parse_cpus, resources, wire_cpus
from supplier import DEFAULT_MAX_OFFERS, DEFAULT_QUOTE_SAMPLE, DEFAULT_RECLAIM_AFTER_S


class Shape(msgspec.Struct, frozen=True):
    """One kind of order: ``cpus`` may be fractional (0.5; at most 3 decimals)."""

    cpus: float
    memory_mb: int
    weight: float = 1.0


class Profile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything a load run depends on. Times in seconds unless the name says _ms."""

    name: str = "custom"
    seed: int = 1
    # the fleet
    regions: int = 2
    workers: int = 40  # in total, spread evenly over the regions
    worker_cpus: float = 16  # may be fractional (at most 3 decimals)
    worker_memory_mb: int = 65536
    images: int = 40  # catalog size
    image_zipf_s: float = 1.1  # popularity of image k is proportional to 1 / k^s
    image_mb: tuple[int, int] = (100, 2000)
    cached_per_worker: int = 4  # images cached at start (drawn by popularity)
    image_cache_mb: int = 8000
    pull_mb_per_s: float = 2000.0
    preset: Literal["spread", "binpack"] = "spread"
    spread_ms: float = 4.0  # the suppliers' offer delay scale ((1 - score) x spread_ms)
    # the load
    mode: Literal["open", "closed"] = "open"
    rate: float = 100.0  # orders per second (open loop)
    concurrency: int = 32  # orders in flight (closed loop)
    duration_s: float = 10.0
    shapes: list[Shape] = msgspec.field(
        default_factory=lambda: [Shape(1, 1024, 5), Shape(2, 4096, 3), Shape(4, 8192, 1)]
    )
    lifetime_s: float = 20.0  # mean (exponential); machines are destroyed after it
    region_weights: list[float] = []  # default: even
    deadline_ms: int = 500
    start_machines: bool = True  # start each placed machine (pulls fill the image caches)
    direct: bool = False  # the generator runs each auction itself (buyer --direct): no exchange
    # the processes
    supplier_processes: int = 2
    exchanges: int = 1
    bid_shards: int = 0  # sampled bidding (0: broadcast every bid to the region)
    bid_sample: int = 2
    max_offers: int = DEFAULT_MAX_OFFERS  # offers per bid from one supplier process; 0: all
    quote_sample: int = DEFAULT_QUOTE_SAMPLE  # a big host prices a sample (candidates.py)
    exchange_max_inflight: int = 10_000  # auctions one exchange runs at once (admission)
    exchange_target_ms: float = DEFAULT_TARGET_MS  # adaptive admission target (0: fixed)
    # the exchanges' quiet window: an auction without an offer ends after this much silence
    exchange_quiet_ms: float = AuctionConfig().quiet_ms
    claims: bool = True  # order claims in JetStream KV (exchanges and the direct generator)
    # the embedded nats-server with JetStream; off: core NATS only, so no claims and events
    # at most once (what durability costs); only for the embedded server of a plain run
    jetstream: bool = True
    prompt_offers: bool = True  # suppliers answer at once, the auction ranks (§4.4.3)
    batches: bool = True  # bids and releases of a region sent together (§4.4.4)
    reclaim_after_s: float = DEFAULT_RECLAIM_AFTER_S  # suppliers ask about reserved machines

    def region_names(self) -> list[str]:
        return [f"r{i}" for i in range(self.regions)]

    def image_names(self) -> list[str]:
        return [f"img{i:03d}" for i in range(self.images)]

    def offered_load(self) -> float:
        """Mean CPUs demanded at steady state / fleet CPUs (1.0 = exactly full)."""
        total_w = sum(s.weight for s in self.shapes)
        mean_cpus = sum(s.cpus * s.weight for s in self.shapes) / total_w
        return self.rate * self.lifetime_s * mean_cpus / (self.workers * self.worker_cpus)


# Offered load = rate x lifetime x mean cpus (15/9 with the default shapes) / fleet cpus.
SCENARIOS: dict[str, Profile] = {
    "smoke": Profile(
        name="smoke",
        workers=12,
        regions=2,
        rate=40,
        duration_s=2.0,
        lifetime_s=2.0,
        supplier_processes=1,
        images=10,
    ),
    "idle-100": Profile(
        name="idle-100",
        workers=100,
        regions=1,
        rate=20,
        duration_s=10.0,
        lifetime_s=5.0,
        supplier_processes=1,
    ),
    # 3000/s x 2.5 s x 1.67 cpus / 16000 cpus = 78% offered load
    "fleet-1k": Profile(
        name="fleet-1k",
        workers=1000,
        regions=10,
        rate=3000,
        duration_s=20.0,
        lifetime_s=2.5,
        supplier_processes=2,
        exchanges=2,
        images=200,
        start_machines=False,
    ),
    # The soak mode's fleet (bourse loadtest --soak): 3 supplier processes and 2 exchanges,
    # so a fault always leaves others serving; 30/s x 2 s x 1.67 cpus / 384 cpus = 26%,
    # leaving room for the capacity a killed or stalled process takes away.
    "soak": Profile(
        name="soak",
        workers=12,
        regions=2,
        worker_cpus=32,
        rate=30,
        duration_s=60.0,
        lifetime_s=2.0,
        supplier_processes=3,
        exchanges=2,
        images=10,
        reclaim_after_s=2.0,  # orphans of the duplicate storm are gone before the audit
    ),
    # 20/s x 17.28 s x 1.67 cpus / 640 cpus = 90% offered load
    "quality-90": Profile(
        name="quality-90",
        workers=40,
        regions=2,
        rate=20.0,
        lifetime_s=17.28,
        duration_s=60.0,
        supplier_processes=1,
    ),
}


def resolve_profile(
    scenario: str, profile_file: Path | None = None, overrides: dict[str, Any] | None = None
) -> Profile:
    """A named scenario or a profile file (JSON or TOML), with the given fields replaced
    (``None`` values are ignored). Raises ValueError naming the problem; an override that is
    not a Profile field is an error, never silently ignored."""
    if profile_file is not None:
        try:
            text = profile_file.read_text()
            is_json = profile_file.suffix == ".json"
            raw = msgspec.json.decode(text) if is_json else tomllib.loads(text)
            base = msgspec.convert(raw, Profile, strict=False)
        except (OSError, tomllib.TOMLDecodeError, msgspec.DecodeError) as exc:
            raise ValueError(f"cannot read {profile_file}: {exc}") from None
        except msgspec.ValidationError as exc:
            raise ValueError(f"{profile_file}: {exc}") from None
    elif scenario in SCENARIOS:
        base = SCENARIOS[scenario]
    else:
        raise ValueError(f"unknown scenario {scenario!r}: use one of {', '.join(SCENARIOS)}")
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = set(given) - set(Profile.__struct_fields__)
    if unknown:
        raise ValueError(f"not profile fields: {sorted(unknown)}")
    try:
        profile = msgspec.convert({**msgspec.to_builtins(base), **given}, Profile, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None
    check_cpus(profile)
    return profile


def check_cpus(p: Profile) -> None:
    """Raise ValueError unless every CPU amount of ``p`` is one a wire message can carry
    (more than 0, whole millicores)."""
    try:
        parse_cpus(p.worker_cpus)
    except ValueError as exc:
        raise ValueError(f"worker_cpus: {exc}") from None
    for i, s in enumerate(p.shapes):
        try:
            parse_cpus(s.cpus)
        except ValueError as exc:
            raise ValueError(f"shapes[{i}].cpus: {exc}") from None


@dataclass(frozen=True, slots=True)
class TraceOrder:
    due_s: float  # when it is due, from the start of the run
    order: PlaceOrder
    lifetime_s: float


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / math.pow(k, s) for k in range(1, n + 1)]


def image_sizes(p: Profile) -> dict[str, int]:
    rng = random.Random(f"{p.seed}:sizes")
    lo, hi = p.image_mb
    return {name: rng.randint(lo, hi) for name in p.image_names()}


def fleet(p: Profile) -> list[dict[str, object]]:
    """Worker configs (fleet-file dicts, sim driver), ``workers`` spread over the regions."""
    rng = random.Random(f"{p.seed}:fleet")
    names, weights = p.image_names(), _zipf_weights(p.images, p.image_zipf_s)
    sizes = image_sizes(p)
    catalog = {name: {"size_mb": sizes[name]} for name in names}
    regions = p.region_names()
    out = []
    for i in range(p.workers):
        cached = sorted(set(rng.choices(names, weights, k=p.cached_per_worker)))
        out.append(
            {
                "worker_id": f"{regions[i % p.regions]}-w{i:04d}",
                "region": regions[i % p.regions],
                "capacity": wire_cpus({"cpus": p.worker_cpus, "memory_mb": p.worker_memory_mb}),
                "images": cached,
                "catalog": catalog,
                "image_cache_mb": p.image_cache_mb,
                "pull_mb_per_s": p.pull_mb_per_s,
                "pricing": {"preset": p.preset, "spread_ms": p.spread_ms},
            }
        )
    return out


def trace(p: Profile, run_id: str = "lt") -> list[TraceOrder]:
    """The orders of one run, in due order. Open loop: Poisson arrivals at ``rate``;
    closed loop: the same sequence, sent as fast as ``concurrency`` allows."""
    rng = random.Random(f"{p.seed}:trace")
    names, weights = p.image_names(), _zipf_weights(p.images, p.image_zipf_s)
    regions = p.region_names()
    rweights = p.region_weights or [1.0] * len(regions)
    shapes, sweights = p.shapes, [s.weight for s in p.shapes]
    asks = {s: resources((parse_cpus(s.cpus), s.memory_mb, 0, 0, 0)) for s in shapes}
    count = max(1, int(p.rate * p.duration_s))
    t = 0.0
    out = []
    for i in range(count):
        t += rng.expovariate(p.rate)
        shape = rng.choices(shapes, sweights)[0]
        order = PlaceOrder(
            order_id=f"{run_id}-{i:07d}",
            region=rng.choices(regions, rweights)[0],
            resources=asks[shape],
            image=rng.choices(names, weights)[0],
            deadline_ms=p.deadline_ms,
        )
        out.append(TraceOrder(t, order, rng.expovariate(1.0 / p.lifetime_s)))
    return out
