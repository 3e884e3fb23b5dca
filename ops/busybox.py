"""The container example of the demo market: ``examples/busybox-httpd`` built (a root of
its own from the host's static busybox) and pushed as ``busybox-httpd:latest`` when
``bourse up --driver oci`` starts, so the line it prints places a container that runs (the
example app, ``hello:latest``, needs the host's python3, which a container lacks)."""

from __future__ import annotations

from pathlib import Path

import anyio
from nats.aio.client import Client as NATS

from bourse.images import ImageError, ImageInfo, ImageStore, RunSpec

BUSYBOX_DIR = Path(__file__).resolve().parent.parent / "examples" / "busybox-httpd"
BUSYBOX_REF = "busybox-httpd:latest"
# What its README pushes it with: busybox's httpd on the machine's PORT.
BUSYBOX_RUN = RunSpec(cmd=("sh", "-c", "exec httpd -f -p $PORT -h /www"))
# How `bourse up --driver oci` says to place it (its hint and the README's line).
BUSYBOX_PLACE = (
    "buyer place --region mad --cpus 1 --memory-mb 64 --disk-mb 64 --image "
    f"{BUSYBOX_REF} --port http --check http:http:/healthz --check-interval 1 --start"
)


async def push_busybox(nc: NATS, prefix: str, root: Path) -> ImageInfo:
    """Build the example's root in ``root`` (its build.sh) and push it as
    ``busybox-httpd:latest``; ImageError, in the script's own words, when it cannot be
    built (no static busybox here)."""
    built = await anyio.run_process([str(BUSYBOX_DIR / "build.sh"), str(root)], check=False)
    if built.returncode != 0:
        said = built.stderr.decode(errors="replace").strip().splitlines() or ["failed"]
        raise ImageError(said[-1])
    store = await ImageStore.open(nc, prefix)
    await store.push_directory(root, BUSYBOX_REF, BUSYBOX_RUN)
    return await store.inspect(BUSYBOX_REF)
