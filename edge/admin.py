"""The edge's page (``edge serve --admin``), its pure core: who may look (the token rules)
and what each view of the page shows, made from the fleet view's rows (docs/page.md).

Who may look (:func:`viewer`): a token presented (``Authorization: Bearer``, the cookie
the page sets from ``?token=``) is always checked, in constant time against every token
given (``--admin-token TOKEN`` the operator's, ``TOKEN=TENANT`` a tenant's); none
presented, a loopback peer is the operator and any other is refused. A refusal is a
:class:`Refused` with the message the 401 says.

What it shows (:func:`fleet_json`): regions with their capacity split into used (the
resources of its machines that run: starting or started), held (committed to machines that
do not run: reserved, stopped, failed) and free (the worker's row: capacity less
committed); workers (gone ones marked, since when); machines; apps with their slots, roles
and generations; the workers' image caches. A tenant's viewer gets the fleet (regions,
workers, caches: the rows every tenant's view holds) and its own machines and apps only.
Nothing here touches a socket or the database: edge/admin_server.py reads the rows.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from bourse.wire.limits import MILLIS_PER_CPU
from bourse.wire.messages import Amount, Event, Machine, Resources, WorkerRow
from bourse.wire.metadata import APP, GEN, ROLE, SLOT
from bourse.wire.resources import millis_of
from bourse.wire.subjects import is_valid_id
from bourse.wire.tenancy import tenant_of_order

COOKIE = "bourse_admin"
# The machine states whose resources are in use; the others committed hold theirs.
RUNNING = ("starting", "started")
# A page lists at most this many machines (the JSON says how many matched).
MAX_MACHINES = 500
# The machines' states, for the page's filter.
STATES = ("reserved", "starting", "started", "stopping", "stopped", "failed", "destroyed")


# What a token may be made of: what a cookie's value and a bearer header carry as they are.
_TOKEN = re.compile(r"^[A-Za-z0-9._~+/-]+\Z")


class TokenError(ValueError):
    """An ``--admin-token`` that cannot be taken."""


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who looks: the operator (``tenant`` None: every row) or a tenant (its own machines
    and apps; ``""`` is the shared buyer key's machines)."""

    tenant: str | None = None

    @property
    def operator(self) -> bool:
        return self.tenant is None

    def sees(self, machine_tenant: str) -> bool:
        return self.tenant is None or self.tenant == machine_tenant

    def label(self) -> str:
        return "operator" if self.tenant is None else f"tenant {self.tenant or '(shared)'}"


OPERATOR = Viewer()


@dataclass(frozen=True, slots=True)
class Refused:
    """A 401's message."""

    message: str


@dataclass(frozen=True, slots=True)
class Tokens:
    """The tokens ``--admin-token`` gave: each one's digest and whose it is (None: the
    operator's)."""

    digests: tuple[tuple[bytes, str | None], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.digests)

    def match(self, given: str) -> Viewer | None:
        """The viewer ``given`` is the token of, or None. Every token is compared, each in
        constant time over a digest of the same length: how long it takes says nothing of
        which token, or how much of one, matched."""
        probe = _digest(given)
        found: Viewer | None = None
        for digest, tenant in self.digests:
            if hmac.compare_digest(probe, digest):
                found = Viewer(tenant)
        return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def parse_tokens(values: Iterable[str]) -> Tokens:
    """``--admin-token`` values: ``TOKEN`` (the operator's view) or ``TOKEN=TENANT`` (that
    tenant's own machines and apps). A token is at least 16 characters of ``_TOKEN``
    (a cookie's value as it is); a tenant a tenant's name; a token given twice is refused."""
    out: list[tuple[bytes, str | None]] = []
    seen: set[bytes] = set()
    for value in values:
        token, sep, tenant = value.partition("=")
        if len(token) < 16 or not _TOKEN.match(token):
            raise TokenError(
                "--admin-token: a token is at least 16 letters, digits or . _ ~ + / - "
                "(e.g. from `openssl rand -hex 16`), then =TENANT for a tenant's"
            )
        if sep and not is_valid_id(tenant):
            raise TokenError(
                f"--admin-token ...={tenant!r}: a tenant's name is lowercase letters, "
                "digits and '-', starting with a letter or digit, at most 63"
            )
        digest = _digest(token)
        if digest in seen:
            raise TokenError("--admin-token: a token is given twice")
        seen.add(digest)
        out.append((digest, tenant if sep else None))
    return Tokens(tuple(out))


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def bearer(authorization: str) -> str:
    """The token of an ``Authorization: Bearer TOKEN`` header ("" for none)."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def cookie_token(cookie_header: str) -> str:
    """The page's cookie's value in a ``Cookie`` header ("" for none)."""
    for part in cookie_header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value.strip()
    return ""


def viewer(peer: str, token: str, tokens: Tokens) -> Viewer | Refused:
    """Who a request from ``peer`` presenting ``token`` ("" for none) is (see the module
    doc)."""
    if token:
        if not tokens:
            return Refused(
                "this page takes no token: it serves loopback only (edge serve --admin-token "
                "gives it tokens)"
            )
        found = tokens.match(token)
        if found is None:
            return Refused(
                "bad admin token: not one of --admin-token's (a cookie from another edge? "
                "open /?token=TOKEN again)"
            )
        return found
    if is_loopback(peer):
        return OPERATOR
    if not tokens:
        return Refused(
            f"the page serves loopback only and {peer} is not (edge serve --admin-token "
            "lets others in with a token)"
        )
    return Refused(
        "this page needs a token from outside loopback: open /?token=TOKEN once (it sets a "
        "cookie), or send Authorization: Bearer TOKEN"
    )


# -- what the page shows -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerSeen:
    """A worker's row, since when it is gone (None: it beats; 0: never seen beating), and
    what its running machines use."""

    row: WorkerRow
    gone_since_ms: int | None
    running: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class MachineSeen:
    machine: Machine
    worker_gone_since_ms: int | None


@dataclass(frozen=True, slots=True)
class AppRow:
    """A row of the view's ``apps`` table."""

    tenant: str
    app: str
    generation: int | None
    regions: str
    machines: int
    started: int
    spares: int
    unknown: int


# The resources a capacity bar is drawn for: CPUs and MiB of memory.
BARS = ("cpu", "memory_mb")


def vector(a: Amount | Resources) -> dict[str, float]:
    """An amount as the bars count it (CPUs, not millicores)."""
    return {"cpu": millis_of(a) / MILLIS_PER_CPU, "memory_mb": float(a.memory_mb)}


def _bar(
    capacity: Amount, free: Amount, running: Mapping[str, float], key: str
) -> dict[str, float]:
    cap = vector(capacity)[key]
    free_now = max(0.0, min(cap, vector(free)[key]))
    committed = cap - free_now
    used = max(0.0, min(committed, float(running.get(key, 0))))
    return {"capacity": cap, "used": used, "held": committed - used, "free": free_now}


def _add(total: dict[str, float], bar: Mapping[str, float]) -> None:
    for k, v in bar.items():
        total[k] = total.get(k, 0.0) + v


def worker_json(w: WorkerSeen) -> dict[str, object]:
    r = w.row
    return {
        "worker_id": r.worker_id,
        "region": r.region,
        "state": _worker_state(w),
        "gone_since_ms": w.gone_since_ms or 0,
        "draining": r.draining,
        "drain_reason": r.drain_reason,
        "machines": r.machines,
        "driver": r.driver,
        "isolation": r.isolation,
        "labels": r.labels,
        "version": r.version,
        "bars": {key: _bar(r.capacity, r.free, w.running, key) for key in BARS},
    }


def _worker_state(w: WorkerSeen) -> str:
    if w.gone_since_ms:
        return "gone"
    if w.gone_since_ms is None:
        return "draining" if w.row.draining else "up"
    return "unseen"  # 0: no heartbeat seen yet


def regions_json(workers: Sequence[WorkerSeen]) -> list[dict[str, object]]:
    """Per region: its workers (how many, how many gone) and the sum of their bars (a gone
    worker's capacity left out: nothing can be placed there)."""
    out: dict[str, dict[str, object]] = {}
    for w in workers:
        region = out.setdefault(
            w.row.region,
            {"region": w.row.region, "workers": 0, "gone": 0, "bars": {k: {} for k in BARS}},
        )
        region["workers"] = int(str(region["workers"])) + 1
        if w.gone_since_ms:
            region["gone"] = int(str(region["gone"])) + 1
            continue
        bars = region["bars"]
        assert isinstance(bars, dict)
        for key in BARS:
            _add(bars[key], _bar(w.row.capacity, w.row.free, w.running, key))
    return [out[k] for k in sorted(out)]


def _address(m: Machine) -> str:
    names = sorted(m.addresses)
    return ", ".join(f"{n} {m.addresses[n]}" for n in names)


def machine_json(seen: MachineSeen) -> dict[str, object]:
    m = seen.machine
    health = m.health
    if not m.checks:
        check = "-"
    elif health is None or not health.status or m.state not in RUNNING:
        check = "-" if m.state not in RUNNING else "checking"
    else:
        check = health.status
    last = m.last_exit
    return {
        "machine_id": m.machine_id,
        "tenant": tenant_of_order(m.order_id),
        "region": m.region,
        "worker_id": m.worker_id,
        "worker_gone": bool(seen.worker_gone_since_ms),
        "state": m.state,
        "app": m.metadata.get(APP, ""),
        "role": m.metadata.get(ROLE, ""),
        "slot": m.metadata.get(SLOT, ""),
        "generation": m.metadata.get(GEN, ""),
        "image": m.image,
        "image_digest": m.image_digest,
        "address": _address(m),
        "private_address": m.private_address,
        "health": check,
        "health_detail": health.detail if health is not None else "",
        "restarts": m.restarts,
        "last_exit": "" if last is None else _exit(last.reason, last.code, last.signal),
        "cpu": vector(m.resources)["cpu"],
        "memory_mb": m.resources.memory_mb,
        "updated_at_ms": m.updated_at_ms,
    }


def _exit(reason: str, code: int | None, signal: int | None) -> str:
    if reason == "exit":
        return f"exit {code}"
    return f"{reason} (signal {signal})"


@dataclass(frozen=True, slots=True)
class SlotRow:
    """An app's machine in its slot, as the view's ``machines`` columns say (no row
    decoded: an app of thousands of machines is listed from its columns)."""

    tenant: str
    app: str
    region: str
    slot: int | None
    role: str | None
    machine_id: str
    state: str
    generation: int | None
    worker_gone_since_ms: int | None


def apps_json(apps: Sequence[AppRow], slots: Sequence[SlotRow]) -> list[dict[str, object]]:
    """Each app with its slots: (region, slot, role) and the machine in it, its state and
    generation (an app's machines that are not destroyed), by region, slot, machine."""
    by_app: dict[tuple[str, str], list[SlotRow]] = {}
    for row in slots:
        if row.state != "destroyed":
            by_app.setdefault((row.tenant, row.app), []).append(row)
    out: list[dict[str, object]] = []
    for a in apps:
        rows = sorted(
            by_app.get((a.tenant, a.app), []),
            key=lambda r: (r.region, r.slot is None, r.slot or 0, r.machine_id),
        )
        out.append(
            {
                "tenant": a.tenant,
                "app": a.app,
                "generation": a.generation,
                "regions": [r for r in a.regions.split(",") if r],
                "machines": a.machines,
                "started": a.started,
                "spares": a.spares,
                "unknown": a.unknown,
                "slots": [
                    {
                        "region": r.region,
                        "slot": r.slot,
                        "role": r.role or "",
                        "machine_id": r.machine_id,
                        "state": r.state,
                        "generation": r.generation,
                        "worker_gone": bool(r.worker_gone_since_ms),
                    }
                    for r in rows
                ],
            }
        )
    return out


def caches_json(
    workers: Sequence[WorkerSeen], images: Mapping[str, Sequence[str]]
) -> list[dict[str, object]]:
    """Each worker's image cache: its bytes, its budget, and the images its machines (those
    the viewer sees) run (``images``: by worker)."""
    return [
        {
            "worker_id": w.row.worker_id,
            "region": w.row.region,
            "bytes": w.row.cache_bytes,
            "budget_bytes": w.row.cache_budget_bytes,
            "images": sorted(images.get(w.row.worker_id, ())),
            "gone": bool(w.gone_since_ms),
        }
        for w in workers
    ]


def fleet_json(
    who: Viewer,
    workers: Sequence[WorkerSeen],
    machines: Sequence[MachineSeen],
    matched: int,
    apps: Sequence[AppRow],
    slots: Sequence[SlotRow],
    images: Mapping[str, Sequence[str]],
    view: Mapping[str, int],
) -> dict[str, object]:
    """The page's one JSON document (``/api/fleet``): ``machines`` those the filters
    matched (at most MAX_MACHINES of ``matched``), ``slots`` the machines of the apps
    shown, ``images`` the images each worker's machines run. The caller
    has already kept what ``who`` may see of the machines, apps and images; the fleet's
    rows are everyone's."""
    return {
        "viewer": who.label(),
        "operator": who.operator,
        "view": dict(view),
        "regions": regions_json(workers),
        "workers": [worker_json(w) for w in workers],
        "machines": [machine_json(m) for m in machines],
        "matched": matched,
        "apps": apps_json(apps, slots),
        "caches": caches_json(workers, images),
        "filters": {
            "regions": sorted({w.row.region for w in workers}),
            "apps": sorted({a.app for a in apps}),
            "states": list(STATES),
        },
    }


def event_json(who: Viewer, event: Event) -> dict[str, object] | None:
    """An event as the page's stream sends it, or None when ``who`` may not see it (a
    tenant sees its own machines' events only)."""
    if not who.sees(tenant_of_order(event.order_id)):
        return None
    return {
        "kind": event.kind,
        "region": event.region,
        "worker_id": event.worker_id,
        "machine_id": event.machine_id,
        "at_ms": event.at_ms,
        "detail": event.detail,
        "health": event.health.status if event.health is not None else "",
    }
