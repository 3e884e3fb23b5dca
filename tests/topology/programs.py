"""Real supplier and exchange processes, connected to the cluster URLs they are given."""

from __future__ import annotations

from pathlib import Path

from buyer_cli.launcher import Program, start_program


async def supplier(
    urls: list[str], prefix: str, root: Path, worker_id: str, region: str, cpus: int
) -> Program:
    """One real supplier process serving one worker, connected with every URL given."""
    return await start_program(
        "supplier", "run", "--worker-id", worker_id, "--region", region,
        "--cpus", str(cpus), "--memory-mb", str(cpus * 1024), "--image", "web",
        "--data-dir", str(root / worker_id), "--nats", ",".join(urls), "--prefix", prefix,
        log_path=root / "logs" / f"{worker_id}.log", ready="supplier ready",
    )  # fmt: skip


async def exchange(urls: list[str], prefix: str, root: Path, name: str) -> Program:
    """One real exchange process (its NATS connection is named ``name``)."""
    return await start_program(
        "exchange", "serve", "--nats", ",".join(urls), "--prefix", prefix, "--name", name,
        log_path=root / "logs" / f"{name}.log", ready="exchange ready",
    )  # fmt: skip
