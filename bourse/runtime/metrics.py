"""Prometheus metrics: the one home for every metric definition and the HTTP endpoint.

Each long-running program (``exchange serve``, ``supplier run``) builds ONE metrics object
with its own ``CollectorRegistry`` (never prometheus_client's global default: several
services share one process in the tests) and serves it on ``--metrics-addr HOST:PORT``
with :class:`MetricsServer`, a task of the program's task group: it stops with the program.

Two kinds of metric, by cost:

- Events on the hot path (an order's outcome, an auction's duration and offers, a store
  commit) are counters and histograms whose label children are bound once per label set
  (:class:`_RegionOrders`), so recording one is a dict lookup and a few locked adds.
- State (capacity, committed, held, holds per worker; a worker's image cache and its counts;
  outbox backlog; admission; NATS connection counters; replies) is read at scrape time by
  custom collectors from the objects that already hold it: zero cost between scrapes.

Names follow Prometheus conventions: ``_total`` counters, ``_seconds`` histograms, base
units (memory and disk in bytes). docs/operations.md lists every metric and what to alert on.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import anyio
import anyio.abc
import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from bourse.errors import BourseError
from bourse.nats.connection import ConnectionStats

log = structlog.get_logger("bourse.metrics")

# The `_created` series double every counter's and histogram's series and no alert here
# uses them. (prometheus_client's switch is process-wide; every program here wants it off.)
disable_created_metrics()

ENV_ADDR = "BOURSE_METRICS_ADDR"
DEFAULT_PORT = 9464  # the port range Prometheus's exporter list gives OpenTelemetry/Prometheus
OFF = ("", "off", "none")
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
# An HTTP request to the endpoint: its head must fit in this and arrive within this.
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0


class MetricsAddrError(BourseError, ValueError):
    """--metrics-addr is not HOST:PORT (or off)."""


def parse_addr(text: str | None) -> tuple[str, int] | None:
    """``"127.0.0.1:9464"`` -> ("127.0.0.1", 9464); ``"[::1]:9464"`` -> ("::1", 9464);
    ``""``, ``"off"``, ``None`` -> None (no endpoint). Port 0: any free port."""
    text = (text or "").strip()
    if text.lower() in OFF:
        return None
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise MetricsAddrError(
            f"--metrics-addr {text!r}: expected HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT}, "
            "port 0 for any free one) or 'off'"
        )
    return host, int(port)


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str, start: int, taken: Iterable[int] = ()) -> int:
    """The first port from ``start`` up that nothing listens on (and not in ``taken``)."""
    skip = set(taken)
    for port in range(start, min(start + 1000, 65536)):
        if port in skip:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise MetricsAddrError(f"no free port on {host} from {start} up")


# -- the programs' metrics ------------------------------------------------------------------


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
        self.registry.register(_ConnectionCollector(self.program, stats))

    def watch_replies(self, service: str, counts: Callable[[], Mapping[str, int]]) -> None:
        """Expose a Responder's counts (requests handled, Error replies by code)."""
        self.registry.register(_RepliesCollector(service, counts))

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
        self.registry.register(_AdmissionCollector(admission))

    def watch_claims(self, claims: Callable[[], ClaimsView]) -> None:
        """Expose the order claims' bucket: its bytes, its limit, whether it is full."""
        self.registry.register(_ClaimsCollector(claims))


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
        self.registry.register(_WorkerCollector(workers, bids_shed))

    def watch_outbox(self, name: str, backlog: Callable[[], int]) -> None:
        """Expose ``backlog()`` as ``bourse_outbox_backlog{outbox=name}``."""
        self.registry.register(_GaugeCollector("bourse_outbox_backlog", _OUTBOX_DOC, name, backlog))

    def watch_event_stream(self, missing: Callable[[], bool]) -> None:
        """Expose ``missing()`` as ``bourse_event_stream_missing`` (1 or 0)."""
        self.registry.register(_FlagCollector("bourse_event_stream_missing", _MISSING_DOC, missing))


_OUTBOX_DOC = (
    "Messages waiting in an outbox to be published (publish: the host's send queue; "
    "events: committed events not yet acknowledged by the event stream)."
)
_MISSING_DOC = (
    "1 while no JetStream stream takes this supplier's events: they wait in its outbox "
    '(bourse_outbox_backlog{outbox="events"}) until the stream is made.'
)


# -- collectors (run at scrape time, in the endpoint's worker thread) -------------------------


class _ConnectionCollector(Collector):
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


class _RepliesCollector(Collector):
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


class _AdmissionCollector(Collector):
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


class _ClaimsCollector(Collector):
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


class _WorkerCollector(Collector):
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


class _GaugeCollector(Collector):
    def __init__(self, name: str, doc: str, label: str, value: Callable[[], float]) -> None:
        self.name = name
        self.doc = doc
        self.label = label
        self.value = value

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.doc, labels=["outbox"])
        family.add_metric([self.label], self.value())
        yield family


class _FlagCollector(Collector):
    def __init__(self, name: str, doc: str, value: Callable[[], bool]) -> None:
        self.name = name
        self.doc = doc
        self.value = value

    def collect(self) -> Iterator[Metric]:
        yield _gauge(self.name, self.doc, 1 if self.value() else 0)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


async def start_endpoint(
    tasks: anyio.abc.TaskGroup, metrics: Metrics, addr: tuple[str, int]
) -> MetricsServer:
    """Serve ``metrics`` on ``addr`` in ``tasks`` (the program's group); returns once it
    listens. Raises MetricsAddrError if it cannot."""
    server = MetricsServer(metrics, *addr)
    await tasks.start(server.run)
    return server


# -- the endpoint -----------------------------------------------------------------------------


@dataclass
class MetricsServer:
    """The HTTP endpoint: ``GET /metrics`` (or ``/``) answers the registry in Prometheus's
    text format. A task of the program's task group (anyio), so it stops with the program;
    a scrape is rendered in a worker thread, so formatting a big fleet's series (~70 ms for
    a thousand workers) never stalls the event loop for long: the GIL hands it back every
    few ms. Collectors only read plain attributes there (immutable tuples, ints, len() of a
    dict): no lock is needed, at worst one gauge is read a moment before another."""

    metrics: Metrics
    host: str
    port: int
    address: str = ""  # HOST:PORT once bound (port 0 -> the one the system gave)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled; ``started`` once listening (``address`` is then set)."""
        try:
            listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        except OSError as exc:
            raise MetricsAddrError(
                f"--metrics-addr {format_addr(self.host, self.port)}: cannot listen: "
                f"{exc.strerror or exc}"
            ) from None
        async with listener:
            sockname = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_address)
            self.address = format_addr(self.host, int(sockname[1]))
            log.info("metrics_serving", url=self.url, program=self.metrics.program)
            task_status.started()
            await listener.serve(self._handle)

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        """One request. Nothing a client does (hang up, dawdle, send junk) ends the server."""
        async with stream:
            with anyio.move_on_after(REQUEST_TIMEOUT_S):
                try:
                    head = await _read_head(stream)
                    await stream.send(await anyio.to_thread.run_sync(self._respond, head))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    pass

    def _respond(self, head: bytes) -> bytes:
        method, _, rest = head.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _response(b"405 Method Not Allowed", b"text/plain", b"use GET\n")
        if path not in (b"/metrics", b"/"):
            return _response(b"404 Not Found", b"text/plain", b"metrics are at /metrics\n")
        try:
            body, content_type = self.metrics.render(_header(head, b"accept"))
        except Exception as exc:  # a collector's bug: say so, keep serving
            log.exception("metrics_render_failed")
            return _response(b"500 Internal Server Error", b"text/plain", repr(exc).encode())
        return _response(b"200 OK", content_type.encode(), body, head=method == b"HEAD")


async def _read_head(stream: anyio.abc.SocketStream) -> bytes:
    """The request's head (up to the blank line); what a scraper sends has no body."""
    data = b""
    while b"\r\n\r\n" not in data and len(data) < MAX_REQUEST_BYTES:
        try:
            data += await stream.receive(MAX_REQUEST_BYTES)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            break
    return data


def _header(head: bytes, name: bytes) -> str:
    """The value of header ``name`` (lower case) in a request head, or ""."""
    for line in head.split(b"\r\n")[1:]:
        key, sep, val = line.partition(b":")
        if sep and key.strip().lower() == name:
            return val.strip().decode("latin-1")
    return ""


def _response(status: bytes, ctype: bytes, body: bytes, *, head: bool = False) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype
        + b"\r\nContent-Length: " + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n" + (b"" if head else body)
    )  # fmt: skip
