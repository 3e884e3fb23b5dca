"""What a chaos run records while it runs (``ChaosStats``: orders, answers, faults,
violations) and the report it ends with (``chaos_report``, written by ``write_report``)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hdrh.histogram import HdrHistogram

from loadtest.audit import AuditResult
from loadtest.runner import new_hist


@dataclass
class FaultRecord:
    """One fault done: when (s since the run's start), what, to whom."""

    at_s: float
    kind: str
    target: str
    detail: str = ""


@dataclass
class ChaosStats:
    """What a chaos run's client saw, as it saw it."""

    sent: int = 0
    attempts: int = 0
    placed: int = 0
    unfilled: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)  # final answer an error, by code
    retried_errors: Counter[str] = field(default_factory=Counter)
    destroy_errors: int = 0
    slowest_ms: float = 0.0
    # send -> Placed/Unfilled, every answered attempt (an error's time is the client's own
    # timeout, not the market's)
    answer_us: HdrHistogram = field(default_factory=new_hist)
    faults: list[FaultRecord] = field(default_factory=list)
    bad_input_sent: int = 0
    violations: list[str] = field(default_factory=list)  # found during the run (I6)
    # duplicates: the extra sends of an order id at once (another path, as a retry), and
    # how many of them were answered Placed (always with the order's one machine: I3)
    duplicate_sends: int = 0
    duplicate_placed: int = 0


def chaos_report(st: ChaosStats, result: AuditResult) -> dict[str, Any]:
    """What a chaos run saw (``st``) and what its audit found, as the soak report's JSON."""
    return {
        "orders": {
            "sent": st.sent,
            "attempts": st.attempts,
            "duplicate_sends": st.duplicate_sends,
            "duplicate_placed": st.duplicate_placed,
            "placed": st.placed,
            "unfilled": dict(st.unfilled),
            "failed": dict(st.failed),
            "retried_after_error": dict(st.retried_errors),
            "slowest_answer_ms": round(st.slowest_ms, 1),
            "answer_ms": {
                f"p{q:g}": round(st.answer_us.get_value_at_percentile(q) / 1000, 1)
                for q in (50, 99, 99.9, 100)
            },
        },
        "faults": {
            "total": len(st.faults),
            "by_kind": dict(Counter(f.kind for f in st.faults)),
            "log": [f.__dict__ for f in st.faults],
        },
        "bad_input_requests": st.bad_input_sent,
        "audit": {
            "files": result.files,
            "machines": result.machines,
            "ops_replayed": result.ops,
            "violations": result.violations,
        },
    }


def write_report(report: dict[str, Any], out: Path) -> Path:
    path = out / "soak-report.json"
    path.write_text(json.dumps(report, indent=2))
    return path
