"""``bourse nats-config``: write nats-server config files for a topology (options only;
the configs are built by :mod:`bourse.nats.serverconf`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bourse.nats import serverconf as natsconf
from bourse.runtime.cli import fail

HTTP_OFF = 0


def nats_config(
    out: Annotated[Path, typer.Option(help="Directory the <server>.conf files are written to.")],
    cluster: Annotated[
        list[str],
        typer.Option(
            help="NAME=HOST[,HOST...] (a host may be SERVER@HOST); repeat for a supercluster.",
            show_default=False,
        ),
    ],
    listen: Annotated[str, typer.Option(help="Address every server binds.")] = "0.0.0.0",
    client_port: Annotated[int, typer.Option(help="Client port (-1: any free one).")] = 4222,
    cluster_port: Annotated[int, typer.Option(help="Route port (clusters of 2+).")] = 6222,
    gateway_port: Annotated[int, typer.Option(help="Gateway port (superclusters).")] = 7222,
    http_port: Annotated[
        int, typer.Option(help=f"Monitoring port (/varz, /routez, /gatewayz); {HTTP_OFF}: off.")
    ] = 8222,
    port_step: Annotated[
        int, typer.Option(min=0, help="Servers sharing a host: server k adds k x STEP to each.")
    ] = 0,
    include: Annotated[
        str | None,
        typer.Option(help="A file to include, e.g. the auth.conf of `bourse auth init`."),
    ] = None,
    tls_cert: Annotated[str | None, typer.Option(help="Client TLS: server certificate.")] = None,
    tls_key: Annotated[str | None, typer.Option(help="Client TLS: its private key.")] = None,
    tls_ca: Annotated[str | None, typer.Option(help="Client TLS: the CA to verify with.")] = None,
    tls_verify: Annotated[bool, typer.Option(help="Require client certificates.")] = False,
    jetstream_dir: Annotated[
        str,
        typer.Option(
            metavar="DIR",
            help="JetStream's store, under DIR/<server> (every server runs JetStream: the "
            "market needs it).",
        ),
    ] = natsconf.DEFAULT_JETSTREAM_DIR,
) -> None:
    """Write nats-server configs: one server, a cluster (routes) or a supercluster (gateways)."""
    if (tls_cert is None) != (tls_key is None):
        fail("--tls-cert and --tls-key go together: give both or neither")
    tls = natsconf.Tls(tls_cert, tls_key, tls_ca, tls_verify) if tls_cert and tls_key else None
    if tls is None and (tls_ca or tls_verify):
        fail("--tls-ca and --tls-verify need --tls-cert and --tls-key")
    ports = natsconf.Ports(
        client=client_port,
        cluster=cluster_port,
        gateway=gateway_port,
        http=None if http_port == HTTP_OFF else http_port,
        step=port_step,
    )
    topo = natsconf.Topology(
        clusters=natsconf.plan(cluster, ports),
        listen=listen,
        include=include,
        tls=tls,
        jetstream_dir=jetstream_dir,
    )
    files = natsconf.render(topo)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
        typer.echo(f"wrote {out / name}")
    stale = sorted(p.name for p in out.glob("*.conf") if p.name not in files)
    if stale:
        typer.echo(f"note: {out} also holds {', '.join(stale)}, not part of this topology")
    for c in topo.clusters:
        urls = natsconf.client_urls(topo, c.name)
        if urls:
            typer.echo(f"cluster {c.name}: --nats {','.join(urls)}")
