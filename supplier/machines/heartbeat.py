"""A tiny machine program for demos and tests: ``{python} <this file> NAME`` (:data:`SCRIPT`:
run as a file it needs nothing but the standard library, so any Python a machine's user may
run runs it).

Prints a line when it starts, one per ``--every-s`` seconds, and a last one when SIGTERM asks
it to stop (then exits 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

SCRIPT = os.path.abspath(__file__)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("name")
    p.add_argument("--every-s", type=float, default=5.0)
    args = p.parse_args()
    machine = os.environ.get("BOURSE_MACHINE_ID", "?")
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    print(f"{args.name} up on {machine} (pid {os.getpid()})", flush=True)
    beats = 0
    while not stop:
        time.sleep(min(args.every_s, 0.2))
        beats += 1
        if beats * 0.2 >= args.every_s:
            beats = 0
            print(f"{args.name} alive", flush=True)
    print(f"{args.name} stopping", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
