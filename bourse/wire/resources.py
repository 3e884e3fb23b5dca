"""The resource vector: one home for the 5-tuple (cpu millicores, memory_mb, disk_mb, gpus,
ports).

Capacity, committed, held and wanted amounts are plain tuples of ints in that order, and
their arithmetic is a handful of plain functions: this is on the hot path (every bid is
checked and priced against every candidate worker), where a tuple and an unrolled
expression cost a fraction of an object with methods. CPU is counted in millicores
(1000 = one CPU) so that half a CPU is the integer 500 and the arithmetic stays exact.
Ports are host ports of a worker's port range (docs/protocol.md §4.2a): an order wants one
per named port, a worker's capacity is the size of its range; they are counted like the
other resources (I1) but not priced (supplier/pricing.py prices ``PRICED``).

The wire types (``Resources``, ``Amount``) convert to and from it here, and nowhere else:
on the wire a CPU amount is ``cpus`` (whole CPUs, v1) and, when the amount is not whole,
``cpu_millis`` beside it with ``cpus`` rounded up (docs/protocol.md §4.1). So are CPU
amounts as people write them (``2``, ``0.5``, ``250m``): :func:`parse_cpus` and
:func:`format_cpus`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from bourse.wire.limits import MAX_CPUS, MILLIS_PER_CPU
from bourse.wire.messages import Amount, Resources

# (cpu millicores, memory_mb, disk_mb, gpus, ports), the order of RESOURCES below. The
# names are those of config curves and weights, subscores and Reasons (the CPU resource is
# "cpus").
Vec = tuple[int, int, int, int, int]
RESOURCES = ("cpus", "memory_mb", "disk_mb", "gpus", "ports")
PRICED = RESOURCES[:4]  # what the utility function scores: ports are counted, not priced
ZERO: Vec = (0, 0, 0, 0, 0)
CPU = 0  # the CPU's index in a Vec
PORTS = 4  # the ports' index in a Vec


def add(a: Vec, b: Vec) -> Vec:
    """``a + b`` per resource."""
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], a[4] + b[4])


def sub(a: Vec, b: Vec) -> Vec:
    """``a - b`` per resource (may go negative: the caller checks with :func:`leq`)."""
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3], a[4] - b[4])


def leq(a: Vec, b: Vec) -> bool:
    """``a <= b`` on every resource (``a`` fits in ``b``)."""
    return a[0] <= b[0] and a[1] <= b[1] and a[2] <= b[2] and a[3] <= b[3] and a[4] <= b[4]


# -- wire <-> vector -----------------------------------------------------------------------------
def vec(r: Resources | Amount, ports: int = 0) -> Vec:
    """The vector of a wire amount: ``cpu_millis`` when present (non-zero), else ``cpus``
    whole (a v1 sender's message); ``ports`` when given, else an ``Amount``'s
    (an order's: one per named port; a worker's capacity: its range's size)."""
    if isinstance(r, Amount) and not ports:
        ports = r.ports
    return (r.cpu_millis or r.cpus * MILLIS_PER_CPU, r.memory_mb, r.disk_mb, r.gpus, ports)


def millis_of(r: Resources | Amount) -> int:
    """The CPU of a wire amount in millicores."""
    return r.cpu_millis or r.cpus * MILLIS_PER_CPU


def whole_cpus(millis: int) -> int:
    """Millicores rounded UP to whole CPUs: what ``cpus`` says beside ``cpu_millis``, so a
    receiver that reads only ``cpus`` never counts less than was asked (500 -> 1)."""
    return -(-millis // MILLIS_PER_CPU)


def cpu_fields(millis: int) -> dict[str, int]:
    """The wire fields of a CPU amount: ``{"cpus": 2}`` when whole (exactly the v1 message);
    ``{"cpus": 1, "cpu_millis": 500}`` when not."""
    if millis % MILLIS_PER_CPU:
        return {"cpus": whole_cpus(millis), "cpu_millis": millis}
    return {"cpus": millis // MILLIS_PER_CPU}


def resources(v: Vec) -> Resources:
    """The wire ``Resources`` of a (positive) vector (its ports are the order's names)."""
    return Resources(**cpu_fields(v[0]), memory_mb=v[1], disk_mb=v[2], gpus=v[3])


def amount(v: Vec) -> Amount:
    """The wire ``Amount`` of a vector (status replies: capacity, committed, held)."""
    return Amount(**cpu_fields(v[0]), memory_mb=v[1], disk_mb=v[2], gpus=v[3], ports=v[4])


# -- as people write them ------------------------------------------------------------------------
_MILLI = re.compile(r"^([0-9]+)m\Z")
_DECIMAL = re.compile(r"^-?[0-9]+(\.[0-9]+)?\Z|^-?\.[0-9]+\Z")
CPUS_HELP = "a number of CPUs (2, 0.5) or of millicores (250m)"


def parse_cpus(value: str | int | float, *, max_cpus: int = MAX_CPUS) -> int:
    """A CPU amount as a person writes it, in millicores: ``2`` -> 2000, ``0.5`` -> 500,
    ``250m`` -> 250 (also an int or a float from a config file). Raises ValueError with a
    one-line reason: not a number, not more than 0, finer than a millicore, over the ceiling."""
    if isinstance(value, bool):  # a bool is an int to Python, never a CPU amount
        raise ValueError(f"{value!r} is not a CPU amount: use {CPUS_HELP}")
    text = value.strip() if isinstance(value, str) else repr(value)
    if m := _MILLI.match(text):
        millis = int(m.group(1))
    elif _DECIMAL.match(text):
        try:
            exact = Decimal(text) * MILLIS_PER_CPU
        except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
            raise ValueError(f"{text!r} is not a CPU amount: use {CPUS_HELP}") from None
        if exact > 0 and exact != exact.to_integral_value():
            raise ValueError(
                f"{text!r} is finer than a millicore (0.001 CPU): use at most 3 decimals, "
                "or millicores (250m)"
            )
        millis = int(exact)
    else:
        raise ValueError(f"{text!r} is not a CPU amount: use {CPUS_HELP}")
    if millis <= 0:
        raise ValueError(f"{text!r} is not more than 0 CPUs: use {CPUS_HELP}")
    if millis > max_cpus * MILLIS_PER_CPU:
        raise ValueError(f"{text!r} is more than {max_cpus} CPUs")
    return millis


def format_cpus(millis: int) -> str:
    """Millicores as CPUs people read: 2000 -> ``2``, 500 -> ``0.5``, 250 -> ``0.25``."""
    whole, rest = divmod(millis, MILLIS_PER_CPU)
    if not rest:
        return str(whole)
    sign = "-" if millis < 0 else ""
    whole, rest = divmod(abs(millis), MILLIS_PER_CPU)
    return f"{sign}{whole}.{rest:03d}".rstrip("0")


def format_value(i: int, value: int) -> str:
    """The ``i``-th resource of a vector as people read it (CPUs as :func:`format_cpus`)."""
    return format_cpus(value) if i == CPU else str(value)


def format_vec(v: Vec) -> str:
    """``cpus=0.5 memory_mb=256 disk_mb=0 gpus=0``: a vector in messages and logs (its
    ports only when it has some: ``... gpus=0 ports=2``)."""
    return " ".join(
        f"{n}={format_value(i, x)}"
        for i, (n, x) in enumerate(zip(RESOURCES, v, strict=True))
        if i != PORTS or x
    )


def wire_cpus(raw: dict[str, Any], key: str = "cpus") -> dict[str, Any]:
    """A raw resources mapping (a config file's capacity) whose ``cpus`` may be written as
    people write it (0.5, "250m"), with ``cpus``/``cpu_millis`` as the wire has them; a
    whole int is left as it is. Raises ValueError naming the amount."""
    value = raw.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return raw
    return {**raw, **cpu_fields(parse_cpus(value))}
