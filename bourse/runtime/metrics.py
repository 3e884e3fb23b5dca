"""Prometheus metrics: the one home for every metric definition.

Each long-running program (``exchange serve``, ``supplier run``) builds ONE metrics object
with its own ``CollectorRegistry`` (never prometheus_client's global default: several
services share one process in the tests) and serves it on ``--metrics-addr HOST:PORT``
(bourse/runtime/endpoint.py ``MetricsServer``, a task of the program's task group: it
stops with the program).

Two kinds of metric, by cost:

- Events on the hot path (an order's outcome, an auction's duration and offers, a store
  commit) are counters and histograms whose label children are bound once per label set
  (:class:`_RegionOrders`), so recording one is a dict lookup and a few locked adds.
- State (capacity, committed, held, holds per worker; a worker's image cache and its counts;
  outbox backlog; admission; NATS connection counters; replies) is read at scrape time by
  custom collectors from the objects that already hold it (bourse/runtime/collectors.py,
  which also holds the samples and views a program hands over): zero cost between scrapes.

Names follow Prometheus conventions: ``_total`` counters, ``_seconds`` histograms, base
units (memory and disk in bytes). docs/operations.md lists every metric and what to alert on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder

from bourse.nats.connection import ConnectionStats
from bourse.runtime.collectors import (
    AdmissionCollector,
    ClaimsCollector,
    ConnectionCollector,
    FlagCollector,
    GaugeCollector,
    RepliesCollector,
    WorkerCollector,
)

# What a program hands its metrics to watch (bourse/runtime/collectors.py), named here too:
# the watch methods below take them.
from bourse.runtime.collectors import AdmissionView as AdmissionView
from bourse.runtime.collectors import CacheSample as CacheSample
from bourse.runtime.collectors import ClaimsView as ClaimsView
from bourse.runtime.collectors import WorkerSample as WorkerSample

# The `_created` series double every counter's and histogram's series and no alert here
# uses them. (prometheus_client's switch is process-wide; every program here wants it off.)
disable_created_metrics()

# Distinct regions the exchange keeps series for; orders to more regions share the label
# OTHER_REGION, so a flood of orders to made-up regions cannot blow up the series count.
MAX_REGIONS = 256
OTHER_REGION = "_other"

OUTCOMES = ("placed", "unfilled", "refused")
UNFILLED_REASONS = (
    "no_workers",
    "no_offers",
    "below_min_score",
    "all_commits_rejected",
    "deadline",
)
REFUSED_REASONS = ("overloaded", "conflicting_order", "cannot_run", "unrecorded")
# Auction durations: an auction ends in a few ms when offers come fast, at its deadline
# (500 ms by default, at most 30 s) when they do not.
AUCTION_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
OFFER_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000)
# An image pull: nothing to fetch (a root unpacked from layers here) in well under a second;
# a few hundred MB at tens of MB/s in seconds; several GB on a slow link in minutes.
PULL_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
# A store commit is one SQLite transaction and one fsync: ~100 us on a fast disk, tens of
# ms on a slow or busy one.
COMMIT_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip


class Metrics:
    """One program's metrics: its own registry, the process's CPU and memory, and its NATS
    connection's counters."""

    def __init__(self, program: str) -> None:
        self.program = program
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, RSS, fds

    def watch_connection(self, stats: ConnectionStats) -> None:
        """Expose the connection's reconnects, disconnects and slow-consumer drops (what
        bourse/nats/connection.py counts anyway), read at scrape time."""
        self.registry.register(ConnectionCollector(self.program, stats))

    def watch_replies(self, service: str, counts: Callable[[], Mapping[str, int]]) -> None:
        """Expose a Responder's counts (requests handled, Error replies by code)."""
        self.registry.register(RepliesCollector(service, counts))

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The registry, and its content type, in the format the scraper's ``Accept``
        header asks for (Prometheus's text format by default, OpenMetrics on request)."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


class _RegionOrders:
    """One region's label children, bound once: recording an order is then a lookup."""

    __slots__ = ("duration", "label", "offers", "placed", "refused", "unfilled")

    def __init__(self, m: ExchangeMetrics, label: str) -> None:
        self.label = label
        self.placed = m.orders.labels(label, "placed", "")
        self.unfilled = {r: m.orders.labels(label, "unfilled", r) for r in UNFILLED_REASONS}
        self.refused = {r: m.orders.labels(label, "refused", r) for r in REFUSED_REASONS}
        self.duration = m.auction_duration.labels(label)
        self.offers = m.auction_offers.labels(label)


class ExchangeMetrics(Metrics):
    """``exchange serve``: orders by region, outcome and reason; auction duration and
    offers per auction; admission (read at scrape time)."""

    def __init__(self, program: str = "exchange") -> None:
        super().__init__(program)
        r = self.registry
        self.orders = Counter(
            "bourse_orders",
            "Orders answered, by region, outcome (placed, unfilled, refused) and reason "
            "(the Unfilled reason, or the refusal: overloaded, conflicting_order, cannot_run, "
            "store_full, unrecorded, shutting_down).",
            ["region", "outcome", "reason"],
            registry=r,
        )
        self.auction_duration = Histogram(
            "bourse_auction_duration_seconds",
            "Auction duration, from its start to Placed or Unfilled (admission wait excluded).",
            ["region"],
            buckets=AUCTION_BUCKETS_S,
            registry=r,
        )
        self.auction_offers = Histogram(
            "bourse_auction_offers",
            "Offers received per auction.",
            ["region"],
            buckets=OFFER_BUCKETS,
            registry=r,
        )
        self._regions: dict[str, _RegionOrders] = {}
        self._other: _RegionOrders | None = None

    def region(self, region: str) -> _RegionOrders:
        """The region's bound children, made on its first order (past MAX_REGIONS regions,
        the shared OTHER_REGION ones)."""
        children = self._regions.get(region)
        if children is not None:
            return children
        if len(self._regions) < MAX_REGIONS:
            children = self._regions[region] = _RegionOrders(self, region)
            return children
        if self._other is None:
            self._other = _RegionOrders(self, OTHER_REGION)
        return self._other

    def placed(self, region: str, seconds: float) -> None:
        children = self.region(region)
        children.placed.inc()
        children.duration.observe(seconds)

    def unfilled(self, region: str, reason: str, seconds: float) -> None:
        children = self.region(region)
        child = children.unfilled.get(reason)
        if child is None:  # a reason added to the wire after this list: still counted
            child = children.unfilled[reason] = self.orders.labels(
                children.label, "unfilled", reason
            )
        child.inc()
        children.duration.observe(seconds)

    def refused(self, region: str, kind: str) -> None:
        children = self.region(region)
        child = children.refused.get(kind)
        if child is None:
            child = children.refused[kind] = self.orders.labels(children.label, "refused", kind)
        child.inc()

    def offers(self, region: str, offers: int) -> None:
        """One auction ended having received ``offers`` offers."""
        self.region(region).offers.observe(offers)

    def watch_admission(self, admission: Callable[[], AdmissionView]) -> None:
        """Expose the adaptive admission limit and the auctions in flight and waiting."""
        self.registry.register(AdmissionCollector(admission))

    def watch_claims(self, claims: Callable[[], ClaimsView]) -> None:
        """Expose the order claims' bucket: its bytes, its limit, whether it is full."""
        self.registry.register(ClaimsCollector(claims))


class SupplierMetrics(Metrics):
    """``supplier run``: per worker and resource capacity, committed and held, holds
    active, its image cache (read at scrape time); store commit and image pull durations;
    outbox backlog; bids shed."""

    def __init__(self, program: str = "supplier") -> None:
        super().__init__(program)
        self.store_commit = Histogram(
            "bourse_store_commit_duration_seconds",
            "One store group commit: the SQLite transaction and its fsync.",
            buckets=COMMIT_BUCKETS_S,
            registry=self.registry,
        )
        self.image_pull = Histogram(
            "bourse_image_pull_seconds",
            "One image made ready for a machine that lacked some of it: its layers fetched "
            "from the image store, checked and unpacked.",
            buckets=PULL_BUCKETS_S,
            registry=self.registry,
        )

    def watch_workers(
        self, workers: Callable[[], Iterable[WorkerSample]], bids_shed: Callable[[], int]
    ) -> None:
        self.registry.register(WorkerCollector(workers, bids_shed))

    def watch_outbox(self, name: str, backlog: Callable[[], int]) -> None:
        """Expose ``backlog()`` as ``bourse_outbox_backlog{outbox=name}``."""
        self.registry.register(GaugeCollector("bourse_outbox_backlog", _OUTBOX_DOC, name, backlog))

    def watch_event_stream(self, missing: Callable[[], bool]) -> None:
        """Expose ``missing()`` as ``bourse_event_stream_missing`` (1 or 0)."""
        self.registry.register(FlagCollector("bourse_event_stream_missing", _MISSING_DOC, missing))

    def watch_state_stream(self, missing: Callable[[], bool]) -> None:
        """Expose ``missing()`` as ``bourse_state_stream_missing`` (1 or 0)."""
        doc = _STATE_MISSING_DOC
        self.registry.register(FlagCollector("bourse_state_stream_missing", doc, missing))


# A request through the edge: a pooled connection to a machine on the same host answers in
# a fraction of a millisecond; a cold or remote one in tens or hundreds of ms.
EDGE_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# Distinct apps the edge keeps series for; requests for more share OTHER_APP, and those
# that named no app (a bad Host, an unknown app) NO_APP.
MAX_APPS = 1024
OTHER_APP = "_other"
NO_APP = "_none"
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")


class _AppRequests:
    """One app's label children, bound once: recording a request is then a lookup."""

    __slots__ = ("errors", "label", "latency", "requests", "retries")

    def __init__(self, m: EdgeMetrics, app: str) -> None:
        self.label = app
        self.requests = [m.requests.labels(app, c) for c in STATUS_CLASSES]
        self.latency = m.latency.labels(app)
        self.retries = m.retries.labels(app)
        self.errors = m.upstream_errors.labels(app)


class EdgeMetrics(Metrics):
    """``edge serve``: per app, requests by status class, their latency, retries on
    another machine, upstream connection errors, machines started by a request (their
    time) and the requests held meanwhile."""

    def __init__(self, program: str = "edge") -> None:
        super().__init__(program)
        r = self.registry
        self.requests = Counter(
            "bourse_edge_requests",
            "Requests answered by the edge, by app and status class (1xx..5xx; a client "
            "that left before its answer counts as 4xx, its status logged as 499).",
            ["app", "code"],
            registry=r,
        )
        self.latency = Histogram(
            "bourse_edge_request_duration_seconds",
            "A request through the edge, from its head parsed to its answer's last byte "
            "written (a WebSocket: to its 101).",
            ["app"],
            buckets=EDGE_BUCKETS_S,
            registry=r,
        )
        self.retries = Counter(
            "bourse_edge_retries",
            "Requests sent again to another machine (its connection failed before a byte "
            "went upstream, or an idempotent one's before a byte came back).",
            ["app"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "bourse_edge_upstream_errors",
            "Upstream connections that failed: refused, timed out, or closed before or "
            "while answering.",
            ["app"],
            registry=r,
        )
        self.cold_starts = Histogram(
            "bourse_edge_cold_start_seconds",
            "Machines started by a request: from the start asked to the edge's own probe "
            "of the machine's port answering (the requests held meanwhile are served then).",
            ["app"],
            buckets=EDGE_BUCKETS_S,
            registry=r,
        )
        self.held = Counter(
            "bourse_edge_held_requests",
            "Requests held while a machine of their app started for them.",
            ["app"],
            registry=r,
        )
        self._apps: dict[str, _AppRequests] = {}

    def app(self, app: str) -> _AppRequests:
        """The app's bound children, made on its first request."""
        children = self._apps.get(app)
        if children is None:
            label = app or NO_APP
            if len(self._apps) >= MAX_APPS:
                label = OTHER_APP
                children = self._apps.get(OTHER_APP)
            if children is None:
                children = _AppRequests(self, label)
            self._apps[label if label == OTHER_APP else app] = children
        return children

    def request(self, app: str, status: int, seconds: float) -> None:
        children = self.app(app)
        if 100 <= status < 600:
            children.requests[status // 100 - 1].inc()
        children.latency.observe(seconds)

    def retry(self, app: str) -> None:
        self.app(app).retries.inc()

    def upstream_error(self, app: str) -> None:
        self.app(app).errors.inc()

    def cold_start(self, app: str, seconds: float) -> None:
        self.cold_starts.labels(self.app(app).label).observe(seconds)

    def held_request(self, app: str) -> None:
        self.held.labels(self.app(app).label).inc()


_OUTBOX_DOC = (
    "Messages waiting in an outbox to be published (publish: the host's send queue; "
    "events: committed events not yet acknowledged by the event stream; rows: machine and "
    "worker rows changed and not yet acknowledged by the state stream)."
)
_STATE_MISSING_DOC = (
    "1 while no JetStream stream takes this supplier's state rows: they wait, marked "
    '(bourse_outbox_backlog{outbox="rows"}), until the stream is made; views see its '
    "workers gone meanwhile."
)
_MISSING_DOC = (
    "1 while no JetStream stream takes this supplier's events: they wait in its outbox "
    '(bourse_outbox_backlog{outbox="events"}) until the stream is made.'
)
