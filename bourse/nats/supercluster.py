"""A real NATS supercluster on this machine (tests, fault runs): clusters of nats-server
processes joined by gateways, started from configs written by ``bourse.nats.serverconf`` (the
code behind ``bourse nats-config``), and ready only once every route and gateway is up
(polled on each server's monitoring endpoint: /routez and /gatewayz)."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bourse.nats.embedded import EmbeddedNats
from bourse.nats.serverconf import Cluster, Server, Topology, client_urls, render

MESH_TIMEOUT_S = 20.0


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports. Routes and gateway URLs must name real ports, so the
    fixture picks them (nats-server's -1 would only tell us after start)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def loopback_topology(layout: dict[str, int]) -> Topology:
    """``{"a": 3, "b": 1}``: cluster a of 3 servers (a-1..a-3), b of 1, all on 127.0.0.1."""
    ports = iter(free_ports(4 * sum(layout.values())))
    clusters = tuple(
        Cluster(
            name,
            tuple(
                Server(f"{name}-{i}", "127.0.0.1", *(next(ports) for _ in range(4)))
                for i in range(1, n + 1)
            ),
        )
        for name, n in layout.items()
    )
    return Topology(clusters=clusters, listen="127.0.0.1")


class Supercluster:
    def __init__(self, root: Path, layout: dict[str, int]) -> None:
        """Every server runs JetStream (its store under ``root``), as the market needs; the
        supercluster is ready only once each cluster has elected its meta leader."""
        self.root = root
        self.topology = dataclasses.replace(
            loopback_topology(layout), jetstream_dir=str(root / "jetstream")
        )
        self.servers: dict[str, EmbeddedNats] = {}

    def urls(self, cluster: str) -> list[str]:
        """Every client URL of one cluster (what a client passes as --nats)."""
        return client_urls(self.topology, cluster)

    def start(self, only: list[str] | None = None) -> Supercluster:
        """Write every server's config and start the servers named in ``only`` (default:
        all); once all of them run, wait until the supercluster is meshed."""
        conf_dir = self.root / "conf"
        conf_dir.mkdir(parents=True, exist_ok=True)
        try:
            for name, text in render(self.topology).items():
                server = name.removesuffix(".conf")
                if server in self.servers or (only is not None and server not in only):
                    continue
                (conf_dir / name).write_text(text)
                self.servers[server] = EmbeddedNats(
                    workdir=self.root / server, config=conf_dir / name, bind_loopback=False
                ).start()
            if len(self.servers) == len(list(self.topology.servers)):
                self.wait_meshed()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for srv in self.servers.values():
            srv.stop()

    def restart(self, server: str) -> None:
        """Start a stopped or killed server again from its config (same ports), and wait
        until the supercluster is meshed again."""
        conf = self.root / "conf" / f"{server}.conf"
        self.servers[server] = EmbeddedNats(
            workdir=self.root / server, config=conf, bind_loopback=False
        ).start()
        self.wait_meshed()

    def kill(self, server: str) -> None:
        """SIGKILL one server (no lame-duck, no goodbye to its routes)."""
        srv = self.servers[server]
        assert srv.proc is not None
        srv.proc.kill()
        srv.proc.wait()
        srv.stop()

    def monitor(self, server: str, endpoint: str) -> dict[str, Any]:
        port = next(s.http_port for _, s in self.topology.servers if s.name == server)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/{endpoint}", timeout=2) as r:
            return json.loads(r.read())

    def connections(self, server: str) -> list[str]:
        """Names of the client connections on one server."""
        return [c.get("name", "") for c in self.monitor(server, "connz")["connections"]]

    def server_of(self, connection_name: str) -> str:
        """The (running) server a named client connection is on."""
        for name, srv in self.servers.items():
            if srv.proc is not None and connection_name in self.connections(name):
                return name
        raise AssertionError(f"no server has a connection named {connection_name!r}")

    def wait_meshed(self, timeout_s: float = MESH_TIMEOUT_S) -> None:
        """Until every server routes to the rest of its cluster and has its gateway out to
        every other cluster (one server's outbound is another's inbound, so that is all of
        them). Raises naming what is still missing."""
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [m for c, s in self.topology.servers for m in self._missing(c, s)]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"supercluster not meshed in {timeout_s}s: {missing}")
            time.sleep(0.05)

    def _missing(self, cluster: Cluster, server: Server) -> list[str]:
        routes = {r.get("remote_name") for r in self.monitor(server.name, "routez")["routes"]}
        gw = self.monitor(server.name, "gatewayz")
        out = {k for k, v in gw.get("outbound_gateways", {}).items() if v.get("connection")}
        others = {c.name for c in self.topology.clusters if c.name != cluster.name}
        want_routes = {s.name for s in cluster.servers if s.name != server.name}
        missing = [
            *(f"{server.name}: route to {r}" for r in sorted(want_routes - routes)),
            *(f"{server.name}: gateway to {g}" for g in sorted(others - out)),
        ]
        if len(cluster.servers) > 1:
            meta = self.monitor(server.name, "jsz").get("meta_cluster") or {}
            if not meta.get("leader"):
                missing.append(f"{server.name}: JetStream meta leader")
        return missing
