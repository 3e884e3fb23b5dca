"""compose.yaml and the Dockerfile, checked against the project (no Docker engine here):
every command is a real program whose typer app accepts its flags and values, every mounted
nats config is exactly what ``bourse nats-config`` generates, every credential is a file
``bourse auth init`` writes, ports do not clash, the image installs the entry points."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from bourse.nats.embedded import find_nats_server
from tests.topology.programs import SCRIPTS, parse_with_the_real_app

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
GENERATE = ROOT / "deploy" / "compose" / "generate.sh"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SECRETS = "./deploy/compose/secrets/"
NATS = {n: s for n, s in SERVICES.items() if s.get("image", "").startswith("nats:")}
BOURSE = {n: s for n, s in SERVICES.items() if n not in NATS}


def argv(service: dict[str, Any]) -> list[str]:
    return [*service.get("entrypoint", []), *service["command"]]


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> source (a ./path for bind mounts, a name for volumes)."""
    out = {}
    for spec in service.get("volumes", []):
        source, target, *_ = spec.split(":")
        out[target] = source
    return out


def generate_command(program: str) -> list[str]:
    """The `bourse <program> ...` line of deploy/compose/generate.sh, as argv."""
    [line] = [ln for ln in GENERATE.read_text().splitlines() if ln.startswith(f"bourse {program}")]
    return shlex.split(line)


def option_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_services_are_three_nats_two_exchanges_two_regions_and_a_buyer() -> None:
    assert sorted(NATS) == ["nats-1", "nats-2", "nats-3"]
    programs = sorted((argv(s)[0], s.get("profiles", [])) for s in BOURSE.values())
    assert programs == [
        ("buyer", ["tools"]),
        ("exchange", []),
        ("exchange", []),
        ("supplier", []),
        ("supplier", []),
    ]
    regions = {option_value(argv(s), "--region") for s in BOURSE.values() if "supplier" in argv(s)}
    assert regions == {"mad", "fra"}


@pytest.mark.parametrize("name", sorted(BOURSE))
def test_every_bourse_command_is_accepted_by_the_program(name: str) -> None:
    service = BOURSE[name]
    args = argv(service)
    assert args[0] in SCRIPTS, f"{name}: {args[0]} is not a [project.scripts] entry point"
    assert service["build"] == "." and (ROOT / "Dockerfile").exists()
    params = parse_with_the_real_app(args, service.get("environment", {}))
    urls = ",".join(params["nats"])
    assert urls == ",".join(f"nats://{n}:4222" for n in sorted(NATS)), name
    assert set(service["depends_on"]) == set(NATS)
    creds = params["creds"]
    assert creds is not None and creds in mounts(service), f"{name}: --creds is not mounted"


@pytest.mark.parametrize("name", sorted(NATS))
def test_nats_servers_run_the_generated_config_they_mount(name: str, tmp_path: Path) -> None:
    service = NATS[name]
    args = argv(service)
    assert args[0] == "nats-server"
    server_help = subprocess.run(
        [find_nats_server(), "--help"], capture_output=True, text=True
    ).stdout
    for flag in (a for a in args[1:] if a.startswith("-")):
        assert re.search(rf"(^|[\s,]){re.escape(flag)}[\s,]", server_help), flag
    config_path = option_value(args, "-c")
    source = mounts(service)[config_path]
    assert source == f"./deploy/compose/nats/{name}.conf"
    text = (ROOT / source).read_text()
    assert f"server_name: {name}\n" in text  # the routes name the servers by service name
    for other in NATS:
        if other != name:
            assert f"nats-route://{other}:6222" in text
    # JetStream on, its store on a volume of the server's own
    store = re.search(r'^  store_dir: "(.*)/' + name + '"$', text, re.M)
    assert store and mounts(service)[store[1]] in COMPOSE["volumes"], name
    include = re.search(r'^include "(.*)"$', text, re.M)
    assert include and mounts(service)[include[1]] == f"{SECRETS}auth.conf"
    ports = {p.split(":")[1] for p in service["ports"]}
    assert ports == {"4222", "8222"} and "listen: 0.0.0.0:4222" in text and ":8222" in text


def test_committed_nats_configs_are_what_the_command_generates(tmp_path: Path) -> None:
    cmd = generate_command("nats-config")
    committed = ROOT / option_value(cmd, "--out")
    cmd[cmd.index("--out") + 1] = str(tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "ops.cli", *cmd[1:]], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    fresh = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert fresh == {p.name: p.read_bytes() for p in committed.iterdir()}
    mounted = {Path(s).name for svc in NATS.values() for s in mounts(svc).values()}
    assert set(fresh) <= mounted, "a generated config is not mounted by any service"


def test_credentials_are_the_files_bourse_auth_init_writes_and_are_not_committed() -> None:
    auth = generate_command("auth")
    assert auth[:3] == ["bourse", "auth", "init"] and option_value(auth, "--out") == SECRETS[2:-1]
    workers = {w.split("=")[0] for i, w in enumerate(auth) if auth[i - 1] == "--worker"}
    expected_role = {"exchange": "exchange.nk", "buyer": "buyer.nk"}
    for name, service in BOURSE.items():
        args = argv(service)
        secrets = {t: s for t, s in mounts(service).items() if s.startswith(SECRETS)}
        if args[0] == "supplier":
            worker_id = option_value(args, "--worker-id")
            assert worker_id in workers, f"{name}: auth init makes no key for {worker_id}"
            want = f"supplier-{worker_id}.nk"
        else:
            want = expected_role[args[0]]
        # each program gets its own role's key and nothing else; an exchange also gets the
        # workers' public keys (trust.json), which is what verifies signed offers
        extra = [f"{SECRETS}trust.json"] if args[0] == "exchange" else []
        assert list(secrets.values()) == [f"{SECRETS}{want}", *extra], name
        if extra:
            assert option_value(args, "--trust") == "/secrets/trust.json", name
    ignored = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "-q", "deploy/compose/secrets/buyer.nk"]
    )
    assert ignored.returncode == 0, "deploy/compose/secrets/ must be git-ignored"
    assert "deploy/compose/secrets" in (ROOT / ".dockerignore").read_text().splitlines()


def test_host_ports_do_not_clash() -> None:
    host_ports = [p.split(":")[0] for s in SERVICES.values() for p in s.get("ports", [])]
    assert host_ports and len(host_ports) == len(set(host_ports)), host_ports


def test_each_supplier_keeps_its_state_in_its_own_named_volume() -> None:
    suppliers = {n: s for n, s in BOURSE.items() if argv(s)[0] == "supplier"}
    volumes = []
    for name, service in suppliers.items():
        data_dir = option_value(argv(service), "--data-dir")
        volume = mounts(service)[data_dir]
        assert volume in COMPOSE["volumes"], f"{name}: {volume} is not a declared volume"
        volumes.append(volume)
    assert len(set(volumes)) == len(suppliers) == 2


def test_dockerfile_installs_the_project_and_its_entry_points() -> None:
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    base = next(ln for ln in lines if ln.startswith("FROM "))
    minor = re.fullmatch(r"FROM python:3\.(\d+)-slim", base)
    required = re.fullmatch(r">=3\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert minor and required and int(minor[1]) >= int(required[1]), base
    copied = {ln.split()[1] for ln in lines if ln.startswith("COPY ")}
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} | {"pyproject.toml"} <= copied
    assert any(re.search(r"pip install (--\S+ )*\.( |$)", ln) for ln in lines)
    # pip installs [project.scripts]: every program compose runs is one of them
    assert {argv(s)[0] for s in BOURSE.values()} <= set(SCRIPTS)
