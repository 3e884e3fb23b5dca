"""The response a client connection writes (edge/http.py ``Client``'s part): its head
and body as the upstream (edge/upstream.py) hands them over, gathered and written at once
(``flush``), its end (the upstream kept for the next request or closed), the switch to a
tunnel after a 101; and each request counted and logged once it is over (the access log).

A mixin of ``Client``'s: the methods run on the client's own state, with no call or lookup
added on the hot path.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import structlog

from edge.requests import NO_BODY_STATUS, as_chunk

if TYPE_CHECKING:
    from edge.proxy import EdgeConfig, Proxy
    from edge.requests import Request
    from edge.upstream import Upstream

log = structlog.get_logger("bourse.edge")


class Responses:
    """A client connection's responses and access log (``Client``'s state, declared)."""

    if TYPE_CHECKING:
        proxy: Proxy
        config: EdgeConfig
        transport: Any
        ip: str
        active: Request | None
        closed: bool
        upgrading: bool
        early: list[bytes]
        tunnel: Upstream | None
        out: list[bytes]

        def _finish(self, r: Request) -> None: ...

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
        self.out.append(as_chunk(body) if r.chunked_out else body)

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
