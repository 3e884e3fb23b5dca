"""`bourse auth init` as a real command, and the programs' handling of bad credentials,
trust and TLS files (one clear error line, exit 1)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from bourse.nats.auth import public_key_of, read_seed_file, tenant_of
from bourse.nats.connection import connect, flush_all
from bourse.nats.embedded import EmbeddedNats
from bourse.nats.jetstream import jetstream_available
from ops.cli import app as bourse
from tests.cli import run_cli, run_module
from tests.security.conftest import FLEET_FRA


async def test_auth_init_writes_keys_config_trust_and_tls(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet-fra.toml"
    fleet.write_text(FLEET_FRA)
    out = tmp_path / "auth"
    init = ("ops.cli", "auth", "init", "--out", str(out), "--fleet", str(fleet))
    code, stdout, err = await run_module(
        *init, "--worker", "mad-1=mad", "--buyer", "alice", "--tls", "--tls-clients"
    )
    assert code == 0, err
    assert "supplier:fleet-fra" in stdout
    assert f"run: nats-server -c {out / 'server.conf'} -js -sd {out / 'jetstream'}\n" in stdout
    assert f"bourse jetstream init --creds {out / 'operator.nk'} " in stdout
    seeds = {p.name: p for p in out.glob("*.nk")}
    assert sorted(seeds) == [
        "buyer-alice.nk",
        "buyer.nk",
        "edge.nk",
        "exchange.nk",
        "operator.nk",
        "supplier-fleet-fra.nk",
        "supplier-mad-1.nk",
    ]
    conf = (out / "auth.conf").read_text()
    for path in seeds.values():
        assert path.stat().st_mode & 0o777 == 0o600
        assert f'nkey: "{public_key_of(read_seed_file(path))}"' in conf
    assert tenant_of(seeds["buyer-alice.nk"]) == "alice" and tenant_of(seeds["buyer.nk"]) == ""
    assert '"bourse.v1.tenant.alice.order.*"' in conf
    fleet_key = public_key_of(seeds["supplier-fleet-fra.nk"].read_text())
    trust = json.loads((out / "trust.json").read_text())["workers"]
    assert trust == {
        "fra-1": fleet_key,
        "fra-2": fleet_key,
        "mad-1": public_key_of(seeds["supplier-mad-1.nk"].read_text()),
    }
    assert (out / "server.conf").read_text().count("include") == 2
    assert (out / "tls" / "supplier-fleet-fra-key.pem").stat().st_mode & 0o777 == 0o600

    # the printed run line starts a server with JetStream, and the fleet's user connects
    # over mutual TLS
    [run_line] = [ln for ln in stdout.splitlines() if ln.startswith("run: nats-server ")]
    run_args = shlex.split(run_line)[2:]
    with EmbeddedNats(workdir=tmp_path / "nats", extra_args=run_args, jetstream=False) as srv:
        nc = await connect(
            srv.url,
            name="fleet",
            creds=str(seeds["supplier-fleet-fra.nk"]),
            service=False,
            tls_ca=str(out / "tls" / "ca.pem"),
            tls_cert=str(out / "tls" / "supplier-fleet-fra.pem"),
            tls_key=str(out / "tls" / "supplier-fleet-fra-key.pem"),
        )
        await flush_all(nc)
        assert await jetstream_available(nc)
        await nc.close()

    old_buyer = public_key_of(seeds["buyer.nk"].read_text())
    code, _, err = await run_module(*init)
    assert code == 1 and "auth.conf exists: pass --force" in err
    code, _, _ = await run_module(*init, "--force")
    assert code == 0
    new_conf = (out / "auth.conf").read_text()
    assert old_buyer not in new_conf
    assert public_key_of(seeds["buyer.nk"].read_text()) in new_conf


def test_auth_init_bad_input(tmp_path: Path) -> None:
    base = ("auth", "init", "--out", str(tmp_path / "a"))
    code, _, err = run_cli(bourse, *base, "--worker", "mad-1")
    assert code == 1 and "--worker 'mad-1' must look like WORKER_ID=REGION" in err
    code, _, err = run_cli(bourse, *base, "--worker", "mad-1=mad", "--worker", "mad-1=fra")
    assert code == 1 and "two suppliers are named 'mad-1'" in err
    code, _, err = run_cli(bourse, *base)
    assert code == 1 and "no supplier given" in err
    code, _, err = run_cli(bourse, *base, "--worker", "mad-1=mad", "--buyer", "Alice")
    assert code == 1 and "invalid buyer name 'Alice'" in err
    code, _, err = run_cli(bourse, *base, "--worker", "mad-1=mad", "--buyer", "a", "--buyer", "a")
    assert code == 1 and "buyer 'a' is given twice" in err
    # the exchange's reserved event token: a supplier key for it could publish `unfilled`
    # outcomes as the exchange (and events no worker of that name could have)
    code, _, err = run_cli(bourse, *base, "--worker", "exchange=mad")
    assert code == 1 and "worker id 'exchange' is reserved" in err, err
    assert not (tmp_path / "a" / "auth.conf").exists()


async def test_programs_name_a_bad_credentials_trust_or_tls_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.creds"
    junk.write_text("not a key\n")
    nats = ("--nats", "nats://127.0.0.1:1")
    code, _, err = await run_module("exchange", "serve", *nats, "--creds", str(junk))
    assert code == 1
    assert err.strip() == (
        f"error: credentials file {junk} is neither a NATS .creds file (with a user JWT) nor "
        "an nkey seed file (one line starting with SU)"
    )
    code, _, err = await run_module("exchange", "serve", *nats, "--trust", str(tmp_path / "nope"))
    assert code == 1 and f"cannot read trust file {tmp_path / 'nope'}" in err
    sup = ("supplier", "run", "--worker-id", "w", "--region", "r", "--cpus", "1")
    code, _, err = await run_module(*sup, "--memory-mb", "1", *nats, "--tls-cert", str(junk))
    assert code == 1 and "--tls-cert and --tls-key go together" in err
    code, _, err = await run_module(
        "buyer_cli", "--tls-ca", str(junk), "fleet", "--region", "mad", *nats
    )
    assert code == 1 and f"cannot use CA file {junk}" in err
