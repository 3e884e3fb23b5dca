"""Every option of every program (buyer, bourse, supplier, exchange) has a help line, and
its help shows what it takes: a metavar for a value, nothing for a flag."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import typer
from typer.core import TyperOption

PROGRAMS = {
    "buyer": "buyer_cli.cli",
    "bourse": "ops.cli",
    "supplier": "supplier.cli",
    "exchange": "exchange.cli",
}


def options(command: Any, path: str) -> list[tuple[str, TyperOption]]:
    found = [(path, p) for p in command.params if isinstance(p, TyperOption)]
    for name, sub in (getattr(command, "commands", None) or {}).items():
        found += options(sub, f"{path} {name}")
    return found


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_every_option_has_help_and_says_what_it_takes(program: str) -> None:
    command = typer.main.get_command(importlib.import_module(PROGRAMS[program]).app)
    ctx = command.make_context(program, [], resilient_parsing=True)
    opts = options(command, program)
    assert opts
    for path, opt in opts:
        name = f"{path} {opt.opts[0]}"
        assert opt.help or opt.name == "help", f"{name} has no help"
        shown = opt.display_type_rich(ctx)
        if opt.is_flag:
            assert shown is None, f"{name} shows {shown}"
        else:
            assert shown and not shown.startswith("<"), f"{name} shows {shown}"
