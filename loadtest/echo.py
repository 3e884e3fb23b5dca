"""A trivial responder for the NATS request-reply ceiling: ``python -m
loadtest.echo URL SUBJECT`` answers every request with an empty body."""

from __future__ import annotations

import sys

import anyio
from nats.aio.msg import Msg

from bourse.nats.connection import connect, flush_all, shutdown
from bourse.runtime.supervise import run


async def serve(url: str, subject: str) -> None:
    """Answer until cancelled (SIGINT/SIGTERM)."""
    nc = await connect(url, name="bourse-echo")
    try:

        async def echo(msg: Msg) -> None:
            await nc.publish(msg.reply, b"")

        await nc.subscribe(subject, cb=echo)
        await flush_all(nc)
        print("echo ready", flush=True)
        await anyio.sleep_forever()
    finally:
        await shutdown(nc)


if __name__ == "__main__":
    run(lambda: serve(sys.argv[1], sys.argv[2]))
