"""``buyer``: place orders, look at the fleet, manage machines. Thin commands over
bourse.client, one module per topic (orders, apps, machines, fleet, watch); this one is the
app: the common options and where every command is registered.

The common options (--nats, --creds, --tls-*, --prefix, --json, --no-jetstream) go before
the command or after it; ``--json`` prints one JSON object per command (README.md lists the shapes).
Exit codes: 0 placed / ok, 2 unfilled, 1 error (one ``error: …`` line on stderr, and with
--json one ``{"error": …}`` object on stdout).
"""

from __future__ import annotations

import typer

from bourse.runtime.cli import (
    BourseGroup,
    CredsOpt,
    JsonOpt,
    NatsOpt,
    NoJetStreamOpt,
    PrefixOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    VersionOpt,
    cli_main,
)
from bourse.wire.subjects import DEFAULT_PREFIX
from buyer_cli import (
    app_views,
    apps,
    execs,
    fleet,
    listing,
    machines,
    orders,
    secrets,
    views,
    watch,
    workers,
)
from buyer_cli.session import Session

app = typer.Typer(
    cls=BourseGroup,
    help="Bourse buyer: place machine orders on the market.",
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help: rich would nearly double a help's time
)
machines_app = typer.Typer(help="Machines on the workers.", no_args_is_help=True)
apps_app = typer.Typer(help="Apps as a whole: their slots, logs and secrets.", no_args_is_help=True)
workers_app = typer.Typer(
    help="The operator's verbs on workers: drain, stop, start (the operator's key).",
    no_args_is_help=True,
)
secrets_app = typer.Typer(
    help="An app's secrets (names shown, never values).", no_args_is_help=True
)


@app.callback()
def _options(
    ctx: typer.Context,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    json: JsonOpt = False,
    no_jetstream: NoJetStreamOpt = False,
    version: VersionOpt = False,
) -> None:
    """Bourse buyer: place machine orders on the market."""
    ctx.obj = Session(nats, creds, tls_ca, tls_cert, tls_key, prefix, json, no_jetstream)


app.command()(orders.place)
app.command()(apps.deploy)
app.command()(apps.failover)
app.command()(fleet.fleet)
app.command()(watch.watch)
app.command()(views.query)
app.add_typer(machines_app, name="machines")
machines_app.command("list")(listing.list_machines)
machines_app.command("show")(machines.show)
machines_app.command("start")(machines.start)
machines_app.command("stop")(machines.stop)
machines_app.command("restart")(machines.restart)
machines_app.command("destroy")(machines.destroy)
machines_app.command("logs")(machines.logs)
# The command's own words are arguments, options included: nothing after its first one is ours.
machines_app.command("exec", context_settings={"allow_interspersed_args": False})(
    execs.exec_command
)
app.add_typer(apps_app, name="apps")
apps_app.command("list")(app_views.list_apps)
apps_app.command("status")(app_views.status)
apps_app.command("logs")(app_views.logs)
apps_app.command("destroy")(app_views.destroy)
apps_app.add_typer(secrets_app, name="secrets")
secrets_app.command("set")(secrets.set_secrets)
secrets_app.command("unset")(secrets.unset_secrets)
secrets_app.command("list")(secrets.list_secrets)
app.add_typer(workers_app, name="workers")
workers_app.command("drain")(workers.drain)
workers_app.command("stop")(workers.stop)
workers_app.command("start")(workers.start)


def main() -> None:
    cli_main(app)
