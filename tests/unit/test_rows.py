"""What a supplier's rows are made of (supplier/rows.py): one heartbeat per 4096 workers,
keyed by its first, naming those that serve; how long a destroyed machine's row stays."""

from __future__ import annotations

import pytest

from bourse.nats.state import RETENTION_S
from bourse.wire.messages import MAX_BEAT_WORKERS, Machine, Resources
from supplier.rows import beat_groups, regrouped, ttl_of, workers_due


def test_one_heartbeat_names_up_to_4096_workers_keyed_by_the_first() -> None:
    workers = [(f"w-{i}", "mad" if i < 5000 else "fra") for i in range(10_000)]
    groups = beat_groups(workers)
    assert [(b, r, len(ws)) for b, r, ws in groups] == [
        ("w-0", "mad", MAX_BEAT_WORKERS),
        ("w-4096", "mad", MAX_BEAT_WORKERS),
        ("w-8192", "fra", 10_000 - 2 * MAX_BEAT_WORKERS),
    ]
    assert [w for _, _, ws in groups for w in ws] == [w for w, _ in workers]
    assert beat_groups([("mad-1", "mad")]) == [("mad-1", "mad", ["mad-1"])]
    assert beat_groups([]) == []


def test_a_stopped_worker_is_left_out_of_its_heartbeat_and_named_again_when_started() -> None:
    """The operator stops a worker (§4.22): its heartbeat names it no more (a view calls it
    gone), its row still names the heartbeat it had; stopping the heartbeat's first worker
    keys it by the next, whose rows go again (a row names its heartbeat)."""
    serving = [("mad-1", "mad", True), ("mad-2", "mad", True), ("fra-1", "fra", True)]
    groups, beat_of, changed = regrouped(serving, {})
    assert (groups, changed) == ([("mad-1", "mad", ["mad-1", "mad-2", "fra-1"])], [])
    assert beat_of == dict.fromkeys(["mad-1", "mad-2", "fra-1"], "mad-1")

    mad2_stopped = [serving[0], ("mad-2", "mad", False), serving[2]]
    groups, beat_of, changed = regrouped(mad2_stopped, beat_of)
    assert (groups, changed) == ([("mad-1", "mad", ["mad-1", "fra-1"])], [])
    assert beat_of["mad-2"] == "mad-1"  # its row names the heartbeat that left it out

    mad1_stopped = [("mad-1", "mad", False), *serving[1:]]
    groups, stopped, changed = regrouped(mad1_stopped, beat_of)
    assert groups == [("mad-2", "mad", ["mad-2", "fra-1"])]
    assert (stopped["mad-1"], stopped["mad-2"], stopped["fra-1"]) == ("mad-1", "mad-2", "mad-2")
    assert changed == ["mad-2", "fra-1"]

    groups, again, changed = regrouped(serving, stopped)  # started: as before, rows again
    first_groups, first_beats, _ = regrouped(serving, {})
    assert (groups, again, changed) == (first_groups, first_beats, ["mad-2", "fra-1"])
    assert regrouped([("mad-1", "mad", False)], {}) == ([], {"mad-1": "mad-1"}, [])


def machine(state: str, updated_at_ms: int) -> Machine:
    return Machine(
        machine_id="mad-1~A",
        order_id="o",
        worker_id="mad-1",
        region="mad",
        state=state,  # type: ignore[arg-type]
        resources=Resources(cpus=1, memory_mb=64),
        image="web",
        updated_at_ms=updated_at_ms,
    )


NOW = 1_800_000_000_000


@pytest.mark.parametrize(
    ("state", "age_s", "ttl"),
    [
        ("started", 10, 0),  # a live machine's row stays for good
        ("stopped", 10 * RETENTION_S, 0),
        ("destroyed", 0, RETENTION_S),
        ("destroyed", 600, RETENTION_S - 600),  # sent again later: what is left of the hour
        ("destroyed", RETENTION_S - 1, 1),
        ("destroyed", RETENTION_S, 0),  # left the stream already: not sent again
        ("destroyed", 2 * RETENTION_S, 0),
    ],
)
def test_a_destroyed_rows_ttl_is_what_is_left_of_the_retention_window(
    state: str, age_s: int, ttl: int
) -> None:
    assert ttl_of(machine(state, NOW - age_s * 1000), NOW) == ttl


def test_a_workers_drain_goes_at_once_its_counts_in_turns_those_sent_longest_ago_first() -> None:
    """A worker's row goes at the next heartbeat when its drain changed (or it was never
    sent); when only its counts changed (free capacity, cache use: every commit of a busy
    worker), at most ``budget`` such rows go a heartbeat, the longest unsent first."""
    sent = {f"w-{i}": (("serving",), (i,)) for i in range(5)}
    sent_at = {"w-0": 4.0, "w-1": 3.0, "w-2": 2.0, "w-3": 1.0, "w-4": 0.0}
    now = dict(sent)
    assert workers_due(now, sent, sent_at, budget=2) == []  # nothing changed

    now |= {"w-0": (("draining",), (0,)), "w-9": (("serving",), (0,))}
    assert workers_due(now, sent, sent_at, budget=2) == ["w-0", "w-9"]  # at once, no budget

    counts_changed = {wid: (key, (99,)) for wid, (key, _) in sent.items()}
    assert workers_due(counts_changed, sent, sent_at, budget=2) == ["w-4", "w-3"]
    assert workers_due(counts_changed, sent, sent_at, budget=10) == [f"w-{i}" for i in range(5)]
    both = counts_changed | {"w-1": (("draining",), (99,))}
    assert workers_due(both, sent, sent_at, budget=1) == ["w-1", "w-4"]
