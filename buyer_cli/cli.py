"""``buyer``: place orders, look at the fleet, manage machines. Thin commands over
bourse.client, one module per topic (orders, apps, machines, fleet, watch; the groups'
commands registered in groups.py); this one is the app: the common options and the list of
commands, each imported when it is used.

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
    Lazy,
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
from buyer_cli.session import Session

# Each command (a group: its commands) is imported when it is run or its help asked for: a
# command pays for its own module only, not for every other's and typer's making of each.
# Each line is the first paragraph of the command's help (tests/unit/test_cli_help.py).
COMMANDS = {
    "place": Lazy("buyer_cli.orders:place", "Place one immediate-or-cancel order."),
    "deploy": Lazy(
        "buyer_cli.apps:deploy",
        "Deploy an app: converge it to its spec (-f APP.TOML, or the flags: a whole spec, "
        "--port/--env/--check as `buyer place` reads them), updates rolling one slot at a "
        "time. --plan prints the plan only. Exit 2 when a slot is left unfilled or the rollout "
        "stopped (no room, checks not passing in time), 1 on an error.",
    ),
    "failover": Lazy(
        "buyer_cli.apps:failover",
        "Start a spare of the app in place of a machine whose worker is gone (--force: stop "
        "the machine first), then place a new spare as deploy would (--label as given to "
        "deploy). Exit 2 when no spare is left, 1 on an error; --json prints the same object "
        'whatever happens ("error" says what went wrong).',
    ),
    "fleet": Lazy(
        "buyer_cli.fleet:fleet",
        "Every worker's capacity, commitments, machines, image cache (bytes used / budget), "
        "labels, and whether it is gone, from the view of the market; --fresh: the workers "
        "answer now (status scatter-gather: holds and images too). In every region or those "
        "given. Exit 2 when a region asked for (or, with none given, any region) has no "
        "worker that beats (--fresh: answers).",
    ),
    "watch": Lazy(
        "buyer_cli.watch:watch",
        "Print market events as they happen (order outcomes: placed, unfilled; machine "
        "events), until Ctrl-C; with --since, replay stored ones first. --json: one event per "
        'line, with its stream sequence ("seq").',
    ),
    "query": Lazy(
        "buyer_cli.views:query",
        "Read-only SQL on the view of the market: tables workers, machines, apps, beats, meta "
        '(docs/architecture.md, bourse/view/db.py). --json: {"columns", "rows": [{col: '
        'value}], "view": {"seq", "age_ms"}}; with --watch one {"op", "row", "seq"} per line.',
    ),
    "machines": Lazy("buyer_cli.groups:machines_app", "Machines on the workers."),
    "apps": Lazy("buyer_cli.groups:apps_app", "Apps as a whole: their slots, logs and secrets."),
    "workers": Lazy(
        "buyer_cli.groups:workers_app",
        "The operator's verbs on workers: drain, stop, start (the operator's key).",
    ),
    "view": Lazy(
        "buyer_cli.groups:view_app", "The view of the market in your cache directory: its keeper."
    ),
}

app = typer.Typer(
    cls=BourseGroup.loading(COMMANDS),
    help="Bourse buyer: place machine orders on the market.",
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help: rich would nearly double a help's time
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


def main() -> None:
    cli_main(app)
