"""The `bourse nats-config` commands quoted in the docs run as written (into a temp dir)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ops.cli import app as bourse
from tests.cli import run_cli
from tests.topology.programs import ROOT


def quoted_commands(doc: str) -> list[list[str]]:
    """Every `bourse nats-config ...` command in a doc's code blocks, continuations joined."""
    text = (ROOT / "docs" / doc).read_text().replace("\\\n", " ")
    return [shlex.split(m) for m in re.findall(r"^bourse nats-config .*$", text, re.M)]


@pytest.mark.parametrize(
    ("doc", "files"),
    [
        (
            "deploy.md",
            ["eu-1.conf", "eu-2.conf", "eu-3.conf", "us-1.conf", "us-2.conf", "us-3.conf"],
        ),
        ("performance.md", ["a-1.conf", "a-2.conf", "b-1.conf"]),
    ],
)
def test_nats_config_commands_in_the_docs_work(doc: str, files: list[str], tmp_path: Path) -> None:
    [cmd] = quoted_commands(doc)
    cmd[cmd.index("--out") + 1] = str(tmp_path)
    code, _, err = run_cli(bourse, *cmd[1:])
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == files


def test_every_loadtest_command_in_the_docs_parses() -> None:
    """A flag renamed or removed would leave a figure whose command no longer runs."""
    from typer.testing import CliRunner

    from ops.cli import app

    text = "\n".join(
        (ROOT / name).read_text().replace("\\\n", " ")
        for name in ("README.md", "docs/performance.md", "docs/reliability.md")
    )
    cmds = [shlex.split(m) for m in re.findall(r"bourse loadtest[^`\n|#]*", text)]
    assert len(cmds) >= 10
    for cmd in cmds:
        args = [a for a in cmd[2:] if a not in ("&", "&&")]
        result = CliRunner().invoke(app, ["loadtest", *args, "--help"])
        assert result.exit_code == 0, (cmd, result.output)


def test_ci_checks_the_code_then_runs_exactly_the_readmes_test_command() -> None:
    """CI runs what a reader runs (the README's command, byte for byte), after the lint,
    format and type checks: a check that fails stops it before the tests."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", readme, re.S)
    [test_cmd] = [b.strip() for b in blocks if b.strip().endswith(".venv/bin/pytest")]
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line]
    assert "set -euo pipefail" in lines  # fail fast
    steps = [line for line in lines if not line.startswith("#")]
    assert steps[-1] == test_cmd, (steps[-1], test_cmd)
    order = [".venv/bin/ruff check .", ".venv/bin/ruff format --check .", ".venv/bin/mypy"]
    at = [next(i for i, s in enumerate(steps) if s.split("  #")[0] == o) for o in order]
    assert at == sorted(at) and at[-1] < len(steps) - 1, steps


def test_every_image_the_readme_changes_an_app_to_is_pushed_before() -> None:
    """A reader who changes app.toml's image as the README says finds it in the store: each
    `image = "X"` a comment asks for is pushed by a line above it (a deploy of an image the
    store lacks is refused before anything is placed)."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    asked = 0
    for block in blocks:
        pushed: set[str] = set()
        for line in block.splitlines():
            if m := re.match(r"\.venv/bin/bourse image push (\S+)", line):
                pushed.add(m.group(1))
            for image in re.findall(r'^# change image = "([^"]+)"', line):
                asked += 1
                assert image in pushed, (image, line)
    assert asked >= 1
