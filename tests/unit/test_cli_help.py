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


@pytest.mark.parametrize(
    "args", [["place"], ["fleet"], ["deploy"], ["failover"], ["machines", "destroy"]]
)
def test_help_shows_no_python_types(args: list[str]) -> None:
    """What a person reads: no <bool> on a flag, no Python type for a value."""
    from typer.testing import CliRunner

    from buyer_cli.cli import app

    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
    text = result.output
    assert result.exit_code == 0 and "--help" in text
    for python_type in ("<bool>", "<str>", "<int>", "<list[str]>", "<float>"):
        assert python_type not in text, text


COMMON = {"--nats", "--creds", "--tls-ca", "--tls-cert", "--tls-key", "--prefix", "--json"}


def test_every_buyer_command_takes_the_common_options_after_it() -> None:
    """Defined once (the app's callback), taken after every command as people type them."""
    command = typer.main.get_command(importlib.import_module(PROGRAMS["buyer"]).app)
    leaves = [
        (path, sub)
        for path, sub in _commands(command, "buyer")
        if not getattr(sub, "commands", None)
    ]
    assert len(leaves) == 19
    for path, sub in leaves:
        names = {o for p in sub.params if isinstance(p, TyperOption) for o in p.opts}
        assert names >= COMMON, f"{path} lacks {COMMON - names}"


def _commands(command: Any, path: str) -> list[tuple[str, Any]]:
    found = []
    for name, sub in (getattr(command, "commands", None) or {}).items():
        found += [(f"{path} {name}", sub), *_commands(sub, f"{path} {name}")]
    return found


def test_the_readme_says_every_buyer_commands_json_shape() -> None:
    """The README's --json table has a row for every command (named in its first column)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("| command | `--json` prints |", 1)[1].split("\n\n", 1)[0]
    first = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `")]
    named = {name for cell in first for name in re.findall(r"`([a-z ]+)`", cell)}
    command = typer.main.get_command(importlib.import_module(PROGRAMS["buyer"]).app)
    leaves = {
        path.removeprefix("buyer ")
        for path, sub in _commands(command, "buyer")
        if not getattr(sub, "commands", None)
    }
    assert len(leaves) == 19 and leaves <= named, leaves - named
