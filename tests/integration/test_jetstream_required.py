"""JetStream is required (docs/deploy.md): every program that would run without the market's
promises (order claims, durable events) refuses a NATS server that has no JetStream, with
one line saying how to turn it on, unless it is started with --no-jetstream, which it then
names at start, in its ready line and in `buyer fleet`. Real programs on a real core-only
nats-server, as an operator would start them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bourse.nats.embedded import EmbeddedNats
from bourse.runtime.launcher import Program, start_program, stop_all
from tests.cli import run_module

WORKER = [
    "--driver",
    "sim",
    "--worker-id",
    "mad-1",
    "--region",
    "mad",
    "--cpus",
    "2",
    "--memory-mb",
    "512",
]
ORDER = ["--region", "mad", "--cpus", "1", "--memory-mb", "64", "--image", "web"]


@pytest.fixture
def core_only(tmp_path: Path) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(workdir=tmp_path / "nats", jetstream=False) as srv:
        yield srv


@pytest.mark.parametrize(
    ("program", "args"),
    [
        ("exchange serve", ["exchange", "serve"]),
        ("supplier run", ["supplier", "run", *WORKER, "--data-dir", "{tmp}/mad-1"]),
        ("buyer --direct", ["buyer_cli", "place", "--direct", *ORDER]),
        ("bourse up", ["ops.cli", "up", "--data-dir", "{tmp}/up"]),
        ("bourse demo", ["ops.cli", "demo"]),
    ],
)
async def test_a_program_refuses_a_server_without_jetstream_in_one_line(
    core_only: EmbeddedNats, tmp_path: Path, program: str, args: list[str]
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, out, err = await run_module(*argv, "--nats", core_only.url)
    assert code == 1 and out == ""
    [line] = err.splitlines()
    assert line.startswith(f"error: the NATS server has no JetStream: {program} needs JetStream")
    assert "nats-server with -js -sd DIR" in line and "jetstream { store_dir: DIR }" in line
    assert "--no-jetstream" in line


@pytest.mark.slow
async def test_the_degraded_mode_is_named_at_start_and_in_the_fleet(
    core_only: EmbeddedNats, tmp_path: Path
) -> None:
    common = ["--nats", core_only.url, "--no-jetstream"]
    programs: list[Program] = []
    try:
        programs.append(
            await start_program(
                "supplier",
                "run",
                *WORKER,
                "--data-dir",
                str(tmp_path / "mad-1"),
                *common,
                log_path=tmp_path / "supplier.log",
                ready="supplier ready",
            )
        )
        programs.append(
            await start_program(
                "exchange",
                "serve",
                *common,
                log_path=tmp_path / "exchange.log",
                ready="exchange ready",
            )
        )
        for p in programs:
            assert "without JetStream (--no-jetstream: no order claims" in p.ready_line
            [warning] = [ln for ln in p.log.splitlines() if "jetstream_off" in ln]
            assert "warning" in warning and "degraded" in warning

        # the buyer's view needs JetStream: without it, one line says so ...
        code, out, err = await run_module("buyer_cli", "fleet", "--nats", core_only.url)
        assert code == 1 and "no JetStream" in err and "--no-jetstream" in err, err
        # ... and --no-jetstream asks the workers, as --fresh does
        fleet = ("buyer_cli", "fleet", "--no-jetstream", "--nats", core_only.url)
        code, out, err = await run_module(*fleet)
        assert code == 0, err
        head, row = out.splitlines()
        assert head.split()[-1] == "jetstream" and row.split()[-1] == "off"
        code, out, err = await run_module(*fleet, "--json")
        assert code == 0, err
        assert [w["jetstream"] for w in json.loads(out)["workers"]] == [False]

        # the degraded market still places
        code, out, err = await run_module("buyer_cli", "place", *ORDER, "--nats", core_only.url)
        assert code == 0 and out.startswith("placed "), err
    finally:
        await stop_all(programs)
