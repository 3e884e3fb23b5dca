"""``bourse``: the operator's program, a list of commands each imported when it is used
(``bourse --help`` imports none of them: bourse/runtime/cli.py :class:`Lazy`).

The main job is ``bourse demo`` and ``bourse up`` (ops/market_cli.py); the tools beside it
are the load test (ops/loadtest_cli.py), the nats-server configs (ops/nats_config.py), the
market's credentials (ops/auth_cli.py), its JetStream (ops/jetstream.py) and its images
(ops/image_cli.py). Each command's line below is the first paragraph of its help.
"""

from __future__ import annotations

import typer

from bourse.runtime.cli import BourseGroup, Lazy, VersionOpt, cli_main

COMMANDS = {
    "nats-config": Lazy(
        "ops.nats_config:nats_config",
        "Write nats-server configs: one server, a cluster (routes) or a supercluster (gateways).",
    ),
    "loadtest": Lazy(
        "ops.loadtest_cli:loadtest",
        "Load-test a simulated fleet; report against the NATS ceiling and the oracle.",
    ),
    "demo": Lazy(
        "ops.market_cli:demo",
        "Run a demo market and place real orders on it (or on yours, with --nats: its "
        "machines carry the app name bourse-demo and are destroyed at the end unless --keep).",
    ),
    "up": Lazy(
        "ops.market_cli:up",
        "Run a demo market until Ctrl-C: NATS, suppliers in 3 regions, an exchange, an edge.",
    ),
    "auth": Lazy("ops.auth_cli:auth_app", "Credentials and TLS for a Bourse market on NATS."),
    "jetstream": Lazy(
        "ops.jetstream:jetstream_app", "The market's JetStream: its streams and buckets."
    ),
    "image": Lazy(
        "ops.image_cli:image_app",
        "The market's images: push a directory, import what docker, podman, skopeo or "
        "buildah write, list, inspect, tag, remove, collect.",
    ),
}

app = typer.Typer(
    cls=BourseGroup.loading(COMMANDS),
    help="Bourse: a market-style machine scheduler on NATS.",
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help: rich would nearly double a help's time
)


@app.callback()
def _callback(version: VersionOpt = False) -> None:
    """Bourse."""


def main() -> None:
    cli_main(app)


if __name__ == "__main__":
    main()
