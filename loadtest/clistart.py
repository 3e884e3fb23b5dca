"""How long a command line takes to answer, from outside: each program's help and version,
and with ``--nats URL`` a ``buyer place`` on that market (the walk-through's order: 1 CPU,
64 MiB of image ``web`` in region ``mad``; its machines carry ``app=clistart`` and are
destroyed at the end). Each command runs ``--runs`` times after one run not counted, as a
person runs it (the installed console script), with the bytecode cache on as an install
has it (``PYTHONDONTWRITEBYTECODE`` left out of the environment); the report gives wall and
CPU time (median, p90, max) and, from one ``python -X importtime`` run of each, the
packages that cost the most to import.

    python -m loadtest.clistart                         # help and version only
    python -m loadtest.clistart --nats nats://127.0.0.1:4222 --runs 30
    python -m loadtest.clistart --json

docs/performance.md gives the current figures; tests/integration/test_cli_start.py holds
what a help may import."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

BIN = Path(sys.executable).parent  # the console scripts of this install
HELP = [
    ["buyer", "--help"],
    ["buyer", "--version"],
    ["buyer", "place", "--help"],
    ["bourse", "--help"],
    ["supplier", "--help"],
    ["exchange", "--help"],
]
APP = "clistart"
PLACE = ["buyer", "place", "--region", "mad", "--cpus", "1", "--memory-mb", "64"]
PLACE += ["--image", "web", "--meta", f"app={APP}"]
TOP = 8  # packages listed by their import cost
TIDY_EVERY = 20  # placements between two destroys of their machines (1 CPU each)


@dataclass
class Figures:
    """One command's runs: seconds of wall and CPU time (user + system) per run."""

    command: str
    runs: int
    wall_p50: float
    wall_p90: float
    wall_max: float
    cpu_p50: float
    imports_ms: dict[str, float]  # the costliest top-level packages, self time summed


def _environ(nats: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if nats:
        env["BOURSE_NATS_URL"] = nats
    return env


def _once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """One run: its wall and CPU seconds (the child's own, from the kernel)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([str(BIN / argv[0]), *argv[1:]], env=env, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.decode()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def imports(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    """The top-level packages that cost most to import in one run, ms of self time summed
    (``python -X importtime``; a module's own time, its imports apart), and ``(all)``."""
    script = [sys.executable, "-X", "importtime", str(BIN / argv[0]), *argv[1:]]
    err = subprocess.run(script, env=env, capture_output=True, text=True).stderr
    us: Counter[str] = Counter()
    for line in err.splitlines():
        fields = line.removeprefix("import time:").split("|")
        if len(fields) == 3 and fields[0].strip().isdigit():
            us[fields[2].strip().split(".")[0]] += int(fields[0])
    top = {name: round(n / 1000, 1) for name, n in us.most_common(TOP)}
    return {"(all)": round(us.total() / 1000, 1), **top}


def _tidy(env: dict[str, str]) -> None:
    """Destroy the machines the orders placed (not timed)."""
    destroy = ["machines", "destroy", "--app", APP, "--yes"]
    subprocess.run([str(BIN / "buyer"), *destroy], env=env, capture_output=True)


def measure(argv: list[str], runs: int, env: dict[str, str]) -> Figures:
    _once(argv, env)  # the first run writes the bytecode cache; not counted
    times = []
    for i in range(runs):
        times.append(_once(argv, env))
        if argv is PLACE and i % TIDY_EVERY == TIDY_EVERY - 1:
            _tidy(env)
    walls, cpus = zip(*times, strict=True)
    p90 = statistics.quantiles(walls, n=10, method="inclusive")[-1] if runs > 1 else walls[0]
    return Figures(
        " ".join(argv),
        runs,
        statistics.median(walls),
        p90,
        max(walls),
        statistics.median(cpus),
        imports(argv, env),
    )


def _table(rows: list[Figures]) -> str:
    lines = [f"{'command':<44} {'wall p50':>9} {'p90':>7} {'max':>7} {'cpu p50':>8}  imports"]
    for r in rows:
        top = ", ".join(f"{n} {ms:g}" for n, ms in list(r.imports_ms.items())[:5])
        name = r.command if len(r.command) <= 44 else r.command[:41] + "..."
        lines.append(
            f"{name:<44} {r.wall_p50 * 1000:>7.0f}ms {r.wall_p90 * 1000:>5.0f}ms "
            f"{r.wall_max * 1000:>5.0f}ms {r.cpu_p50 * 1000:>6.0f}ms  {top} (ms)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.clistart", description=__doc__)
    parser.add_argument("--runs", type=int, default=20, help="runs of each command (20)")
    parser.add_argument("--nats", help="a market up (bourse up): also time buyer place there")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    env = _environ(args.nats)
    commands = HELP + ([PLACE] if args.nats else [])
    try:
        rows = [measure(c, max(args.runs, 1), env) for c in commands]
    finally:
        if args.nats:  # the orders' machines, whatever happened
            _tidy(env)
    print(json.dumps([asdict(r) for r in rows]) if args.json else _table(rows))


if __name__ == "__main__":
    main()
