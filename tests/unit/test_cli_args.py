"""The CLIs' argument handling and error lines, in this process through typer's runner (no
NATS needed: bad input is refused before any connection; the connection errors are in
tests/integration/test_cli_connect.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import structlog
import typer
from typer.testing import CliRunner

from bourse.errors import BourseError
from bourse.runtime.cli import BourseGroup, JsonOpt, error_fields, fail
from buyer_cli.cli import app as buyer
from ops.cli import app as bourse
from supplier.cli import app as supplier
from tests.cli import run_cli

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
        ([*PLACE, "--port", "9x"], "--port '9x': a port name is a variable name"),
        ([*PLACE, "--port", "http", "--port", "HTTP"], "--port 'HTTP' is given twice"),
        ([*PLACE, "--env", "A-B=1"], "--env 'A-B=1': 'A-B' is not a variable name"),
        ([*PLACE, "--port", "http", "--check", "web:tcp"], "port 'web' is not one of --port"),
        ([*PLACE, "--port", "http", "--check", "http:grpc"], "kind 'grpc'"),
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


@pytest.mark.parametrize(
    ("options", "command", "text"),
    [
        ([], [], "no command: write it after --"),
        (["-e", "A-B=1"], ["id"], "--env 'A-B=1': 'A-B' is not a variable name"),
    ],
)
def test_exec_refuses_bad_arguments(options: list[str], command: list[str], text: str) -> None:
    """``machines exec``: every word after the machine id is the command's (options go
    before it); what is wrong is said before any connection."""
    machine = "mad-1~01J8Y3Z6V5W4X3Y2Z1A0B9C8D7"
    args = ["machines", "exec", *NO_NATS, *options, machine, "--", *command]
    result = runner.invoke(buyer, args)
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


@pytest.mark.parametrize(
    ("name", "text"), [("f.toml", "worker = []\n"), ("f.json", '{"worker": []}')]
)
def test_supplier_refuses_a_fleet_file_without_workers(
    tmp_path: Path, name: str, text: str
) -> None:
    fleet = tmp_path / name
    fleet.write_text(text)
    result = runner.invoke(supplier, ["run", "--fleet", str(fleet), *NO_NATS])
    assert result.exit_code == 1
    assert f"fleet file {fleet} lists no workers" in result.output
    assert "Traceback" not in result.output


def test_supplier_refuses_overlapping_port_ranges_in_one_line(tmp_path: Path) -> None:
    fleet = tmp_path / "f.toml"
    worker = (
        '[[worker]]\nworker_id = "{}"\nregion = "mad"\ncapacity = {{cpus = 1, memory_mb = 64}}\n'
    )
    fleet.write_text(
        worker.format("a")
        + 'ports = "20000-20099"\n'
        + worker.format("b")
        + 'ports = "20050-20149"\n'
    )
    result = runner.invoke(supplier, ["run", "--fleet", str(fleet), *NO_NATS])
    assert result.exit_code != 0
    assert result.output.strip() == (
        "error: workers a and b: port ranges 20000-20099 and 20050-20149 overlap: "
        "workers of one host need ranges apart"
    )
    bad = runner.invoke(
        supplier,
        ["run", "--worker-id", "w", "--region", "mad", "--cpus", "1", "--memory-mb", "64",
         "--ports", "20000", *NO_NATS],
    )  # fmt: skip
    assert "port range '20000': write it FIRST-LAST" in bad.output


def test_supplier_refuses_the_worker_id_the_exchange_publishes_outcomes_under() -> None:
    args = ["run", "--worker-id", "exchange", "--region", "mad", "--cpus", "1"]
    result = runner.invoke(supplier, [*args, "--memory-mb", "64", *NO_NATS])
    assert result.exit_code == 1
    assert "worker id 'exchange' is reserved" in result.output


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


@pytest.mark.parametrize(
    ("app", "args"), [(buyer, []), (buyer, ["machines"]), (bourse, []), (bourse, ["image"])]
)
def test_no_command_shows_the_help(app: typer.Typer, args: list[str]) -> None:
    """What was asked for: the help on stdout and exit 0, not an error line."""
    code, out, err = run_cli(app, *args)
    usage = out.splitlines()[0]
    assert (code, err) == (0, "") and "\nCommands:\n" in out
    assert usage.startswith("Usage: ") and usage.endswith(" [OPTIONS] COMMAND [ARGS]...")
    assert usage.split()[2:-3] == args


MALFORMED = ["bogus", "mad-1~", "MAD-1~01J", "mad-1~01J!"]


@pytest.mark.parametrize("verb", ["show", "start", "stop", "destroy", "logs"])
@pytest.mark.parametrize("bad", MALFORMED)
def test_a_malformed_machine_id_says_what_one_looks_like(verb: str, bad: str) -> None:
    """Refused before any connection (NO_NATS: nothing listens there)."""
    result = runner.invoke(buyer, ["machines", verb, bad, *NO_NATS])
    said = " ".join(result.output.replace("│", " ").split())  # unwrap the usage box
    assert result.exit_code != 0 and "cannot connect" not in said
    assert f"{bad!r} is not a machine id: one looks like <worker_id>~<ulid>" in said


BOGUS_LINE = (
    "Invalid value for 'MACHINE_ID': 'bogus' is not a machine id: one looks like"
    " <worker_id>~<ulid>, e.g. mad-1~01JD5X7Q2M4N6P8R0T2V4X6Z8B (copy it from `buyer"
    " place` or `machines list`)"
)


def test_the_program_says_it_in_one_line() -> None:
    code, out, err = run_cli(buyer, "machines", "show", "bogus", *NO_NATS)
    assert (code, out, err) == (1, "", f"error: {BOGUS_LINE}\n")
    code, out, err = run_cli(buyer, "place", "--cpus", "1", *NO_NATS)
    assert (code, out) == (1, "") and err == "error: Missing option '--region'.\n"
    code, out, err = run_cli(buyer, *PLACE, "--label", "nokey", *NO_NATS)
    assert (code, out) == (1, "")
    assert err == "error: Invalid value: --label 'nokey' must look like key=value\n"


# -- errors with --json: the line on stderr, and one object on stdout ------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["machines", "show", "bogus", *NO_NATS, "--json"], BOGUS_LINE),  # a usage error
        (["--json", "machines", "show", "bogus", *NO_NATS], BOGUS_LINE),  # --json before
        (  # a command's own check (fail)
            [*PLACE, "--dry-run", "--start", *NO_NATS, "--json"],
            "--dry-run places nothing: --start does not apply",
        ),
        (  # a BourseError (the TLS file), before any connection
            ["fleet", *NO_NATS, "--tls-ca", "/nonexistent/ca.pem", "--json"],
            "cannot use CA file /nonexistent/ca.pem: [Errno 2] No such file or directory",
        ),
        (
            ["machines", "destroy", "--app", "a", "--region", "mad", "--json"],
            "no NATS server given: pass --nats URL or set BOURSE_NATS_URL",
        ),
    ],
)
def test_an_error_is_one_line_and_with_json_one_object(args: list[str], message: str) -> None:
    code, out, err = run_cli(buyer, *args, env={"BOURSE_NATS_URL": None})
    assert (code, err) == (1, f"error: {message}\n")
    assert json.loads(out) == {"error": message}
    code, out, err = run_cli(buyer, *[a for a in args if a != "--json"])
    assert (code, out) == (1, "")


def _program(body: Callable[[], None]) -> typer.Typer:
    """A program of one command, ``go``, that runs ``body``."""
    app = typer.Typer(cls=BourseGroup)

    @app.callback()
    def _callback() -> None:
        """A program."""

    @app.command()
    def go(ctx: typer.Context, json: JsonOpt = False) -> None:
        """Run the body."""
        error_fields(ctx, what="go")
        body()

    return app


def _raise(exc: Exception) -> Callable[[], None]:
    def body() -> None:
        raise exc

    return body


def test_only_errors_raised_on_purpose_are_one_line() -> None:
    code, out, err = run_cli(_program(_raise(BourseError("out of luck"))), "go", "--json")
    assert (code, err) == (1, "error: out of luck\n")
    assert out == '{"what":"go","error":"out of luck"}\n'  # with the command's own fields
    with pytest.raises(ZeroDivisionError):  # a bug: its traceback is what helps
        run_cli(_program(_raise(ZeroDivisionError("bug"))), "go")


def test_fail_keeps_its_exit_code() -> None:
    code, out, err = run_cli(_program(lambda: fail("nothing left", 2)), "go", "--json")
    assert (code, out, err) == (
        2,
        '{"what":"go","error":"nothing left"}\n',
        "error: nothing left\n",
    )


@pytest.mark.parametrize(
    "args",
    [
        ["fleet", "--bogus", "--json"],  # an unknown option: refused before --json is read
        ["--json", "fleet", "--region"],  # an option without its value
    ],
)
def test_a_parse_error_with_json_is_one_object_too(args: list[str]) -> None:
    code, out, err = run_cli(buyer, *args, *NO_NATS)
    assert code == 1 and err.startswith("error: ") and len(err.splitlines()) == 1
    assert json.loads(out) == {"error": err.removeprefix("error: ").strip()}


def test_bourse_says_a_bad_option_in_one_line_and_json() -> None:
    code, out, err = run_cli(bourse, "demo", "--prefix", "a b", "--json")
    assert code == 1 and err.startswith("error: Invalid value for '--prefix'")
    assert json.loads(out)["error"] == err.removeprefix("error: ").strip()
    code, out, err = run_cli(bourse, "up", "--metrics-addr", "nowhere")
    assert (code, out) == (1, "") and err.startswith("error: ") and len(err.splitlines()) == 1


# -- --cpus: fractions and millicores; bad amounts in one line naming the flag -----------------
CPUS_ERRORS = [
    ("0", "'0' is not more than 0 CPUs: use a number of CPUs (2, 0.5) or of millicores (250m)"),
    ("-1", "'-1' is not more than 0 CPUs: use a number of CPUs (2, 0.5) or of millicores (250m)"),
    ("0m", "'0m' is not more than 0 CPUs: use a number of CPUs (2, 0.5) or of millicores (250m)"),
    (
        "1.0005",
        "'1.0005' is finer than a millicore (0.001 CPU): use at most 3 decimals, or millicores "
        "(250m)",
    ),
    ("abc", "'abc' is not a CPU amount: use a number of CPUs (2, 0.5) or of millicores (250m)"),
]


@pytest.mark.parametrize(("value", "why"), CPUS_ERRORS)
@pytest.mark.parametrize("program", ["buyer place", "buyer deploy", "supplier run"])
def test_a_bad_cpus_is_one_line_naming_the_flag(program: str, value: str, why: str) -> None:
    args = {
        "buyer place": ["place", "--region", "mad", "--memory-mb", "64", "--image", "web"],
        "buyer deploy": [
            *("deploy", "--app", "a", "--region", "mad", "--memory-mb", "64", "--image", "x"),
        ],
        "supplier run": ["run", "--worker-id", "w1", "--region", "mad", "--memory-mb", "64"],
    }[program]
    app = buyer if program.startswith("buyer") else supplier
    code, out, err = run_cli(app, *args, "--cpus", value, *NO_NATS)
    assert (code, out) == (1, "")
    assert err == f"error: Invalid value for '--cpus': {why}\n"


def test_a_fleet_file_may_sell_fractional_cpus(tmp_path: Path) -> None:
    from bourse.wire.resources import vec
    from supplier.config import load_fleet

    fleet = tmp_path / "f.toml"
    fleet.write_text(
        '[[worker]]\nworker_id = "w1"\nregion = "mad"\ncapacity = {cpus = 0.5, memory_mb = 64}\n'
        '[[worker]]\nworker_id = "w2"\nregion = "mad"\n'
        'capacity = {cpus = "1500m", memory_mb = 64}\n'
        '[[worker]]\nworker_id = "w3"\nregion = "mad"\ncapacity = {cpus = 4, memory_mb = 64}\n'
    )
    assert [vec(w.capacity)[0] for w in load_fleet(fleet)] == [500, 1500, 4000]


@pytest.mark.parametrize(
    ("capacity", "error"),
    [
        ("{cpus = 1.0005, memory_mb = 64}", "'1.0005' is finer than a millicore"),
        ('{cpus = "0m", memory_mb = 64}', "'0m' is not more than 0 CPUs"),
        ("{cpus = 1, cpu_millis = 3000, memory_mb = 64}", "cpu_millis 3000 needs cpus 3"),
    ],
)
def test_a_fleet_file_with_a_bad_cpu_amount_is_refused(
    tmp_path: Path, capacity: str, error: str
) -> None:
    fleet = tmp_path / "f.toml"
    fleet.write_text(f'[[worker]]\nworker_id = "w1"\nregion = "mad"\ncapacity = {capacity}\n')
    result = runner.invoke(supplier, ["run", "--fleet", str(fleet), *NO_NATS])
    assert result.exit_code == 1
    assert f"fleet file {fleet}: {error}" in result.output
    assert "$.worker[0].capacity" in result.output


def test_supplier_run_sells_fractional_cpus() -> None:
    from bourse.wire.messages import Amount
    from supplier.cli import _cpus, _single_worker

    w = _single_worker("w1", "mad", _cpus("1.5"), 64, 0, 0, None, None, "spread", 0.3, 4.0, False)
    assert w.capacity == Amount(cpus=2, cpu_millis=1500, memory_mb=64)
    w = _single_worker("w1", "mad", _cpus("8"), 64, 0, 0, None, None, "spread", 0.3, 4.0, False)
    assert w.capacity == Amount(cpus=8, memory_mb=64)  # whole: as in v1


def test_supplier_log_flags_set_what_a_fleet_worker_leaves_unset() -> None:
    from supplier.cli import _unset_from
    from supplier.config import WorkerConfig
    from supplier.machines.host.output import LogCaps
    from supplier.machines.shim.logfiles import DEFAULT_WORKER_LOG_MB

    own = msgspec.convert(
        {"worker_id": "w1", "region": "mad", "capacity": {"cpus": 1, "memory_mb": 64}},
        WorkerConfig,
    )
    assert own.log_caps == LogCaps()  # the defaults: 10 MiB a file, 1 GiB a worker
    own = msgspec.structs.replace(own, machine_log_mb=5)
    flags = {"max_hold_ms": None, "machine_log_mb": 2, "worker_log_mb": 64}
    got = _unset_from(own, flags)
    assert got.log_caps == LogCaps(machine_mb=5, worker_mb=64)  # the worker's own wins
    assert got.max_hold_ms is None  # a flag not given sets nothing
    assert _unset_from(own, {"worker_log_mb": None}).log_caps.worker_mb == DEFAULT_WORKER_LOG_MB


@pytest.mark.parametrize(
    ("driver", "catalog", "unrunnable"),
    [
        ("sim", {}, []),
        ("process", {}, ["web"]),
        ("process", {"web": {"command": ["true"]}}, []),
        ("process", {"web": {"command": []}}, ["web"]),
        ("oci", {"web": {"command": ["true"]}}, ["web"]),  # an oci worker runs no catalog image
    ],
)
def test_a_worker_names_the_images_it_lists_but_cannot_run(
    driver: str, catalog: dict[str, object], unrunnable: list[str]
) -> None:
    from supplier.config import WorkerConfig, unrunnable_images

    raw = {"worker_id": "w1", "region": "mad", "capacity": {"cpus": 1, "memory_mb": 64}}
    w = msgspec.convert(
        {**raw, "images": ["web"], "driver": driver, "catalog": catalog}, WorkerConfig
    )
    assert unrunnable_images(w) == unrunnable
