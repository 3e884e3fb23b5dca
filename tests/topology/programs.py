"""Real supplier and exchange processes, connected to the cluster URLs they are given; and
the programs' own parsers, to check command lines written in deployment files."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer

from bourse.runtime.launcher import Program, start_program

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


async def supplier(
    urls: list[str], prefix: str, root: Path, worker_id: str, region: str, cpus: int
) -> Program:
    """One real supplier process serving one worker, connected with every URL given."""
    return await start_program(
        "supplier", "run", "--driver", "sim", "--worker-id", worker_id, "--region", region,
        "--cpus", str(cpus), "--memory-mb", str(cpus * 1024), "--image", "web",
        "--data-dir", str(root / worker_id), "--nats", ",".join(urls), "--prefix", prefix,
        log_path=root / "logs" / f"{worker_id}.log", ready="supplier ready",
    )  # fmt: skip


async def exchange(urls: list[str], prefix: str, root: Path, name: str) -> Program:
    """One real exchange process (its NATS connection is named ``name``)."""
    return await start_program(
        "exchange", "serve", "--nats", ",".join(urls), "--prefix", prefix, "--name", name,
        log_path=root / "logs" / f"{name}.log", ready="exchange ready",
    )  # fmt: skip


def parse_with_the_real_app(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Parse a command line with the program's own typer app (options, types, ranges);
    returns the subcommand's parameters. Raises the parser's error on anything refused."""
    module, _, _ = SCRIPTS[args[0]].partition(":")
    group = typer.main.get_command(importlib.import_module(module).app)
    assert isinstance(group, typer.core.TyperGroup), f"{args[0]} has no subcommands"
    mp = pytest.MonkeyPatch()
    try:
        for k, v in env.items():
            mp.setenv(k, v)
        # the program's own options (a buyer's connection options are the app's), read
        # from the environment, then the command's
        parent = group.make_context(args[0], [args[1]], resilient_parsing=True)
        sub = group.get_command(parent, args[1])
        assert sub is not None, f"{args[0]} has no command {args[1]!r}"
        return {**parent.params, **sub.make_context(args[1], args[2:], parent=parent).params}
    finally:
        mp.undo()
