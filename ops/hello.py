"""The example app of the demo market: ``examples/hello-http`` pushed into the market's image
store as ``hello:latest`` when ``bourse demo`` or ``bourse up`` starts, and placed by the
demo by its tag."""

from __future__ import annotations

from pathlib import Path

from nats.aio.client import Client as NATS

from bourse.client import BourseClient
from bourse.images import ImageInfo, ImageStore, RunSpec
from bourse.wire.messages import Placed, PlaceOrder, Resources, Unfilled

HELLO_DIR = Path(__file__).resolve().parent.parent / "examples" / "hello-http"
HELLO_REF = "hello:latest"
# An image carries the app's files only: the interpreter is the worker's own python3.
HELLO_RUN = RunSpec(cmd=("python3", "server.py"), env=("HELLO_VERSION=1",))


async def push_hello(nc: NATS, prefix: str, directory: Path = HELLO_DIR) -> ImageInfo:
    """Push the example app as ``hello:latest`` (the same tree gives the same digest: a
    second start uploads nothing) and return what the store says of it."""
    store = await ImageStore.open(nc, prefix)
    await store.push_directory(directory, HELLO_REF, HELLO_RUN)
    return await store.inspect(HELLO_REF)


async def place_hello(
    client: BourseClient, region: str, metadata: dict[str, str]
) -> Placed | Unfilled:
    """One machine of the example app in ``region``, by its tag (resolved to the digest
    where the order enters, as any buyer's)."""
    order = PlaceOrder(
        region=region,
        resources=Resources(cpus=1, memory_mb=256),
        image=HELLO_REF,
        metadata=metadata,
    )
    return await client.place(order)
