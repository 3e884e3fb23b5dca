"""The edge's HTTP/1.1 reverse proxy: asyncio protocols over httptools' parsers (llhttp,
in C) on uvloop.

A client connection is a :class:`Client`; each upstream connection an
:class:`~edge.upstream.Upstream`, kept in a pool per machine address between requests
(keep-alive on both sides; the pools and what else the connections share: edge/proxy.py
``Proxy``). The hot path runs in the protocols' callbacks, with no task and no future: a
request's head is parsed, routed (edge/routing.py) and written to a pooled connection in
one callback, and the response's bytes go to the client as they arrive (edge/responses.py).
Only a new upstream connection is made in a task (the proxy's
:class:`~bourse.runtime.tasks.TaskSet`), since connecting is awaited (edge/retries.py).

Bodies are streamed both ways, never read whole: a request body goes upstream chunk by
chunk as it arrives (re-framed: Content-Length passed on, chunked re-chunked), a response
body to the client likewise; each side's full write buffer pauses reading on the other.
``Upgrade`` (WebSockets): after the upstream's 101, bytes are passed both ways as they
come. Retries and the hold while a machine starts: edge/retries.py.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import httptools

from edge.hosts import BadHost, NotRouted, rule
from edge.requests import (
    CONTINUE,
    DROPPED_REQUEST,
    PENDING_MAX,
    REPLAY_MAX,
    Request,
    as_chunk,
    local_response,
)
from edge.responses import Responses
from edge.retries import Retries
from edge.routing import UNKNOWN_APP, Choice

if TYPE_CHECKING:
    from edge.proxy import Proxy
    from edge.upstream import Upstream


class Client(Retries, Responses, asyncio.Protocol):
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
            transport.write(
                local_response(429, "too many connections from your address", close=True)
            )
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

    def cut(self, dead: Collection[str]) -> None:
        r = self.active
        if r is not None and r.up is not None and r.backend_id in dead:
            r.up.abort()  # connection_lost: upstream_lost, retried when it may be

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
            self.transport.write(
                local_response(408, "request head not received in time", close=True)
            )
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
                parts.append(as_chunk(chunk) if r.chunked_in else chunk)
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
            up.transport.write(as_chunk(body) if r.chunked_in else body)
            return
        r.pending.append(body)
        r.pending_bytes += len(body)
        if r.pending_bytes > PENDING_MAX:
            self.transport.pause_reading()

    # -- endings ---------------------------------------------------------------------------

    def _respond(self, r: Request, status: int, detail: str, *, close: bool = False) -> None:
        """Answer ``r`` from the edge itself: ``status`` with ``detail`` as its text."""
        r.status = status
        r.error = detail
        if close or self.upgrading:
            r.keep_alive = False
        self.transport.write(
            local_response(status, detail, close=not r.keep_alive, version=r.version)
        )
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
