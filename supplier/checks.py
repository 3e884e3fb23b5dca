"""A machine's health checks (docs/protocol.md §4.2a): a pure core that turns each check's
results into the machine's ``Health``, and the probes that produce them on real sockets.

- :class:`HealthCore` (pure, clock injected): per check, whether its last run passed and
  how many runs in a row failed. The machine is ``critical`` while one check's last run
  failed, ``passing`` once every check passed its last run, ``""`` before that; ``since_ms``
  is when that status began. It says when the status changed (an event of kind ``check``
  and a durable record) and when a check has just failed :data:`RESTART_AFTER` times in a
  row (a machine whose restart policy is ``on-failure`` is restarted then, once per run of
  failures).
- :func:`probe`: one run of a check against an address: ``tcp`` passes when a connection
  is accepted within the timeout; ``http`` sends ``GET path`` and passes on a 2xx or 3xx
  status line within the timeout.

The supplier runs each started machine's checks in tasks of its own (supplier/machines.py),
each every ``interval_s``, the first one interval after the start (the machine's time to
begin listening).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import anyio

from bourse.wire.messages import Check, Health

# A check that failed this many times in a row restarts a machine whose policy is
# on-failure.
RESTART_AFTER = 3
# How much of an http answer is read: its status line is all a check needs.
STATUS_LINE_BYTES = 1024


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one result means: the machine's health now, whether its status changed, and
    whether the check just reached :data:`RESTART_AFTER` failures in a row."""

    health: Health
    changed: bool
    restart: bool


@dataclass(slots=True)
class HealthCore:
    """One machine's health from its checks' results (see the module doc)."""

    checks: int
    passed: dict[int, bool] = field(default_factory=dict)  # check index -> its last run
    failures: dict[int, int] = field(default_factory=dict)  # check index -> in a row
    details: dict[int, str] = field(default_factory=dict)  # check index -> last failure
    health: Health = field(default_factory=Health)

    def observe(self, i: int, ok: bool, detail: str, now_ms: int) -> Verdict:
        """Check ``i`` ran at ``now_ms``: passed (``ok``) or failed saying ``detail``."""
        self.passed[i] = ok
        self.failures[i] = 0 if ok else self.failures.get(i, 0) + 1
        if ok:
            self.details.pop(i, None)
        else:
            self.details[i] = detail
        failing = [j for j, passed in self.passed.items() if not passed]
        if failing:
            status = "critical"
        elif len(self.passed) == self.checks:
            status = "passing"
        else:
            status = ""  # some check has not run yet, none failed
        worst = max(failing, key=lambda j: self.failures[j], default=None)
        changed = status != self.health.status
        self.health = Health(
            status=status,
            since_ms=now_ms if changed else self.health.since_ms,
            failures=self.failures[worst] if worst is not None else 0,
            detail=self.details[worst] if worst is not None else "",
        )
        return Verdict(self.health, changed, not ok and self.failures[i] == RESTART_AFTER)


async def probe(check: Check, address: str) -> tuple[bool, str]:
    """Run ``check`` once against ``address`` (``host:port``): (passed, what failed)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        with anyio.fail_after(check.timeout_s):
            async with await anyio.connect_tcp(host, int(port)) as stream:
                if check.kind == "tcp":
                    return True, ""
                request = f"GET {check.path} HTTP/1.0\r\nHost: {address}\r\n\r\n"
                await stream.send(request.encode())
                head = b""
                while b"\r\n" not in head and len(head) < STATUS_LINE_BYTES:
                    head += await stream.receive(STATUS_LINE_BYTES)
    except TimeoutError:
        return False, f"{check.kind} {address}: no answer within {check.timeout_s:g}s"
    except OSError as exc:
        why = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc  # anyio wraps it
        return False, f"{check.kind} {address}: {os.strerror(why.errno) if why.errno else why}"
    except (anyio.EndOfStream, anyio.BrokenResourceError):
        return False, f"{check.kind} {address}: closed before answering"
    return _http_status(check, address, head)


def _http_status(check: Check, address: str, head: bytes) -> tuple[bool, str]:
    """Pass on a 2xx or 3xx status line."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        return False, f"http {address}{check.path}: not an HTTP answer: {line[:80]!r}"
    status = int(parts[1])
    if 200 <= status < 400:
        return True, ""
    return False, f"http {address}{check.path}: status {status}"
