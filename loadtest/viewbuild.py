"""A view built from scratch, alone in a process (the ``view`` scenario runs it so that its
memory is its own): ``python -m loadtest.viewbuild URL PREFIX PATH`` builds the view of
the market at ``PATH`` (a file, made anew) and prints one JSON object: the seconds from
opening it to caught up, the rows it holds, the process's peak resident memory and the
CPU seconds it used (its start included).

Its peak memory is read from ``/proc/self/status`` (Linux), see :func:`peak_rss_kib`."""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from pathlib import Path

from bourse.nats.connection import connect, shutdown
from bourse.runtime import logs
from bourse.view import open_view
from bourse.wire.subjects import Subjects


def peak_rss_kib() -> int:
    """This process's peak resident memory (KiB): the kernel's high-water mark of its own
    memory, ``VmHWM``. Not ``getrusage``'s ``ru_maxrss``, which a process started by
    fork (or vfork) and exec inherits from its parent: the harness's own, 300 MB here."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0])


async def build(url: str, prefix: str, path: Path) -> dict[str, object]:
    nc = await connect([url], name="bourse-view-build", service=False)
    try:
        began = time.perf_counter()
        async with open_view(nc, Subjects(prefix), path, catch_up_s=600) as view:
            elapsed = time.perf_counter() - began
            machines = view.db.db.execute("SELECT count(*) FROM machines").fetchone()[0]
            workers = view.db.db.execute("SELECT count(*) FROM workers").fetchone()[0]
            seq = view.freshness().seq
    finally:
        await shutdown(nc)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "seconds": round(elapsed, 3),
        "machines": machines,
        "workers": workers,
        "seq": seq,
        "peak_rss_mb": round(peak_rss_kib() / 1024, 1),
        # the process's CPU, its start included: what a build costs whatever else runs
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
    }


if __name__ == "__main__":
    logs.configure("warning")
    url, prefix, where = sys.argv[1:4]
    Path(where).unlink(missing_ok=True)  # from scratch
    built = asyncio.run(build(url, prefix, Path(where)))
    print(json.dumps(built | {"file_mb": round(Path(where).stat().st_size / 2**20, 1)}))
