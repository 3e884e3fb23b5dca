"""What a running machine costs, for the starts scenario (loadtest/starts.py): its shim's
memory (the proportional set size of every shim, read from ``/proc/<pid>/smaps_rollup``,
with ``n`` machines started at once) and one request's time on a connection of its own
(through a machine's published port, its private address, the host's routable address).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec

from bourse.client import BourseClient
from bourse.wire.messages import Placed, PlaceOrder, Resources


def get_ms(host: str, port: int) -> float:
    """One small GET on a connection of its own: ms to the whole response."""
    began = time.perf_counter()
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        while sock.recv(65536):
            pass
    return (time.perf_counter() - began) * 1000


def primary_address() -> str:
    """The host's address on its default route (no packet is sent), or "" without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
            return str(s.getsockname()[0])
        except OSError:
            return ""


def pss_kib(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return None


def shim_pids(shims_dir: Path) -> list[int]:
    pids = []
    for state in shims_dir.glob("*/state.json"):
        try:
            pids.append(int(msgspec.json.decode(state.read_bytes())["shim_pid"]))
        except (OSError, msgspec.DecodeError, KeyError, TypeError, ValueError):
            continue
    return pids


async def memory(
    client: BourseClient, n: int, shims_dir: Path, region: str, say: Callable[[str], None]
) -> dict[str, Any]:
    """``n`` machines at once on the process worker of ``region``: each shim's PSS (KiB)."""
    say(f"{n} machines at once for the shims' memory...")
    ids: list[str] = []

    async def one() -> None:
        order = PlaceOrder(
            region=region,
            # a quarter of a CPU each: 100 fit on the worker's 64 CPUs
            resources=Resources(cpus=1, cpu_millis=250, memory_mb=64),
            image="sleeper:latest",
            constraints={"kind": "process"},
        )
        placed = await client.place(order)
        if isinstance(placed, Placed):
            ids.append(placed.machine_id)
            await client.machine("start", placed.machine_id)

    try:
        async with anyio.create_task_group() as tasks:
            for _ in range(n):
                tasks.start_soon(one)
        pss = [p for p in (pss_kib(pid) for pid in shim_pids(shims_dir)) if p is not None]
    finally:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tasks:
                for mid in ids:
                    tasks.start_soon(client.machine, "destroy", mid)
    pss.sort()
    return {
        "machines": len(ids),
        "shims": len(pss),
        "pss_kib_mean": round(sum(pss) / len(pss)) if pss else None,
        "pss_kib_p50": pss[len(pss) // 2] if pss else None,
        "pss_kib_max": pss[-1] if pss else None,
    }
