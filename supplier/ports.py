"""Host ports for machines: a worker's port range, the ports its machines hold, the ranges
the suppliers of one host use, and a machine's addresses (docs/protocol.md §4.2a).

Machines share their worker's network, so each port an order names is a host port the
worker gives the machine from its port range. The layers:

- :class:`PortRange`: a range as an operator writes it (``20000-20999``).
- :class:`Allocator` (pure): which port of the range each machine holds. A pick goes on
  from a cursor that moves past every port it gives out (a port just given back is taken
  again last); each port is tried as bindable (a function given to it) and one that is
  not, busy on the host, is skipped.
- :class:`WorkerPorts`: a worker's allocator beside its ledger, which counts ports as the
  5th resource of its vector (I1: a commit's ports come from its hold, a destroyed
  machine's go back with its other resources), and its advertised host.
- :class:`HostClaims` (files and locks): the ranges the suppliers of a host serve, each a
  claim file locked by its live owner, looked at and written under one lock; a range that
  overlaps a live claim is refused, and a process or oci worker without a range takes the
  first free block of the default ones (kept across its supplier's restarts).

So no two reserved, starting or started machines on one host hold the same port (I8): one
worker gives a port to one machine at a time, and the workers of a host draw from ranges
that do not overlap.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from bourse.errors import BourseError
from bourse.wire.messages import Machine
from bourse.wire.resources import PORTS
from supplier.ledger import Ledger

# A worker without a range of its own (a process or oci one) takes one of these blocks:
# 20000-20099, 20100-20199, ... 32600-32699, below Linux's ephemeral ports (32768-60999),
# which outgoing connections take.
DEFAULT_FIRST_PORT = 20000
DEFAULT_BLOCK = 100
DEFAULT_BLOCKS = 127
# Where the suppliers of a host write their claims: one directory for every user's.
DEFAULT_CLAIMS_DIR = Path(tempfile.gettempdir()) / "bourse-port-claims"
CLAIMS_LOCK = ".lock"
CLAIM_SUFFIX = ".claim"
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
    """The default ranges, in the order a worker without one tries them."""
    for i in range(DEFAULT_BLOCKS):
        lo = DEFAULT_FIRST_PORT + i * DEFAULT_BLOCK
        yield PortRange(lo, lo + DEFAULT_BLOCK - 1)


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
        return {name: address(self.host, p) for name, p in got.items()}

    def give_back(self, machine_id: str) -> None:
        """The machine is destroyed (or its commit was not written): its ports are free
        (the ledger frees their count with its other resources)."""
        self.allocator.give_back(machine_id)

    def hold(self, machine_id: str, addresses: Mapping[str, str]) -> None:
        """A machine recorded holding these addresses before a restart holds their ports
        again (the ledger's count comes with its resources: Worker.recover)."""
        if addresses:
            self.allocator.hold(machine_id, {n: port_of(a) for n, a in addresses.items()})

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


# -- the ranges of a host's suppliers (files and locks) ---------------------------------------
@dataclass(frozen=True, slots=True)
class RangeClaim:
    """A range a live supplier serves for one of its workers: a host's port claim, read
    from its claim file (not an order's claim, bourse/auction/claims.py ``Claim``)."""

    worker_id: str
    owner: str
    range: PortRange
    pid: int


@dataclass(frozen=True, slots=True)
class Wanted:
    """What a worker asks of the host's ports: its own range, or (``default``) a default
    block, preferring ``kept`` (the one it had before); neither: none."""

    worker_id: str
    range: PortRange | None
    default: bool = False
    kept: PortRange | None = None


class HostClaims:
    """This process's claims on its host's ports (see the module doc): each a file
    ``<dir>/<owner>-<worker_id>.claim`` holding its range and pid, locked (flock) for as
    long as the process serves it; the kernel drops a lock when its process ends, however
    it ends, so a claim whose file nobody locks is stale and ignored."""

    def __init__(self, directory: Path = DEFAULT_CLAIMS_DIR) -> None:
        self.directory = directory
        self._held: list[tuple[Path, int]] = []

    def claim(self, wanted: Sequence[Wanted], owner: str) -> dict[str, PortRange]:
        """Each worker's range (worker id -> range; none for a worker that has none),
        claimed for this process: an own range unless it overlaps a live claim, a default
        block (the kept one, else the first free one). PortError names the worker, its
        range and the claim in the way."""
        try:
            self.directory.mkdir(mode=0o1777, parents=True, exist_ok=True)
            lock = os.open(self.directory / CLAIMS_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise PortError(f"cannot claim ports in {self.directory}: {exc.strerror}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one supplier of the host chooses at a time
            # a claim of this owner is this data dir's from a run before (one supplier per
            # data dir): its lock may outlive that run in a process it started
            chosen = choose(wanted, [c for c in self._live() if c.owner != owner])
            for worker_id, r in chosen.items():
                self._write(worker_id, owner, r)
            return chosen
        finally:
            os.close(lock)

    def release(self) -> None:
        """Give up every claim of this process (its end does the same)."""
        for path, fd in self._held:
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)
        self._held.clear()

    def _live(self) -> list[RangeClaim]:
        """The claims of live suppliers (stale ones are removed where this user may)."""
        live = []
        for path in sorted(self.directory.glob("*" + CLAIM_SUFFIX)):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue  # removed meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                claim = _read_claim(fd)
                if claim is not None:
                    live.append(claim)
            else:  # nobody holds it: its supplier is gone
                with contextlib.suppress(OSError):
                    path.unlink()
            finally:
                os.close(fd)
        return live

    def _write(self, worker_id: str, owner: str, r: PortRange) -> None:
        path = self.directory / f"{owner}-{worker_id}{CLAIM_SUFFIX}"
        # a new file renamed over the claim: the old one's lock may still be held by a
        # process a run before started, which must not keep this claim from being ours
        fresh = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as exc:
            raise PortError(f"cannot write the port claim {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            body = {"worker_id": worker_id, "owner": owner, "range": str(r), "pid": os.getpid()}
            os.pwrite(fd, json.dumps(body).encode(), 0)
            os.rename(fresh, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                fresh.unlink()
            raise
        self._held.append((path, fd))


def host_ranges(
    wanted: Sequence[Wanted], kept: Mapping[str, str], claims: HostClaims | None, owner: str
) -> dict[str, PortRange]:
    """Each worker's range, a default block preferring the one ``kept`` from its last run
    (worker id -> range); claimed on the host for ``owner`` when ``claims`` is given."""
    wanted = [
        replace(w, kept=PortRange.parse(kept[w.worker_id])) if w.worker_id in kept else w
        for w in wanted
    ]
    return choose(wanted, []) if claims is None else claims.claim(wanted, owner)


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
    return f"worker {c.worker_id} (supplier pid {c.pid})"


def _read_claim(fd: int) -> RangeClaim | None:
    try:
        body = json.loads(os.pread(fd, 4096, 0))
        return RangeClaim(
            body["worker_id"], body["owner"], PortRange.parse(body["range"]), body["pid"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # being written, or not ours: its writer holds it, the range is unknown
