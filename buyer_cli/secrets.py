"""``buyer apps secrets set | unset | list``: an app's secrets, by name. Values are written
to the secrets' bucket, which gives none back; their names and revisions are the app's
record's, changed by the same command (list shows names only); a change rolls the app at
its next deploy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from bourse.errors import BourseError
from bourse.runtime.cli import fail
from buyer_cli.session import session, with_client

if TYPE_CHECKING:
    from bourse.client import BourseClient
    from bourse.client.apps.store import AppRecord, AppStore, SecretStore

AppArg = Annotated[str, typer.Argument(metavar="NAME", help="The app's name.")]


async def _store(c: BourseClient, create: bool) -> SecretStore:
    from bourse.client.apps.store import SecretStore

    return await SecretStore.open(c.nc, c.subjects.prefix, tenant=c.tenant, create=create)


async def _apps(c: BourseClient, create: bool) -> AppStore:
    from bourse.client.apps.store import AppStore

    return await AppStore.open(c.nc, c.subjects.prefix, tenant=c.tenant, create=create)


def _pairs(items: list[str]) -> dict[str, str]:
    from bourse.client.apps.store import check_secret_name

    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq:
            fail(f"{name!r}: a secret is NAME=VALUE")
        try:
            out[check_secret_name(name)] = value
        except BourseError as exc:
            fail(str(exc))
    return out


def set_secrets(
    ctx: typer.Context,
    name: AppArg,
    pairs: Annotated[list[str], typer.Argument(metavar="NAME=VALUE...", help="Secrets to set.")],
) -> None:
    """Set secrets of the app (given to its machines as env at start)."""
    import msgspec

    values = _pairs(pairs)

    async def go(c: BourseClient) -> list[str]:
        apps = await _apps(c, create=True)
        revisions = await (await _store(c, create=True)).set(name, values)

        def named(r: AppRecord) -> AppRecord:
            return msgspec.structs.replace(r, secrets=r.secrets | revisions)

        await apps.change(name, named)
        return sorted(values)

    _said(ctx, name, "set", with_client(ctx, go))


def unset_secrets(
    ctx: typer.Context,
    name: AppArg,
    names: Annotated[list[str], typer.Argument(metavar="NAME...", help="Secrets to remove.")],
) -> None:
    """Remove secrets of the app."""
    import msgspec

    from bourse.client.apps.store import check_secret_name

    for n in names:
        try:
            check_secret_name(n)
        except BourseError as exc:
            fail(str(exc))

    async def go(c: BourseClient) -> list[str]:
        apps = await _apps(c, create=False)
        rec = await apps.get(name)
        have = rec.secrets if rec else {}
        if missing := [n for n in names if n not in have]:
            fail(f"app {name!r} has no secret {missing[0]!r} (buyer apps secrets list {name})")
        await (await _store(c, create=False)).unset(name, names)

        def unnamed(r: AppRecord) -> AppRecord:
            return msgspec.structs.replace(
                r, secrets={k: v for k, v in r.secrets.items() if k not in names}
            )

        await apps.change(name, unnamed)
        return sorted(names)

    _said(ctx, name, "unset", with_client(ctx, go))


def list_secrets(ctx: typer.Context, name: AppArg) -> None:
    """The app's secrets' names (never their values)."""

    async def go(c: BourseClient) -> list[str]:
        rec = await (await _apps(c, create=False)).get(name)
        return sorted(rec.secrets) if rec else []

    names = with_client(ctx, go)
    if session(ctx).json:
        session(ctx).echo_json({"app": name, "secrets": names})
    else:
        for n in names:
            typer.echo(n)


def _said(ctx: typer.Context, app: str, verb: str, names: list[str]) -> None:
    if session(ctx).json:
        session(ctx).echo_json({"app": app, verb: names})
    else:
        typer.echo(f"app {app}: {verb} {', '.join(names)} (deploy to roll it)")
