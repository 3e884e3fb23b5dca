"""The edge's HTTP/1.1 reverse proxy: asyncio protocols over httptools' parsers (llhttp,
in C) on uvloop.

A client connection is a :class:`Client`; each upstream connection an :class:`Upstream`,
kept in a pool per machine address between requests (keep-alive on both sides). The hot
path runs in the protocols' callbacks, with no task and no future: a request's head is
parsed, routed (edge/routing.py) and written to a pooled connection in one callback, and
the response's bytes go to the client as they arrive. Only a new upstream connection is
made in a task (the proxy's :class:`~bourse.runtime.tasks.TaskSet`), since connecting is
awaited.

Bodies are streamed both ways, never read whole: a request body goes upstream chunk by
chunk as it arrives (re-framed: Content-Length passed on, chunked re-chunked), a response
body to the client likewise; each side's full write buffer pauses reading on the other.
``Upgrade`` (WebSockets): after the upstream's 101, bytes are passed both ways as they
come. Retries (at most ``attempts`` in all): on another machine when connecting failed (no
byte went upstream), and for idempotent methods when the connection ended before any
response byte came back; the machine is then skipped until the prober's next passing
probe (edge/probe.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httptools
import structlog

from bourse.runtime.tasks import TaskSet
from edge.hosts import BadHost, NotRouted, app_of, rule
from edge.routing import UNKNOWN_APP, Choice, Router

if TYPE_CHECKING:
    from bourse.runtime.metrics import EdgeMetrics
    from edge.starts import Starts


class Abortable(Protocol):
    """A connection the stop closes at once (an HTTP client's, a TCP service's)."""

    def abort(self) -> None: ...


log = structlog.get_logger("bourse.edge")

IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"})
# Headers that speak for one connection (RFC 9110 §7.6.1), and those the edge sets itself.
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
     b"transfer-encoding", b"upgrade"}
)  # fmt: skip
OWN = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"bourse-machine"})
DROPPED_REQUEST = HOP_BY_HOP | OWN | {b"expect"}
DROPPED_RESPONSE = HOP_BY_HOP | {b"bourse-machine"}
# A request body kept for a retry on another machine: up to this many bytes.
REPLAY_MAX = 64 * 1024
# A request body waiting for its upstream connection: past this, the client is not read.
PENDING_MAX = 256 * 1024
NO_BODY_STATUS = frozenset({204, 304})
HOSTS_KEPT = 4096
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
REASONS = {
    400: b"Bad Request",
    404: b"Not Found",
    408: b"Request Timeout",
    413: b"Content Too Large",
    429: b"Too Many Requests",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
}


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    """How the proxy treats clients and upstreams (``edge serve``'s options)."""

    domain: str = "localhost"
    max_body_bytes: int = 10 * 1024 * 1024
    header_timeout_s: float = 10.0  # a request's head, from its first byte
    idle_timeout_s: float = 60.0  # a kept-alive client connection between requests
    max_conns_per_ip: int = 256
    connect_timeout_s: float = 2.0
    attempts: int = 3  # machines a request may be sent to, in all
    pool_idle_s: float = 1.0  # an idle upstream connection is not reused after this long
    pool_max: int = 64  # idle upstream connections kept per machine address
    access_log: bool = True


class Request:
    """One request through the edge: what was parsed, where it went, how it ended. The
    plain values' defaults are the class's: an instance sets only what it changes (a
    request's object is made per request, on the hot path)."""

    url = b""
    host = b""
    method = b""
    version = "1.1"
    keep_alive = True
    upgrade: bytes | None = None
    content_length: int | None = None
    chunked_in = False
    continue_100 = False
    body_in = 0
    body_done = False
    pending_bytes = 0
    app = ""
    backend_id = ""
    address: tuple[str, int] = ("", 0)
    attempts = 0
    up: Upstream | None = None
    responded = False  # a byte of the response went to the client
    response_done = False
    chunked_out = False
    close_after = False
    head_only = False
    discard = False  # the rest of the body is read and dropped
    status = 0
    error = ""
    bytes_out = 0
    hosts = 0  # Host headers seen
    held = False  # it waited for a machine's start (once at most)

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.pending: list[bytes] = []
        self.replay: list[bytes] | None = []  # None: too big to send again
        self.tried: list[str] = []
        self.started = time.perf_counter()


class Proxy:
    """What the connections share: the router, the upstream pools, the config, metrics,
    the tasks that connect, and every client connection (to close them at a stop)."""

    def __init__(
        self, router: Router, config: EdgeConfig, metrics: EdgeMetrics | None = None
    ) -> None:
        self.router = router
        self.config = config
        self.metrics = metrics
        self.starts: Starts | None = None  # requests held while a machine starts
        self.tasks = TaskSet("edge-connect")
        self.pools: dict[tuple[str, int], deque[Upstream]] = {}
        self.clients: set[Abortable] = set()
        self.per_ip: dict[str, int] = {}
        self.in_flight = 0
        self._idle: asyncio.Event | None = None  # made by wait_idle, set at 0
        self.loop = asyncio.get_running_loop()
        self.period = min(config.header_timeout_s, config.idle_timeout_s)
        self.hosts: dict[bytes, str] = {}  # Host -> app key, as app_of said

    def client(self) -> Client:
        return Client(self)

    def take(self, address: tuple[str, int]) -> Upstream | None:
        """An idle pooled connection to ``address`` still fit for a request, or None."""
        pool = self.pools.get(address)
        if not pool:
            return None
        oldest = time.monotonic() - self.config.pool_idle_s
        while pool:
            up = pool.pop()  # the most recently used: the likeliest still open
            if not up.closed and up.idle_since >= oldest:
                return up
            up.close()
        return None

    def give(self, address: tuple[str, int], up: Upstream) -> None:
        """Keep ``up`` for the next request to ``address`` (or close it: pool full)."""
        pool = self.pools.get(address)
        if pool is None:
            pool = self.pools[address] = deque()
        if len(pool) >= self.config.pool_max:
            up.close()
            return
        up.idle_since = time.monotonic()
        pool.append(up)

    def busy(self, delta: int) -> None:
        self.in_flight += delta
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def wait_idle(self) -> None:
        """Until no request is in flight."""
        if self.in_flight:
            self._idle = self._idle or asyncio.Event()
            await self._idle.wait()

    def app_of(self, host: bytes) -> str:
        """edge/hosts.py ``app_of``, remembered per Host (a few thousand at most)."""
        key = self.hosts.get(host)
        if key is None:
            key = app_of(host, self.config.domain)
            if len(self.hosts) >= HOSTS_KEPT:
                self.hosts.clear()
            self.hosts[host] = key
        return key

    def close(self) -> None:
        """Every connection, client and upstream, closed at once (the stop's last step)."""
        for client in list(self.clients):
            client.abort()
        for pool in self.pools.values():
            for up in pool:
                up.close()
        self.pools.clear()


def reason_of(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return type(exc).__name__


class Client(asyncio.Protocol):
    """One client connection: its requests parsed, routed and proxied one at a time (a
    pipelined one waits, the client unread meanwhile)."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.config = proxy.config
        self.transport: Any = None
        self.ip = ""
        self.ip_bytes = b""
        self.parser = httptools.HttpRequestParser(self)
        self.cur: Request | None = None  # being parsed
        self.active: Request | None = None  # being proxied
        self.queued: deque[Request] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.deadline = math.inf
        self.closed = False
        self.upgrading = False  # the parser stopped at an Upgrade: the rest is raw bytes
        self.early: list[bytes] = []  # those bytes, until the tunnel is open
        self.tunnel: Upstream | None = None
        self.bad = ""  # a parse error after the active request: said once it is done
        self.counted = False
        self.out: list[bytes] = []  # a response's parts, written at once (flush)

    # -- the connection --------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.ip = str(peer[0]) if peer else ""
        self.ip_bytes = self.ip.encode()
        proxy = self.proxy
        n = proxy.per_ip.get(self.ip, 0)
        if n >= self.config.max_conns_per_ip:
            transport.write(_local(429, "too many connections from your address", close=True))
            transport.close()
            self.closed = True
            return
        proxy.per_ip[self.ip] = n + 1
        self.counted = True
        proxy.clients.add(self)
        self._arm(self.config.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        proxy = self.proxy
        proxy.clients.discard(self)
        if self.counted:
            self.counted = False
            left = proxy.per_ip.get(self.ip, 1) - 1
            if left:
                proxy.per_ip[self.ip] = left
            else:
                proxy.per_ip.pop(self.ip, None)
        if self.tunnel is not None:
            self.tunnel.close()
        r = self.active
        if r is not None:
            if r.up is not None:
                self._drop_upstream(r, abort=True)
            if not r.response_done:
                r.status = r.status or 499  # the client left before its answer
                r.error = r.error or "client closed the connection"
            self._done(r)
        self.queued.clear()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def pause_writing(self) -> None:
        up = self.tunnel or (self.active.up if self.active is not None else None)
        if up is not None and up.transport is not None:
            up.transport.pause_reading()

    def resume_writing(self) -> None:
        up = self.tunnel or (self.active.up if self.active is not None else None)
        if up is not None and up.transport is not None:
            up.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.tunnel is not None:
            self.tunnel.transport.write(data)
            return
        if self.upgrading:
            self.early.append(data)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self.upgrading = True
            rest = data[exc.args[0] :]
            if rest:
                self.early.append(rest)
        except httptools.HttpParserError as exc:
            self._bad_request(str(exc) or "malformed request")

    def eof_received(self) -> bool | None:
        if self.tunnel is not None:
            if self.tunnel.transport.can_write_eof():
                self.tunnel.transport.write_eof()
            return True
        if self.active is not None:  # the client is done sending: answer, then close
            self.active.keep_alive = False
            self.queued.clear()
            return True
        return None

    # -- timers ----------------------------------------------------------------------------

    # A deadline per connection, set per request (a float); the timer that checks it is
    # made at most once per ``period`` (never per request: a timer handle made and cancelled
    # twice a request cost more than routing it), and never waits past ``period``, so a
    # nearer deadline set later is still met on time.

    def _arm(self, seconds: float) -> None:
        now = self.proxy.loop.time()
        self.deadline = now + seconds
        if self.timer is None:
            self.timer = self.proxy.loop.call_at(
                min(self.deadline, now + self.proxy.period), self._timed_out
            )

    def _disarm(self) -> None:
        self.deadline = math.inf  # the timer, if any, fires and finds nothing due

    def _timed_out(self) -> None:
        self.timer = None
        if self.closed:
            return
        now = self.proxy.loop.time()
        if self.deadline > now:
            if self.deadline != math.inf:
                self.timer = self.proxy.loop.call_at(
                    min(self.deadline, now + self.proxy.period), self._timed_out
                )
            return
        if self.active is not None:
            return
        if self.cur is not None:  # a head begun, not finished in time
            self.transport.write(_local(408, "request head not received in time", close=True))
        self.transport.close()

    # -- httptools' callbacks (a request's parts) -------------------------------------------

    def on_message_begin(self) -> None:
        self.cur = Request()
        if self.active is None:
            self._arm(self.config.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        assert self.cur is not None
        self.cur.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        r = self.cur
        assert r is not None
        lower = name.lower()
        if lower not in DROPPED_REQUEST:
            r.headers.append((name, value))
            if lower == b"host":
                r.hosts += 1  # two: routed by one, read upstream by the other? refused
                r.host = value
            elif lower == b"content-length" and value.isdigit():
                r.content_length = int(value)
        elif lower == b"transfer-encoding":
            r.chunked_in = b"chunked" in value.lower()
        elif lower == b"upgrade":
            r.upgrade = value
        elif lower == b"expect":
            r.continue_100 = value.lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        r = self.cur
        assert r is not None
        parser = self.parser
        r.method = parser.get_method()
        r.version = parser.get_http_version()
        r.keep_alive = parser.should_keep_alive()
        if not parser.should_upgrade():
            r.upgrade = None
        r.head_only = r.method == b"HEAD"
        if self.active is None:
            self._disarm()
            self._begin(r)
        else:
            self.queued.append(r)
            self.transport.pause_reading()

    def on_body(self, body: bytes) -> None:
        r = self.cur
        assert r is not None
        r.body_in += len(body)
        if r.discard:
            return
        if r.body_in > self.config.max_body_bytes:
            self._too_large(r)
            return
        self._forward_body(r, body)

    def on_message_complete(self) -> None:
        r = self.cur
        assert r is not None
        self.cur = None
        r.body_done = True
        if r.discard:
            if r.response_done:
                self._finish(r)
            return
        up = r.up
        if up is not None and r.chunked_in:
            up.transport.write(b"0\r\n\r\n")
        if r.response_done and r is self.active:
            self._finish(r)

    # -- a request's way -------------------------------------------------------------------

    def _begin(self, r: Request) -> None:
        self.active = r
        self.proxy.busy(+1)
        try:
            if r.hosts > 1:
                raise BadHost("more than one Host header")
            r.app = self.proxy.app_of(r.host)
        except BadHost as exc:
            self._respond(r, 400, str(exc), close=True)
            return
        except NotRouted as exc:
            self._respond(r, 404, str(exc))
            return
        length = r.content_length
        if length is not None and length > self.config.max_body_bytes:
            self._respond(r, 413, self._too_large_detail(), close=True)
            return
        if r.continue_100:
            self.transport.write(CONTINUE)
        self._route(r)

    def _route(self, r: Request) -> None:
        choice = self.proxy.router.pick(r.app, exclude=r.tried)
        if not isinstance(choice, Choice):
            if choice.reason == UNKNOWN_APP and not r.error:
                self._respond(r, 404, f"{choice.detail}: {rule(self.config.domain)}")
            else:  # a retry that found no other machine (502), or none could take it (503)
                self._hold(r, choice.detail)
            return
        backend = choice.backend
        r.backend_id = backend.machine_id
        r.address = choice.address
        r.tried.append(backend.machine_id)
        r.attempts += 1
        self.proxy.router.begin(backend.machine_id)
        up = self.proxy.take(choice.address)
        if up is not None:
            self._send(r, up, reused=True)
        else:
            self.proxy.tasks.spawn(self._connect(r, choice.address))

    def _hold(self, r: Request, detail: str) -> None:
        """No machine can take ``r``: held while a stopped machine of its app starts
        (edge/starts.py), else 503 with why (502 with the error of a retry: the machine
        tried failed, and no other could take it)."""
        status, detail = (502, r.error) if r.error else (503, detail)
        starts = self.proxy.starts
        if starts is None or r.held:
            self._respond(r, status, detail)
            return
        why = starts.hold(r.app, lambda why: self._released(r, why))
        if why is None:
            r.held = True
            if self.proxy.metrics is not None:
                self.proxy.metrics.held_request(r.app)
        else:
            self._respond(r, status, f"{detail}; {why}" if why else detail)

    def _released(self, r: Request, why: str | None) -> None:
        """The start ``r`` waited for answered (``why`` None: route it again, to any
        machine: the one started may be one it tried at an old address) or not."""
        if r is not self.active or self.closed or r.response_done:
            return  # the client left, or the request was answered meanwhile (413)
        if why is None:
            r.tried.clear()
            r.error = ""
            self._route(r)
        else:
            self._respond(r, 503, why)

    async def _connect(self, r: Request, address: tuple[str, int]) -> None:
        proxy = self.proxy
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                _, up = await proxy.loop.create_connection(
                    lambda: Upstream(proxy, address), address[0], address[1]
                )
        except (OSError, TimeoutError) as exc:
            if r is self.active and not self.closed:
                self.upstream_failed(r, f"connect to {r.backend_id}: {reason_of(exc)}", retry=True)
            else:
                proxy.router.end(r.backend_id)
            return
        if r is not self.active or self.closed:  # the client left meanwhile
            up.close()
            proxy.router.end(r.backend_id)
            return
        self._send(r, up, reused=False)

    def upstream_failed(
        self, r: Request, error: str, *, retry: bool, skip: bool = True, sent: bool = False
    ) -> None:
        """The request's upstream failed before any response byte came back: skip that
        machine (unless only a kept-alive connection went stale) and send the request to
        another one when ``retry`` allows and attempts are left; else 502. ``sent``: its
        head (and body so far) went up that connection, so the body is sent again from
        what was kept of it (a retry after a send needs ``r.replay``)."""
        proxy = self.proxy
        proxy.router.end(r.backend_id)
        if skip:
            proxy.router.failed(r.backend_id, r.address)
        r.error = error
        metrics = proxy.metrics
        if metrics is not None:
            metrics.upstream_error(r.app)
        if retry and r.attempts < self.config.attempts:
            if metrics is not None:
                metrics.retry(r.app)
            if sent and r.replay is not None:
                r.pending = list(r.replay)  # every chunk received so far, sent or not
                r.pending_bytes = sum(len(c) for c in r.pending)
            if not skip:  # a stale pooled connection: the same machine may be tried again
                r.tried.pop()
            self._route(r)
        else:
            self._respond(r, 502, error)

    def _send(self, r: Request, up: Upstream, *, reused: bool) -> None:
        r.up = up
        up.attach(self, r, reused)
        parts = [r.method, b" ", r.url, b" HTTP/1.1\r\n"]
        for name, value in r.headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (b"X-Forwarded-For: ", self.ip_bytes, b"\r\nX-Forwarded-Proto: http\r\n")
        if r.chunked_in:
            parts.append(b"Transfer-Encoding: chunked\r\n")
        if r.upgrade is not None:
            parts += (b"Connection: Upgrade\r\nUpgrade: ", r.upgrade, b"\r\n")
        parts.append(b"\r\n")
        if r.pending:
            for chunk in r.pending:
                parts.append(_chunk(chunk) if r.chunked_in else chunk)
            r.pending = []
            if r.pending_bytes > PENDING_MAX:
                self.transport.resume_reading()
            r.pending_bytes = 0
        if r.body_done and r.chunked_in:
            parts.append(b"0\r\n\r\n")
        up.transport.write(b"".join(parts))

    def _forward_body(self, r: Request, body: bytes) -> None:
        if r.replay is not None:
            if r.body_in <= REPLAY_MAX:
                r.replay.append(body)
            else:
                r.replay = None
        up = r.up
        if up is not None and r is self.active:
            up.transport.write(_chunk(body) if r.chunked_in else body)
            return
        r.pending.append(body)
        r.pending_bytes += len(body)
        if r.pending_bytes > PENDING_MAX:
            self.transport.pause_reading()

    # -- the response ----------------------------------------------------------------------

    def response_head(
        self, up: Upstream, status: int, reason: bytes, headers: list[bytes], framed: bool
    ) -> None:
        r = self.active
        assert r is not None
        r.status = status
        r.responded = True
        parts = [b"HTTP/1.1 %d " % status, reason, b"\r\n", *headers]
        parts += (b"Bourse-Machine: ", r.backend_id.encode(), b"\r\n")
        if status == 101:
            parts += (b"Connection: Upgrade\r\nUpgrade: ", up.upgrade or b"", b"\r\n")
        elif not framed and not r.head_only and status not in NO_BODY_STATUS:
            if r.version == "1.1":
                r.chunked_out = True
                parts.append(b"Transfer-Encoding: chunked\r\n")
            else:
                r.close_after = True
        if status != 101:
            if r.close_after or not r.keep_alive or self.upgrading:
                parts.append(b"Connection: close\r\n")
            elif r.version == "1.0":
                parts.append(b"Connection: keep-alive\r\n")
        parts.append(b"\r\n")
        self.out.append(b"".join(parts))

    def response_body(self, body: bytes) -> None:
        r = self.active
        assert r is not None
        r.bytes_out += len(body)
        self.out.append(_chunk(body) if r.chunked_out else body)

    def flush(self) -> None:
        """Write what the response's callbacks gathered: one write (one system call) for
        a small answer's head and body, parsed from one read."""
        out = self.out
        if out:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()

    def response_end(self, up: Upstream, keep: bool) -> None:
        r = self.active
        assert r is not None
        if r.chunked_out:
            self.out.append(b"0\r\n\r\n")
        r.response_done = True
        r.up = None
        up.detach()
        self.proxy.router.end(r.backend_id)
        if keep and r.body_done and not up.closed:
            self.proxy.give(r.address, up)
        else:
            up.close()
        if r.body_done:
            self._finish(r)
        else:  # answered before the body was all sent: the rest is read and dropped
            r.discard = True
            r.keep_alive = False

    def upstream_lost(self, up: Upstream, reused: bool) -> None:
        """``up`` ended before its response did."""
        r = self.active
        if r is None or r.up is not up:
            return
        r.up = None
        if r.responded:  # part of the answer went out: the client's connection ends too
            self.proxy.router.end(r.backend_id)
            r.error = "upstream closed mid-response"
            if self.proxy.metrics is not None:
                self.proxy.metrics.upstream_error(r.app)
            r.response_done = True
            self._done(r)
            self.active = None
            self.out.clear()
            self.transport.abort()
            return
        retry = not up.got_bytes and r.method in IDEMPOTENT and r.replay is not None
        error = f"{r.backend_id} closed the connection before answering"
        self.upstream_failed(r, error, retry=retry, skip=not reused, sent=True)

    def start_tunnel(self, up: Upstream, rest: bytes) -> None:
        """The upstream switched protocols (101): bytes pass both ways from now on."""
        r = self.active
        assert r is not None
        self.tunnel = up
        r.up = None
        r.response_done = True
        self.upgrading = False
        self.flush()
        if rest:
            self.transport.write(rest)
        for chunk in self.early:
            up.transport.write(chunk)
        self.early = []
        self._done(r)
        self.active = None

    def tunnel_closed(self, up: Upstream) -> None:
        self.proxy.router.end(up.machine_id)
        self.tunnel = None
        if not self.closed:
            self.transport.close()

    # -- endings ---------------------------------------------------------------------------

    def _respond(self, r: Request, status: int, detail: str, *, close: bool = False) -> None:
        """Answer ``r`` from the edge itself: ``status`` with ``detail`` as its text."""
        r.status = status
        r.error = detail
        if close or self.upgrading:
            r.keep_alive = False
        self.transport.write(_local(status, detail, close=not r.keep_alive, version=r.version))
        r.responded = True
        r.response_done = True
        if r.body_done or not r.keep_alive:
            self._finish(r)
        else:
            r.discard = True

    def _too_large_detail(self) -> str:
        return f"request body larger than {self.config.max_body_bytes} bytes"

    def _too_large(self, r: Request) -> None:
        r.discard = True
        if r is not self.active:  # still queued: the active one is answered first
            r.keep_alive = False
            return
        if r.up is not None:
            self._drop_upstream(r, abort=True)
        if r.responded:
            self.transport.abort()
        else:
            self._respond(r, 413, self._too_large_detail(), close=True)

    def _bad_request(self, detail: str) -> None:
        if self.active is not None:
            self.bad = detail
            self.transport.pause_reading()
            return
        r = self.cur or Request()
        self.cur = None
        self.active = r
        self.proxy.busy(+1)
        self._respond(r, 400, f"malformed request: {detail.lower()}", close=True)

    def _drop_upstream(self, r: Request, *, abort: bool) -> None:
        up = r.up
        assert up is not None
        r.up = None
        up.detach()
        self.proxy.router.end(r.backend_id)
        if abort:
            up.abort()

    def _finish(self, r: Request) -> None:
        """``r`` is over, its answer sent: the next request (or the connection's end)."""
        self.flush()
        self._done(r)
        self.active = None
        if self.closed:
            return
        if self.bad:
            r2 = Request()
            self.active = r2
            self.proxy.busy(+1)
            self._respond(r2, 400, f"malformed request: {self.bad.lower()}", close=True)
            return
        if not r.keep_alive or r.close_after or self.upgrading:
            self.transport.close()
            return
        if self.queued:
            nxt = self.queued.popleft()
            self.transport.resume_reading()
            self._begin(nxt)
        else:
            self._arm(self.config.idle_timeout_s)

    def _done(self, r: Request) -> None:
        """Count and log ``r`` (once)."""
        if r.started < 0:
            return
        seconds = time.perf_counter() - r.started
        r.started = -1.0
        proxy = self.proxy
        proxy.busy(-1)
        if proxy.metrics is not None:
            proxy.metrics.request(r.app, r.status, seconds)
        if self.config.access_log:
            log.info(
                "request",
                client=self.ip,
                method=r.method.decode("latin-1"),
                host=r.host.decode("latin-1"),
                path=r.url.decode("latin-1")[:200],
                status=r.status,
                app=r.app,
                machine=r.backend_id,
                attempts=r.attempts,
                ms=round(seconds * 1000, 3),
                body_in=r.body_in,
                body_out=r.bytes_out,
                error=r.error or None,
            )


class Upstream(asyncio.Protocol):
    """One connection to a machine: a response parsed at a time, handed to its client."""

    def __init__(self, proxy: Proxy, address: tuple[str, int]) -> None:
        self.proxy = proxy
        self.address = address
        self.transport: Any = None
        self.parser = httptools.HttpResponseParser(self)
        self.client: Client | None = None
        self.machine_id = ""
        self.reused = False
        self.closed = False
        self.got_bytes = False
        self.idle_since = 0.0
        self.headers: list[bytes] = []
        self.reason = b""
        self.length = False  # the response has a Content-Length
        self.chunked = False  # the response is chunked
        self.interim = False
        self.upgrade: bytes | None = None
        self.tunnel = False

    def attach(self, client: Client, r: Request, reused: bool) -> None:
        self.client = client
        self.machine_id = r.backend_id
        self.reused = reused
        self.got_bytes = False

    def detach(self) -> None:
        self.client = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        client = self.client
        if client is None:
            return
        if self.tunnel:
            client.tunnel_closed(self)
            return
        r = client.active
        if r is not None and r.up is self and r.responded and not (self.length or self.chunked):
            client.response_end(self, keep=False)  # a body that ends with the connection
            client.flush()
            return
        self.client = None
        client.upstream_lost(self, self.reused)

    def pause_writing(self) -> None:
        if self.client is not None and self.client.transport is not None:
            self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.client is not None and self.client.transport is not None:
            self.client.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        client = self.client
        if self.tunnel:
            if client is not None:
                client.transport.write(data)
            return
        if client is None:  # bytes nobody asked for on an idle connection
            self.abort()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
            client.flush()
        except httptools.HttpParserUpgrade as exc:
            self.tunnel = True
            client.start_tunnel(self, data[exc.args[0] :])
        except httptools.HttpParserError as exc:
            self.abort()
            r = client.active
            if r is not None and r.up is self:
                self.client = None
                r.up = None
                if r.responded:
                    client.upstream_lost(self, False)
                else:
                    error = f"bad response from {r.backend_id}: {exc}"
                    client.upstream_failed(r, error, retry=False)

    def eof_received(self) -> bool | None:
        if self.tunnel and self.client is not None:
            transport = self.client.transport
            if transport.can_write_eof():
                transport.write_eof()
            return True
        return None

    # -- httptools' callbacks (a response's parts) ------------------------------------------

    def on_message_begin(self) -> None:
        self.headers = []
        self.length = False
        self.chunked = False
        self.upgrade = None

    def on_status(self, reason: bytes) -> None:
        self.reason = reason

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower in DROPPED_RESPONSE:
            if lower == b"transfer-encoding":
                self.chunked = b"chunked" in value.lower()  # re-chunked to the client
            elif lower == b"upgrade":
                self.upgrade = value
            return
        if lower == b"content-length":
            self.length = True
        self.headers.append(name + b": " + value + b"\r\n")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.interim = True  # 100 Continue and the like: the edge answered its own
            return
        client = self.client
        if client is None:
            return
        client.response_head(self, status, self.reason, self.headers, self.length)
        r = client.active
        if r is not None and r.head_only:
            # httptools cannot be told a response has no body (a HEAD's Content-Length
            # would be waited for): the answer ends here and the connection is not reused
            self.client = None
            client.response_end(self, keep=False)

    def on_body(self, body: bytes) -> None:
        if self.client is not None and not self.interim:
            self.client.response_body(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        client = self.client
        if client is None or self.parser.get_status_code() == 101:
            return
        client.response_end(self, self.parser.should_keep_alive())


def _chunk(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(body), body)


def _local(status: int, detail: str, *, close: bool, version: str = "1.1") -> bytes:
    """A response the edge writes itself: ``detail`` as plain text."""
    body = detail.encode("utf-8", "replace") + b"\n"
    reason = REASONS.get(status, b"Error")
    if close:
        conn = b"Connection: close\r\n"
    else:
        conn = b"Connection: keep-alive\r\n" if version == "1.0" else b""
    return (
        (
            b"HTTP/%s %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n"
            % (version.encode(), status, reason, len(body))
        )
        + conn
        + b"\r\n"
        + body
    )
