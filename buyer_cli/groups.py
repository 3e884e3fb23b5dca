"""The ``buyer`` command groups (machines, apps and its secrets, workers, view): each a typer app
whose commands are registered here, imported only when the group is used (buyer_cli/cli.py
lists it by its :class:`~bourse.runtime.cli.Lazy` line)."""

from __future__ import annotations

import typer

from buyer_cli import app_views, execs, keeper, listing, machines, secrets, workers

machines_app = typer.Typer(help="Machines on the workers.", no_args_is_help=True)
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

apps_app = typer.Typer(help="Apps as a whole: their slots, logs and secrets.", no_args_is_help=True)
apps_app.command("list")(app_views.list_apps)
apps_app.command("status")(app_views.status)
apps_app.command("logs")(app_views.logs)
apps_app.command("destroy")(app_views.destroy)
secrets_app = typer.Typer(
    help="An app's secrets (names shown, never values).", no_args_is_help=True
)
apps_app.add_typer(secrets_app, name="secrets")
secrets_app.command("set")(secrets.set_secrets)
secrets_app.command("unset")(secrets.unset_secrets)
secrets_app.command("list")(secrets.list_secrets)

workers_app = typer.Typer(
    help="The operator's verbs on workers: drain, stop, start (the operator's key).",
    no_args_is_help=True,
)
workers_app.command("drain")(workers.drain)
workers_app.command("stop")(workers.stop)
workers_app.command("start")(workers.start)

view_app = typer.Typer(
    help="The view of the market in your cache directory: its keeper.", no_args_is_help=True
)
view_app.command("keep")(keeper.keep)
view_app.command("stop")(keeper.stop)
