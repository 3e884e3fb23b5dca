"""An option's text converted to its value as typer does it, without pydantic, for the plain
types the programs' options have: ``str``, ``bool``, ``int`` and ``float`` (with ``min`` /
``max``), ``Path``, lists of those, and a ``parser=`` of our own.

Typer (0.29) converts every parameter through a pydantic ``TypeAdapter``: importing pydantic
and building an adapter for each of a command's options cost about as much as the rest of a
``buyer place`` before its first message (docs/performance.md). Here those types get a
conversion of their own; any other (a choice, a file, a datetime, ``clamp``) goes on to
typer's. The values and the error lines are typer's, case for case
(tests/unit/test_cli_coercion.py compares the two over a table of inputs, so a typer that
changes its own is noticed). bourse/runtime/cli.py installs it with the common options.

It leans on three names typer does not export (its conversion's hook and base class, and
its check of a path), as the help's metavars do (bourse/runtime/cli.py)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

import typer.core
from typer._click.exceptions import BadParameter
from typer._click.utils import _escape_control_characters
from typer._coercion import RuntimeParam, TypeDescriptor
from typer._param_types import coerce_cli_path
from typer.models import ParameterInfo

# What pydantic takes as an int from text: ASCII digits, `_` between two of them, a sign,
# a fraction of zeros, whitespace around.
_INT = re.compile(r"\s*[+-]?[0-9](?:_?[0-9])*(?:\.0+)?\s*\Z")
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
NOT_INT = "Input should be a valid integer, unable to parse string as an integer"
NOT_NUMBER = "Input should be a valid number, unable to parse string as a number"
NOT_BOOL = "Input should be a valid boolean, unable to interpret input"


class Invalid(ValueError):
    """A value that is not of its option's type: the message is typer's error line."""


Convert = Callable[[Any, Any, Any], Any]  # (value, param, ctx) -> the option's value


@dataclass(frozen=True)
class PlainRuntimeParam(RuntimeParam):
    """Typer's conversion of one parameter, done by ``convert``."""

    convert: Convert

    def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            return self.convert(value, param, ctx)
        except Invalid as exc:
            raise BadParameter(str(exc), ctx=ctx, param=param) from None


def _str(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _bool(value: Any) -> bool:
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE or text in _FALSE or not text:
            return text in _TRUE
    elif value in (0, 1):
        return bool(value)
    raise Invalid(NOT_BOOL)


def _int(value: Any) -> int:
    if isinstance(value, str):
        if not _INT.match(value):
            raise Invalid(NOT_INT)
        return int(value.strip().partition(".")[0])
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Invalid("Input should be a finite number")
        if not value.is_integer():
            raise Invalid("Input should be a valid integer, got a number with a fractional part")
    return int(value)


def _float(value: Any) -> float:
    if isinstance(value, str) and not value.isascii():
        raise Invalid(NOT_NUMBER)
    try:
        return float(value)
    except ValueError:
        raise Invalid(NOT_NUMBER) from None


def _shown(bound: float) -> str:
    """A bound as pydantic's message writes it: 1, 0.1, 0.00001, never 1e-05."""
    from decimal import Decimal  # only for an error line

    if isinstance(bound, float) and bound.is_integer():
        return str(int(bound))
    return format(Decimal(repr(bound)), "f") if isinstance(bound, float) else str(bound)


def _ranged(number: Callable[[Any], float], info: ParameterInfo) -> Callable[[Any], Any]:
    low, high = info.min, info.max
    if low is None and high is None:
        return number

    def convert(value: Any) -> Any:
        n = number(value)
        if low is not None and n < low:
            raise Invalid(f"Input should be greater than or equal to {_shown(low)}")
        if high is not None and n > high:
            raise Invalid(f"Input should be less than or equal to {_shown(high)}")
        return n

    return convert


def _parsed(parser: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        try:
            return parser(value)
        except ValueError as exc:  # pydantic's word for it; a BadParameter goes on as it is
            raise Invalid(_escape_control_characters(f"Value error, {exc}")) from None

    return convert


def _leaf(annotation: Any, info: ParameterInfo) -> Convert | None:
    """The conversion of one value of ``annotation``, or None: typer's own, then."""
    if info.parser is not None:
        plain: Callable[[Any], Any] = _parsed(info.parser)
    elif annotation is str:
        plain = _str
    elif annotation is bool:
        plain = _bool
    elif annotation is int:
        plain = _ranged(_int, info)
    elif annotation is float:
        plain = _ranged(_float, info)
    elif annotation is Path and info.path_type is None:

        def path(value: Any, param: Any, ctx: Any) -> Any:
            given = value if isinstance(value, Path) else Path(value)
            return coerce_cli_path(given, info, path_type=Path, param=param, ctx=ctx)

        return path
    else:
        return None
    return lambda value, _param, _ctx: plain(value)


def plain_runtime_param(descriptor: TypeDescriptor) -> PlainRuntimeParam | None:
    """The conversion of a parameter of a plain type (module docstring), or None."""
    info = descriptor.parameter_info
    if descriptor.file_annotation is not None or descriptor.is_choice or info.clamp:
        return None
    annotation = descriptor.annotation
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        one = _leaf(item, info)
        if one is None:
            return None

        def each(value: Any, param: Any, ctx: Any) -> list[Any]:
            items = value if isinstance(value, list | tuple) else [value]
            return [one(v, param, ctx) for v in items]

        convert: Convert | None = each
    else:
        convert = _leaf(annotation, info)
    if convert is None:
        return None
    return PlainRuntimeParam(parameter_info=info, annotation=annotation, convert=convert)


def install() -> None:
    """Have typer convert the plain types here, every other as it does (once)."""
    typers = typer.core.build_runtime_param
    if getattr(typers, "_bourse", False):
        return

    def build(descriptor: TypeDescriptor) -> RuntimeParam:
        return plain_runtime_param(descriptor) or typers(descriptor)

    build._bourse = True  # type: ignore[attr-defined]  # a marker: install once
    typer.core.build_runtime_param = build
