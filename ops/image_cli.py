"""``bourse image``: the market's images (push, import, ls, inspect, tag, rm, gc).

Options and printing only; the work is bourse/client/images.py. The common options
(--nats, --creds, --tls-*, --prefix, --json) go before the command or after it. Without
credentials, or with the operator's key, the store is written directly; a tenant's key
pushes, tags and removes through the exchange, under its own names only
(docs/security.md). --json prints one JSON object per command (README.md lists the
shapes); an error is one ``error: …`` line (and with --json one ``{"error": …}``).
"""

from __future__ import annotations

import shlex
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, TypeVar

import anyio
import nats.errors
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from bourse.client import ClientError, render
from bourse.client.images import ImageClient, Pushed
from bourse.images import ImageInfo, RunSpec
from bourse.images.bounds import DEFAULT_MAX_IMAGE_MB, MAX_RATIO, Bounds
from bourse.images.store import GC_GRACE_S
from bourse.nats.auth import tenant_of
from bourse.nats.connection import shutdown
from bourse.runtime import logs
from bourse.runtime.cli import (
    BourseGroup,
    CredsOpt,
    JsonOpt,
    NatsOpt,
    PrefixOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
)
from bourse.runtime.connection import Connection
from bourse.wire.subjects import DEFAULT_PREFIX, Subjects

T = TypeVar("T")

image_app = typer.Typer(cls=BourseGroup, no_args_is_help=True)  # its help: ops/cli.py
RefArg = Annotated[str, typer.Argument(metavar="NAME[:TAG]", help="The image's tag.")]
MaxImageOpt = Annotated[
    int,
    typer.Option(
        min=1,
        metavar="MIB",
        help="Refuse an image whose layers unpack to more than this many MiB in all (each "
        f"layer is read once before anything is sent; one past {MAX_RATIO} times its "
        "compressed size is refused too). A tenant's push is bounded by the exchange's "
        "own --max-image-mb.",
    ),
]


@dataclass
class ImageSession:
    """The common options of one invocation (given before or after the command)."""

    nats: list[str] | None = None
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    prefix: str = DEFAULT_PREFIX
    json: bool = False


@image_app.callback()
def _options(
    ctx: typer.Context,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    json: JsonOpt = False,
) -> None:
    """The market's images."""
    ctx.obj = ImageSession(nats, creds, tls_ca, tls_cert, tls_key, prefix, json)


def _session(ctx: typer.Context) -> ImageSession:
    found = ctx.find_object(ImageSession)
    assert found is not None, "the image app's callback keeps its options in ctx.obj"
    return found


def _run(
    ctx: typer.Context, fn: Callable[[ImageClient], Awaitable[T]], bounds: Bounds | None = None
) -> T:
    """``fn`` on an image client of the invocation's market (its pushes within
    ``bounds``); NATS's own failures are one error line too."""
    s = _session(ctx)
    logs.configure("warning")
    conn = Connection.from_options(s.nats, s.creds, s.tls_ca, s.tls_cert, s.tls_key)
    tenant = tenant_of(conn.creds) if conn.creds else ""

    async def main() -> T:
        try:
            nc = await conn.connect("bourse-image", service=False)
        except Exception as exc:  # nats-py's own errors, OSError, TimeoutError: one line
            raise ClientError(f"cannot connect to NATS at {', '.join(conn.urls)}: {exc}") from None
        try:
            return await fn(ImageClient(nc, Subjects(s.prefix), tenant, bounds))
        except (nats.errors.Error, TimeoutError) as exc:
            raise ClientError(f"the image store: {exc or type(exc).__name__}") from None
        except OSError as exc:
            raise ClientError(str(exc), "bad_request") from None
        finally:
            await shutdown(nc)

    return anyio.run(main)


def _echo(obj: object) -> None:
    typer.echo(render.as_json(obj))


class _Bar:
    """A push's progress on the terminal (stderr), gone once it is done."""

    def __init__(self, what: str) -> None:
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self.task = self.bar.add_task(what, total=None)

    def total(self, size: int) -> None:
        self.bar.update(self.task, total=size)

    def advance(self, size: int) -> None:
        self.bar.advance(self.task, size)


async def _pushing(
    ctx: typer.Context, what: str, work: Callable[[_Bar | None], Awaitable[Pushed]]
) -> Pushed:
    """``work`` with a progress bar when a person watches (a terminal, no --json)."""
    if _session(ctx).json or not Console(stderr=True).is_terminal:
        return await work(None)
    bar = _Bar(what)
    with bar.bar:
        return await work(bar)


def _pushed(ctx: typer.Context, done: Pushed) -> None:
    if _session(ctx).json:
        _echo(asdict(done))
        return
    layers = f"{done.layers} layer{'s' if done.layers != 1 else ''}"
    render.console.print(
        f"pushed {render.safe(done.reference)} {done.digest}\n"
        f"  {_size(done.size)}, {layers}: {_size(done.uploaded_bytes)} sent, "
        f"{_size(done.reused_bytes)} stored already",
        highlight=False,
    )


def _words(option: str, text: str | None) -> tuple[str, ...]:
    """A command as a shell would split it (``--cmd "python3 -m app"``)."""
    if not text:
        return ()
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise typer.BadParameter(f"{option} {text!r}: {exc}") from None


@image_app.command()
def push(
    ctx: typer.Context,
    ref: RefArg,
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="The image's files.")],
    cmd: Annotated[
        str | None,
        typer.Option(help="What the image runs (split as a shell does): its Cmd."),
    ] = None,
    entrypoint: Annotated[
        str | None, typer.Option(help="Its Entrypoint (the command's arguments follow it).")
    ] = None,
    env: Annotated[
        list[str] | None, typer.Option(metavar="KEY=VALUE", help="Environment (repeatable).")
    ] = None,
    workdir: Annotated[str, typer.Option(help="Working directory, absolute.")] = "",
    user: Annotated[str, typer.Option(help="The config's User.")] = "",
    max_image_mb: MaxImageOpt = DEFAULT_MAX_IMAGE_MB,
) -> None:
    """Push DIR as a one-layer image tagged NAME[:TAG].

    The same files and options give the same digest."""
    words, entry = _words("--cmd", cmd), _words("--entrypoint", entrypoint)
    if not words and not entry:
        raise typer.BadParameter("give --cmd (or --entrypoint): what the image runs")
    run = RunSpec(cmd=words, entrypoint=entry, env=tuple(env or ()), workdir=workdir, user=user)

    async def go(c: ImageClient) -> Pushed:
        return await _pushing(ctx, f"push {ref}", lambda bar: c.push(directory, ref, run, bar))

    _pushed(ctx, _run(ctx, go, Bounds.of_mb(max_image_mb)))


@image_app.command("import")
def import_(
    ctx: typer.Context,
    ref: RefArg,
    path: Annotated[
        Path,
        typer.Argument(
            metavar="PATH", help="An OCI layout dir, an oci-archive or a docker save tarball."
        ),
    ],
    pick: Annotated[
        str, typer.Option(metavar="NAME", help="Which image of several the archive holds.")
    ] = "",
    max_image_mb: MaxImageOpt = DEFAULT_MAX_IMAGE_MB,
) -> None:
    """Import what docker, podman, skopeo or buildah wrote as NAME[:TAG].

    An OCI layout directory, an oci-archive, or a docker save tarball; every blob's digest
    is checked."""

    async def go(c: ImageClient) -> Pushed:
        return await _pushing(
            ctx, f"import {ref}", lambda bar: c.import_image(path, ref, pick, bar)
        )

    _pushed(ctx, _run(ctx, go, Bounds.of_mb(max_image_mb)))


@image_app.command("ls")
def ls(ctx: typer.Context) -> None:
    """Every tag: its image's digest, size, creation time and the workers that hold it."""
    rows = _run(ctx, lambda c: c.ls())
    if _session(ctx).json:
        _echo({"images": [asdict(r) for r in rows]})
        return
    t = Table(title="images")
    for col in ("reference", "digest", "size", "created", "cached by"):
        t.add_column(col)
    for r in rows:
        size = _size(r.size) if r.size is not None else "(manifest missing)"
        cached = ", ".join(render.safe(w) for w in r.cached_by) or "-"
        t.add_row(render.safe(r.reference), r.digest, size, r.created or "-", cached)
    render.show(t)


@image_app.command()
def inspect(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(metavar="REF", help="NAME[:TAG] or NAME@sha256:…")],
) -> None:
    """An image's manifest and config: what it runs, its layers."""
    info = _run(ctx, lambda c: c.inspect(ref))
    if _session(ctx).json:
        _echo({"image": asdict(info)})
        return
    for line in _described(info):
        render.console.out(render.visible(line), highlight=False)


def _described(info: ImageInfo) -> list[str]:
    lines = [
        f"digest      {info.digest}",
        f"size        {_size(info.size)} ({info.size} bytes)",
        f"created     {info.created or '-'}",
        f"platform    {info.platform}",
        f"entrypoint  {shlex.join(info.entrypoint) or '-'}",
        f"cmd         {shlex.join(info.cmd) or '-'}",
        f"workdir     {info.workdir or '-'}",
        f"user        {info.user or '-'}",
        f"config      {info.config_digest}",
    ]
    lines += [f"env         {e}" for e in info.env]
    lines += [f"layer       {x.digest}  {_size(x.size)}  {x.media_type}" for x in info.layers]
    return lines


@image_app.command()
def tag(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(metavar="SRC", help="NAME[:TAG] or NAME@sha256:…")],
    dest: Annotated[str, typer.Argument(metavar="DST", help="The new tag, NAME[:TAG].")],
) -> None:
    """Tag the image SRC names as DST too (a tag that exists moves)."""
    done = _run(ctx, lambda c: c.tag(source, dest))
    if _session(ctx).json:
        _echo({"reference": done.reference, "digest": done.digest})
        return
    render.console.print(f"tagged {render.safe(done.reference)} {done.digest}", highlight=False)


@image_app.command()
def rm(ctx: typer.Context, ref: RefArg) -> None:
    """Remove a tag (its blobs stay until gc finds nothing uses them)."""
    done = _run(ctx, lambda c: c.remove(ref))
    if _session(ctx).json:
        _echo({"reference": done.reference, "digest": done.digest})
        return
    render.console.print(
        f"removed tag {render.safe(done.reference)} ({done.digest}; its blobs stay until gc)",
        highlight=False,
    )


@image_app.command()
def gc(
    ctx: typer.Context,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go.")] = False,
    grace_s: Annotated[
        float,
        typer.Option(min=0, help="Spare blobs written this recently (a push still under way)."),
    ] = GC_GRACE_S,
) -> None:
    """Remove the blobs no tag reaches and nothing uses.

    In use: what any worker's cache holds, what any machine not destroyed names. Removes
    nothing unless every worker listed its machines."""
    done = _run(ctx, lambda c: c.gc(dry_run=dry_run, grace_s=grace_s))
    if _session(ctx).json:
        _echo(asdict(done))
        return
    verb = "would remove" if done.dry_run else "removed"
    render.console.print(
        f"{verb} {len(done.removed)} blobs ({_size(done.removed_bytes)}); kept {done.kept} "
        f"(tagged or in use: {done.in_use} images held or run), {done.young} younger than "
        f"{grace_s:g} s",
        highlight=False,
    )
    for digest in done.removed:
        render.console.out(f"  {digest}", highlight=False)


_UNITS = ("B", "kB", "MB", "GB", "TB")


def _size(n: int) -> str:
    """Bytes as people read them: 950 B, 12.3 kB, 104.9 MB (powers of 1000)."""
    value, i = float(n), 0
    while value >= 1000 and i < len(_UNITS) - 1:
        value /= 1000
        i += 1
    return f"{n} B" if i == 0 else f"{value:.1f} {_UNITS[i]}"
