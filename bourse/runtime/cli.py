"""What every CLI does the same way: ONE definition of each common option (--nats, --creds,
--tls-*, --prefix, --json, logging; the Connection they make: bourse/runtime/connection.py),
and the error and exit-code
contract: an error Bourse raises on purpose is ONE ``error: …`` line on stderr and exit 1
(with --json also ONE JSON object on stdout); anything else is a bug and stays a traceback.
How a program runs (the event loop, signals) is bourse/runtime/supervise.py.

Help answers at once: this module imports only typer and leaves at its top (nats-py,
cryptography and msgspec when an option is checked or a connection made), every program's
help is plain text (typer's ``rich_markup_mode=None``: rich's import and rendering would
nearly double a ``--help``'s time), and a program may load a command only when it is run
or its help asked for (:class:`Lazy`); tests/integration/test_cli_start.py holds it to
that. A command's options are converted without pydantic (bourse/runtime/coercion.py)."""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, NoReturn

import typer
import typer.main
from typer.core import TyperGroup

import bourse
from bourse.errors import BourseError
from bourse.nats.names import (
    DEGRADED,
    ENV_CA,
    ENV_CERT,
    ENV_CREDS,
    ENV_KEY,
    ENV_URL,
    NO_JETSTREAM_FLAG,
)
from bourse.runtime import coercion
from bourse.wire.subjects import Subjects

if TYPE_CHECKING:
    pass

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

# Keys of the click context's ``meta`` (one dict shared by a command and its group): --json
# was given, so an error is printed as a JSON object too; and the fields that object carries
# besides "error" (error_fields).
JSON_MODE = "bourse.json"
ERROR_FIELDS = "bourse.error_fields"
ERROR_PRINTED = "bourse.error_printed"


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
coercion.install()  # options converted without pydantic (bourse/runtime/coercion.py)

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
# `bourse demo`, `up` and `loadtest` start their own market unless told otherwise: their
# --nats reads no environment variable, so an exported BOURSE_NATS_URL (as the walk-through
# has a person do) never silently points them at another market.
OwnServerNatsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--nats",
        metavar="URL",
        help="Use this NATS server (repeat, or comma-separate, for a cluster) instead of "
        "starting one; BOURSE_NATS_URL is not read here.",
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
# One meaning everywhere (exchange serve, supplier run, buyer --direct, bourse up/demo/
# loadtest): run without JetStream. Without it a program refuses a server that has none.
NoJetStreamOpt = Annotated[
    bool,
    typer.Option(
        NO_JETSTREAM_FLAG,
        help=f"Run without JetStream, the degraded mode ({DEGRADED}); without this flag a "
        "NATS server with no JetStream is refused.",
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


def _prefix(value: str) -> str:
    """--prefix checked when parsed: a bad one is a usage error naming the option."""
    try:
        Subjects(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


PrefixOpt = Annotated[
    str,
    typer.Option(
        "--prefix",
        envvar="BOURSE_PREFIX",
        metavar="PREFIX",
        help="Subject prefix (tokens).",
        callback=_prefix,
    ),
]


def _json_mode(ctx: typer.Context, value: bool) -> bool:
    if value:
        ctx.meta[JSON_MODE] = True
    return value


def json_flag(help: str = "Print JSON instead of tables.") -> Any:
    """The --json option (``Annotated[bool, json_flag("...")]``): with it, an error is ALSO
    one JSON object on stdout. Eager, so that even a bad value of another option is."""
    return typer.Option("--json", help=help, callback=_json_mode, is_eager=True)


JsonOpt = Annotated[bool, json_flag()]


def _version(ctx: typer.Context, value: bool) -> None:
    if value:
        typer.echo(f"{ctx.find_root().info_name} {bourse.__version__}")
        raise typer.Exit()


VERSION = "version"  # the parameter's name in a program's callback (not after a command)
VersionOpt = Annotated[
    bool,
    typer.Option("--version", help="Print the version and exit.", callback=_version, is_eager=True),
]
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


def parse_labels(pairs: list[str] | None, what: str = "--label") -> dict[str, str]:
    """``["disk=ssd", "zone=a"]`` -> dict; a clear error names the bad pair."""
    import msgspec

    from bourse.runtime.words import in_words
    from bourse.wire.codec import validation_detail
    from bourse.wire.messages import Labels

    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{what} {pair!r} must look like key=value")
        out[key] = value
    try:
        return msgspec.convert(out, Labels)
    except msgspec.ValidationError as exc:
        raise typer.BadParameter(f"{what}: {in_words(validation_detail(exc))}") from None


class Failed(typer.Exit):
    """The exit of :func:`fail`: its line is on stderr already; a :class:`BourseGroup` adds
    the JSON object with --json."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(code)
        self.message = message


def fail(message: str, code: int = 1) -> NoReturn:
    """One clear line on stderr and a non-zero exit (and, under a BourseGroup with --json,
    one JSON object on stdout, with the message exact)."""
    _error_line(message)
    raise Failed(message, code)


def _error_line(message: str) -> None:
    """``error: <message>`` on stderr, its control characters visible: a message may carry
    a worker's or a buyer's text (render.visible)."""
    # the client's rendering module is imported only when there is an error to show
    from bourse.client.render import visible

    typer.echo(f"error: {visible(message)}", err=True)


def error_fields(ctx: typer.Context, **fields: object) -> None:
    """The fields the JSON object of an error of this command carries besides "error" (its
    own shape, when it promises one object whatever happens)."""
    ctx.meta[ERROR_FIELDS] = fields


def _error_json(meta: dict[str, Any], message: str) -> str:
    import msgspec

    return msgspec.json.encode({**meta.get(ERROR_FIELDS, {}), "error": message}).decode()


@dataclass(frozen=True)
class Lazy:
    """A command of a program imported only when it is run or its help is asked for: its
    module may load what the program's own ``--help`` must not (nats-py, the auction).

    ``target`` is ``module:attribute``: a command's function, or a ``typer.Typer`` for a
    group. ``help`` is its line in the program's list of commands: a group's help (said
    here only, as ``add_typer(help=...)`` would), or the first paragraph of the function's
    docstring (tests/unit/test_cli_help.py checks that they agree)."""

    target: str
    help: str


class BourseGroup(TyperGroup):
    """A program's root command (``typer.Typer(cls=BourseGroup)``).

    An error Bourse raises on purpose (a :class:`BourseError`, or :func:`fail`) ends the
    command as ONE ``error: …`` line on stderr and its exit code (1 unless fail says else);
    with --json, ALSO one JSON object on stdout: ``{"error": "…"}`` plus the command's
    :func:`error_fields`. Any other exception is a bug and goes on as a traceback.

    The options of the app's callback (but --version) may also be given after any command,
    at any depth (``buyer place --nats URL``, as people type them): every command gets them
    too, and a value given after the command replaces the one before it in ``ctx.obj``,
    where the callback keeps its options as attributes of the same names.

    Its list of commands gives each the first paragraph of its help, whole (click's plain
    help would cut it at the line's width). ``BourseGroup.loading({...})`` is one whose
    commands are :class:`Lazy`: listed from their line, imported when one is used."""

    lazy: ClassVar[Mapping[str, Lazy]] = {}

    @classmethod
    def loading(cls, commands: Mapping[str, Lazy]) -> type[BourseGroup]:
        """A BourseGroup whose commands are ``commands`` (in this order), each imported at
        its first use."""
        return type(cls.__name__, (cls,), {"lazy": dict(commands)})

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self._after = [_after_the_command(p) for p in self.params if p.name != VERSION]
        self._adopt(_descendants(self))

    def _adopt(self, commands: Iterator[Any]) -> None:
        for command in commands:
            own = {p.name for p in command.params}
            command.params.extend(p for p in self._after if p.name not in own)
            if command.short_help is None and command.help:
                first = inspect.cleandoc(command.help).split("\n\n")[0]
                command.short_help = first.replace("\n", " ")

    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *(n for n in self.lazy if n not in self.commands)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            self.commands[cmd_name] = self._load(cmd_name)
        return super().get_command(ctx, cmd_name)

    def _load(self, name: str) -> Any:
        """The command ``name`` as typer makes it from its :class:`Lazy` target, as if it
        had been there from the start (this program's options after it, its help plain)."""
        lazy = self.lazy[name]
        module, _, attribute = lazy.target.partition(":")
        found = getattr(importlib.import_module(module), attribute)
        command: Any  # typer's TyperGroup or click's Command
        if isinstance(found, typer.Typer):
            command = typer.main.get_group(found)
            command.help = lazy.help  # as add_typer(help=...) would give it
        else:
            one = typer.Typer(add_completion=False)
            one.command(name)(found)
            command = typer.main.get_command(one)
        command.name = name
        loaded = [command, *_descendants(command)]
        for c in loaded:
            c.rich_markup_mode = self.rich_markup_mode
        self._adopt(iter(loaded))
        return command

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        """The list of commands; one not imported yet by its :class:`Lazy` line (printing
        the list imports none)."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.commands.get(name)
            if command is None:
                rows.append((name, self.lazy[name].help))
            elif not command.hidden:
                rows.append((name, command.get_short_help_str()))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx: Any) -> Any:  # click's Context (typer's own click since 0.29)
        try:
            try:
                return super().invoke(ctx)
            except BourseError as exc:
                fail(str(exc))
        except Failed as failed:
            # meta is shared by nested groups (``bourse image``): the innermost prints it
            if ctx.meta.get(JSON_MODE) and not ctx.meta.get(ERROR_PRINTED):
                ctx.meta[ERROR_PRINTED] = True
                typer.echo(_error_json(ctx.meta, failed.message))
            raise


def _descendants(group: Any) -> Iterator[Any]:
    for command in getattr(group, "commands", {}).values():
        yield command
        yield from _descendants(command)


def _after_the_command(param: Any) -> Any:
    """A callback option as a command takes it: not passed to the command's function, and
    written into ``ctx.obj`` when it is on the command line (not from a default or the
    environment, which the callback's own option has read already)."""
    shared = copy.copy(param)
    shared.expose_value = False
    shared.callback = functools.partial(_given_after, param.callback)
    return shared


def _given_after(
    original: Callable[[Any, Any, Any], Any] | None, ctx: typer.Context, param: Any, value: Any
) -> Any:
    source = ctx.get_parameter_source(param.name)
    if getattr(source, "name", "") == "COMMANDLINE":  # click's ParameterSource, by name
        if original is not None:
            value = original(ctx, param, value)
        setattr(ctx.obj, param.name, list(value) if isinstance(value, tuple) else value)
    return value


def cli_main(app: typer.Typer, args: Sequence[str] | None = None) -> NoReturn:
    """Run a typer app as a console script (``args``: instead of sys.argv) with Bourse's
    exit-code contract: usage errors are ONE line on stderr (with --json also one JSON
    object) and exit 1 (click's 2 would read as "unfilled"); a BourseError that reaches
    here (a program whose root is a plain group) is one line and exit 1; Ctrl-C is 130."""
    try:
        code = app(args=args, standalone_mode=False)
    except _USAGE_ERRORS as exc:
        message = exc.format_message()  # type: ignore[attr-defined]  # click/typer usage errors have it
        if type(exc).__name__ == "NoArgsIsHelpError":  # no arguments: the help, as asked for
            typer.echo(message)
            sys.exit(0)
        _error_line(message)
        ctx = getattr(exc, "ctx", None)
        meta: dict[str, Any] = ctx.meta if ctx is not None else {}
        if meta.get(JSON_MODE) or _asks_json(sys.argv[1:] if args is None else args):
            typer.echo(_error_json(meta, message))
        sys.exit(1)
    except BourseError as exc:
        _error_line(str(exc))
        sys.exit(1)
    except _ABORTS:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def _asks_json(argv: Sequence[str]) -> bool:
    """Whether the command line has --json (before a ``--``): a usage error the parser
    raised before it read --json (an unknown option, a missing value) still owes a script
    its JSON object."""
    for a in argv:
        if a == "--":
            return False
        if a == "--json":
            return True
    return False
