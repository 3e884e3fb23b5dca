"""The CLIs' argument handling through typer's runner (no NATS needed: bad input is refused
before any connection)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from typer.testing import CliRunner

from buyer_cli.cli import app as buyer
from supplier.cli import app as supplier

runner = CliRunner()


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # the CLIs configure logging for the whole process


PLACE = ["place", "--region", "mad", "--cpus", "1", "--memory-mb", "64", "--image", "web"]
NO_NATS = ["--nats", "nats://127.0.0.1:1"]


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (
            ["place", "--region", "mad", "--cpus", "0", "--memory-mb", "64", "--image", "web"],
            "'0' is not more than 0 CPUs",
        ),
        (
            ["place", "--region", "Mad!", "--cpus", "1", "--memory-mb", "64", "--image", "web"],
            "(--region)",
        ),
        ([*PLACE, "--label", "disk"], "--label 'disk' must look like key=value"),
        ([*PLACE, "--min-score", "2"], "(--min-score)"),
        ([*PLACE, "--deadline-ms", "0"], "(--deadline-ms)"),
        ([*PLACE, "--order-id", "bad id"], "(--order-id)"),
        (
            [
                "deploy",
                "--app",
                "a",
                "--region",
                "mad",
                "--cpus",
                "0",
                "--memory-mb",
                "1",
                "--image",
                "x",
            ],
            "'0' is not more than 0 CPUs",
        ),
    ],
)
def test_buyer_refuses_bad_arguments_naming_the_flag(args: list[str], text: str) -> None:
    result = runner.invoke(buyer, [*args, *NO_NATS])
    assert result.exit_code != 0
    assert text in result.output


def test_buyer_without_a_nats_url_says_how_to_give_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BOURSE_NATS_URL", raising=False)
    result = runner.invoke(buyer, PLACE)
    assert result.exit_code == 1
    assert "pass --nats URL or set BOURSE_NATS_URL" in result.output


def test_supplier_refuses_a_fleet_file_with_a_bad_field(tmp_path: Path) -> None:
    fleet = tmp_path / "f.toml"
    fleet.write_text('[[worker]]\nworker_id = "w1"\nregion = "mad"\ncapacity = {cpus = -1}\n')
    result = runner.invoke(supplier, ["run", "--fleet", str(fleet), *NO_NATS])
    assert result.exit_code == 1
    assert f"fleet file {fleet}" in result.output and "$.worker[0].capacity.cpus" in result.output


def test_settle_heap_puts_what_exists_out_of_the_collectors_reach() -> None:
    import gc

    from bourse.runtime.supervise import settle_heap

    keep = [[i] for i in range(1000)]  # a started program's state
    try:
        settle_heap()
        assert gc.get_freeze_count() >= len(keep)
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(
    "args",
    [
        [*PLACE, "--tls-ca", "/nonexistent/ca.pem"],  # after the command
        ["--tls-ca", "/nonexistent/ca.pem", *PLACE],  # before it (docs/security.md)
        ["machines", "list", "--worker", "w1", "--tls-ca", "/nonexistent/ca.pem"],
    ],
)
def test_buyer_takes_tls_options_before_or_after_the_command(args: list[str]) -> None:
    result = runner.invoke(buyer, [*args, *NO_NATS])
    assert result.exit_code == 1
    assert "/nonexistent/ca.pem" in result.output  # checked before any connection


def test_direct_says_what_it_means_on_each_command() -> None:
    machines = runner.invoke(buyer, ["machines", "list", "--help"], terminal_width=200)
    assert "Talk to the worker directly" in machines.output
    assert "Run the auction here" not in machines.output
    place = runner.invoke(buyer, ["place", "--help"], terminal_width=200)
    assert "Run the auction here" in place.output


MALFORMED = ["bogus", "mad-1~", "MAD-1~01J", "mad-1~01J!"]


@pytest.mark.parametrize("verb", ["show", "start", "stop", "destroy", "logs"])
@pytest.mark.parametrize("bad", MALFORMED)
def test_a_malformed_machine_id_says_what_one_looks_like(verb: str, bad: str) -> None:
    """Refused before any connection (NO_NATS: nothing listens there)."""
    result = runner.invoke(buyer, ["machines", verb, bad, *NO_NATS])
    said = " ".join(result.output.replace("│", " ").split())  # unwrap the usage box
    assert result.exit_code != 0 and "cannot connect" not in said
    assert f"{bad!r} is not a machine id: one looks like <worker_id>~<ulid>" in said


def test_the_program_says_it_in_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "buyer_cli", "machines", "show", "bogus", *NO_NATS],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == (
        "error: Invalid value for 'MACHINE_ID': 'bogus' is not a machine id: one looks like"
        " <worker_id>~<ulid>, e.g. mad-1~01JD5X7Q2M4N6P8R0T2V4X6Z8B (copy it from `buyer"
        " place` or `machines list`)\n"
    )
