"""A tiny machine program for demos and tests: ``{python} <this file> NAME`` (:data:`SCRIPT`:
run as a file it needs nothing but the standard library, so any Python a machine's user may
run runs it), or :func:`command`, which carries the program in its command line.

Prints a line when it starts, one per ``--every-s`` seconds, and a last one when SIGTERM asks
it to stop (then exits 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

# this file ("" when run as ``-c`` source: :func:`command`)
SCRIPT = os.path.abspath(__file__) if "__file__" in globals() else ""


def command(name: str, every_s: float = 5.0) -> list[str]:
    """A catalog command that runs this program as ``{python} -c <its source> NAME``: a
    machine of its own user (a root supplier's) sees a /tmp of its own and cannot enter a
    home of mode 700, so a checkout under /tmp or /root (where a newcomer clones) would
    leave it no file to run: the source travels in its arguments instead."""
    with open(SCRIPT, encoding="utf-8") as f:
        source = f.read()
    return ["{python}", "-c", source, name, "--every-s", f"{every_s:g}"]


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
