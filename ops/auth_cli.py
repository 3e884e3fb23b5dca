"""``bourse auth init``: credentials per role, the nats-server config that enforces them, the
trust file for signed offers, and (``--tls``) a CA with server and client certificates.
The generation itself lives in bourse/nats/auth.py and bourse/nats/tls.py."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bourse.nats.authdir import SupplierSpec, parse_worker_flag, write_auth_dir
from bourse.nats.tls import DEFAULT_HOSTS, TLS_CONF, write_tls_dir
from bourse.runtime.cli import PrefixOpt, fail
from bourse.wire.subjects import DEFAULT_PREFIX, Subjects
from supplier import load_fleet

# its help: its line in ops/cli.py
auth_app = typer.Typer()


def supplier_specs(fleets: list[Path], workers: list[str]) -> list[SupplierSpec]:
    """One supplier user per fleet file (named by the file's stem, covering exactly its
    workers) and one per ``--worker ID=REGION`` (named by the worker id)."""
    specs = []
    for path in fleets:
        cfgs = load_fleet(path)
        specs.append(SupplierSpec(path.stem, tuple((w.worker_id, w.region) for w in cfgs)))
    for flag in workers:
        wid, region = parse_worker_flag(flag)
        specs.append(SupplierSpec(wid, ((wid, region),)))
    return specs


@auth_app.command("init")
def init(
    out: Annotated[Path, typer.Option(help="Directory to write the files into.")],
    fleet: Annotated[
        list[Path] | None,
        typer.Option(help="A fleet file: one supplier user for all its workers (repeatable)."),
    ] = None,
    worker: Annotated[
        list[str] | None,
        typer.Option(help="ID=REGION: a one-worker supplier user (repeatable)."),
    ] = None,
    buyer: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME: a buyer of its own, a tenant: its key reaches only its own orders "
            "and machines (repeatable; the shared buyer key stays, as an operator's)."
        ),
    ] = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    force: Annotated[bool, typer.Option(help="Replace existing keys.")] = False,
    tls: Annotated[bool, typer.Option(help="Also make a CA and certificates for TLS.")] = False,
    tls_host: Annotated[
        list[str] | None,
        typer.Option(help="Another name or IP of the server certificate (repeatable)."),
    ] = None,
    tls_clients: Annotated[
        bool, typer.Option(help="Mutual TLS: a client certificate per user; the server checks.")
    ] = False,
) -> None:
    """Write per-role nkey seeds, auth.conf, trust.json and server.conf into --out."""
    specs = supplier_specs(fleet or [], worker or [])
    if not specs:
        fail("no supplier given: pass --fleet FILE and/or --worker ID=REGION")
    files = write_auth_dir(
        out,
        Subjects(prefix),
        specs,
        force=force,
        extra_includes=[TLS_CONF] if tls else [],
        buyers=buyer or [],
    )
    typer.echo(f"wrote {files.auth_conf} ({len(files.users)} users), {files.trust}")
    for u in files.users:
        typer.echo(f"  {u.name:<24} {out / u.file_name}  {u.public_key}")
    if tls:
        names = [u.name for u in files.users] if tls_clients else []
        hosts = [*DEFAULT_HOSTS, *(tls_host or [])]
        t = write_tls_dir(out, hosts=hosts, clients=names, verify_clients=tls_clients)
        typer.echo(f"wrote {t.conf}: CA {t.ca}, server certificate for {', '.join(hosts)}")
        if tls_clients:
            typer.echo(f"  client certificates in {t.ca.parent} (the server requires one)")
    # JetStream on: the market needs it (order claims, durable events)
    typer.echo(f"run: nats-server -c {files.server_conf} -js -sd {out / 'jetstream'}")
    typer.echo(
        f"then, once: bourse jetstream init --creds {files.seed_file('operator')} "
        "--nats nats://HOST:4222 (the market's streams and buckets; an exchange's start makes "
        "those it needs too)"
    )
