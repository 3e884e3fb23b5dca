"""Generated server configs (bourse/nats/serverconf.py) pass nats-server's own config check
(``nats-server -t``); the text they must hold: tests/unit/test_natsconf.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

from bourse.nats.embedded import find_nats_server
from bourse.nats.serverconf import Cluster, Server, Topology, plan, render


def test_nats_server_accepts_every_generated_config(tmp_path: Path) -> None:
    (tmp_path / "auth.conf").write_text("authorization {\n  users = [{user: a, password: b}]\n}\n")
    topo = Topology(
        clusters=(
            Cluster("a", (Server("a1", "h1"), Server("a2", "h2"), Server("a3", "h3"))),
            *plan(["b=h4"]),
        ),
        include="auth.conf",  # relative to the config file, as nats-server resolves it
        jetstream_dir=str(tmp_path / "jetstream"),
    )
    for name, text in render(topo).items():
        (tmp_path / name).write_text(text)
        check = subprocess.run(
            [find_nats_server(), "-c", str(tmp_path / name), "-t"], capture_output=True, text=True
        )
        assert check.returncode == 0, check.stderr
        assert "is valid" in check.stdout + check.stderr
