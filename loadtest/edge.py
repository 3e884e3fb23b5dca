"""The ``edge`` scenario: what the edge costs over a direct request, and its throughput
beside nginx's reverse proxy, in one run.

One upstream (nginx serving a 6-byte static answer from one worker: an app that costs
next to nothing, so the proxies' own cost is what is measured), and in front of it, each on
a loopback port of its own:

- **direct**: the upstream itself;
- **edge**: ``edge serve`` (``processes`` of them on one port, SO_REUSEPORT), routing
  ``web.localhost`` to the upstream from a routes file, its access log off;
- **nginx**: Debian's nginx as a reverse proxy with as many worker processes, its access
  log off, keep-alive to the upstream (``keepalive 64``, HTTP/1.1), setting
  X-Forwarded-For and -Proto and adding a response header, as the edge does.

``wrk`` (Debian's) drives each the same way, the three alternated for ``rounds`` rounds so
that all see the same machine: one connection for ``latency_s`` (the p50 of a request
with nothing queued: the overhead), then ``connections`` connections for ``duration_s``
(requests a second at saturation, and the CPU the proxy's processes used a request). The
report gives each arm's median over the rounds, the edge's p50 over direct (target <= 1 ms),
its throughput over nginx's (target >= 0.5), and nginx's CPU a request over the edge's (what
that ratio would be with a core each: on a machine others load, the raw throughputs follow
the CPU each process happens to get).

``python -m loadtest.edge --help``; ``bourse loadtest --scenario edge``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
from rich.table import Table

from bourse.errors import BourseError
from bourse.runtime.endpoint import free_port
from bourse.runtime.launcher import Program, start_program, stop_all
from loadtest.runner import fresh_run_dir

Say = Callable[[str], None]
HOST = "127.0.0.1"
APP_HOST = "web.localhost"
BODY = "hello\n"
READY_S = 30.0
ARMS = ("direct", "edge", "nginx")
# The targets of issue 38 (docs/performance.md).
OVERHEAD_TARGET_MS = 1.0
RATIO_TARGET = 0.5


class EdgeRunError(BourseError):
    pass


@dataclass(frozen=True, slots=True)
class EdgeProfile:
    processes: int = 1  # edge processes on one port, and nginx's worker processes
    connections: int = 64  # wrk's connections in the throughput runs
    threads: int = 1  # wrk's threads
    duration_s: float = 10.0  # each throughput run
    latency_s: float = 5.0  # each one-connection run
    rounds: int = 3  # each arm measured this many times, alternated


@dataclass(slots=True)
class Arm:
    """One way to the upstream, and what wrk measured through it."""

    name: str
    address: str
    p50_ms: list[float] = field(default_factory=list)  # one connection
    rps: list[float] = field(default_factory=list)  # at saturation
    sat_p50_ms: list[float] = field(default_factory=list)
    sat_p99_ms: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)  # the proxy's CPU per request
    errors: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # the processes whose CPU is counted


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    if found is None:
        raise EdgeRunError(f"the edge scenario needs {name} (Debian package {name})")
    return found


def nginx_conf(directory: Path, name: str, listen: int, workers: int, upstream: int | None) -> Path:
    """An nginx config of its own in ``directory``: a static answer (``upstream`` None) or a
    reverse proxy to ``127.0.0.1:upstream``."""
    temp = directory / f"{name}-temp"
    temp.mkdir(parents=True, exist_ok=True)
    if upstream is None:
        serve = 'location / { return 200 "hello\\n"; }'  # BODY, as nginx escapes it
        pool = ""
    else:
        pool = f"upstream app {{ server {HOST}:{upstream}; keepalive 64; }}"
        serve = (
            "location / { proxy_pass http://app; proxy_http_version 1.1; "
            'proxy_set_header Connection ""; proxy_set_header X-Forwarded-For $remote_addr; '
            "proxy_set_header X-Forwarded-Proto $scheme; add_header Bourse-Machine m1; }"
        )
    text = f"""
worker_processes {workers};
daemon off;
pid {directory}/{name}.pid;
error_log {directory}/{name}.error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {temp}/body;
  proxy_temp_path {temp}/proxy;
  fastcgi_temp_path {temp}/fastcgi;
  uwsgi_temp_path {temp}/uwsgi;
  scgi_temp_path {temp}/scgi;
  keepalive_requests 1000000;
  {pool}
  server {{ listen {HOST}:{listen}; {serve} }}
}}
"""
    path = directory / f"{name}.conf"
    path.write_text(text)
    return path


async def start_nginx(conf: Path, port: int, log: Path) -> asyncio.subprocess.Process:
    """nginx in the foreground with ``conf``; returns once ``port`` takes connections."""
    with log.open("ab") as out:
        proc = await asyncio.create_subprocess_exec(
            tool("nginx"), "-c", str(conf), "-p", str(conf.parent),
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
        )  # fmt: skip
    deadline = time.monotonic() + READY_S
    while True:
        if proc.returncode is not None:
            tail = (await anyio.Path(log).read_text())[-500:]
            raise EdgeRunError(f"nginx ({conf.name}) exited: {tail}")
        try:
            await (await anyio.connect_tcp(HOST, port)).aclose()
            return proc
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise EdgeRunError(f"nginx ({conf.name}) did not listen on {port}") from None
            await anyio.sleep(0.01)  # a pace while it starts


_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def parse_wrk(text: str) -> dict[str, float]:
    """wrk --latency's output -> rps, p50_ms, p99_ms (and errors: non-2xx, socket)."""
    out: dict[str, float] = {}
    if m := re.search(r"Requests/sec:\s+([\d.]+)", text):
        out["rps"] = float(m.group(1))
    if m := re.search(r"^\s+(\d+) requests in", text, re.MULTILINE):
        out["requests"] = float(m.group(1))
    for pct, key in (("50", "p50_ms"), ("99", "p99_ms")):
        if m := re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", text, re.MULTILINE):
            out[key] = float(m.group(1)) * _UNITS[m.group(2)]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    out["errors"] = float(bad.group(1)) if bad else 0.0
    out["errors"] += sum(float(g) for g in sock.groups()) if sock else 0.0
    return out


async def wrk(address: str, connections: int, threads: int, seconds: float) -> dict[str, float]:
    proc = await asyncio.create_subprocess_exec(
        tool("wrk"), f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s",
        "--latency", "-H", f"Host: {APP_HOST}", f"http://{address}/",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    text = (await proc.communicate())[0].decode(errors="replace")
    got = parse_wrk(text)
    if proc.returncode != 0 or "rps" not in got or "p50_ms" not in got:
        raise EdgeRunError(f"wrk against {address} failed: {text[-500:]}")
    return got


async def check(address: str) -> None:
    """One request through ``address`` answers the upstream's body (the arms are wired)."""
    reader, writer = await asyncio.open_connection(*address.rsplit(":", 1))
    try:
        writer.write(f"GET / HTTP/1.1\r\nHost: {APP_HOST}\r\nConnection: close\r\n\r\n".encode())
        answer = await reader.read()
    finally:
        writer.close()
    if not answer.startswith(b"HTTP/1.1 200") or not answer.endswith(BODY.encode()):
        raise EdgeRunError(f"{address} did not answer the upstream's 200: {answer[:200]!r}")


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user and system) the processes ``pids`` have used so far."""
    import psutil

    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def workers_of(master: int) -> list[int]:
    """nginx's worker processes (the master only watches them)."""
    import psutil

    return [c.pid for c in psutil.Process(master).children()]


async def measure(arms: list[Arm], profile: EdgeProfile, say: Say) -> None:
    for n in range(profile.rounds):
        for arm in arms:
            one = await wrk(arm.address, 1, 1, profile.latency_s)
            before = cpu_s(arm.pids)
            sat = await wrk(arm.address, profile.connections, profile.threads, profile.duration_s)
            used = cpu_s(arm.pids) - before
            if sat.get("requests"):
                arm.cpu_us.append(used / sat["requests"] * 1e6)
            arm.p50_ms.append(one["p50_ms"])
            arm.rps.append(sat["rps"])
            arm.sat_p50_ms.append(sat["p50_ms"])
            arm.sat_p99_ms.append(sat.get("p99_ms", 0.0))
            if one["errors"] or sat["errors"]:
                arm.errors.append(f"round {n + 1}: {one['errors'] + sat['errors']:.0f} errors")
            say(
                f"round {n + 1} {arm.name}: p50 {one['p50_ms']:.3f} ms (1 connection), "
                f"{sat['rps']:.0f} requests/s ({profile.connections} connections), "
                f"{used / max(sat.get('requests', 1), 1) * 1e6:.1f} us of CPU a request"
            )


def prepare(out: Path) -> Path:
    """The run's directory made afresh; the absolute path of its nginx configs (nginx
    reads a relative path from its prefix)."""
    fresh_run_dir(out)
    conf_dir = Path(os.path.abspath(out)) / "nginx"
    conf_dir.mkdir(parents=True, exist_ok=True)
    return conf_dir


async def run_edge(profile: EdgeProfile, out: Path, say: Say) -> dict[str, Any]:
    conf_dir = prepare(out)
    taken: list[int] = []

    def port() -> int:
        taken.append(free_port(HOST, 28000, taken))
        return taken[-1]

    up_port, edge_port, px_port = port(), port(), port()
    nginxes: list[asyncio.subprocess.Process] = []
    edges: list[Program] = []
    try:
        nginxes.append(
            await start_nginx(
                nginx_conf(conf_dir, "upstream", up_port, 1, None), up_port, conf_dir / "up.log"
            )
        )
        nginxes.append(
            await start_nginx(
                nginx_conf(conf_dir, "proxy", px_port, profile.processes, up_port),
                px_port,
                conf_dir / "proxy.log",
            )
        )
        routes = out / "routes.json"
        machine = {"id": "m1", "region": "edge", "addresses": {"http": f"{HOST}:{up_port}"}}
        routes.write_text(json.dumps({"apps": [{"app": "web", "machines": [machine]}]}))
        for i in range(profile.processes):
            edges.append(
                await start_program(
                    "edge", "serve", "--listen", f"{HOST}:{edge_port}", "--routes", str(routes),
                    "--no-access-log", "--log-level", "warning",
                    log_path=out / "logs" / f"edge-{i}.log", ready="edge serving on",
                )
            )  # fmt: skip
        arms = [
            Arm("direct", f"{HOST}:{up_port}", pids=workers_of(nginxes[0].pid)),
            Arm("edge", f"{HOST}:{edge_port}", pids=[p.proc.pid for p in edges]),
            Arm("nginx", f"{HOST}:{px_port}", pids=workers_of(nginxes[1].pid)),
        ]
        for arm in arms:
            await check(arm.address)
        say(f"upstream {HOST}:{up_port}; edge x{profile.processes}; nginx x{profile.processes}")
        await measure(arms, profile, say)
    finally:
        await stop_all(edges)
        for proc in nginxes:
            if proc.returncode is None:
                proc.terminate()
                await proc.wait()
    rep = report(profile, arms)
    (out / "report.json").write_bytes(msgspec.json.format(msgspec.json.encode(rep)))
    return rep


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else 0.0


def report(profile: EdgeProfile, arms: list[Arm]) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {
        a.name: {
            "p50_ms": _median(a.p50_ms),
            "rps": round(_median(a.rps)),
            "saturated_p50_ms": _median(a.sat_p50_ms),
            "saturated_p99_ms": _median(a.sat_p99_ms),
            "cpu_us_per_request": _median(a.cpu_us),
            "rounds": {"p50_ms": a.p50_ms, "rps": a.rps, "cpu_us": a.cpu_us},
            "errors": a.errors,
        }
        for a in arms
    }
    direct, edge, nginx = rows["direct"], rows["edge"], rows["nginx"]
    overhead = round(edge["p50_ms"] - direct["p50_ms"], 3)
    ratio = round(edge["rps"] / nginx["rps"], 3) if nginx["rps"] else 0.0
    return {
        "scenario": "edge",
        "profile": asdict(profile),
        "arms": rows,
        "edge_over_direct_p50_ms": overhead,
        "nginx_over_direct_p50_ms": round(nginx["p50_ms"] - direct["p50_ms"], 3),
        "edge_over_nginx_rps": ratio,
        # nginx's CPU a request over the edge's: the throughput ratio each would reach on a
        # core of its own (the load-independent figure on a shared machine)
        "nginx_over_edge_cpu": round(nginx["cpu_us_per_request"] / edge["cpu_us_per_request"], 3)
        if edge["cpu_us_per_request"]
        else 0.0,
        "overhead_met": overhead <= OVERHEAD_TARGET_MS,
        "ratio_met": ratio >= RATIO_TARGET,
    }


def table(rep: dict[str, Any]) -> Table:
    p = rep["profile"]
    t = Table(
        title=f"edge: {p['processes']} edge process(es) against nginx with as many workers, "
        f"median of {p['rounds']} rounds"
    )
    columns = ("arm", "p50 (1 conn)", f"requests/s ({p['connections']} conns)", "p50", "p99")
    for column in (*columns, "CPU/request"):
        t.add_column(column, justify="right")
    for name, a in rep["arms"].items():
        t.add_row(
            name,
            f"{a['p50_ms']:.3f} ms",
            f"{a['rps']}",
            f"{a['saturated_p50_ms']:.2f} ms",
            f"{a['saturated_p99_ms']:.2f} ms",
            f"{a['cpu_us_per_request']:.1f} us",
        )
    t.caption = (
        f"edge p50 over direct: {rep['edge_over_direct_p50_ms']:.3f} ms (target <= "
        f"{OVERHEAD_TARGET_MS} ms: {'met' if rep['overhead_met'] else 'NOT met'}); edge/nginx "
        f"throughput: {rep['edge_over_nginx_rps']:.2f} (target >= {RATIO_TARGET}: "
        f"{'met' if rep['ratio_met'] else 'NOT met'}); nginx's CPU a request over the "
        f"edge's: {rep['nginx_over_edge_cpu']:.2f}"
    )
    return t


def profile_of(given: dict[str, Any]) -> EdgeProfile:
    names = {"concurrency": "connections"}
    fields = {names.get(k, k): v for k, v in given.items()}
    return EdgeProfile(**{k: v for k, v in fields.items() if k in EdgeProfile.__dataclass_fields__})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.edge", description=__doc__)
    d = EdgeProfile()
    parser.add_argument("--processes", type=int, default=d.processes, help="edge processes")
    parser.add_argument("--connections", type=int, default=d.connections)
    parser.add_argument("--threads", type=int, default=d.threads)
    parser.add_argument("--duration-s", type=float, default=d.duration_s)
    parser.add_argument("--latency-s", type=float, default=d.latency_s)
    parser.add_argument("--rounds", type=int, default=d.rounds)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    profile = EdgeProfile(
        args.processes, args.connections, args.threads, args.duration_s, args.latency_s,
        args.rounds,
    )  # fmt: skip
    out = args.out or Path(".bourse") / "loadtest" / f"edge-{time.strftime('%Y%m%d-%H%M%S')}"
    from bourse.client import render
    from bourse.runtime.supervise import run

    say: Say = (lambda _: None) if args.json else render.console.print
    try:
        rep = run(lambda: run_edge(profile, out, say))
    except EdgeRunError as exc:
        sys.exit(f"error: {exc}")
    if args.json:
        print(json.dumps(rep))
    else:
        render.console.print(table(rep))
        render.console.print(f"report: {out / 'report.json'}")


if __name__ == "__main__":
    main()
