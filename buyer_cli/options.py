"""The options several ``buyer`` commands take (resources, labels, deadlines, machine ids),
each defined once with its parser, and the exit code of an order left unfilled."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from bourse.runtime.cli import fail
from bourse.runtime.defaults import DEFAULT_CHECK_INTERVAL_S, DEFAULT_CHECK_TIMEOUT_S
from bourse.wire.limits import MACHINE_ID_PATTERN
from bourse.wire.metadata import RESTART_POLICIES

# Exit codes: 0 placed / done, 2 unfilled (nothing placed, a slot left empty, no spare, a
# region with no worker), 1 an error.
EXIT_UNFILLED = 2


def _cpus(text: str) -> int:
    """``--cpus`` as people write it (2, 0.5, 250m), in millicores; one clear error else."""
    from bourse.wire.resources import parse_cpus

    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


# The value is in millicores once parsed (2 -> 2000, 0.5 -> 500, 250m -> 250).
CpusOpt = Annotated[
    int,
    typer.Option(
        metavar="CPUS", parser=_cpus, help="CPUs: whole (2), fractional (0.5) or millicores (250m)."
    ),
]
# The same, where a command can do without it (``deploy -f`` takes the spec's).
OptionalCpusOpt = Annotated[
    int | None,
    typer.Option(
        metavar="CPUS", parser=_cpus, help="CPUs: whole (2), fractional (0.5) or millicores (250m)."
    ),
]
MemoryOpt = Annotated[int, typer.Option(metavar="MIB", help="Memory in MiB.")]
ImageOpt = Annotated[
    str,
    typer.Option(
        metavar="IMAGE",
        help="Image to run: NAME[:TAG] or NAME@sha256:... of the market's image store "
        "(`bourse image`), or a name in the workers' catalogs.",
    ),
]
DiskOpt = Annotated[int, typer.Option(metavar="MIB", help="Disk in MiB (0: none).")]
GpusOpt = Annotated[int, typer.Option(metavar="N", help="GPUs (0: none).")]
LabelOpt = Annotated[
    list[str] | None,
    typer.Option(metavar="KEY=VALUE", help="A label the worker must have (repeatable)."),
]
MinScoreOpt = Annotated[
    float,
    typer.Option(metavar="SCORE", help="Least score (0-1) an offer needs to be taken."),
]
DeadlineOpt = Annotated[
    int, typer.Option(metavar="MS", help="How long the auction may take, in milliseconds.")
]
AppOpt = Annotated[
    str, typer.Option("--app", metavar="NAME", help="The app's name (its machines carry it).")
]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]


def _restart(value: str | None) -> str | None:
    if value is not None and value not in RESTART_POLICIES:
        raise typer.BadParameter(f"{value!r} is not a restart policy: use no, on-failure or always")
    return value


RestartOpt = Annotated[
    str | None,
    typer.Option(
        help="Restart the machine's process when it ends: no, on-failure (non-zero exit, "
        "signal, oom), always (process driver; sent as metadata restart=...). Default: "
        "the image's policy.",
        metavar="POLICY",
        callback=_restart,
    ),
]
DirectOpt = Annotated[
    bool, typer.Option("--direct", help="Run the auction here; no exchange needed.")
]
# On a machine command --direct skips the exchange's routing, not an auction.
MachineDirectOpt = Annotated[
    bool, typer.Option("--direct", help="Talk to the worker directly; no exchange needed.")
]


def check_machine_id(value: str) -> str:
    """A machine id as the CLI takes it, or a usage error that says what one looks like."""
    if re.match(MACHINE_ID_PATTERN, value) is None:
        raise typer.BadParameter(
            f"{value!r} is not a machine id: one looks like <worker_id>~<ulid>, e.g. "
            "mad-1~01JD5X7Q2M4N6P8R0T2V4X6Z8B (copy it from `buyer place` or `machines list`)"
        )
    return value


MachineIdArg = Annotated[
    str, typer.Argument(help="<worker_id>~<ulid>", metavar="MACHINE_ID", callback=check_machine_id)
]

# JSON paths of a PlaceOrder (or Resources) -> the flag a person typed.
_FLAGS = {
    "resources.cpus": "--cpus",
    "resources.cpu_millis": "--cpus",
    "resources.memory_mb": "--memory-mb",
    "resources.disk_mb": "--disk-mb",
    "resources.gpus": "--gpus",
    "cpus": "--cpus",
    "cpu_millis": "--cpus",
    "memory_mb": "--memory-mb",
    "disk_mb": "--disk-mb",
    "gpus": "--gpus",
    "region": "--region",
    "image": "--image",
    "constraints": "--label",
    "exclude_workers": "--exclude",
    "min_score": "--min-score",
    "deadline_ms": "--deadline-ms",
    "order_id": "--order-id",
    "metadata": "--meta",
}
_PATH = re.compile(r" - at `\$\.([A-Za-z_.]+)[^`]*`")


def flag_names(text: str) -> str:
    """``Expected `int` >= 1 - at `$.resources.cpus` `` -> ``... (--cpus)``."""

    def sub(m: re.Match[str]) -> str:
        path = m.group(1)
        for key in sorted(_FLAGS, key=len, reverse=True):
            if path == key or path.startswith(key + "."):
                return f" ({_FLAGS[key]})"
        return m.group(0)

    return _PATH.sub(sub, text)


# A machine's ports, env and checks (``buyer place`` and ``deploy``: one parser,
# bourse/client/orderflags.py).
PortOpt = Annotated[
    list[str] | None,
    typer.Option(
        metavar="NAME",
        help="A named port (repeatable): the worker gives it a host port, PORT (the "
        "first), BOURSE_PORT_<NAME> and BOURSE_ADDR_<NAME>; its address is printed.",
    ),
]
EnvOpt = Annotated[
    list[str] | None,
    typer.Option(
        metavar="KEY=VALUE",
        help="An environment variable of the machine (repeatable); `machines show` "
        "shows its key only.",
    ),
]
CheckOpt = Annotated[
    list[str] | None,
    typer.Option(
        metavar="PORT:http:/PATH|PORT:tcp",
        help="A health check the worker runs on a named port (repeatable).",
    ),
]
CheckIntervalOpt = Annotated[
    float, typer.Option(metavar="SECONDS", help="How often each check runs.")
]
CheckTimeoutOpt = Annotated[
    float, typer.Option(metavar="SECONDS", help="How long a check may take to pass.")
]


def reach(
    port: list[str] | None,
    env: list[str] | None,
    check: list[str] | None,
    interval_s: float = DEFAULT_CHECK_INTERVAL_S,
    timeout_s: float = DEFAULT_CHECK_TIMEOUT_S,
) -> dict[str, object]:
    """``ports``, ``env`` and ``checks`` from their flags; a bad one ends the command with
    one line naming it."""
    from bourse.client.orderflags import FlagError, parse_checks, parse_env, parse_ports

    try:
        ports = parse_ports(port)
        return {
            "ports": ports,
            "env": parse_env(env),
            "checks": parse_checks(check, ports, interval_s, timeout_s),
        }
    except FlagError as exc:
        fail(str(exc))
