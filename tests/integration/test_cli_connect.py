"""The CLIs' connection errors, in this process through typer's runner: a real connection
refused (nothing listens where these tests point), the line that says so, and what
``--json`` keeps on it. Errors before any connection: tests/unit/test_cli_args.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import structlog
from typer.testing import CliRunner

from buyer_cli.cli import app as buyer
from tests.cli import run_cli

runner = CliRunner()

PLACE = ["place", "--region", "mad", "--cpus", "1", "--memory-mb", "64", "--image", "web"]
NO_NATS = ["--nats", "nats://127.0.0.1:1"]


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # the CLIs configure logging for the whole process


def test_failover_json_keeps_its_keys_on_an_error() -> None:
    mid = "mad-1~01JD5X7Q2M4N6P8R0T2V4X6Z8B"
    args = ["failover", "--app", "web", "--machine", mid, "--region", "mad", *NO_NATS, "--json"]
    code, out, err = run_cli(buyer, *args)
    assert code == 1 and err.startswith("error: cannot connect to NATS at nats://127.0.0.1:1")
    assert json.loads(out) == {
        "app": "web",
        "replaced": mid,
        "started": None,
        "stopped": None,
        "queued": None,
        "queue_error": "",
        "spare": None,
        "spare_unfilled": [],
        "error": err.removeprefix("error: ").strip(),
    }


def test_the_common_options_go_before_or_after_the_command() -> None:
    """--nats before the command, after it (which wins), and from the environment; the
    connection error names the server that was used."""
    one, two, env = "nats://127.0.0.1:1", "nats://127.0.0.1:2", "nats://127.0.0.1:3"
    for args, used in [
        (["--nats", one, "fleet"], one),
        (["fleet", "--nats", one], one),
        (["--nats", one, "fleet", "--nats", two], two),
        (["fleet"], env),
        (["--nats", one, "machines", "list"], one),
        (["machines", "--nats", one, "list", "--nats", two], two),
    ]:
        code, _, err = run_cli(buyer, *args, env={"BOURSE_NATS_URL": env})
        assert (code, err.split(": ")[1]) == (1, f"cannot connect to NATS at {used}"), args


def test_fractional_cpus_are_accepted() -> None:
    # No server: the order is built (and checked) before connecting, so a valid 0.5 or
    # 250m gets as far as the connection (the integration tests place them for real).
    for value in ("0.5", "250m", "2"):
        result = runner.invoke(buyer, ["place", *PLACE[1:4], value, *PLACE[5:], *NO_NATS])
        assert "cannot connect to NATS" in result.output, result.output
