"""One request through the edge, and the HTTP/1.1 the edge writes itself: the headers it
drops or sets, its limits on bodies, a chunk's framing, its own answers (``local_response``).

A :class:`Request` is made per request, on the hot path: its plain values are class
defaults. Nothing here does I/O.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

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


class Connection(Protocol):
    """What a request does with its upstream connection (edge/upstream.py ``Upstream``),
    seen from here: requests.py is below upstream.py, which reads a client's Request."""

    transport: Any
    closed: bool
    got_bytes: bool

    def detach(self) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...


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
    up: Connection | None = None
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
    held = False  # it waited for a machine's start, or for one to take it
    held_until = 0.0  # until when it may be held (time.monotonic; set at its first hold)

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.pending: list[bytes] = []
        self.replay: list[bytes] | None = []  # None: too big to send again
        self.tried: list[str] = []
        self.started = time.perf_counter()


def reason_of(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return type(exc).__name__


def as_chunk(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(body), body)


def local_response(status: int, detail: str, *, close: bool, version: str = "1.1") -> bytes:
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
