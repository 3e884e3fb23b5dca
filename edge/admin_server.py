"""The edge's page, its shell: a listener of its own (``edge serve --admin HOST:PORT``,
never the apps' one) serving the page's files, its JSON (``/api/fleet``, read from the
edge's fleet view once per change of it, per viewer and filters) and its live stream
(``/api/stream``, server-sent events: ``fleet`` when the view changed, ``event`` for each
of the market's events). Who may look and what each viewer sees: edge/admin.py.
docs/page.md says the endpoints.

HTTP here is the least the page needs: GET (and HEAD) only, one request per connection,
a head of at most 16 KiB read within 10 s.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.abc
import structlog

from bourse.runtime.endpoint import format_addr
from bourse.runtime.supervise import cleanup_scope
from bourse.wire.codec import BadMessage, decode
from bourse.wire.messages import Event, Machine, WorkerRow
from edge.admin import (
    COOKIE,
    MAX_MACHINES,
    RUNNING,
    AppRow,
    MachineSeen,
    Refused,
    SlotRow,
    Tokens,
    Viewer,
    WorkerSeen,
    bearer,
    cookie_token,
    event_json,
    fleet_json,
    is_loopback,
    viewer,
)
from edge.service import reuseport_socket

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg

    from bourse.view import View
    from bourse.wire.subjects import Subjects

log = structlog.get_logger("bourse.edge")

HEAD_LIMIT = 16 * 1024
MAX_CONNECTIONS = 256  # open at once (streams included): the next ones are answered 503
MAX_SLOTS = 10_000  # apps' machines listed in their slots
FILTERS = ("region", "app", "state")  # /api/fleet's machines' filters
ANSWERS_KEPT = 64  # /api/fleet answers kept (by viewer and filters)
# After a read of the view that took T, the next one waits READ_EVERY times T: the page's
# reads take at most a tenth of the edge's loop, however large the market.
READ_EVERY = 10
SLOW_READ_S = 0.1
HEAD_TIMEOUT_S = 10.0
KEEPALIVE_S = 15.0
EVENTS_KEPT = 200  # per stream: the oldest dropped when a client reads slower
RECENT = 50  # the last events heard, sent to a stream as it opens
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page.css": ("page.css", "text/css; charset=utf-8"),
    "/page.js": ("page.js", "text/javascript; charset=utf-8"),
}
_HEADERS = (
    "Cache-Control: no-store\r\n"
    "X-Content-Type-Options: nosniff\r\n"
    "X-Frame-Options: DENY\r\n"
    "Referrer-Policy: no-referrer\r\n"
    "Content-Security-Policy: default-src 'self'; frame-ancestors 'none'\r\n"
)
_REASONS = {200: "OK", 303: "See Other", 400: "Bad Request", 401: "Unauthorized",
            404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}  # fmt: skip


def page_file(name: str) -> bytes:
    return resources.files("edge").joinpath("admin_page", name).read_bytes()


# -- the view's rows ------------------------------------------------------------------------

_ORDER = " ORDER BY region, worker_id, created_at_ms, machine_id"


def read_fleet(
    db: sqlite3.Connection, who: Viewer, query: dict[str, str], freshness: dict[str, int]
) -> dict[str, object]:
    """``/api/fleet``'s document from the view's tables (``query``: the machines' filters
    region, app, state)."""
    running: dict[str, dict[str, float]] = {}
    own = " AND tenant = ?" if who.tenant is not None else ""  # a tenant's: its own used
    for wid, millis, mb in db.execute(
        "SELECT worker_id, sum(cpu_millis), sum(memory_mb) FROM machines "
        f"WHERE state IN ({', '.join('?' * len(RUNNING))}){own} GROUP BY worker_id",
        [*RUNNING, *([who.tenant] if who.tenant is not None else [])],
    ):
        running[wid] = {"cpu": (millis or 0) / 1000, "memory_mb": float(mb or 0)}
    workers = []
    for row, gone in db.execute(
        "SELECT row, gone_since_ms FROM workers ORDER BY region, worker_id"
    ):
        try:
            w = decode(row.encode(), WorkerRow)
        except BadMessage:
            continue
        workers.append(WorkerSeen(w, gone, running.get(w.worker_id, {})))
    clauses, args = ["1"], []
    if who.tenant is not None:
        clauses.append("tenant = ?")
        args.append(who.tenant)
    apps_where = " AND ".join(clauses)
    for column in FILTERS:
        if query.get(column):
            clauses.append(f"{column} = ?")
            args.append(query[column])
    if query.get("state") != "destroyed":
        clauses.append("state != 'destroyed'")
    where = " AND ".join(clauses)
    (matched,) = db.execute(f"SELECT count(*) FROM machines WHERE {where}", args).fetchone()
    machines = _machines(
        db, f"SELECT row, worker_gone_since_ms FROM machines WHERE {where}{_ORDER} LIMIT ?",
        [*args, MAX_MACHINES],
    )  # fmt: skip
    tenant_args = [who.tenant] if who.tenant is not None else []
    apps = [
        AppRow(*r)
        for r in db.execute(
            "SELECT tenant, app, generation, regions, machines, started, spares, unknown "
            f"FROM apps WHERE {apps_where} ORDER BY tenant, app",
            tenant_args,
        )
    ]
    slots = [
        SlotRow(*r)
        for r in db.execute(
            "SELECT tenant, app, region, slot, role, machine_id, state, generation, "
            "worker_gone_since_ms FROM machines WHERE app IS NOT NULL AND state != 'destroyed' "
            f"AND {apps_where} ORDER BY tenant, app, region, slot, machine_id LIMIT ?",
            [*tenant_args, MAX_SLOTS],
        )
    ]
    images: dict[str, list[str]] = {}
    for wid, image in db.execute(
        f"SELECT DISTINCT worker_id, image FROM machines WHERE state != 'destroyed' AND "
        f"{apps_where}",
        tenant_args,
    ):
        images.setdefault(wid, []).append(image)
    return fleet_json(who, workers, machines, matched, apps, slots, images, freshness)


def _machines(db: sqlite3.Connection, sql: str, args: Sequence[object]) -> list[MachineSeen]:
    out = []
    for row, gone in db.execute(sql, args):
        try:
            out.append(MachineSeen(decode(row.encode(), Machine), gone))
        except BadMessage:
            continue
    return out


# -- the listener -----------------------------------------------------------------------------


@dataclass(eq=False)
class _Stream:
    """One open ``/api/stream``: what it has not been sent yet."""

    who: Viewer
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    fleet: bool = True  # the view changed since the last ``fleet`` sent
    events: deque[dict[str, object]] = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))


@dataclass(frozen=True, slots=True)
class _Kept:
    """An answer of /api/fleet: the view's change it was read at, and until when it
    stands for later ones."""

    version: int
    body: bytes
    until: float


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    peer: str


@dataclass
class AdminPage:
    """The page's listener (see the module doc). ``view`` gives the edge's fleet view
    (None until it is open, or when the routes come from elsewhere); ``nc`` and
    ``subjects``: where the market's events are heard (None: no event stream)."""

    listen: tuple[str, int]
    view: Callable[[], View | None]
    tokens: Tokens = field(default_factory=Tokens)
    nc: NATS | None = None
    subjects: Subjects | None = None
    address: str = ""
    _streams: set[_Stream] = field(default_factory=set)
    _recent: deque[Event] = field(default_factory=lambda: deque(maxlen=RECENT))
    _closing: bool = False
    _open: int = 0  # connections
    _version: int = 0  # the view's changes told
    # /api/fleet's answers by viewer and filters: open pages share a read
    _answers: dict[tuple[str | None, str], _Kept] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.address}/"

    def changed(self, _db: sqlite3.Connection | None = None) -> None:
        """The view changed (a batch applied, a worker gone or back): every stream says so."""
        self._version += 1
        for s in self._streams:
            s.fleet = True
            s.wake.set()

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = decode(msg.data, Event)
        except BadMessage:
            return
        self._recent.append(event)
        for s in self._streams:
            shown = event_json(s.who, event)
            if shown is not None:
                s.events.append(shown)
                s.wake.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled; ``started`` once it listens."""
        sub = None
        if self.nc is not None and self.subjects is not None:
            sub = await self.nc.subscribe(self.subjects.events(), cb=self._on_event)
        sock = reuseport_socket(*self.listen)
        server = await asyncio.start_server(self._serve, sock=sock, limit=HEAD_LIMIT)
        self.address = format_addr(self.listen[0], sock.getsockname()[1])
        log.info("admin_serving", address=self.address, tokens=len(self.tokens.digests))
        try:
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with cleanup_scope():
                server.close()
                self._closing = True
                for s in self._streams:
                    s.wake.set()  # each ends its answer
                if sub is not None:
                    with suppress(Exception):
                        await sub.unsubscribe()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open > MAX_CONNECTIONS:
                await _answer(writer, 503, b"too many connections to the page\n", "text/plain")
                return
            request = await asyncio.wait_for(_read(reader, writer), HEAD_TIMEOUT_S)
            if request is None:
                await _answer(writer, 400, b"bad request\n", "text/plain")
            else:
                await self._route(request, writer)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self._open -= 1
            writer.close()
            with suppress(Exception):
                await writer.wait_closed()

    async def _route(self, r: _Request, writer: asyncio.StreamWriter) -> None:
        if r.method not in ("GET", "HEAD"):
            await _answer(writer, 405, b"GET only\n", "text/plain", head=False)
            return
        api = r.path.startswith("/api/")
        if r.path in ("/page.css", "/page.js"):  # the page's code: nothing of the market's
            name, kind = FILES[r.path]
            await _answer(writer, 200, page_file(name), kind, head=r.method == "HEAD")
            return
        if r.path != "/" and not api:
            await _answer(writer, 404, b"no such page\n", "text/plain")
            return
        asked = r.query.get("token", "") if r.path == "/" else ""
        token = (
            asked or bearer(r.headers.get("authorization", ""))
            or cookie_token(r.headers.get("cookie", ""))
        )  # fmt: skip
        who = self._who(r, token)
        if isinstance(who, Refused):
            log.info("admin_refused", peer=r.peer, path=r.path, why=who.message)
            body, kind = _refusal(who.message, api)
            await _answer(
                writer, 401, body, kind, extra='WWW-Authenticate: Bearer realm="bourse"\r\n'
            )
            return
        if asked:  # the token into a cookie, and out of the address bar
            cookie = f"{COOKIE}={asked}; Path=/; HttpOnly; SameSite=Strict"
            await _answer(
                writer, 303, b"", "text/plain", extra=f"Location: /\r\nSet-Cookie: {cookie}\r\n"
            )
            return
        if r.path == "/":
            await _answer(
                writer, 200, page_file("index.html"), FILES["/"][1], head=r.method == "HEAD"
            )
        elif r.path == "/api/fleet":
            await self._fleet(r, who, writer)
        elif r.path == "/api/stream":
            await self._stream(who, writer)
        else:
            await _answer(
                writer, 404, _json({"error": f"no endpoint {r.path}"}), "application/json"
            )

    def _who(self, r: _Request, token: str) -> Viewer | Refused:
        who = viewer(r.peer, token, self.tokens)
        if not token and isinstance(who, Viewer) and not _local_host(r.headers.get("host", "")):
            # loopback, but a name that is not: a page elsewhere rebinding its name to here
            return Refused("without a token, the page answers a loopback address or localhost")
        return who

    async def _fleet(self, r: _Request, who: Viewer, writer: asyncio.StreamWriter) -> None:
        view = self.view()
        if view is None:
            why = "the fleet view is not open (the edge's routes come from elsewhere)"
            await _answer(writer, 503, _json({"error": why}), "application/json")
            return
        doc = self._fleet_json(view, who, r.query)
        await _answer(writer, 200, doc, "application/json", head=r.method == "HEAD")

    def _fleet_json(self, view: View, who: Viewer, query: dict[str, str]) -> bytes:
        """The fleet as ``who`` sees it with ``query``'s filters: read from the view once per
        change of it, whatever the pages open. The read runs on the edge's loop, beside its
        requests: after one that took T, the answer is kept for READ_EVERY times T even if
        the view changed (``"behind": true`` says so, and the page asks again)."""
        key = (who.tenant, json.dumps({k: query.get(k, "") for k in FILTERS}))
        now = time.monotonic()
        kept = self._answers.get(key)
        if kept is not None and (kept.version == self._version or now < kept.until):
            return (
                kept.body if kept.version == self._version else b'{"behind":true,' + kept.body[1:]
            )
        fresh = view.freshness()
        doc = read_fleet(view.db.db, who, query, {"seq": fresh.seq, "age_ms": fresh.age_ms})
        body = _json(doc)
        took = time.monotonic() - now
        if len(self._answers) >= ANSWERS_KEPT:
            self._answers.clear()
        self._answers[key] = _Kept(self._version, body, now + took * READ_EVERY)
        if took > SLOW_READ_S:
            log.info("admin_slow_read", ms=round(took * 1000), machines=doc["matched"])
        return body

    async def _stream(self, who: Viewer, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            + _HEADERS.encode()
            + b"Connection: close\r\n\r\nretry: 1000\n\n"
        )
        stream = _Stream(who)
        for event in self._recent:  # what came before it opened: the last few heard
            shown = event_json(who, event)
            if shown is not None:
                stream.events.append(shown)
        self._streams.add(stream)
        try:
            while True:
                await writer.drain()
                with anyio.move_on_after(KEEPALIVE_S) as waited:
                    await stream.wake.wait()
                if waited.cancelled_caught:
                    writer.write(b": keepalive\n\n")
                    continue
                stream.wake.clear()
                if self._closing or writer.is_closing():
                    return
                if stream.fleet:
                    stream.fleet = False
                    writer.write(b"event: fleet\ndata: {}\n\n")
                while stream.events:
                    data = _json(stream.events.popleft())
                    writer.write(b"event: event\ndata: " + data + b"\n\n")
        finally:
            self._streams.discard(stream)


async def _read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        return None
    line, *lines = head.decode("latin-1").split("\r\n")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[1].startswith("/"):
        return None
    headers: dict[str, str] = {}
    for h in lines:
        name, sep, value = h.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    url = urlsplit(parts[1])
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
    peer = writer.get_extra_info("peername")
    return _Request(parts[0], url.path, query, headers, str(peer[0]) if peer else "")


def _local_host(host: str) -> bool:
    """Whether a Host header names this machine's loopback: localhost or a loopback
    address, with or without a port."""
    if host.startswith("["):
        name = host[1:].partition("]")[0]
    else:
        name = host.rpartition(":")[0] if host.count(":") == 1 else host
    return name.lower() == "localhost" or is_loopback(name)


def _json(doc: object) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _refusal(message: str, api: bool) -> tuple[bytes, str]:
    if api:
        return _json({"error": message}), "application/json"
    return f"401: {message}\n".encode(), "text/plain; charset=utf-8"


async def _answer(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    kind: str,
    *,
    head: bool = False,
    extra: str = "",
) -> None:
    writer.write(
        (
            f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(body)}\r\n{_HEADERS}{extra}Connection: close\r\n\r\n"
        ).encode()
        + (b"" if head else body)
    )
    await writer.drain()
