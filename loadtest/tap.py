"""``bourse loadtest --tap``: every message of a run counted by kind, by a subscriber on
``>`` in a process of its own (``python -m loadtest.tap URL PREFIX COUNTS_FILE``, started
and stopped as the run's other programs are: bourse/runtime/launcher.py).

A request's kind comes from its subject (``kind_of_subject``); a reply's from the request
it answers (the tap saw that request's reply subject) and the ``type`` its body names, so
a commit's ``Placed`` and an order's ``Placed`` count apart, and a JetStream
acknowledgement is told by what it acknowledges (a claim write, an event).

The tap adds one delivery of every message: nats-server works more, and the box has one
busy process more, so a tapped run's CPU and latency figures are not comparable with an
untapped one's (its message counts are).
"""

from __future__ import annotations

import json
import re
import signal
import sys
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bourse.nats.connection import connect, flush_all, shutdown
from bourse.nats.jetstream import jetstream_available
from bourse.runtime import logs
from bourse.runtime.launcher import start_program, stop_all
from bourse.wire.subjects import Subjects

# How long the tap may take to write its counts once told to stop.
TAP_STOP_S = 30.0
TAP_READY = "tap ready"
# The reply subjects remembered (oldest forgotten first): replies come within a deadline.
REMEMBERED_REPLIES = 200_000
_TYPE = re.compile(rb'"type"\s*:\s*"([A-Za-z]+)"')


def kind_of_subject(subject: str, subjects: Subjects) -> str:
    """What a message published to ``subject`` is, for the market of ``subjects``:
    ``order``, ``bid``, ``commit``, ``event placed``, ``claim write``...; ``reply`` for
    anything else (an inbox)."""
    if subject.startswith(subjects.root + "."):
        t = subjects.tail(subject, 0)
        head = t[0]
        if head == "bid":
            if len(t) == 2:
                return "bid"
            return "bid batch" if t[2] == "batch" else "bid (shard)"
        if head == "release":
            return "region release"
        if head == "worker" and len(t) >= 3:
            return " ".join(t[2:4]) if t[2] == "machine" else t[2]
        if head == "event" and len(t) >= 4:
            return f"event {t[3]}"
        return head
    if subject.startswith("$KV."):
        return "claim write"
    if subject.startswith("$JS.API."):
        return "jetstream api"
    if subject.startswith("$JS.EVENT."):
        return "jetstream advisory"
    if subject.startswith("$JS.ACK."):
        return "jetstream consumer ack"
    return "reply"


def kind_of_reply(request: str | None, data: bytes) -> str:
    """A reply's kind: ``<request kind> -> <what it is>``, where what it is is the ``type``
    its body names, ``ack`` for a JetStream acknowledgement, ``status`` for a body-less
    status (no responders). ``Answers`` go to the ``answers_to`` of a ``bid batch``."""
    if not data:
        what = "status"
    elif data.startswith(b'{"stream"'):
        what = "ack"
    else:
        m = _TYPE.search(data, 0, 96)
        what = m.group(1).decode() if m else "other"
    if request is None and what == "Answers":  # to a Batch's answers_to (not a reply subject)
        request = "bid batch"
    return f"{request or 'unknown request'} -> {what}"


class Tally:
    """Counts by kind; remembers each request's reply subject to name its replies."""

    def __init__(self, subjects: Subjects, remembered: int = REMEMBERED_REPLIES) -> None:
        self.subjects = subjects
        self.counts: Counter[str] = Counter()
        self._asked: OrderedDict[str, str] = OrderedDict()
        self._remembered = remembered

    def see(self, subject: str, reply: str, data: bytes) -> str:
        kind = kind_of_subject(subject, self.subjects)
        if kind == "reply":
            kind = kind_of_reply(self._asked.get(subject), data)
        if reply:
            self._asked[reply] = kind
            if len(self._asked) > self._remembered:
                self._asked.popitem(last=False)
        self.counts[kind] += 1
        return kind


async def tapped_subjects(nc: NATS, prefix: str) -> list[str]:
    """Every subject (``>``) on a server with JetStream. On a core-only server the JetStream
    API's subjects are left out: a subscriber there would be the only "responder" to a
    program's "is JetStream there?" request, which then times out instead of being told
    at once that nobody answers (and the exchange's first orders fail waiting for it).
    The run's own subjects and the reply inboxes are all a run publishes to there."""
    if await jetstream_available(nc):
        return [">"]
    return [f"{prefix}.>", "_INBOX.>"]


async def tap(url: str, prefix: str, counts_file: Path) -> None:
    """Count until SIGTERM or SIGINT, then write the counts to ``counts_file`` (JSON).
    Prints ``tap ready`` once the subscription is in place."""
    logs.configure("warning")  # to stderr: stdout is the launcher's readiness pipe
    nc = await connect([url], name="bourse-tap", service=False)
    tally = Tally(Subjects(prefix))

    async def on_msg(msg: Msg) -> None:
        tally.see(msg.subject, msg.reply, msg.data)

    try:
        subs = [
            # 0: no limit (a slow tap must not drop what it counts)
            await nc.subscribe(subject, cb=on_msg, pending_msgs_limit=0, pending_bytes_limit=0)
            for subject in await tapped_subjects(nc, prefix)
        ]
        await flush_all(nc)  # every subscription the server's before it says ready
        print(TAP_READY, flush=True)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        for sub in subs:
            await sub.drain()  # what the server sent before the signal is counted
    finally:
        await shutdown(nc)
    partial = counts_file.with_suffix(".partial")  # whole or absent, never half-written
    partial.write_text(json.dumps(dict(tally.counts.most_common())))
    partial.replace(counts_file)


@asynccontextmanager
async def tapped(
    url: str, subjects: Subjects, out: Path
) -> AsyncIterator[Callable[[], Awaitable[dict[str, int]]]]:
    """Run the tap in a process of its own (its CPU is not the run's; it dies with this
    one), from once it has subscribed; yields ``stop``, which ends it and returns its
    counts. Its log is ``out/logs/tap.log``. Left early (an error), the tap is stopped."""
    counts_file = out / "tap-counts.json"
    counts_file.unlink(missing_ok=True)
    prog = await start_program(
        "loadtest.tap",
        url,
        subjects.prefix,
        str(counts_file),
        log_path=out / "logs" / "tap.log",
        ready=TAP_READY,
    )

    async def stop() -> dict[str, int]:
        code = await prog.stop(TAP_STOP_S)
        if code != 0 or not counts_file.exists():
            tail = "\n".join(prog.log.splitlines()[-5:])
            raise RuntimeError(f"the tap exited with code {code} and no counts:\n{tail}")
        counts: dict[str, int] = json.loads(counts_file.read_text())
        return counts

    try:
        yield stop
    finally:
        await stop_all([prog])


if __name__ == "__main__":
    anyio.run(tap, sys.argv[1], sys.argv[2], Path(sys.argv[3]))
