"""What a worker says of itself when asked: its status (the answer to ``status.<region>``,
docs/protocol.md §4.12) and its sample for the metrics scrape.

Assembled from the worker's ledger, images, driver and ports (supplier/worker.py); its row
of the state stream is the worker's own (``Worker.row``: the state rows read it,
supplier/rows.py ``Rowed``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bourse.runtime.collectors import CacheSample, WorkerSample
from bourse.wire.messages import WorkerStatus
from bourse.wire.resources import amount

if TYPE_CHECKING:
    from supplier.worker import Worker

# WorkerStatus.image_digests holds at most this many (the wire's bound).
MAX_STATUS_DIGESTS = 4096


def worker_sample(w: Worker) -> WorkerSample:
    """The worker's ledger as the metrics scrape reads it (from the endpoint's thread:
    plain reads of immutable tuples)."""
    ledger = w.ledger
    cache = w.images.state()
    return WorkerSample(
        w.worker_id,
        w.region,
        ledger.capacity,
        ledger.committed,
        ledger.held,
        len(ledger.holds),
        w.draining,
        CacheSample(
            cache.used_bytes,
            cache.budget_bytes,
            cache.hits,
            cache.misses,
            cache.pulled_bytes,
            cache.evictions,
        ),
    )


def worker_status(w: Worker) -> WorkerStatus:
    """The worker's status (its expired holds dropped first: a status counts live ones)."""
    w.expire_holds()
    cache = w.images.state()
    return WorkerStatus(
        worker_id=w.worker_id,
        region=w.region,
        labels=w.labels,
        capacity=amount(w.ledger.capacity),
        committed=amount(w.ledger.committed),
        held=amount(w.ledger.held),
        images=w.images.names(),
        machines=w.live_machines(),
        draining=w.draining,
        holds=len(w.ledger.holds),
        drain_reason=w.drain_reason,
        confinement=w.confinement,
        isolation=w.driver.isolation,
        driver=w.driver.name,
        runtime=w.driver.runtime_version,
        cache_bytes=cache.used_bytes,
        cache_budget_bytes=cache.budget_bytes,
        image_digests=cache.digests[:MAX_STATUS_DIGESTS],
        advertise_host=w.ports.host,
        port_range=str(w.ports.range) if w.ports.range else "",
    )
