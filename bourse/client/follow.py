"""``buyer machines logs --follow``: a machine's output as it is printed.

Workers have no log stream on the bus; the client polls ``logs`` with ``since`` (the byte
offset just past what it already has, from the previous reply's ``end``), so no line is
shown twice or skipped whatever the lines say, and a poll that finds nothing costs one
small request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio

from bourse.client.client import BourseClient
from bourse.client.errors import ClientError
from bourse.wire.messages import MachineLogs

POLL_S = 0.5


async def follow_logs(
    client: BourseClient, machine_id: str, tail: int, every_s: float = POLL_S
) -> AsyncIterator[MachineLogs]:
    """The last ``tail`` lines, then each batch of new lines as it comes, until cancelled.
    A worker older than ``MachineLogs.end`` cannot be followed: ClientError after the tail."""
    got = await client.logs(machine_id, tail)
    yield got
    if got.end is None:
        raise ClientError(
            f"the worker of {machine_id} cannot follow logs (its supplier predates it)",
            "bad_request",
        )
    end = got.end
    while True:
        got = await client.logs(machine_id, since=end)
        if got.lines or got.truncated:
            yield got
        if got.end is None or got.end == end:
            await anyio.sleep(every_s)  # a pace: nothing new yet; ask again in a moment
        end = got.end if got.end is not None else end
