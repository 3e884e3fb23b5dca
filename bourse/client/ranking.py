"""A dry run's verdicts ranked, and an unfilled order's detail said from them.

``rank`` puts every worker's verdict (docs/protocol.md §4.15) in the order ``buyer place
--dry-run`` shows them, the would-be winner first (``DryRun``); ``why_unfilled`` turns the
same verdicts, gathered after an order ended ``no_offers``, into the one line that says
why no worker took it. Pure: verdicts in, an order and words out.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from bourse.wire.messages import PlaceOrder, Reason, WorkerVerdict

# Declines are grouped by their first reason, in the order of the desk's stages (§6.2).
DECLINE_ORDER = (
    "machine_being_reclaimed",
    "machine_being_aborted",
    "commit_under_way",
    "draining",
    "excluded",
    "constraint_mismatch",
    "image_not_runnable",
    "too_small_to_confine",
    "image_too_big",
    "insufficient",
    "blocked_by_holds",
)
# A client-side note on an offer the auction would not take (PlaceOrder.min_score).
BELOW_MIN_SCORE = "below_min_score"


class DryRun(msgspec.Struct, kw_only=True):
    """Where an order would go and why not elsewhere (``buyer place --dry-run``): every
    worker of the region, the would-be winner first, then other offers by score, workers
    that would wait, declines grouped by reason, and workers that gave no answer."""

    order_id: str
    region: str
    winner: str | None  # the worker the auction would pick now, if any
    verdicts: list[WorkerVerdict]
    # True when every process that answered sent its last page and every worker the status
    # scatter-gather found has a verdict (else the deadline ended the gather).
    complete: bool
    elapsed_ms: float
    errors: list[str] = []  # Error replies of suppliers (e.g. a bad request)


def rank(
    verdicts: Iterable[WorkerVerdict], min_score: float = 0.0
) -> tuple[str | None, list[WorkerVerdict]]:
    """The would-be winner and the verdicts in display order (see DryRun). The auction takes
    an existing machine at once, else the best offer scoring at least ``min_score``; an
    offer below it gets a ``below_min_score`` note."""
    vs = [_min_score_note(v, min_score) for v in verdicts]

    def key(v: WorkerVerdict) -> tuple[int, int, float, str]:
        if v.verdict == "decline":
            code = v.reasons[0].code if v.reasons else ""
            group = DECLINE_ORDER.index(code) if code in DECLINE_ORDER else len(DECLINE_ORDER)
            return (4, group, 0.0, v.worker_id)
        kind = {"existing": 0, "offer": 1, "wait": 3, "no_answer": 5}[v.verdict]
        if kind == 1 and v.score < min_score:
            kind = 2
        return (kind, 0, -v.score, v.worker_id)

    vs.sort(key=key)
    winner = next(
        (
            v.worker_id
            for v in vs
            if v.verdict == "existing" or (v.verdict == "offer" and v.score >= min_score)
        ),
        None,
    )
    return winner, vs


# How an unfilled order's region answered, per reason code: a phrase over the workers that
# gave it (``{names}``), in the desk's order (§6.2). ``image_not_runnable`` on every worker
# is said as "no worker serves image ...".
_WHY_NOT = {
    "machine_being_reclaimed": "the order's machine is being reclaimed on {names}",
    "machine_being_aborted": "the order's machine is being destroyed (aborted) on {names}",
    "commit_under_way": "a commit for this order is under way on {names}",
    "draining": "draining: {names}",
    "excluded": "excluded by the order: {names}",
    "constraint_mismatch": "labels do not match on {names} ({detail})",
    "insufficient": "not enough free capacity on {names} ({detail})",
    "blocked_by_holds": "capacity held by other orders on {names}",
    "image_not_runnable": "image {image!r} is not served by {names}",
    "too_small_to_confine": "too small to confine on {names} ({detail})",
    "image_too_big": "image {image!r} is bigger than the image cache of {names}",
}
# At most this many worker ids are named per reason; the rest are counted.
WHY_NOT_NAMES = 3


def served_nowhere(dry: DryRun) -> bool:
    """Every worker that answered declined the order's image (none runs it)."""
    return bool(dry.verdicts) and all(
        any(r.code == "image_not_runnable" for r in v.reasons) for v in dry.verdicts
    )


def why_unfilled(order: PlaceOrder, dry: DryRun) -> str | None:
    """An unfilled order's detail from what the region's workers answered an explain of it
    (``None`` when nobody answered): which workers declined for which reason (capacity,
    labels, an image no worker serves, draining, excluded, holds), named, in the desk's
    order; workers that would offer now (capacity freed since) and silent ones are said too.
    ``no worker in 'sjc' took 1 cpus + 128 MiB of image 'x': no worker serves image 'x'``."""
    if not dry.verdicts:
        return None
    by_code: dict[str, list[WorkerVerdict]] = {}
    offers: list[str] = []
    silent: list[str] = []
    for v in dry.verdicts:
        if v.verdict in ("offer", "existing"):
            offers.append(v.worker_id)
        elif v.verdict == "no_answer":
            silent.append(v.worker_id)
        elif v.verdict == "wait":
            by_code.setdefault("blocked_by_holds", []).append(v)
        for r in v.reasons if v.verdict == "decline" else ():
            by_code.setdefault(r.code, []).append(v)
    parts: list[str] = []
    for code in sorted(by_code, key=lambda c: (_decline_rank(c), c)):
        vs = by_code[code]
        if code == "image_not_runnable" and served_nowhere(dry):
            parts.append(f"no worker serves image {order.image!r}")
            continue
        first = next((r.detail for r in vs[0].reasons if r.code == code), "")
        if len(vs) > 1 and first:
            first = f"{vs[0].worker_id}: {first}"  # one worker's numbers, named
        phrase = _WHY_NOT.get(code, code + " on {names}")
        parts.append(phrase.format(names=_names(vs), detail=first, image=order.image))
    if offers:
        parts.append(f"{_names_of(offers)} would offer now (capacity freed since)")
    if silent:
        parts.append(f"no explanation from {_names_of(silent)}")
    from bourse.auction.core import describe

    what = f"{describe(order)} of image {order.image!r}"
    return f"no worker in {order.region!r} took {what}: " + "; ".join(parts)


def _decline_rank(code: str) -> int:
    return DECLINE_ORDER.index(code) if code in DECLINE_ORDER else len(DECLINE_ORDER)


def _names(vs: list[WorkerVerdict]) -> str:
    return _names_of([v.worker_id for v in vs])


def _names_of(ids: list[str]) -> str:
    shown = ", ".join(ids[:WHY_NOT_NAMES])
    more = len(ids) - WHY_NOT_NAMES
    return f"{shown} and {more} more" if more > 0 else shown


def _min_score_note(v: WorkerVerdict, min_score: float) -> WorkerVerdict:
    if v.verdict != "offer" or v.score >= min_score:
        return v
    note = Reason(code=BELOW_MIN_SCORE, detail=f"score {v.score:g} < min_score {min_score:g}")
    return msgspec.structs.replace(v, reasons=[*v.reasons, note])
