"""Waiting for the state stream (docs/protocol.md §4.21) in tests: a machine's row in a
state, asked of the stream itself (a direct get of its last message), so a test that then
reads a view knows the row is there to be read. Each ask is a round trip to the server."""

from __future__ import annotations

import time

from nats.aio.client import Client as NATS

from bourse.nats.state import state_stream_name
from bourse.wire.codec import decode
from bourse.wire.messages import Machine, worker_of_machine
from bourse.wire.subjects import Subjects


async def row(nc: NATS, subjects: Subjects, machine_id: str) -> Machine | None:
    """The machine's row as the stream holds it now (None: no row)."""
    subject = subjects.state_machines(worker_id=worker_of_machine(machine_id))[:-1] + machine_id
    stream = state_stream_name(subjects.prefix)
    msg = await nc.request(f"$JS.API.DIRECT.GET.{stream}.{subject}", b"", timeout=2.0)
    if (msg.headers or {}).get("Status"):  # 404: no message
        return None
    return decode(msg.data, Machine)


async def published(
    nc: NATS, subjects: Subjects, machine_id: str, state: str, timeout_s: float = 5.0
) -> Machine:
    """The machine's row once the stream holds it in ``state``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = await row(nc, subjects, machine_id)
        if got is not None and got.state == state:
            return got
    raise AssertionError(f"no {state} row of {machine_id} in the state stream in {timeout_s} s")


async def worker_published(
    nc: NATS, subjects: Subjects, region: str, worker_id: str, timeout_s: float = 5.0
) -> None:
    """Once the stream holds the worker's row."""
    stream = state_stream_name(subjects.prefix)
    subject = f"$JS.API.DIRECT.GET.{stream}.{subjects.state_worker(region, worker_id)}"
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        msg = await nc.request(subject, b"", timeout=2.0)
        if not (msg.headers or {}).get("Status"):
            return
    raise AssertionError(f"no row of worker {worker_id} in the state stream in {timeout_s} s")
