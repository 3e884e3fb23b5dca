"""What a scrape reads of a program's state: the samples and views the programs hand over
(``AdmissionView``, ``ClaimsView``, ``WorkerSample``, ``CacheSample``) and the custom
collectors that turn them into metric families when Prometheus scrapes.

Collectors run at scrape time, in the endpoint's worker thread (bourse/runtime/endpoint.py):
they only read plain attributes and call the functions they were given, so state costs
nothing between scrapes. Which program watches what is said in bourse/runtime/metrics.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bourse.nats.connection import ConnectionStats

# Resources as exposed: the wire's names, memory and disk converted to bytes (base units).
MIB = 1024 * 1024
# Per resource: its name, and how a vector's value becomes it (x mul / div): the vector
# counts CPU in millicores (bourse/wire/resources.py), exposed in CPUs (0.5, exactly).
RESOURCE_LABELS = (
    ("cpus", 1, 1000),
    ("memory_bytes", MIB, 1),
    ("disk_bytes", MIB, 1),
    ("gpus", 1, 1),
    ("ports", 1, 1),
)


class AdmissionView(NamedTuple):
    limit: float
    inflight: int
    waiting: int
    refused: int


class ClaimsView(NamedTuple):
    """The order claims' bucket as its last look found it (-1: not known, or no limit);
    ``full``: new orders are refused (``store_full``) for want of room."""

    stored: int
    max_bytes: int
    full: bool


class CacheSample(NamedTuple):
    """A worker's image cache as the scrape reads it: bytes on disk and budget, and its
    counts since the supplier started (pulls that found the image here or made it, bytes
    fetched from the image store, entries evicted)."""

    used_bytes: int
    budget_bytes: int
    hits: int
    misses: int
    pulled_bytes: int
    evictions: int


class WorkerSample(NamedTuple):
    """One worker's state as the scrape reads it. Amounts are the resource vector
    (cpu millicores, memory_mb, disk_mb, gpus, ports) of bourse/wire/resources.py."""

    worker_id: str
    region: str
    capacity: tuple[int, int, int, int, int]
    committed: tuple[int, int, int, int, int]
    held: tuple[int, int, int, int, int]
    holds: int
    draining: bool
    cache: CacheSample


class ConnectionCollector(Collector):
    def __init__(self, program: str, stats: ConnectionStats) -> None:
        self.program = program
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        for name, doc, value in (
            ("bourse_nats_reconnects", "Reconnections to NATS.", s.reconnects),
            ("bourse_nats_disconnects", "Connections to NATS lost.", s.disconnects),
            (
                "bourse_nats_slow_consumer_drops",
                "Messages dropped by the NATS client: a subscription fell behind.",
                s.slow_consumer_drops,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=["program"])
            family.add_metric([self.program], value)
            yield family


# Why the responder (bourse/nats/responder.py) drops a request: its count keys.
DROP_REASONS = ("reply_not_inbox", "fanout_shed")


class RepliesCollector(Collector):
    def __init__(self, service: str, counts: Callable[[], Mapping[str, int]]) -> None:
        self.service = service
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self.counts()
        requests = CounterMetricFamily(
            "bourse_requests",
            "Messages handled by the service's subscriptions.",
            labels=["service"],
        )
        requests.add_metric([self.service], counts.get("requests", 0))
        errors = CounterMetricFamily(
            "bourse_request_errors",
            "Error replies sent, by code (bad_request: bad input, I6; internal: a failure).",
            labels=["service", "code"],
        )
        for code in ("bad_request", "unknown_subject", "internal"):
            errors.add_metric([self.service, code], counts.get(f"error.{code}", 0))
        dropped = CounterMetricFamily(
            "bourse_requests_dropped",
            "Requests dropped unanswered, by reason (reply_not_inbox: a reply subject that is "
            "not an inbox; fanout_shed: a status/explain request past the process's rate).",
            labels=["service", "reason"],
        )
        for reason in DROP_REASONS:
            dropped.add_metric([self.service, reason], counts.get(reason, 0))
        yield requests
        yield errors
        yield dropped


class AdmissionCollector(Collector):
    def __init__(self, admission: Callable[[], AdmissionView]) -> None:
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        a = self.admission()
        yield _gauge("bourse_admission_limit", "Auctions admitted at once (adaptive).", a.limit)
        yield _gauge("bourse_auctions_inflight", "Auctions running now.", a.inflight)
        yield _gauge("bourse_admission_waiting", "Orders waiting for a slot.", a.waiting)
        refused = CounterMetricFamily(
            "bourse_admission_refused", "Orders that found no admission slot in time."
        )
        refused.add_metric([], a.refused)
        yield refused


class ClaimsCollector(Collector):
    def __init__(self, claims: Callable[[], ClaimsView]) -> None:
        self.claims = claims

    def collect(self) -> Iterator[Metric]:
        c = self.claims()
        yield _gauge("bourse_claims_bytes", "Bytes in the order claims' bucket.", c.stored)
        yield _gauge(
            "bourse_claims_max_bytes", "The order claims' bucket's byte limit.", c.max_bytes
        )
        yield _gauge(
            "bourse_claims_full",
            "1 while new orders are refused (store_full) for want of room for claims.",
            float(c.full),
        )


class WorkerCollector(Collector):
    def __init__(
        self, workers: Callable[[], Iterable[WorkerSample]], bids_shed: Callable[[], int]
    ) -> None:
        self.workers = workers
        self.bids_shed = bids_shed

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "region", "resource"]
        capacity = GaugeMetricFamily(
            "bourse_worker_capacity", "A worker's capacity per resource.", labels=labels
        )
        committed = GaugeMetricFamily(
            "bourse_worker_committed", "Committed to machines, per resource.", labels=labels
        )
        held = GaugeMetricFamily(
            "bourse_worker_held", "Held for auctions under way, per resource.", labels=labels
        )
        holds = GaugeMetricFamily(
            "bourse_worker_holds_active", "Holds alive on a worker.", labels=["worker", "region"]
        )
        draining = GaugeMetricFamily(
            "bourse_worker_draining", "1 if the worker offers nothing.", labels=["worker", "region"]
        )
        cache = _CacheFamilies()
        for w in self.workers():
            cache.add([w.worker_id, w.region], w.cache)
            for i, (resource, mul, div) in enumerate(RESOURCE_LABELS):
                if not w.capacity[i]:  # a resource the worker has none of: no series
                    continue
                key = [w.worker_id, w.region, resource]
                capacity.add_metric(key, w.capacity[i] * mul / div)
                committed.add_metric(key, w.committed[i] * mul / div)
                held.add_metric(key, w.held[i] * mul / div)
            holds.add_metric([w.worker_id, w.region], w.holds)
            draining.add_metric([w.worker_id, w.region], 1 if w.draining else 0)
        shed = CounterMetricFamily(
            "bourse_bids_shed", "Bids dropped unanswered: queued too long (overload)."
        )
        shed.add_metric([], self.bids_shed())
        yield from (capacity, committed, held, holds, draining, shed, *cache.families())


class _CacheFamilies:
    """The image cache's series of every worker, filled one worker at a time."""

    def __init__(self) -> None:
        labels = ["worker", "region"]
        self.used = GaugeMetricFamily(
            "bourse_image_cache_bytes", "Bytes an image cache holds on disk.", labels=labels
        )
        self.budget = GaugeMetricFamily(
            "bourse_image_cache_budget_bytes", "An image cache's budget.", labels=labels
        )
        self.hits = CounterMetricFamily(
            "bourse_image_cache_hits", "Pulls that found the image's root here.", labels=labels
        )
        self.misses = CounterMetricFamily(
            "bourse_image_cache_misses",
            "Pulls that made the image's root (fetching what it lacked).",
            labels=labels,
        )
        self.pulled = CounterMetricFamily(
            "bourse_image_pulled_bytes", "Bytes fetched from the image store.", labels=labels
        )
        self.evictions = CounterMetricFamily(
            "bourse_image_cache_evictions", "Layers and roots evicted.", labels=labels
        )

    def add(self, key: list[str], c: CacheSample) -> None:
        self.used.add_metric(key, c.used_bytes)
        self.budget.add_metric(key, c.budget_bytes)
        self.hits.add_metric(key, c.hits)
        self.misses.add_metric(key, c.misses)
        self.pulled.add_metric(key, c.pulled_bytes)
        self.evictions.add_metric(key, c.evictions)

    def families(self) -> tuple[Metric, ...]:
        return (self.used, self.budget, self.hits, self.misses, self.pulled, self.evictions)


class GaugeCollector(Collector):
    def __init__(self, name: str, doc: str, label: str, value: Callable[[], float]) -> None:
        self.name = name
        self.doc = doc
        self.label = label
        self.value = value

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.doc, labels=["outbox"])
        family.add_metric([self.label], self.value())
        yield family


class FlagCollector(Collector):
    def __init__(self, name: str, doc: str, value: Callable[[], bool]) -> None:
        self.name = name
        self.doc = doc
        self.value = value

    def collect(self) -> Iterator[Metric]:
        yield _gauge(self.name, self.doc, 1 if self.value() else 0)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
