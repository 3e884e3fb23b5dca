"""``bourse jetstream init``: the market's JetStream set-up, by the operator (the key
``bourse auth init`` writes as ``operator.nk``; the only key that may make, change or delete
the market's streams and buckets besides the exchange, which makes what is missing at its
start: the event stream, the claims bucket, the image store and its staging stream). Each
of the market's streams and buckets is made if it is missing; one that exists keeps its own
settings (change them with ``nats stream edit`` and the operator key)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import anyio
import typer
from nats.aio.client import Client as NATS
from nats.js import errors as js_errors
from rich.table import Table

from bourse.auction.claim_store import ClaimStore
from bourse.client import render
from bourse.client.apps.store import AppStore, SecretStore
from bourse.images import ImageStore
from bourse.images.staging import DEFAULT_MAX_BYTES as STAGING_MAX_BYTES
from bourse.images.staging import make_staging
from bourse.nats.commands import DEFAULT_MAX_BYTES as COMMANDS_MAX_BYTES
from bourse.nats.commands import CommandStream, make_command_stream
from bourse.nats.connection import shutdown
from bourse.nats.grants import (
    APP_SECRETS,
    APPS,
    CLAIMS,
    COMMANDS,
    EVENTS,
    IMAGE_TAGS,
    IMAGES,
    STAGING,
    STATE,
    Resource,
)
from bourse.nats.jetstream import (
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_BYTES,
    HOW_TO_TURN_ON,
    EventStream,
    event_stream_bytes,
    make_stream,
    replicas_for,
    settled,
)
from bourse.nats.state import DEFAULT_MAX_BYTES as STATE_MAX_BYTES
from bourse.nats.state import StateStream, make_state_stream
from bourse.runtime import logs
from bourse.runtime.cli import (
    CredsOpt,
    NatsOpt,
    PrefixOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    fail,
)
from bourse.runtime.connection import Connection
from bourse.wire.subjects import DEFAULT_PREFIX, Subjects

jetstream_app = typer.Typer()  # its help: its line in ops/cli.py
MIB = 1024 * 1024
HOUR_S = 3600.0


@dataclass(frozen=True, slots=True)
class Made:
    """One stream or bucket of the market after the set-up."""

    what: str
    stream: str
    created: bool
    replicas: int
    max_bytes: int  # -1: no limit
    max_age_s: float  # 0: no limit
    messages: int


async def set_up(
    nc: NATS,
    subjects: Subjects,
    events: EventStream,
    replicas: int,
    staging_max_bytes: int = STAGING_MAX_BYTES,
    commands_max_bytes: int = COMMANDS_MAX_BYTES,
    state_max_bytes: int = STATE_MAX_BYTES,
) -> list[Made]:
    """Make what is missing of the market's streams and buckets (``events``: the event
    stream's settings; ``replicas``: the image store's, its staging's, the apps', the
    command stream's and the state stream's; the claims bucket has its own)."""
    prefix = subjects.prefix
    commands = CommandStream.of(subjects, replicas=replicas, max_bytes=commands_max_bytes)
    state = StateStream.of(subjects, replicas=replicas, max_bytes=state_max_bytes)
    steps = (
        (EVENTS, lambda: make_stream(nc.jetstream(), events)),
        (CLAIMS, lambda: ClaimStore.open(nc, subjects)),
        (IMAGES, lambda: ImageStore.open(nc, prefix, replicas=replicas)),
        (IMAGE_TAGS, lambda: ImageStore.open(nc, prefix, replicas=replicas)),
        (STAGING, lambda: make_staging(nc, subjects, replicas, staging_max_bytes)),
        (APPS, lambda: AppStore.open(nc, prefix, replicas=replicas)),
        (APP_SECRETS, lambda: SecretStore.open(nc, prefix, replicas=replicas)),
        (COMMANDS, lambda: make_command_stream(nc.jetstream(), commands)),
        (STATE, lambda: make_state_stream(nc.jetstream(), state)),
    )
    existed = {r.key: await _exists(nc, r.stream(prefix)) for r, _ in steps}
    for _, make in steps:
        await make()
    return [await _made(nc, r, prefix, created=not existed[r.key]) for r, _ in steps]


async def _exists(nc: NATS, stream: str) -> bool:
    try:
        await nc.jetstream().stream_info(stream)
    except js_errors.NotFoundError:
        return False
    return True


async def _made(nc: NATS, resource: Resource, prefix: str, *, created: bool) -> Made:
    info = await nc.jetstream().stream_info(resource.stream(prefix))
    c = info.config
    return Made(
        what=f"{resource.title} {resource.bucket(prefix)}",
        stream=resource.stream(prefix),
        created=created,
        replicas=c.num_replicas or 1,
        max_bytes=c.max_bytes if c.max_bytes is not None else -1,
        max_age_s=c.max_age or 0.0,
        messages=info.state.messages,
    )


@jetstream_app.command("init")
def init(
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    orders_per_s: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Size the event stream for this many orders a second over its age limit (the "
            "sizing rule, docs/operations.md) [default: 1 GiB, the rule at 1/s for 7 days]",
            show_default=False,
        ),
    ] = None,
    events_max_age_h: Annotated[
        float, typer.Option(min=0.01, help="The event stream's age limit, hours.")
    ] = DEFAULT_MAX_AGE_S / HOUR_S,
    replicas: Annotated[
        int | None,
        typer.Option(
            min=1, max=5, help="Replicas of what is made [default: 3 in a cluster of 3+, else 1]"
        ),
    ] = None,
    staging_max_mib: Annotated[
        int,
        typer.Option(
            min=1,
            help="What the image staging stream holds at most, every tenant's pushes under "
            "way together (the largest image a tenant may push, and some).",
        ),
    ] = STAGING_MAX_BYTES // MIB,
    commands_max_mib: Annotated[
        int,
        typer.Option(
            min=1,
            help="What the command stream holds at most: the stops and destroys kept for "
            "workers away at once, 1.25 KiB per machine of theirs (the sizing rule, "
            "docs/operations.md).",
        ),
    ] = COMMANDS_MAX_BYTES // MIB,
    state_max_mib: Annotated[
        int,
        typer.Option(
            min=1,
            help="What the state stream holds at most: a row per live machine and worker, "
            "and the destroyed machines' rows of the last hour, about 1 KiB each (the "
            "sizing rule, docs/operations.md).",
        ),
    ] = STATE_MAX_BYTES // MIB,
) -> None:
    """Make the market's streams and buckets that are missing: the event stream, the order
    claims, the image store and its staging stream, the apps' specs and secrets, the
    command stream, the state stream. Run with the operator's key (operator.nk)."""
    logs.configure("warning")
    conn = Connection.from_options(nats, creds, tls_ca, tls_cert, tls_key)
    subjects = Subjects(prefix)

    async def main() -> list[Made]:
        nc = await conn.connect("bourse-jetstream-init", service=False)
        try:
            if not await settled(nc):
                fail(f"the NATS server has no JetStream: {HOW_TO_TURN_ON}")
            n = replicas or replicas_for(nc)
            age_s = events_max_age_h * HOUR_S
            size = DEFAULT_MAX_BYTES
            if orders_per_s is not None:  # whole MiB, up
                size = -(-event_stream_bytes(orders_per_s, age_s) // MIB) * MIB
            events = EventStream.of(subjects, replicas=n, max_bytes=size, max_age_s=age_s)
            return await set_up(
                nc,
                subjects,
                events,
                n,
                staging_max_mib * MIB,
                commands_max_mib * MIB,
                state_max_mib * MIB,
            )
        finally:
            await shutdown(nc)

    try:
        made = anyio.run(main)
    except (js_errors.Error, TimeoutError) as exc:
        fail(f"the JetStream set-up failed: {exc!r} (is --creds the operator's key?)")
    render.show(_table(made))


def _table(made: list[Made]) -> Table:
    t = Table(title="jetstream")
    for col in ("stream", "what", "state", "replicas", "max MiB", "max age h", "messages"):
        t.add_column(col, no_wrap=True)
    for m in made:
        t.add_row(
            m.stream,
            m.what,
            "created" if m.created else "there (kept as it is)",
            str(m.replicas),
            "-" if m.max_bytes < 0 else f"{m.max_bytes / MIB:g}",
            "-" if not m.max_age_s else f"{m.max_age_s / HOUR_S:g}",
            str(m.messages),
        )
    return t
