"""The README's walk-through, run as written: ``bourse up`` in one process, then every
``buyer`` line of the walk-through in order as a real subprocess (stdout not a terminal,
as a newcomer's pipe or script), asserting the exact lines and exit codes it shows."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import pytest

from bourse.runtime.launcher import start_program, stop_all
from tests.isolation import ONE_DEMO_FLEET_AT_A_TIME

pytestmark = ONE_DEMO_FLEET_AT_A_TIME

ID = r"[a-z0-9-]+~[0-9A-Z]+"


async def run(url: str, module: str, *args: str) -> tuple[int, str, str]:
    """``python -m module args`` with the walk-through's BOURSE_NATS_URL; stdin is not a
    terminal (a script)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "BOURSE_NATS_URL": url},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def buyer(url: str, *args: str) -> tuple[int, str, str]:
    return await run(url, "buyer_cli", *args)


def rows(out: str) -> list[list[str]]:
    """A plain table's data lines, split on runs of two or more spaces."""
    return [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()[1:] if line.strip()]


@pytest.mark.slow
async def test_the_readme_walk_through_works_as_written(tmp_path: Path) -> None:
    up = await start_program(
        "ops.cli",
        *("up", "--port", "-1", "--data-dir", str(tmp_path / "up")),
        # metrics on free ports: `up`'s 9464 and up may be another test's at the same moment
        *("--metrics-addr", "127.0.0.1:0"),
        log_path=tmp_path / "up.log",
        ready="BOURSE_NATS_URL=",
    )
    url = up.ready_line.split("=", 1)[1].strip()
    try:
        await _walk_through(url)
    finally:
        await stop_all([up])


async def _walk_through(url: str) -> None:
    # buyer place --region mad --cpus 2 --memory-mb 1024 --image web --start
    code, out, err = await buyer(
        url, "place", "--region", "mad", "--cpus", "2", "--memory-mb", "1024", "--image", "web",
        "--start",
    )  # fmt: skip
    assert (code, err) == (0, ""), out + err
    lines = out.splitlines()
    placed = re.fullmatch(rf"placed ({ID}) on (mad-\d) \(mad\)", lines[0])
    assert placed is not None, out
    machine, on = placed.groups()
    assert on == "mad-1"  # the best score in the demo fleet, as the README shows
    assert re.fullmatch(r"  score 0\.951  cpus=0\.875 memory_mb=0\.984375 \S+ image=1", lines[1])
    if os.geteuid() == 0:  # a root supplier gives each machine a network of its own
        assert re.fullmatch(r"  private address: 10\.\d+\.\d+\.\d+", lines[3]), out
    assert lines[-1] == f"  machine {machine} is started"

    # buyer machines logs <id>
    code, out, err = await buyer(url, "machines", "logs", machine)
    assert (code, err) == (0, ""), out + err

    # buyer machines exec <id> -- id -u: the machine's user; the command's exit code is buyer's
    code, out, err = await buyer(url, "machines", "exec", machine, "--", "id", "-u")
    assert (code, err) == (0, "") and out.strip().isdigit(), out + err
    if os.geteuid() == 0:  # a root supplier gives each machine users of its own
        assert out.strip() != "0", out
    code, out, err = await buyer(url, "machines", "exec", machine, "--", "sh", "-c", "exit 3")
    assert (code, out, err) == (3, "", ""), out + err

    # buyer place --region mad --cpus 64 --memory-mb 64 --image web ; exit 2
    code, out, err = await buyer(
        url, "place", "--region", "mad", "--cpus", "64", "--memory-mb", "64", "--image", "web"
    )
    assert (code, err) == (2, "")
    assert out.splitlines()[0] == (
        "unfilled (no_offers) in mad: no worker in 'mad' took 64 cpus + 64 MiB of image 'web': "
        "not enough free capacity on mad-1, mad-2, mad-3 and 1 more "
        "(mad-1: cpus: wants 64, free 14 (capacity 16, committed 2, held 0))"
    )
    assert re.fullmatch(r"  offers 0, commits tried 0, elapsed [\d.]+ ms", out.splitlines()[1])

    # an image no worker serves is said so, named (not "no capacity")
    code, out, err = await buyer(
        url, "place", "--region", "sjc", "--cpus", "1", "--memory-mb", "128",
        "--image", "nosuchimage",
    )  # fmt: skip
    assert (code, err) == (2, "")
    assert out.splitlines()[0] == (
        "unfilled (no_offers) in sjc: no worker in 'sjc' took 1 cpus + 128 MiB of image "
        "'nosuchimage': no worker serves image 'nosuchimage'"
    )

    # --dry-run
    code, out, err = await buyer(
        url, "place", "--region", "mad", "--cpus", "4", "--memory-mb", "4096", "--image", "api",
        "--label", "disk=ssd", "--dry-run",
    )  # fmt: skip
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "worker  verdict      score  why"
    assert [r[:2] for r in rows(out) if r[0].startswith("mad-")] == [
        ["mad-1", "would win"],
        ["mad-3", "would offer"],
        ["mad-2", "declines"],
        ["mad-4", "declines"],
    ]
    assert "mad-2   declines     -      label disk: wants 'ssd', has 'hdd'" in lines
    assert "mad-4   declines     -      label disk: wants 'ssd', missing" in lines
    assert re.fullmatch(r"would place on mad-1; 2 would offer, 2 declines; [\d.]+ ms", lines[-1])

    # --explain
    code, out, err = await buyer(
        url, "place", "--region", "mad", "--cpus", "64", "--memory-mb", "64", "--image", "web",
        "--explain",
    )  # fmt: skip
    assert (code, err) == (2, "")
    assert (
        "mad-1   declines  -      cpus: wants 64, free 14 (capacity 16, committed 2, held 0)"
        in out.splitlines()
    )

    # deploy: a primary and a spare in each region, on distinct workers
    deploy = (
        "deploy", "--app", "shop", "--region", "mad", "--region", "fra", "--count", "1",
        "--spares", "1", "--cpus", "2", "--memory-mb", "1024", "--image", "web",
    )  # fmt: skip
    code, out, err = await buyer(url, *deploy)
    assert (code, err) == (0, ""), out + err
    assert re.split(r"\s{2,}", out.splitlines()[0]) == [
        "region", "slot", "role", "action", "result", "machine", "worker", "detail",
    ]  # fmt: skip
    slots = {(r[0], r[2]): r for r in rows(out)}
    assert sorted(slots) == [("fra", "primary"), ("fra", "spare"), ("mad", "primary"),
                             ("mad", "spare")]  # fmt: skip
    assert {(r[3], r[4]) for r in slots.values()} == {("create", "done")}
    assert all(re.fullmatch(ID, r[5]) for r in slots.values())  # whole ids
    assert len({r[6] for r in slots.values()}) == 4
    primary, spare = slots["mad", "primary"][5], slots["mad", "spare"]

    # failover: without --force it says why not (the worker answers), with it: as the README
    failover = ("failover", "--app", "shop", "--machine", primary, "--region", "mad")
    code, out, err = await buyer(url, *failover)
    assert (code, out) == (1, "")
    worker_of = primary.split("~")[0]
    assert err == (
        f"error: worker {worker_of} still answers; nothing to fail over (use --force to stop "
        "the machine and start a spare anyway)\n"
    )
    code, out, err = await buyer(url, *failover, "--force")
    assert (code, err) == (0, ""), out + err
    lines = out.splitlines()
    assert lines[0] == f"started spare {spare[5]} on {spare[6]} (mad) in place of {primary}"
    assert lines[1] == f"stopped {primary} (its worker still answers: --force)"
    refill = re.fullmatch(rf"new spare ({ID}) on (mad-\d) \(mad\)", lines[2])
    assert refill is not None, out
    assert len(lines) == 3

    # a re-run of deploy keeps one running in each region: the started spare is mad's
    # primary now, the new spare is kept and the stopped machine goes (one spare, as asked)
    code, out, err = await buyer(url, *deploy, "--json")
    assert code == 0, err
    again = {
        (s["region"], s["role"], s["action"]): s["machine_id"] for s in json.loads(out)["slots"]
    }
    assert again == {
        ("mad", "spare", "destroy"): primary,
        ("mad", "primary", "keep"): spare[5],
        ("mad", "spare", "keep"): refill.group(1),
        ("fra", "primary", "keep"): slots["fra", "primary"][5],
        ("fra", "spare", "keep"): slots["fra", "spare"][5],
    }

    # fleet: every worker of every region, whole ids, no --region needed (from the view)
    code, out, err = await buyer(url, "fleet")
    assert (code, err) == (0, "")
    assert re.split(r"\s{2,}", out.splitlines()[0]) == [
        "region", "worker", "cpus", "mem MiB", "machines", "cache", "labels", "state",
        "driver", "confined", "isolated", "version",
    ]  # fmt: skip
    assert [(r[0], r[1]) for r in rows(out)] == [
        ("fra", "fra-1"), ("fra", "fra-2"), ("fra", "fra-3"),
        ("mad", "mad-1"), ("mad", "mad-2"), ("mad", "mad-3"), ("mad", "mad-4"),
        ("sjc", "sjc-1"), ("sjc", "sjc-2"),
    ]  # fmt: skip

    # machines list --app shop: its machines in every region, sorted, whole ids
    code, out, err = await buyer(url, "machines", "list", "--app", "shop")
    assert (code, err) == (0, ""), out + err
    assert re.split(r"\s{2,}", out.splitlines()[0]) == [
        "machine", "worker", "region", "state", "cpus", "memory MiB", "image", "age",
        "restarts", "health", "addresses", "app",
    ]  # fmt: skip
    listed = rows(out)
    assert len(listed) == 4 and all(re.fullmatch(ID, r[0]) for r in listed)
    assert [(r[2], r[1]) for r in listed] == sorted((r[2], r[1]) for r in listed)
    assert {r[2] for r in listed} == {"fra", "mad"} and {r[-1] for r in listed} == {"shop"}
    assert sorted(r[3] for r in listed) == ["reserved", "reserved", "started", "started"]

    # machines restart --app shop: the app's running machines (its spares left as they are)
    code, out, err = await buyer(url, "machines", "restart", "--app", "shop", "--json")
    assert (code, err) == (0, ""), out + err
    restarted = json.loads(out)["machines"]
    assert sorted((m["region"], m["state"]) for m in restarted) == [
        ("fra", "started"), ("mad", "started"),
    ]  # fmt: skip

    # watch --since 15m: order outcomes (placed and unfilled) as well as machine events
    code, out, err = await buyer(
        url, "watch", "--since", "15m", "--kind", "unfilled", "--count", "3"
    )
    assert code == 0, err
    assert err.startswith("watching ") and "replaying from" in err
    outcomes = out.splitlines()
    assert len(outcomes) == 3
    assert all(
        re.search(r"  unfilled +(mad|sjc)  exchange  order=\S+  no_offers: ", o) for o in outcomes
    )
    assert "no worker in 'sjc' offered 1 cpus + 128 MiB of image 'nosuchimage'" in outcomes[1]
    code, out, err = await buyer(url, "watch", "--since", "15m", "--count", "1", "--json")
    assert code == 0, err
    first = json.loads(out)
    assert (first["kind"], first["machine_id"]) == ("placed", machine)

    # machines destroy --app shop: a script without --yes is refused in one line
    code, out, err = await buyer(url, "machines", "destroy", "--app", "shop")
    assert (code, out) == (1, "")
    assert err == (
        "error: destroy 4 machine(s) of app 'shop': not confirmed (no terminal to ask on); "
        "pass --yes\n"
    )
    code, out, err = await buyer(url, "machines", "destroy", "--app", "shop", "--yes")
    # the deploy kept the app's spec: said, with how to remove it
    spec_stays = (
        "app 'shop': its spec stays (buyer apps list; a deploy places its machines again): "
        "buyer apps destroy shop removes it\n"
    )
    assert (code, err) == (0, spec_stays)
    gone = rows(out)
    assert len(gone) == 4 and {r[2] for r in gone} == {"destroyed"}
    assert {r[1].split(".")[0] for r in gone} == {"shop"}  # the app's order ids
    code, out, err = await buyer(url, "machines", "destroy", "--app", "shop", "--yes")
    nothing = "app 'shop' has no live machines: nothing to destroy\n"
    assert (code, out, err) == (0, nothing, spec_stays)

    # bourse demo --nats $BOURSE_NATS_URL: the scripted batch, cleaned up after
    code, out, err = await run(url, "ops.cli", "demo", "--nats", url)
    assert code == 0, err
    code, out, err = await buyer(url, "fleet", "--json", "--fresh")  # the workers say
    mad1 = next(s for s in json.loads(out)["workers"] if s["worker_id"] == "mad-1")
    assert mad1["committed"]["cpus"] == 2  # the first machine of the walk-through only
