"""Every option of every program (buyer, bourse, supplier, exchange, edge) has a help line, and
its help shows what it takes: a metavar for a value, nothing for a flag. A command listed
before it is imported (bourse/runtime/cli.py ``Lazy``) is listed as its own help says."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import typer
from typer.core import TyperOption

PROGRAMS = {
    "buyer": "buyer_cli.cli",
    "bourse": "ops.cli",
    "supplier": "supplier.cli",
    "exchange": "exchange.cli",
    "edge": "edge.cli",
}


def subcommands(command: Any) -> list[tuple[str, Any]]:
    """A group's commands by name, those imported at their first use included."""
    if not hasattr(command, "list_commands"):
        return []
    ctx = command.make_context(command.name, [], resilient_parsing=True)
    return [(name, command.get_command(ctx, name)) for name in command.list_commands(ctx)]


def options(command: Any, path: str) -> list[tuple[str, TyperOption]]:
    found = [(path, p) for p in command.params if isinstance(p, TyperOption)]
    for name, sub in subcommands(command):
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
    leaves = [(path, sub) for path, sub in _commands(command, "buyer") if not subcommands(sub)]
    assert len(leaves) == 26
    for path, sub in leaves:
        names = {o for p in sub.params if isinstance(p, TyperOption) for o in p.opts}
        assert names >= COMMON, f"{path} lacks {COMMON - names}"


def _commands(command: Any, path: str) -> list[tuple[str, Any]]:
    found = []
    for name, sub in subcommands(command):
        found += [(f"{path} {name}", sub), *_commands(sub, f"{path} {name}")]
    return found


@pytest.mark.parametrize("program", ["bourse", "buyer"])
def test_a_command_is_listed_as_its_own_help_begins(program: str) -> None:
    """A program (a BourseGroup) lists each command by the first paragraph of its help,
    whole (click's plain list would cut it to the line); a command imported at its first use
    by its Lazy line, which is that paragraph too."""
    command = typer.main.get_command(importlib.import_module(PROGRAMS[program]).app)
    lazy = getattr(command, "lazy", {})
    for path, sub in [(program, command), *_commands(command, program)]:
        if not subcommands(sub):
            continue
        ctx = sub.make_context(path, [], resilient_parsing=True)
        for name in sub.list_commands(ctx):
            listed = sub.get_command(ctx, name)
            first = inspect.cleandoc(listed.help).split("\n\n")[0].replace("\n", " ")
            assert listed.get_short_help_str() == first, f"{path} {name}"
            if sub is command and name in lazy:
                assert lazy[name].help == first, f"{path} {name}: its Lazy line"


def test_lazy_commands_are_listed_without_being_imported() -> None:
    """`bourse --help` lists every command from its Lazy line: none is made (imported)."""
    from typer.testing import CliRunner

    command = typer.main.get_command(importlib.import_module(PROGRAMS["bourse"]).app)
    ctx = command.make_context("bourse", [], resilient_parsing=True)
    lines = []
    with ctx:
        formatter = ctx.make_formatter()
        command.format_commands(ctx, formatter)
        lines = formatter.getvalue().split()
    assert command.lazy and not command.commands, command.commands
    assert set(command.lazy) <= set(lines)
    result = CliRunner().invoke(importlib.import_module(PROGRAMS["bourse"]).app, ["--help"])
    assert result.exit_code == 0 and "nats-config" in result.output


def test_the_machine_states_of_the_help_are_the_wire_contracts() -> None:
    from typing import get_args

    from bourse.client.policy import RUNS
    from bourse.wire.messages import MachineState
    from buyer_cli.listing import MACHINE_STATES
    from buyer_cli.machines import RUNNING

    assert get_args(MachineState) == MACHINE_STATES
    assert RUNNING == RUNS  # what restart selects is what it restarts


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
        if not subcommands(sub)
    }
    assert len(leaves) == 26 and leaves <= named, leaves - named
