"""Host ports for machines: a worker's port range, the ports its machines hold, the ranges
the suppliers of one host use, and a machine's addresses (docs/protocol.md §4.2a).

Each port an order names is a host port the worker gives the machine from its port range
(published into the machine's own network where it has one, else bound by the machine on
the host's). The layers:

- :class:`PortRange`: a range as an operator writes it (``20000-20999``).
- :class:`Allocator` (pure): which port of the range each machine holds. A pick goes on
  from a cursor that moves past every port it gives out (a port just given back is taken
  again last); each port is tried as bindable (a function given to it) and one that is
  not, busy on the host, is skipped.
- :class:`WorkerPorts`: a worker's allocator beside its ledger, which counts ports as the
  5th resource of its vector (I1: a commit's ports come from its hold, a destroyed
  machine's go back with its other resources), and its advertised host.
- :class:`PortClaims`: the ranges the suppliers of a host serve, each a claim of the host's
  (supplier/machines/host/claims.py, beside its subnets and user ids) that lasts while its
  supplier runs or its machines hold ports of it; a range that overlaps a standing claim
  is refused, and a process or oci worker without a range takes the first free block of
  the default ones (kept across its supplier's restarts, and its own while it is away
  with machines holding ports).

So no two reserved, starting or started machines on one host hold the same port (I8): one
worker gives a port to one machine at a time, and the workers of a host draw from ranges
that do not overlap.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from bourse.errors import BourseError
from bourse.wire.messages import Machine
from bourse.wire.resources import PORTS
from supplier.ledger import Ledger
from supplier.machines.host.claims import Claim, ClaimError, HostClaims, host_claims

# A worker without a range of its own (a process or oci one) takes one of these blocks:
# 20000-20099, 20100-20199, ... 32600-32699, below Linux's ephemeral ports (32768-60999),
# which outgoing connections take.
DEFAULT_FIRST_PORT = 20000
DEFAULT_BLOCK = 100
DEFAULT_BLOCKS = 127
MAX_PORT = 65535

_RANGE = re.compile(r"^\s*([0-9]{1,5})\s*-\s*([0-9]{1,5})\s*\Z")

# Whether a host port can be bound now (tried by a pick before it gives a port out).
Bindable = Callable[[int], bool]


class PortError(BourseError, ValueError):
    """A port range that cannot be used: malformed, or overlapping another worker's."""


class NoPort(BourseError, RuntimeError):
    """A machine cannot be given the ports it names: none free, or none bindable."""


@dataclass(frozen=True, slots=True, order=True)
class PortRange:
    """Host ports ``lo`` to ``hi``, both included."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> PortRange:
        """``"20000-20999"`` (or one port, ``"20000-20000"``); PortError says what is wrong."""
        m = _RANGE.match(text)
        if m is None:
            raise PortError(f"port range {text!r}: write it FIRST-LAST, e.g. 20000-20999")
        lo, hi = int(m.group(1)), int(m.group(2))
        if not 1 <= lo <= hi <= MAX_PORT:
            raise PortError(
                f"port range {text!r}: needs 1 <= FIRST <= LAST <= {MAX_PORT}, e.g. 20000-20999"
            )
        return cls(lo, hi)

    @property
    def size(self) -> int:
        return self.hi - self.lo + 1

    def overlaps(self, other: PortRange) -> bool:
        return self.lo <= other.hi and other.lo <= self.hi

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.lo <= port <= self.hi

    def __str__(self) -> str:
        return f"{self.lo}-{self.hi}"


def default_blocks() -> Iterator[PortRange]:
    """The default ranges, in the order a worker without one tries them: all of them, or
    the slice ``BOURSE_PORT_BLOCKS`` (``FIRST-LAST``, from 0) names (a test session's own,
    so that two with claims directories of their own never publish the same port)."""
    first, _, last = os.environ.get("BOURSE_PORT_BLOCKS", "").partition("-")
    lo, hi = (int(first), int(last)) if first.isdigit() and last.isdigit() else (0, DEFAULT_BLOCKS)
    for i in range(max(0, lo), min(DEFAULT_BLOCKS - 1, hi) + 1):
        start = DEFAULT_FIRST_PORT + i * DEFAULT_BLOCK
        yield PortRange(start, start + DEFAULT_BLOCK - 1)


def overlap(ranges: Sequence[tuple[str, PortRange]]) -> str:
    """How two of ``(worker id, range)`` overlap (the first such pair), or "" when none do."""
    for i, (a, ra) in enumerate(ranges):
        for b, rb in ranges[i + 1 :]:
            if ra.overlaps(rb):
                return f"workers {a} and {b}: port ranges {ra} and {rb} overlap"
    return ""


def bindable(port: int) -> bool:
    """Whether a server could bind ``port`` on every address now: nothing else is bound to
    it on any address (tried as servers bind, with SO_REUSEADDR, so a closed connection's
    TIME_WAIT does not count). The socket is closed at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


@cache
def default_host() -> str:
    """The host's primary address (the source address of its default route, found without
    sending anything), else ``127.0.0.1``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: a route lookup, no packet leaves
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def address(host: str, port: int) -> str:
    """``host:port``; an IPv6 host in brackets (``[::1]:20000``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def port_of(addr: str) -> int:
    """The port of a ``host:port`` address."""
    return int(addr.rsplit(":", 1)[1])


def run_env(m: Machine, env: Mapping[str, str]) -> dict[str, str]:
    """What a machine's process sees above its image's environment (docs/protocol.md
    §4.2a): its order's ``env``, then Bourse's own variables, which win: ``PORT`` (its
    first named port), ``BOURSE_PORT_<NAME>`` and ``BOURSE_ADDR_<NAME>`` per named port
    (the name upper-cased), ``BOURSE_MACHINE_ID`` and ``BOURSE_ORDER_ID``."""
    out = dict(env)
    for i, (name, addr) in enumerate(m.addresses.items()):
        port = str(port_of(addr))
        if i == 0:
            out["PORT"] = port
        out[f"BOURSE_PORT_{name.upper()}"] = port
        out[f"BOURSE_ADDR_{name.upper()}"] = addr
    out["BOURSE_MACHINE_ID"] = m.machine_id
    out["BOURSE_ORDER_ID"] = m.order_id
    return out


# -- which machine holds which port (pure) --------------------------------------------------------
class Allocator:
    """The ports of one worker's range its machines hold (see the module doc)."""

    def __init__(self, port_range: PortRange | None) -> None:
        self.range = port_range
        self.holder: dict[int, str] = {}  # port -> the machine that holds it
        self.of: dict[str, dict[str, int]] = {}  # machine id -> its ports by name
        self._cursor = port_range.lo if port_range else 0

    def take(
        self, machine_id: str, names: Sequence[str], can_bind: Bindable
    ) -> dict[str, int] | None:
        """A free, bindable port for each of ``names``, now held by ``machine_id``; None
        (nothing taken) when there are not enough."""
        got: list[int] = []
        for p in self._around():
            if p not in self.holder and can_bind(p):
                got.append(p)
                if len(got) == len(names):
                    break
        if len(got) < len(names):
            return None
        self._cursor = got[-1] + 1
        ports = dict(zip(names, got, strict=True))
        self.hold(machine_id, ports)
        return ports

    def hold(self, machine_id: str, ports: Mapping[str, int]) -> None:
        """``machine_id`` holds ``ports`` (taken, or as recorded before a restart)."""
        self.of[machine_id] = dict(ports)
        for p in ports.values():
            self.holder[p] = machine_id

    def give_back(self, machine_id: str) -> int:
        """``machine_id`` holds its ports no more; returns how many it held."""
        ports = self.of.pop(machine_id, {})
        for p in ports.values():
            if self.holder.get(p) == machine_id:
                del self.holder[p]
        return len(ports)

    def _around(self) -> Iterator[int]:
        """Every port of the range once, from the cursor on, wrapping around."""
        r = self.range
        if r is None:
            return
        start = self._cursor if self._cursor in r else r.lo
        yield from range(start, r.hi + 1)
        yield from range(r.lo, start)


# -- a worker's ports: the allocator beside the ledger's count ---------------------------------
class WorkerPorts:
    """One worker's port range: the concrete ports its machines hold (:class:`Allocator`)
    beside their count in the worker's ledger (the vector's ports), and the host its
    addresses name. A machine holds its ports from its commit until it is destroyed, as it
    holds its other resources: started again, it is reached at the same addresses."""

    def __init__(
        self,
        port_range: PortRange | None,
        ledger: Ledger,
        host: str,
        can_bind: Bindable = bindable,
    ) -> None:
        self.range = port_range
        self.ledger = ledger
        self.host = host
        self.can_bind = can_bind
        self.allocator = Allocator(port_range)
        # Told whether its machines hold ports (when that changes): its host claim's
        # ``held`` (PortClaims.hold), so that the range outlives a supplier killed with them.
        self.on_held: Callable[[bool], None] | None = None
        self._said: bool | None = None

    def take(self, machine_id: str, names: Sequence[str]) -> dict[str, str]:
        """Addresses for a committed machine's ``names`` (the ledger counts them already:
        its hold had them). Raises NoPort saying why."""
        if not names:
            return {}
        n = len(names)
        if self.range is None:
            raise NoPort(f"it names {n} port(s) and the worker has no port range")
        got = self.allocator.take(machine_id, names, self.can_bind)
        if got is None:
            raise NoPort(
                f"no bindable port: it names {n}, and fewer of the free ports of {self.range} "
                "can be bound (others on this host use them)"
            )
        self.tell()
        return {name: address(self.host, p) for name, p in got.items()}

    def give_back(self, machine_id: str) -> None:
        """The machine is destroyed (or its commit was not written): its ports are free
        (the ledger frees their count with its other resources)."""
        if self.allocator.give_back(machine_id):
            self.tell()

    def hold(self, machine_id: str, addresses: Mapping[str, str]) -> None:
        """A machine recorded holding these addresses before a restart holds their ports
        again (the ledger's count comes with its resources: Worker.recover)."""
        if addresses:
            self.allocator.hold(machine_id, {n: port_of(a) for n, a in addresses.items()})
            self.tell()

    def tell(self) -> None:
        """Say whether its machines hold ports, if that changed (or was never said)."""
        held = bool(self.allocator.of)
        if self.on_held is not None and held != self._said:
            self.on_held(held)
            self._said = held

    def problems(self) -> list[str]:
        """I8 and I1 for ports on this worker: each port held by one machine, inside the
        range, and no more held than the ledger counts (what it finds broken, in words)."""
        a = self.allocator
        out = []
        held = sum(len(p) for p in a.of.values())
        if held != len(a.holder):
            out.append(f"{held} ports held by machines but {len(a.holder)} distinct")
        if a.holder and (self.range is None or any(p not in self.range for p in a.holder)):
            out.append(f"ports held outside the worker's range {self.range}")
        if len(a.holder) > self.ledger.committed[PORTS]:
            out.append(
                f"{len(a.holder)} ports held, the ledger commits {self.ledger.committed[PORTS]}"
            )
        return out


# -- the ranges of a host's suppliers (its claims) --------------------------------------------
KIND = "ports"


@dataclass(frozen=True, slots=True)
class RangeClaim:
    """A range another supplier of the host serves for one of its workers: a host's port
    claim (not an order's claim, bourse/auction/claims.py ``Claim``)."""

    worker_id: str
    owner: str
    range: PortRange


@dataclass(frozen=True, slots=True)
class Wanted:
    """What a worker asks of the host's ports: its own range, or (``default``) a default
    block, preferring ``kept`` (the one it had before); neither: none."""

    worker_id: str
    range: PortRange | None
    default: bool = False
    kept: PortRange | None = None


class PortClaims:
    """This process's workers' port ranges, claimed on the host beside its other claims
    (supplier/machines/host/claims.py, kind ``ports``: one claim per worker, its range the
    value). A claim lasts while its supplier runs, or while its data dir records machines
    holding ports of it (``held``: :meth:`hold`, as the worker's machines take their first
    port and give back their last): a supplier killed with such machines keeps its range
    for its next run, whoever starts meanwhile; one whose machines hold none gives it back
    as it ends, however it ends."""

    def __init__(self, claims: HostClaims | None = None) -> None:
        self._claims = claims
        self._mine: dict[str, tuple[str, str]] = {}  # worker id -> (owner, claim key)

    @property
    def claims(self) -> HostClaims:
        if self._claims is None:
            self._claims = host_claims()  # the process's own view, made at the first use
        return self._claims

    def claim(self, wanted: Sequence[Wanted], owner: str, home: Path) -> dict[str, PortRange]:
        """Each worker's range (worker id -> range; none for a worker that has none),
        claimed for ``owner`` (the supplier of the data dir ``home``): an own range unless
        it overlaps another's standing claim, a default block (the kept one, else the first
        free one). PortError names the worker, its range and the claim in the way."""
        try:
            self.claims.live(owner, home)
            with self.claims.locked():  # one supplier of the host chooses at a time
                standing = self.claims.standing(KIND)
                mine = {c.holder: c for c in standing if c.owner == owner}
                others = [r for c in standing if c.owner != owner and (r := _range_claim(c))]
                chosen = choose(wanted, others)
                for c in mine.values():
                    if c.holder not in chosen:  # a worker this supplier serves no more
                        self.claims.remove(KIND, c.key)
                for worker_id, given in chosen.items():
                    before = mine.get(worker_id)
                    held = before is not None and before.held and before.value == str(given)
                    key = f"{owner}.{worker_id}"
                    self.claims.take(Claim(KIND, key, owner, worker_id, held, str(given)))
                    self._mine[worker_id] = (owner, key)
        except ClaimError as exc:
            raise PortError(f"cannot claim ports: {exc}") from None
        return chosen

    def hold(self, worker_id: str, held: bool) -> None:
        """Whether the worker's machines hold ports of its range (its claim outlives this
        process then)."""
        mine = self._mine.get(worker_id)
        if mine is not None:
            owner, key = mine
            self.claims.hold(KIND, key, owner, held)

    def release(self) -> None:
        """This process stops serving its workers: a range whose machines hold no port is
        given back; the others last (the kept machines' ports)."""
        for owner, key in self._mine.values():
            for c in self.claims.owned(KIND, owner):
                if c.key == key and not c.held:
                    self.claims.drop(KIND, key, owner)
        self._mine.clear()


def _range_claim(c: Claim) -> RangeClaim | None:
    try:
        return RangeClaim(c.holder, c.owner, PortRange.parse(c.value))
    except PortError:
        return None  # not a range: it claims nothing


def host_ranges(
    wanted: Sequence[Wanted],
    kept: Mapping[str, str],
    claims: PortClaims | None,
    owner: str,
    home: Path,
) -> dict[str, PortRange]:
    """Each worker's range, a default block preferring the one ``kept`` from its last run
    (worker id -> range); claimed on the host for ``owner`` (the supplier of the data dir
    ``home``) when ``claims`` is given."""
    wanted = [
        replace(w, kept=PortRange.parse(kept[w.worker_id])) if w.worker_id in kept else w
        for w in wanted
    ]
    return choose(wanted, []) if claims is None else claims.claim(wanted, owner, home)


def held_twice(workers: Mapping[str, WorkerPorts]) -> list[str]:
    """I8 across one host's workers (and I8 and I1 for ports within each): what is broken."""
    problems: list[str] = []
    holder: dict[int, str] = {}
    for worker_id, ports in workers.items():
        problems += [f"{worker_id}: {p}" for p in ports.problems()]
        for port, machine_id in ports.allocator.holder.items():
            if port in holder:
                problems.append(f"port {port} held by {holder[port]} and {machine_id}")
            holder[port] = machine_id
    return problems


def choose(wanted: Sequence[Wanted], live: Sequence[RangeClaim]) -> dict[str, PortRange]:
    """Each worker's range among the live claims of the host (pure: see HostClaims.claim):
    own ranges first, checked against the live claims; then the default blocks."""
    taken: list[tuple[str, PortRange]] = [(_who(c), c.range) for c in live]
    chosen: dict[str, PortRange] = {}
    for w in wanted:
        if w.range is not None:
            _refuse_overlap(w.worker_id, w.range, taken, "its range")
            chosen[w.worker_id] = w.range
    taken += [(f"worker {wid}", r) for wid, r in chosen.items()]
    for w in wanted:
        if w.range is not None or not w.default:
            continue
        # the block it had before, unless another supplier took it while this one was away
        # (a default block is the host's to choose: then the first free one)
        r = w.kept if w.kept is not None and not _in(w.kept, taken) else _free_block(w, taken)
        chosen[w.worker_id] = r
        taken.append((f"worker {w.worker_id}", r))
    return chosen


def _free_block(w: Wanted, taken: Sequence[tuple[str, PortRange]]) -> PortRange:
    free = next((b for b in default_blocks() if not _in(b, taken)), None)
    if free is None:
        raise PortError(
            f"worker {w.worker_id}: every default port range is taken on this host: "
            'give it one (ports = "FIRST-LAST", supplier run --ports)'
        )
    return free


def _refuse_overlap(
    worker_id: str, r: PortRange, taken: Sequence[tuple[str, PortRange]], what: str
) -> None:
    for who, other in taken:
        if r.overlaps(other):
            raise PortError(
                f"worker {worker_id}: {what} {r} overlaps {who}'s port range {other} on this "
                "host: give one of them another range"
            )


def _in(r: PortRange, taken: Sequence[tuple[str, PortRange]]) -> bool:
    return any(r.overlaps(other) for _, other in taken)


def _who(c: RangeClaim) -> str:
    return f"worker {c.worker_id} (of another supplier, owner {c.owner})"
