"""What every CLI does the same way: ONE definition of each common option (--nats, --creds,
--tls-*, --prefix, --json, logging), the Connection they make, and the exit-code contract.
How a program runs (the event loop, signals) is bourse/runtime/supervise.py."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec
import typer
from nats.aio.client import Client as NATS

from bourse.nats.auth import AuthError, read_credentials
from bourse.nats.connection import ENV_CREDS, ENV_URL, connect, split_urls
from bourse.nats.tls import ENV_CA, ENV_CERT, ENV_KEY, TlsError, client_context
from bourse.wire.codec import validation_detail
from bourse.wire.messages import Labels

T = TypeVar("T")

# Typer >= 0.29 carries its own click; older ones use click's exceptions.
try:
    from typer import Abort as _TyperAbort
    from typer import TyperException as _TyperException

    _USAGE_ERRORS: tuple[type[Exception], ...] = (_TyperException,)
    _ABORTS: tuple[type[BaseException], ...] = (_TyperAbort,)
except ImportError:  # pragma: no cover - older typer
    import click

    _USAGE_ERRORS = (click.ClickException,)
    _ABORTS = (click.exceptions.Abort,)


def _help_metavars() -> None:
    """Help that says what an option takes: a flag shows no value (typer would print
    ``<bool>``, even for --help); an option without its own metavar shows its name
    (``--region REGION``) rather than a Python type (``<str>``, ``<list[str]>``). Choices
    keep their list. One place for every program (buyer, bourse, supplier, exchange)."""
    from typer.core import TyperArgument, TyperOption

    def argument_type(self: TyperArgument, ctx: Any) -> str | None:
        return None  # an argument's metavar (MACHINE_ID) already says what it takes

    TyperArgument.display_type_rich = argument_type  # type: ignore[method-assign, assignment]  # patching typer on purpose
    original = TyperOption.display_type_rich
    if getattr(original, "_bourse", False):
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        if self.metavar is not None:
            return self.metavar or None
        if self.is_flag:
            return None
        if getattr(self.type_descriptor, "is_choice", False):
            return original(self, ctx)
        return (self.name or "value").upper()

    display_type_rich._bourse = True  # type: ignore[attr-defined]  # a marker: patch once
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]  # on purpose


_help_metavars()

NatsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--nats",
        envvar=ENV_URL,
        help="NATS server URL (repeat, or comma-separate, for a cluster).",
        metavar="URL",
        show_default=False,
    ),
]
CredsOpt = Annotated[
    str | None,
    typer.Option(
        "--creds",
        envvar=ENV_CREDS,
        metavar="FILE",
        help="NATS credentials: an nkey seed file (from `bourse auth init`) or a JWT .creds file.",
    ),
]
TlsCaOpt = Annotated[
    str | None,
    typer.Option(
        "--tls-ca", envvar=ENV_CA, metavar="FILE", help="TLS to NATS: the CA file to trust."
    ),
]
TlsCertOpt = Annotated[
    str | None,
    typer.Option(
        "--tls-cert", envvar=ENV_CERT, metavar="FILE", help="Mutual TLS: this client's certificate."
    ),
]
TlsKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--tls-key",
        envvar=ENV_KEY,
        metavar="FILE",
        help="Mutual TLS: the client certificate's key.",
    ),
]
PrefixOpt = Annotated[
    str,
    typer.Option(
        "--prefix", envvar="BOURSE_PREFIX", metavar="PREFIX", help="Subject prefix (tokens)."
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
LogLevelOpt = Annotated[
    str,
    typer.Option(
        "--log-level",
        envvar="BOURSE_LOG_LEVEL",
        metavar="LEVEL",
        help="Least severe log level shown: debug, info, warning, error.",
    ),
]
LogJsonOpt = Annotated[bool, typer.Option("--log-json", help="Log JSON lines instead of k=v.")]
MetricsAddrOpt = Annotated[
    str,
    typer.Option(
        "--metrics-addr",
        envvar="BOURSE_METRICS_ADDR",
        metavar="HOST:PORT",
        help="Serve Prometheus metrics on HOST:PORT at /metrics (port 0: any free one; "
        "'' or off: none). See docs/operations.md.",
    ),
]


@dataclass(frozen=True)
class Connection:
    """How a command reaches NATS: the common options (--nats, --creds, --tls-*), checked
    once (one clear error each) and passed down; no module-global connection state."""

    urls: list[str]
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_options(
        cls,
        nats: list[str] | None,
        creds: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> Connection:
        urls = nats_urls(nats)
        tls = check_tls(tls_ca, tls_cert, tls_key)
        return cls(urls, creds_file(creds), tls["tls_ca"], tls["tls_cert"], tls["tls_key"])

    async def connect(self, name: str, *, service: bool = True) -> NATS:
        """bourse.nats.connection.connect with these options."""
        return await connect(
            self.urls,
            name=name,
            creds=self.creds,
            service=service,
            tls_ca=self.tls_ca,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
        )


def parse_labels(pairs: list[str] | None, what: str = "--label") -> dict[str, str]:
    """``["disk=ssd", "zone=a"]`` -> dict; a clear error names the bad pair."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{what} {pair!r} must look like key=value")
        out[key] = value
    try:
        return msgspec.convert(out, Labels)
    except msgspec.ValidationError as exc:
        raise typer.BadParameter(f"{what}: {validation_detail(exc)}") from None


def cli_main(app: typer.Typer) -> None:
    """Run a typer app as a console script with Bourse's exit-code contract: usage errors
    are ONE line on stderr and exit 1 (click's 2 would read as "unfilled"); Ctrl-C is 130."""
    try:
        code = app(standalone_mode=False)
    except _USAGE_ERRORS as exc:
        message = exc.format_message()  # type: ignore[attr-defined]  # click/typer usage errors have it
        if not message:  # no arguments: the help was shown, which is what was asked for
            sys.exit(0)
        typer.echo(f"error: {message}", err=True)
        sys.exit(1)
    except _ABORTS:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def nats_urls(given: list[str] | None) -> list[str]:
    """The servers from --nats / $BOURSE_NATS_URL, or one clear error."""
    urls = split_urls(given)
    if not urls:
        fail(f"no NATS server given: pass --nats URL or set {ENV_URL}")
    return urls


def creds_file(given: str | None) -> str | None:
    """The --creds file, read now so that a bad one is one clear error before connecting."""
    if given:
        try:
            read_credentials(given)
        except AuthError as exc:
            fail(str(exc))
    return given or None


def check_tls(ca: str | None, cert: str | None, key: str | None) -> dict[str, str | None]:
    """The TLS options, checked now (one clear error), as connect() keyword arguments."""
    try:
        client_context(ca, cert, key)
    except TlsError as exc:
        fail(str(exc))
    return {"tls_ca": ca, "tls_cert": cert, "tls_key": key}


def fail(message: str, code: int = 1) -> Any:
    """One clear line on stderr and a non-zero exit."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
