"""A command line answers at once: help and --version import nothing of NATS, the auction,
cryptography, rich or pydantic, and an order through the exchange loads neither the auction
nor cryptography (no --creds) nor pydantic (typer's conversion: bourse/runtime/coercion.py).

Each command runs in an interpreter of its own (a subprocess of this Python) that then
writes down every module it imported: what one must not load is a list, so the test is
deterministic where a timed one would not be. The times themselves are measured by
``python -m loadtest.clistart`` (docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import bourse
from bourse.nats.embedded import EmbeddedNats
from bourse.wire.subjects import Subjects

# Runs a program's console script (its ``main``) with the given arguments, then writes its
# exit code and the names of every module imported into the file named first.
PROBE = """
import json, sys
out, program, module, *args = sys.argv[1:]
sys.argv = [program, *args]
code = 0
try:
    __import__(module, fromlist=["main"]).main()
except SystemExit as done:
    code = done.code
with open(out, "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""
SCRIPTS = {"buyer": "buyer_cli.cli", "bourse": "ops.cli"}
# What no help may import: the client library and all it stands on.
HEAVY = ("nats", "bourse.auction", "bourse.client", "bourse.images", "cryptography", "nkeys")
HEAVY += ("rich", "pydantic", "structlog", "anyio", "msgspec", "ulid")


def run(tmp_path: Path, program: str, *args: str) -> tuple[int, str, str, list[str]]:
    """``program args`` in a fresh interpreter: its exit code, stdout and stderr, and the
    modules it imported."""
    out = tmp_path / "modules.json"
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(out), program, SCRIPTS[program], *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    got = json.loads(out.read_text())
    return got["code"], done.stdout, done.stderr, got["modules"]


def loaded(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in names or m.startswith(names)]


@pytest.mark.parametrize(
    "argv",
    [
        ["buyer", "--help"],
        ["buyer"],  # no command: the help
        ["buyer", "place", "--help"],
        ["buyer", "machines", "list", "--help"],
        ["buyer", "apps", "secrets", "set", "--help"],
        ["bourse", "--help"],
    ],
    ids=" ".join,
)
def test_help_imports_nothing_heavy(tmp_path: Path, argv: list[str]) -> None:
    code, out, _, modules = run(tmp_path, *argv)
    assert code == 0 and out.startswith("Usage: "), out
    assert loaded(modules, HEAVY) == []


@pytest.mark.parametrize("program", sorted(SCRIPTS))
def test_version_imports_nothing_heavy(tmp_path: Path, program: str) -> None:
    code, out, _, modules = run(tmp_path, program, "--version")
    assert code == 0 and out.split() == [program, bourse.__version__], out
    assert loaded(modules, HEAVY) == []


def test_an_order_loads_no_auction_no_cryptography_no_pydantic(
    tmp_path: Path, nats_server: EmbeddedNats, subjects: Subjects
) -> None:
    """Through the exchange (none here: the order is refused at once, after it was sent),
    without --creds: the auction, the image store, nkeys, cryptography and pydantic stay
    out. The refusal says the order reached NATS, so the whole path ran."""
    args = ["place", "--region", "mad", "--cpus", "1", "--memory-mb", "64", "--image", "web"]
    args += ["--nats", nats_server.url, "--prefix", subjects.prefix]
    code, _, err, modules = run(tmp_path, "buyer", *args)
    assert (code, err) == (1, f"error: no exchange is listening on {subjects.order('mad')}\n")
    assert "nats.aio.client" in modules and "bourse.client" in modules
    assert loaded(modules, ("bourse.auction", "bourse.images", "cryptography")) == []
    assert loaded(modules, ("nkeys", "nacl", "pydantic", "pydantic_core")) == []


async def _a_worker_beats(nats_server: EmbeddedNats, subjects: Subjects) -> None:
    """The state stream with one worker's row and its heartbeat (no machine): stream
    sequences 1 (the epoch) to 3."""
    from bourse.nats.connection import connect, shutdown
    from bourse.nats.state import StateStream, make_state_stream
    from bourse.wire.codec import encode
    from bourse.wire.messages import Amount, Heartbeat, WorkerRow, now_ms

    nc = await connect([nats_server.url], name="maker", service=False)
    try:
        js = nc.jetstream()
        await make_state_stream(js, StateStream.of(subjects))
        row = WorkerRow(worker_id="mad-1", region="mad", beat="mad-1", capacity=Amount(),
                        free=Amount())  # fmt: skip
        await js.publish(subjects.state_worker("mad", "mad-1"), encode(row))
        beat = Heartbeat(beat="mad-1", workers=["mad-1"], at_ms=now_ms())
        await js.publish(subjects.state_beat("mad", "mad-1"), encode(beat))
    finally:
        await shutdown(nc)


async def test_a_listing_from_the_view_loads_no_structlog_no_client(
    tmp_path: Path, nats_server: EmbeddedNats, subjects: Subjects
) -> None:
    """``machines list --json`` from the view (a worker that beats, no machine) loads
    neither structlog (nothing was logged), nor anyio's asyncio backend, nor the client's
    package: what it needs is NATS, the view and SQLite."""
    await _a_worker_beats(nats_server, subjects)
    args = ["machines", "list", "--json", "--nats", nats_server.url, "--prefix", subjects.prefix]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        code, out, err, modules = run(tmp_path, "buyer", *args)
    assert (code, err) == (0, "")
    listed = json.loads(out)
    assert (listed["machines"], listed["regions"], listed["gone"]) == ([], ["mad"], {})
    assert "bourse.view.view" in modules and "nats.aio.client" in modules
    assert loaded(modules, ("structlog", "anyio._backends", "bourse.client")) == []


async def test_a_view_caught_up_a_moment_ago_answers_without_nats(
    tmp_path: Path, nats_server: EmbeddedNats, subjects: Subjects
) -> None:
    """A listing caught up its view and stamped it (bourse/view/cache.py): the next one
    within BOURSE_VIEW_FRESH_MS (FRESH_MS, a second, unless set: here a minute, so that a
    loaded machine cannot make it late) reads it as it stands without nats-py, saying how
    old it is. A command that may change the market (any through the client: here
    ``--fresh``) removes the stamp, and the next listing catches up again; so does every
    one with BOURSE_VIEW_FRESH_MS=0."""
    await _a_worker_beats(nats_server, subjects)
    args = ["machines", "list", "--json", "--nats", nats_server.url, "--prefix", subjects.prefix]

    def listing() -> tuple[dict[str, int], bool]:
        code, out, err, modules = run(tmp_path, "buyer", *args)
        # its one heartbeat is 3 s old on a slow machine: then gone, and no region beats
        assert (code, err) in ((0, ""), (2, "no worker answers in any region\n")), err
        assert json.loads(out)["machines"] == []
        return json.loads(out)["view"], "nats.aio.client" in modules

    with pytest.MonkeyPatch.context() as env:
        env.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        env.setenv("BOURSE_VIEW_FRESH_MS", "60000")
        first, networked = listing()
        assert networked and first["seq"] == 3
        again, networked = listing()
        assert not networked and again["seq"] == 3 and again["age_ms"] >= first["age_ms"]
        code, _, err, _ = run(tmp_path, "buyer", *args, "--fresh")
        assert (code, err) == (2, "no worker answers in any region\n")  # none runs: it asked
        assert listing()[1]  # the stamp was removed: caught up
        assert not listing()[1]
        env.setenv("BOURSE_VIEW_FRESH_MS", "0")
        assert listing()[1]
        env.setenv("BOURSE_VIEW_FRESH_MS", "soon")
        code, _, err, _ = run(tmp_path, "buyer", *args)
        assert (code, err) == (1, "error: BOURSE_VIEW_FRESH_MS must be a number of "
                               "milliseconds (0: always catch up), not 'soon'\n")  # fmt: skip


def test_a_lazily_configured_log_imports_structlog_at_its_first_line_shown() -> None:
    """bourse/runtime/logs.py: with ``configure(lazy=True)`` a line below the level is
    dropped without structlog; the first one at the level imports it, configured."""
    probe = """
import sys
from bourse.runtime import logs
logs.configure("warning", lazy=True)
log = logs.get_logger("probe").bind(client="c")
log.info("hidden")
print("structlog" in sys.modules)
log.warning("shown", n=1)
log.debug("hidden")
print("structlog" in sys.modules)
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["False", "True"]
    assert "hidden" not in done.stderr
    assert "level='warning' event='shown' client='c' n=1" in done.stderr, done.stderr


@pytest.mark.slow
def test_the_benchmark_reports_each_command(tmp_path: Path) -> None:
    """``python -m loadtest.clistart`` (help and version; one run each): a figure per
    command and what its imports cost, as JSON. Its numbers are not judged here."""
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.clistart", "--runs", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = json.loads(done.stdout)
    assert [r["command"] for r in rows][:2] == ["buyer --help", "buyer --version"]
    for r in rows:
        assert r["runs"] == 1 and r["cpu_p50"] > 0 and 0 < r["wall_p50"] <= r["wall_max"]
        # the costliest packages, costliest first, within the whole (which they are is the
        # machine's: under load typer fell out of the top 8 of ~600 modules)
        top = [ms for name, ms in r["imports_ms"].items() if name != "(all)"]
        assert top and top == sorted(top, reverse=True), r
        assert 0 < sum(top) <= r["imports_ms"]["(all)"] + 0.1 * len(top), r
