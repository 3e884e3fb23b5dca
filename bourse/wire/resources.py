"""The resource vector: one home for the 4-tuple (cpus, memory_mb, disk_mb, gpus).

Capacity, committed, held and wanted amounts are plain tuples of ints in that order, and
their arithmetic is a handful of plain functions: this is on the hot path (every bid is
checked and priced against every candidate worker), where a tuple and an unrolled
expression cost a fraction of an object with methods. The wire types (``Resources``,
``Amount``) convert to and from it here, and nowhere else.
"""

from __future__ import annotations

from bourse.wire.messages import Amount, Resources

# (cpus, memory_mb, disk_mb, gpus), the order of RESOURCES below.
Vec = tuple[int, int, int, int]
RESOURCES = ("cpus", "memory_mb", "disk_mb", "gpus")
ZERO: Vec = (0, 0, 0, 0)


def add(a: Vec, b: Vec) -> Vec:
    """``a + b`` per resource."""
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3])


def sub(a: Vec, b: Vec) -> Vec:
    """``a - b`` per resource (may go negative: the caller checks with :func:`leq`)."""
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3])


def leq(a: Vec, b: Vec) -> bool:
    """``a <= b`` on every resource (``a`` fits in ``b``)."""
    return a[0] <= b[0] and a[1] <= b[1] and a[2] <= b[2] and a[3] <= b[3]


def vec(r: Resources | Amount) -> Vec:
    """The vector of a wire amount."""
    return (r.cpus, r.memory_mb, r.disk_mb, r.gpus)


def amount(v: Vec) -> Amount:
    """The wire ``Amount`` of a vector (status replies: capacity, committed, held)."""
    return Amount(cpus=v[0], memory_mb=v[1], disk_mb=v[2], gpus=v[3])
