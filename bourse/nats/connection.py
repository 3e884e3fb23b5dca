"""Connecting to NATS the same way in every program.

Every program takes ``--nats URL`` (repeatable, or comma-separated; env ``BOURSE_NATS_URL``)
and ``--creds FILE`` (env ``BOURSE_NATS_CREDS``): a JWT ``.creds`` file or an nkey seed file,
told apart by content (bourse/nats/auth.py ``read_credentials``). Long-running services
reconnect forever; connection events are logged with structlog.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

import anyio
import nats
import nats.errors
from nats.aio.client import Client as NATS

from bourse.nats.names import ENV_CA, ENV_CERT, ENV_CREDS, ENV_KEY, ENV_URL, split_urls
from bourse.runtime import logs

log = logs.get_logger("bourse.nats")  # structlog imported at its first line

# A slow consumer drops messages one error at a time: log at most this often (with totals).
SLOW_LOG_INTERVAL_S = 1.0


@dataclass
class ConnectionStats:
    """What happened to one program's connection (logged, and counted for reports/tests)."""

    slow_consumer_drops: int = 0  # messages nats-py dropped: a subscription fell behind
    disconnects: int = 0
    reconnects: int = 0
    _slow_logged_at: float = 0.0


# Every connection made by this process, by client name (a daemon has one; tests many).
STATS: dict[str, ConnectionStats] = {}


def stats_of(nc: NATS) -> ConnectionStats:
    """The counters of ``nc``'s connection (made by :func:`connect`), for metrics."""
    return STATS.setdefault(str(nc.options.get("name") or ""), ConnectionStats())


# Closing a client that never connected, or is reconnecting, is bounded by this: after a
# failed TLS handshake nats-py's close() waits for a stream that is never told it closed.
CLOSE_AFTER_FAILURE_S = 1.0
# A drain on the way out (finish queued messages, flush) gets at most this long.
DRAIN_S = 1.0


async def connect(
    servers: list[str] | str,
    *,
    name: str,
    creds: str | None = None,
    service: bool = True,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    **options: Any,
) -> NATS:
    """Connect to NATS. ``service=True``: reconnect forever (daemons); False: fail fast (CLI).

    Cancellable in every state: a service that never reaches a server keeps retrying until
    its scope is cancelled (SIGTERM), and then closes the half-made client within
    ``CLOSE_AFTER_FAILURE_S``.

    TLS: ``tls_ca`` (the CA that signed the server's certificate), ``tls_cert``/``tls_key``
    (a client certificate, for mutual TLS); each falls back to $BOURSE_NATS_TLS_CA,
    $BOURSE_NATS_TLS_CERT, $BOURSE_NATS_TLS_KEY."""
    servers = split_urls(servers)
    if not servers:
        raise ValueError(f"no NATS server given: pass --nats URL or set ${ENV_URL}")
    creds = creds or os.environ.get(ENV_CREDS) or None
    bound = log.bind(client=name)
    stats = STATS.setdefault(name, ConnectionStats())

    async def error_cb(exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            stats.slow_consumer_drops += 1
            now = time.monotonic()
            if now - stats._slow_logged_at >= SLOW_LOG_INTERVAL_S:
                stats._slow_logged_at = now
                bound.warning(
                    "nats_slow_consumer",
                    subject=exc.subject,
                    dropped_total=stats.slow_consumer_drops,
                )
            return
        # A one-shot command reports its own failure in one line; daemons log every error.
        (bound.warning if service else bound.debug)("nats_error", error=repr(exc))

    async def disconnected_cb() -> None:
        if nc.is_closed or nc.is_draining:
            bound.debug("nats_closed")
        else:
            stats.disconnects += 1
            bound.warning("nats_disconnected", total=stats.disconnects)

    async def reconnected_cb() -> None:
        stats.reconnects += 1
        url = str(nc.connected_url.netloc if nc.connected_url else "")
        bound.info("nats_reconnected", url=url, total=stats.reconnects)

    opts: dict[str, Any] = {
        "servers": servers,
        "name": name,
        "error_cb": error_cb,
        "disconnected_cb": disconnected_cb,
        "reconnected_cb": reconnected_cb,
        "connect_timeout": 2,
    }
    if service:
        opts.update(max_reconnect_attempts=-1, reconnect_time_wait=0.25)
    else:
        opts.update(max_reconnect_attempts=2, reconnect_time_wait=0.1, allow_reconnect=True)
    # Credentials and TLS load nkeys and cryptography: only when they are asked for.
    if creds:
        from bourse.nats.auth import read_credentials

        opts.update(read_credentials(creds))
    tls_files = (
        tls_ca or os.environ.get(ENV_CA),
        tls_cert or os.environ.get(ENV_CERT),
        tls_key or os.environ.get(ENV_KEY),
    )
    if any(tls_files):
        from bourse.nats.tls import client_context

        opts["tls"] = client_context(*tls_files)
    opts.update(options)
    nc = NATS()
    try:
        await nc.connect(**opts)
    except BaseException:
        # A refused connection (bad credentials, an untrusted certificate) or a cancelled
        # one (the program is stopping) leaves no socket open.
        await close_bounded(nc)
        raise
    return nc


async def close_bounded(nc: NATS, timeout_s: float = CLOSE_AFTER_FAILURE_S) -> None:
    """Close ``nc`` even while the caller is being cancelled (shielded), giving up after
    ``timeout_s``: a client that never connected, or is reconnecting, must not hold a stop."""
    _drop_unsendable(nc)
    with anyio.move_on_after(timeout_s, shield=True) as scope:
        try:
            await nc.close()
        except asyncio.CancelledError:
            if scope.cancel_called:
                raise  # the bound: the scope ends it
            # Not a cancellation of this task (shielded, and not the bound): a future of the
            # closed socket's was cancelled under it (uvloop's close waiter, when the socket
            # was lost while nats-py reconnected). The socket is closed: nothing to wait for.


def _drop_unsendable(nc: NATS) -> None:
    """Forget what nats-py kept to send on a reconnect when there will be none: its close
    writes that to the dead socket and raises (uvloop: RuntimeError "the handler is
    closed"; asyncio: ConnectionResetError), the close left half done and a program
    stopped while reconnecting exiting 1."""
    if not nc.is_connected and nc._pending_data_size:
        nc._pending = []
        nc._pending_data_size = 0


async def flush_all(nc: NATS, timeout_s: int = 10) -> None:
    """A round trip to the server after EVERY command queued so far, subscriptions included.

    nats-py 2.16's ``flush()`` writes its PING straight to the socket, ahead of commands still
    queued for its flusher task (the SUB of a ``subscribe()`` just before), so the PONG can
    come back before the server has seen those subscriptions: a program would say "ready"
    while a message sent to it right then reaches nobody. Push the queue out first."""
    flush_pending = getattr(nc, "_flush_pending", None)
    if flush_pending is not None and nc.is_connected:
        await flush_pending(force_flush=True)
    await nc.flush(timeout_s)


async def shutdown(nc: NATS, drain_s: float = DRAIN_S) -> None:
    """Drain if connected (finish what is queued, for at most ``drain_s``); close at once
    if not (drain would wait for its timeout on a connection that cannot flush). Shielded
    and bounded: safe in a ``finally`` of a program that is being cancelled."""
    if nc.is_closed:
        return
    if nc.is_connected:
        with anyio.move_on_after(drain_s, shield=True):
            await nc.drain()
    if not nc.is_closed:
        await close_bounded(nc)
