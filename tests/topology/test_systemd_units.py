"""The example systemd units of docs/deploy.md, checked against the programs they run."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import pytest

from bourse.nats.connection import split_urls
from supplier.config import load_fleet
from tests.topology.programs import ROOT, SCRIPTS, parse_with_the_real_app

UNITS = ROOT / "deploy" / "systemd"
# what systemd would substitute for the specifiers the units use
SPECIFIERS = {"%i": "mad-1", "%S": "/var/lib", "%d": "/run/credentials/x", "%H": "host-1"}


class _UnitParser(configparser.ConfigParser):
    """A systemd unit's keys are case-sensitive (ExecStart, not execstart)."""

    def optionxform(self, optionstr: str) -> str:
        return optionstr


def service(unit: str) -> dict[str, str]:
    cp = _UnitParser(interpolation=None, strict=False)
    cp.read_string((UNITS / unit).read_text())
    return dict(cp["Service"])


def exec_start(svc: dict[str, str]) -> list[str]:
    line = svc["ExecStart"]
    for spec, value in SPECIFIERS.items():
        line = line.replace(spec, value)
    return shlex.split(line)


def example_env() -> dict[str, str]:
    lines = (UNITS / "bourse.env.example").read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if ln and not ln.startswith("#"))


@pytest.mark.parametrize("unit", ["bourse-supplier@.service", "bourse-exchange@.service"])
def test_exec_start_is_accepted_by_the_program(unit: str) -> None:
    svc = service(unit)
    args = exec_start(svc)
    program = Path(args[0]).name
    assert program in SCRIPTS and args[0] == f"/opt/bourse/venv/bin/{program}"
    params = parse_with_the_real_app([program, *args[1:]], example_env())
    assert len(split_urls(params["nats"])) == 3  # every URL of the cluster, for failover
    # the credential the unit loads is the one the program is told to use
    name, _, source = svc["LoadCredential"].partition(":")
    assert params["creds"] == f"{SPECIFIERS['%d']}/{name}"
    role = "supplier-%i" if program == "supplier" else "exchange"
    assert source == f"/etc/bourse/creds/{role}.nk"
    assert svc["Restart"] in ("always", "on-failure") and svc["KillSignal"] == "SIGTERM"


def test_supplier_keeps_its_state_in_the_state_directory_of_its_instance() -> None:
    svc = service("bourse-supplier@.service")
    params = parse_with_the_real_app(["supplier", *exec_start(svc)[1:]], example_env())
    assert str(params["data_dir"]) == f"{SPECIFIERS['%S']}/{svc['StateDirectory']}".replace(
        "%i", SPECIFIERS["%i"]
    )
    # SIGTERM reaches the supplier alone, so it stops its machines gracefully itself
    assert svc["KillMode"] == "mixed"
    assert str(params["fleet"]) == "/etc/bourse/mad-1.toml"
    [worker] = load_fleet(UNITS / "mad-1.toml")  # the example the unit's comment points to
    assert (worker.worker_id, worker.driver) == ("mad-1", "process")
