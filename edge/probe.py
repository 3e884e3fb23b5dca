"""The edge's own probe of the machines it skips after a failure: a TCP connect to the
address that failed, nothing more (it answers whether the machine takes connections
again; its checks are the worker's). The core decides whom to probe and when
(edge/routing.py ``Router.probes_due``); this task only connects."""

from __future__ import annotations

import anyio
import anyio.abc
import structlog

from edge.routing import Router

log = structlog.get_logger("bourse.edge")

PROBE_TIMEOUT_S = 1.0
IDLE_S = 0.25  # how often the prober looks for new skips while none is due


async def probe(address: tuple[str, int], timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``address`` accepts a TCP connection within ``timeout_s``."""
    with anyio.move_on_after(timeout_s):
        try:
            stream = await anyio.connect_tcp(*address)
        except OSError:
            return False
        await stream.aclose()
        return True
    return False


async def run_prober(
    router: Router,
    timeout_s: float = PROBE_TIMEOUT_S,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Probe the skipped machines as they fall due, until cancelled."""

    async def one(machine_id: str, address: tuple[str, int]) -> None:
        ok = await probe(address, timeout_s)
        router.probed(machine_id, ok)
        log.info("probe", machine=machine_id, address=f"{address[0]}:{address[1]}", ok=ok)

    task_status.started()
    async with anyio.create_task_group() as tasks:
        while True:
            for machine_id, address in router.probes_due():
                tasks.start_soon(one, machine_id, address)
            wait = router.next_probe_in()
            # a timer: the next probe's due time, or a look for new skips
            await anyio.sleep(IDLE_S if wait is None else min(wait, IDLE_S))
