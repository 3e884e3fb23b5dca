"""The programs' options are converted without pydantic (bourse/runtime/coercion.py) to the
same values, and refused with the same lines, as typer's own conversion: both are run over
the same inputs, each kind of option the programs have."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

import pytest
import typer
from typer._click.exceptions import BadParameter
from typer._coercion import build_runtime_param, resolve_type_descriptor
from typer.models import OptionInfo

from bourse.runtime.coercion import PlainRuntimeParam, plain_runtime_param

INTS = ["5", " 5 ", "+5", "-5", "-0", "1_000", "00012", "5.0", "5.00", " -5.000 ", "5\n"]
ARABIC_12, ARABIC_1_5 = "\u0661\u0662", "\u0661\u066b\u0665"  # digits Python reads, pydantic not
INTS += ["5.", ".0", "5.5", "1__0", "_1", "1_", "1e3", "0x10", ARABIC_12, "", " ", "abc"]
INTS += [5, 5.0, -3.0, 5.5, math.inf, True, 99999999999999999999999]
FLOATS = ["1.5", " 2 ", "+1.5", "-0", "1e3", "1e400", "1.", ".5", "1_0.5", "1_000.0_1"]
FLOATS += ["inf", "-inf", "Infinity", "nan", " nan ", ARABIC_12, ARABIC_1_5, "1.5e", "0x1"]
FLOATS += ["", "abc"]
FLOATS += [3, 2.5, True]
BOOLS = ["true", "TRUE", " Yes ", "1", "on", "t", "y", "false", "0", "no", "off", "f", "n"]
BOOLS += ["", " ", "maybe", "2", 1, 0, 2, 1.0, 0.0, True, False]

CASES: list[tuple[Any, dict[str, Any], list[Any]]] = [
    (str, {}, ["x", "", " spaced ", b"bytes", 5]),
    (bool, {}, BOOLS),
    (int, {}, INTS),
    (int, {"min": 0, "max": 1000}, ["-1", "0", "1000", "1001", -1, "abc"]),
    (int, {"min": 1}, ["0", "1", "abc"]),
    (float, {}, FLOATS),
    (float, {"min": 0.1}, ["0.05", "0.1", "-1", "abc"]),
    (float, {"min": 0.001}, ["0.0005", "0.001"]),
    (float, {"min": 1e-05, "max": 1e20}, ["0", "1e21", "5"]),
    (float, {"min": 1.0, "max": 50}, ["0", "51", "50"]),
    (float, {"min": 0, "max": 1}, ["-0.5", "1.5", "0.3"]),
    (Path, {}, ["a/b", "", ".", "/nonexistent/x", Path("p")]),
    (list[str], {}, [("a", "b"), ["c"], "x", ()]),
    (list[Path], {}, [("a", "b"), []]),
    (list[int], {"min": 1}, [("1", "2"), ("0",), ("x",)]),
]


def _outcome(rp: Any, value: Any) -> tuple[str, str]:
    try:
        got = rp._coerce_value(value, None, None)
    except BadParameter as exc:
        return "refused", exc.message
    return type(got).__name__, repr(got)


@pytest.mark.parametrize(("annotation", "info", "values"), CASES, ids=repr)
def test_options_convert_as_typer_converts_them(
    annotation: Any, info: dict[str, Any], values: list[Any]
) -> None:
    descriptor = resolve_type_descriptor(annotation, OptionInfo(**info))
    plain = plain_runtime_param(descriptor)
    assert isinstance(plain, PlainRuntimeParam)
    typers = build_runtime_param(descriptor)  # typer's own, with pydantic
    for value in values:
        assert _outcome(plain, value) == _outcome(typers, value), repr(value)


def _cpus(text: str) -> int:  # a parser as buyer's --cpus has one
    if text == "bad":
        raise typer.BadParameter("not a number of CPUs")
    if text == "worse":
        raise ValueError("a\x1b[31m value")
    return int(text) * 1000


def test_a_parser_is_run_as_typer_runs_it() -> None:
    descriptor = resolve_type_descriptor(int, OptionInfo(parser=_cpus))
    plain, typers = plain_runtime_param(descriptor), build_runtime_param(descriptor)
    for value in ["2", "bad", "worse"]:
        assert _outcome(plain, value) == _outcome(typers, value), value


def test_a_path_that_must_exist_is_checked_as_typer_checks_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    info = OptionInfo(exists=True, dir_okay=False)
    descriptor = resolve_type_descriptor(Path, info)
    plain, typers = plain_runtime_param(descriptor), build_runtime_param(descriptor)
    for value in [str(tmp_path / "file"), str(tmp_path / "none"), str(tmp_path)]:
        assert _outcome(plain, value) == _outcome(typers, value), value


@pytest.mark.parametrize(
    ("annotation", "info"),
    [
        (int, {"clamp": True, "min": 0, "max": 5}),
        (typer.FileText, {}),
        (bytes, {}),
    ],
    ids=repr,
)
def test_other_options_are_left_to_typer(annotation: Any, info: dict[str, Any]) -> None:
    assert plain_runtime_param(resolve_type_descriptor(annotation, OptionInfo(**info))) is None


PROGRAMS = ["buyer_cli.cli", "ops.cli", "supplier.cli", "exchange.cli"]


@pytest.mark.parametrize("module", PROGRAMS)
def test_every_option_of_the_programs_is_converted_here(module: str) -> None:
    """Every option the programs have is of a plain type: none of them needs pydantic."""
    from tests.unit.test_cli_help import options

    command = typer.main.get_command(importlib.import_module(module).app)
    params = [p for _, p in options(command, module)]
    for p in params:
        assert plain_runtime_param(p.type_descriptor) is not None, p.opts
