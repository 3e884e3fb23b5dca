"""Whether a worker can take an order: ONE ordered chain of small named checks.

Each check looks at one thing of a worker (what it reads is a :class:`WorkerView`) against
an order (an :class:`OrderLike`: a Bid or an ExplainRequest) and returns None (go on) or
its reason, a named constant below. Handed a list (``why``), it also appends a ``Reason``
for each thing it finds, with its numbers in the detail, and does not stop at the first:
each constraint not met, each short resource. The chain is read two ways:

    first_failure   a bid, on every worker it reaches (the hot path): the first reason,
                    nothing allocated while the checks pass
    every_failure   "why not" (docs/protocol.md §4.15): every reason of every check

so an offer and its explanation cannot disagree: they run the same checks, one of them
with a collector attached (as Nomad's feasibility checkers serve both a placement and its
plan). A bid (supplier/desk.py ``Desk.quote``) first drops the order's earlier hold and the
expired holds, then runs the whole chain once; an explanation (supplier/explain.py
``verdict``) leaves those holds out of ``free`` instead, stops at the order's ``STANDING``
as a bid does, and collects every reason of the ``FEASIBLE`` stage.

The existing-machine rule is here too (:func:`handout`): the commit path asks it as well.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from typing import Protocol

from bourse.wire.limits import MILLIS_PER_CPU
from bourse.wire.messages import Layer, Reason, Resources
from bourse.wire.resources import CPU, PORTS, RESOURCES, Vec, format_value, leq, vec
from supplier.ledger import Ledger

__all__ = [
    "BLOCKED",
    "CANNOT_RUN",
    "CHECKS",
    "COMMITTING",
    "CONSTRAINT_MISMATCH",
    "DRAINING",
    "EXCLUDED",
    "EXISTING",
    "FEASIBLE",
    "IMAGE_TOO_BIG",
    "INSUFFICIENT",
    "RECLAIMING",
    "REFUSED",
    "STANDING",
    "TOO_SMALL",
    "UNDOING",
    "Check",
    "OrderLike",
    "Placements",
    "WorkerView",
    "every_failure",
    "first_failure",
    "handout",
    "tenant_refusal",
    "wanted",
]

# The reasons, in the chain's order. EXISTING is not a refusal: the order's answer is the
# machine it already has on the worker.
EXISTING = "existing_machine"
RECLAIMING = "machine_being_reclaimed"  # asked whether it is an orphan: handed to nobody
UNDOING = "machine_being_aborted"  # its commit's abort is being written: handed to nobody
COMMITTING = "commit_under_way"  # a commit for this order is being written on the worker
DRAINING = "draining"
EXCLUDED = "excluded"
CONSTRAINT_MISMATCH = "constraint_mismatch"
INSUFFICIENT = "insufficient"  # committed machines take what the order needs
BLOCKED = "blocked_by_holds"  # only other orders' holds are in the way: a bid may wait
CANNOT_RUN = "image_not_runnable"  # the worker's driver cannot run the order's image
TOO_SMALL = "too_small_to_confine"  # below what the driver can confine (memory < 4 MiB)
IMAGE_TOO_BIG = "image_too_big"  # a pull of the image could never fit the worker's cache


def tenant_refusal(policy: str, driver: str, isolation: str) -> str:
    """Why a worker may not run a tenant's order under ``policy`` (supplier run
    --tenant-images: docs/protocol.md §6.8e), or "": ``isolated`` wants machines with users
    and a network of their own, ``oci-only`` such containers, ``allow`` anything; a ``sim``
    worker runs nothing and takes any."""
    if policy == "allow" or driver == "sim":
        return ""
    if isolation != "users,network":
        return (
            f"a tenant's order: this worker's machines are not isolated ({isolation}), and "
            f"--tenant-images {policy} runs tenants' machines only where they have users and "
            "a network of their own"
        )
    if policy == "oci-only" and driver != "oci":
        return f"a tenant's order: --tenant-images oci-only runs them in containers, not {driver}"
    return ""


class Placements(Protocol):
    """What the existing-machine rule reads of a worker (:func:`handout`)."""

    @property
    def by_order(self) -> Container[str]:
        """The orders that have a machine on this worker (not aborted: I3)."""
        ...

    @property
    def reclaiming(self) -> Container[str]:
        """Orders whose machine here is being asked about (supplier/reclaim.py)."""
        ...

    @property
    def undoing(self) -> Container[str]:
        """Orders whose machine here is being destroyed by an abort (supplier/commits.py)."""
        ...


class WorkerView(Placements, Protocol):
    """What the checks read of one worker."""

    @property
    def worker_id(self) -> str: ...
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def draining(self) -> bool: ...
    @property
    def drain_reason(self) -> str: ...
    @property
    def ledger(self) -> Ledger: ...
    def unrunnable(self, order: OrderLike) -> str:
        """Why the worker cannot run the order's image at all, or "" (it can)."""
        ...

    def unconfinable(self, r: Resources) -> str:
        """Why the worker's driver cannot confine a machine of ``r``, or "" (it can)."""
        ...

    def image_too_big(self, order: OrderLike) -> str:
        """Why a pull of the order's image could never fit the worker's cache, or ""."""
        ...


class OrderLike(Protocol):
    """What the checks read of an order: a Bid or an ExplainRequest."""

    @property
    def order_id(self) -> str: ...
    @property
    def resources(self) -> Resources: ...
    @property
    def image(self) -> str: ...
    @property
    def image_digest(self) -> str: ...
    @property
    def layers(self) -> Sequence[Layer]: ...
    @property
    def constraints(self) -> Mapping[str, str]: ...
    @property
    def exclude_workers(self) -> Sequence[str]: ...
    @property
    def ports(self) -> Sequence[str]:
        """The order's named ports: it wants a host port of the worker's range for each."""
        ...


def wanted(order: OrderLike) -> Vec:
    """What the order takes of a worker, as a vector: its resources, and a port per name."""
    return vec(order.resources, len(order.ports))


# check(worker, order, want, free, why) -> its reason or None. ``want``: the order's
# resources as a vector; ``free``: what the order may take on the worker (what a bid finds
# free once it has dropped its earlier hold and the expired ones).
Check = Callable[[WorkerView, OrderLike, Vec, Vec, list[Reason] | None], str | None]


# Why an order's machine here is handed to nobody now (handout), as a Reason's detail.
REFUSED = {
    RECLAIMING: "the order's machine here is being reclaimed",
    UNDOING: "the order's machine here is being destroyed: its commit was aborted",
}


def handout(w: Placements, order_id: str) -> str | None:
    """EXISTING when the order has a machine on ``w`` that may be handed out (to a bid's
    auction or a commit: I3), RECLAIMING when it has one that is being asked about (its
    verdict may be "orphan", §5.3d: handed to nobody meanwhile), UNDOING when the abort of
    its commit is being written (§6.6: decided before anyone else was handed it, so it is
    destroyed, and a Placed for it would be a lie), None when it has none."""
    if order_id not in w.by_order:
        return None
    if order_id in w.undoing:
        return UNDOING
    return RECLAIMING if order_id in w.reclaiming else EXISTING


# -- the checks ---------------------------------------------------------------------------
def existing_machine(
    w: WorkerView, order: OrderLike, want: Vec, free: Vec, why: list[Reason] | None
) -> str | None:
    """The order's machine is here: it is the answer (no new hold), even on a draining or
    full worker; the verdict carries it, so EXISTING adds no Reason."""
    if order.order_id not in w.by_order:  # the common case, answered without a call more
        return None
    reason = handout(w, order.order_id)
    if why is not None and reason is not None and reason in REFUSED:
        why.append(Reason(code=reason, detail=REFUSED[reason]))
    return reason


def commit_under_way(
    w: WorkerView, order: OrderLike, want: Vec, free: Vec, why: list[Reason] | None
) -> str | None:
    """A commit of this order is being written here: its reply is the answer."""
    h = w.ledger.holds.get(order.order_id)
    if h is None or not h.committing:
        return None
    if why is not None:
        why.append(Reason(code=COMMITTING, detail="a commit for this order is being written here"))
    return COMMITTING


def draining(
    w: WorkerView, order: OrderLike, want: Vec, free: Vec, why: list[Reason] | None
) -> str | None:
    """The worker takes no new orders (configured, or its store refuses writes)."""
    if not w.draining:
        return None
    if why is not None:
        detail = f"draining: {w.drain_reason}" if w.drain_reason else "draining"
        why.append(Reason(code=DRAINING, detail=detail))
    return DRAINING


def excluded(
    w: WorkerView, order: OrderLike, want: Vec, free: Vec, why: list[Reason] | None
) -> str | None:
    """The order names the worker in ``exclude_workers``."""
    ex = order.exclude_workers
    if not ex or w.worker_id not in ex:
        return None
    if why is not None:
        why.append(Reason(code=EXCLUDED, detail="excluded by the order"))
    return EXCLUDED


def labels(
    w: WorkerView, order: OrderLike, want: Vec, free: Vec, why: list[Reason] | None
) -> str | None:
    """Every constraint of the order is one of the worker's labels, with that value; one
    Reason per constraint that is not."""
    constraints = order.constraints
    if not constraints:
        return None
    failed = None
    have = w.labels
    for key, value in constraints.items():
        has = have.get(key)
        if has == value:
            continue
        if why is None:
            return CONSTRAINT_MISMATCH
        failed = CONSTRAINT_MISMATCH
        found = "missing" if has is None else f"has {has!r}"
        why.append(
            Reason(
                code=CONSTRAINT_MISMATCH,
                detail=f"label {key}: wants {value!r}, {found}",
                label=key,
                expected=value,
                actual=has,
            )
        )
    return failed


def fits(
    w: WorkerView, order: OrderLike, want: Vec, free: Vec, why: list[Reason] | None
) -> str | None:
    """The order fits in ``free`` on every resource, its ports too. Short only of what other
    orders' holds take, BLOCKED (a bid may wait for them, §6.3); else INSUFFICIENT. One
    Reason per short resource, with the numbers."""
    if (
        want[0] <= free[0]
        and want[1] <= free[1]
        and want[2] <= free[2]
        and want[3] <= free[3]
        and want[4] <= free[4]
    ):
        return None
    ledger = w.ledger
    reason = BLOCKED if leq(want, ledger.free_of_committed) else INSUFFICIENT
    if why is not None:
        cap, committed = ledger.capacity, ledger.committed
        for i, name in enumerate(RESOURCES):
            if want[i] > free[i]:
                why.append(_short(reason, i, name, want[i], free[i], cap[i], committed[i]))
    return reason


def runnable(
    w: WorkerView, order: OrderLike, want: Vec, free: Vec, why: list[Reason] | None
) -> str | None:
    """The worker can run the order's image: a catalog image its driver knows, a content
    image with a store to pull it from (or already here)."""
    cannot = w.unrunnable(order)
    if not cannot:
        return None
    if why is not None:
        why.append(Reason(code=CANNOT_RUN, detail=cannot))
    return CANNOT_RUN


def confinable(
    w: WorkerView, order: OrderLike, want: Vec, free: Vec, why: list[Reason] | None
) -> str | None:
    """The worker's driver can confine a machine of the order's resources."""
    small = w.unconfinable(order.resources)
    if not small:
        return None
    if why is not None:
        why.append(Reason(code=TOO_SMALL, detail=small))
    return TOO_SMALL


def image_fits(
    w: WorkerView, order: OrderLike, want: Vec, free: Vec, why: list[Reason] | None
) -> str | None:
    """A pull of the order's image could fit the worker's image cache at all."""
    big = w.image_too_big(order)
    if not big:
        return None
    if why is not None:
        why.append(Reason(code=IMAGE_TOO_BIG, detail=big))
    return IMAGE_TOO_BIG


# The chain. Why each check sits where it does:
CHECKS: tuple[Check, ...] = (
    # The order's standing on the worker comes first and ends the chain both ways: a
    # machine already placed for it is its answer even on a draining or full worker (I3),
    existing_machine,
    # and while its commit is being written, that commit's reply is.
    commit_under_way,
    # Then the worker's will and the order's wishes: a field read or two each.
    draining,
    excluded,
    labels,
    # The driver's checks: a method call each, spared for workers refused already.
    runnable,
    confinable,
    # The image cache's: a sum over the image's layers (content images only); a worker
    # that could never hold the image declines, whatever its free capacity.
    image_fits,
    # Capacity last: the only refusal a bid may wait out (BLOCKED), so it is reached only
    # when nothing else refuses (a bid never waits for a worker that could not take it).
    fits,
)
# The order's standing on the worker, and the worker's fitness for it: an explanation
# stops at the first as a bid does, and lists every reason of the second.
STANDING = CHECKS[:2]
FEASIBLE = CHECKS[2:]


def first_failure(
    checks: Sequence[Check],
    w: WorkerView,
    order: OrderLike,
    want: Vec,
    free: Vec,
    why: list[Reason] | None = None,
) -> str | None:
    """The reason of the first check that refuses, None when all pass. With ``why``, that
    check's Reasons are appended to it."""
    for check in checks:
        reason = check(w, order, want, free, why)
        if reason is not None:
            return reason
    return None


def every_failure(
    checks: Sequence[Check], w: WorkerView, order: OrderLike, want: Vec, free: Vec
) -> list[Reason]:
    """Every Reason of every check, in the chain's order (empty: the worker can take it)."""
    why: list[Reason] = []
    for check in checks:
        check(w, order, want, free, why)
    return why


def _short(
    reason: str, i: int, name: str, want: int, free: int, capacity: int, committed: int
) -> Reason:
    """A shortage of resource ``i`` with its numbers (``held``: what other orders' live
    holds take of it). The detail writes CPUs as people do (``cpus: wants 0.5, free 0.25
    ...``). The fields carry CPUs as ``resource: "cpus"`` in whole CPUs when every number is
    whole (the v1 reason), else as ``resource: "cpu_millis"`` in millicores (§4.15)."""
    nums: tuple[int, ...] = (want, free, capacity, committed, capacity - committed - free)
    f = [format_value(i, n) for n in nums]
    detail = f"{name}: wants {f[0]}, free {f[1]} (capacity {f[2]}, committed {f[3]}, held {f[4]})"
    if reason == BLOCKED:
        detail += ": only holds are in the way (would wait)"
    elif i == PORTS and not capacity:
        detail += ": the worker has no port range"
    if i == CPU:
        if any(n % MILLIS_PER_CPU for n in nums):
            name = "cpu_millis"
        else:
            nums = tuple(n // MILLIS_PER_CPU for n in nums)
    return Reason(
        code=reason,
        detail=detail,
        resource=name,
        want=nums[0],
        free=nums[1],
        capacity=nums[2],
        committed=nums[3],
        held=nums[4],
    )
