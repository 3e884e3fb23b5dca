"""An order's ports, environment and checks as people write them on a command line
(``--port http``, ``--env K=V``, ``--check http:http:/healthz``), parsed into what a
``PlaceOrder`` carries (docs/protocol.md §4.2a). Pure: ``buyer place`` and ``deploy`` parse
with these, and each bad flag is one :class:`FlagError` naming it."""

from __future__ import annotations

import re
from collections.abc import Sequence

from bourse.errors import BourseError
from bourse.runtime.defaults import DEFAULT_CHECK_INTERVAL_S, DEFAULT_CHECK_TIMEOUT_S
from bourse.wire.limits import (
    CONTROL_CHARACTERS,
    ENV_KEY_PATTERN,
    MAX_CHECK_PATH,
    MAX_CHECKS,
    MAX_ENV,
    MAX_PORTS,
    PORT_NAME_PATTERN,
)
from bourse.wire.messages import CHECK_KINDS, Check

_PORT_NAME = re.compile(PORT_NAME_PATTERN)
_ENV_KEY = re.compile(ENV_KEY_PATTERN)
_CONTROL = re.compile(f"[{CONTROL_CHARACTERS}]")


class FlagError(BourseError, ValueError):
    """A --port, --env or --check that cannot be read (the message names it)."""


def parse_ports(names: Sequence[str] | None) -> list[str]:
    """``--port NAME`` (repeatable), in order (the first is ``PORT``): each a valid variable
    name, none given twice (told apart upper-cased, as ``BOURSE_PORT_<NAME>`` is)."""
    out: list[str] = []
    seen: set[str] = set()
    for name in names or ():
        if not _PORT_NAME.match(name):
            raise FlagError(
                f"--port {name!r}: a port name is a variable name (letters, digits and _, "
                "not starting with a digit, at most 32 characters)"
            )
        if name.upper() in seen:
            raise FlagError(f"--port {name!r} is given twice (names are told apart upper-cased)")
        seen.add(name.upper())
        out.append(name)
    if len(out) > MAX_PORTS:
        raise FlagError(f"--port: at most {MAX_PORTS} ports, not {len(out)}")
    return out


def parse_env(pairs: Sequence[str] | None) -> dict[str, str]:
    """``--env KEY=VALUE`` (repeatable; a later KEY wins): each KEY a valid variable name."""
    env: dict[str, str] = {}
    for pair in pairs or ():
        key, eq, value = pair.partition("=")
        if not eq:
            raise FlagError(f"--env {pair!r}: write it KEY=VALUE")
        if not _ENV_KEY.match(key):
            raise FlagError(
                f"--env {pair!r}: {key!r} is not a variable name (letters, digits and _, "
                "not starting with a digit)"
            )
        env[key] = value
    if len(env) > MAX_ENV:
        raise FlagError(f"--env: at most {MAX_ENV} variables, not {len(env)}")
    return env


def parse_checks(
    specs: Sequence[str] | None,
    ports: Sequence[str],
    interval_s: float = DEFAULT_CHECK_INTERVAL_S,
    timeout_s: float = DEFAULT_CHECK_TIMEOUT_S,
) -> list[Check]:
    """``--check PORT:http:/PATH`` or ``PORT:tcp`` (repeatable), each on one of ``ports``,
    run every ``interval_s`` with ``timeout_s`` to answer."""
    if not 0.1 <= interval_s <= 3600:
        raise FlagError(f"--check-interval {interval_s:g}: give 0.1 to 3600 seconds")
    if not 0.01 <= timeout_s <= 600:
        raise FlagError(f"--check-timeout {timeout_s:g}: give 0.01 to 600 seconds")
    checks = [parse_check(s, ports, interval_s, timeout_s) for s in specs or ()]
    if len(checks) > MAX_CHECKS:
        raise FlagError(f"--check: at most {MAX_CHECKS} checks, not {len(checks)}")
    return checks


def parse_check(spec: str, ports: Sequence[str], interval_s: float, timeout_s: float) -> Check:
    """One ``--check`` (see :func:`parse_checks`)."""
    port, _, rest = spec.partition(":")
    kind, _, path = rest.partition(":")
    if port not in ports:
        named = ", ".join(ports) if ports else "none"
        raise FlagError(f"--check {spec!r}: port {port!r} is not one of --port ({named})")
    if kind not in CHECK_KINDS:
        raise FlagError(f"--check {spec!r}: kind {kind!r}: write PORT:http:/PATH or PORT:tcp")
    if kind == "http" and not path.startswith("/"):
        raise FlagError(f"--check {spec!r}: an http check needs a path from /: PORT:http:/PATH")
    if kind == "tcp" and path:
        raise FlagError(f"--check {spec!r}: a tcp check has no path: PORT:tcp")
    if control := _CONTROL.search(path):
        raise FlagError(
            f"--check {spec!r}: its path has the control character {control.group()!r}: "
            "percent-encode it (%0D for CR, %0A for LF)"
        )
    if len(path) > MAX_CHECK_PATH:
        raise FlagError(f"--check {spec!r}: its path is longer than {MAX_CHECK_PATH} characters")
    return Check(port=port, kind=kind, path=path, interval_s=interval_s, timeout_s=timeout_s)
