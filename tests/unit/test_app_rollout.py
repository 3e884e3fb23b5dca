"""The rollout's state machine (bourse/client/apps/rollout.py): events in, actions out, one
step at a time; an update stops the rollout when there is no room or its checks do not pass
in time, and the old machine is destroyed only once the new one is as it should be."""

from __future__ import annotations

import msgspec
import pytest

from bourse.client.apps.plan import Plan, Step
from bourse.client.apps.rollout import (
    Action,
    Destroyed,
    DestroyMachine,
    Drained,
    DrainMachine,
    Event,
    Finished,
    Health,
    Place,
    Placed,
    Rollout,
    Started,
    StartFailed,
    StartMachine,
    Tick,
    Unfilled,
    WatchHealth,
)

UPDATE = Step(region="mad", slot=0, role="primary", action="update", machine_id="w1~OLD",
              worker_id="w1", order_id="app.g2.mad.0", fields=["resources"])  # fmt: skip
UPDATE_SPARE = Step(region="mad", slot=1, role="spare", action="update", machine_id="w2~OLDS",
                    worker_id="w2", order_id="app.g2.mad.1")  # fmt: skip
CREATE = Step(region="ams", slot=0, role="primary", action="create", order_id="app.g2.ams.0")
DESTROY = Step(region="mad", slot=2, role="spare", action="destroy", machine_id="w3~S",
               worker_id="w3")  # fmt: skip
START = Step(region="mad", slot=0, role="primary", action="start", machine_id="w1~R",
             worker_id="w1")  # fmt: skip
KEEP = Step(region="mad", slot=3, role="primary", action="keep", machine_id="w4~K", worker_id="w4")


def run(
    steps: list[Step], script: list[tuple[Event, int]], checks: bool = True
) -> tuple[Rollout, list[Action]]:
    r = Rollout(Plan(app="app", generation=2, steps=steps, records={}), checks, 5000)
    actions = [r.begin(0)]
    for event, now in script:
        actions.append(r.on(event, now))
    return r, actions


def test_an_update_places_starts_waits_for_checks_then_destroys_the_old() -> None:
    r, actions = run(
        [UPDATE, KEEP],
        [
            (Placed("w5~NEW", "w5"), 1),
            (Started("w5~NEW"), 2),
            (Health(""), 100),
            (Health("critical", "connection refused"), 200),
            (Health("passing"), 300),
            (Destroyed("w1~OLD"), 400),
        ],
    )
    assert actions == [
        Place(UPDATE, "app.g2.mad.0", ("w1", "w4")),  # the app's workers: another one
        StartMachine("w5~NEW"),
        WatchHealth("w5~NEW"),
        WatchHealth("w5~NEW"),
        WatchHealth("w5~NEW"),
        DestroyMachine("w1~OLD"),
        Finished(),
    ]
    assert r.complete and not r.stopped
    [done] = r.outcomes
    assert (done.result, done.machine_id, done.worker_id) == ("done", "w5~NEW", "w5")


def test_an_update_of_a_started_machine_drains_it_before_its_destroy() -> None:
    """The old machine was serving (started): drained (the edges send it nothing new, what
    is under way finishes, it is stopped), then destroyed; a stopped one is not."""
    serving = Step(**{**msgspec.structs.asdict(UPDATE), "state": "started"})
    r, actions = run(
        [serving],
        [(Placed("w5~NEW", "w5"), 1), (Started("w5~NEW"), 2), (Drained("w1~OLD"), 3),
         (Destroyed("w1~OLD"), 4)],
        checks=False,
    )  # fmt: skip
    assert actions == [
        Place(serving, "app.g2.mad.0", ("w1",)),
        StartMachine("w5~NEW"),
        DrainMachine("w1~OLD"),
        DestroyMachine("w1~OLD"),
        Finished(),
    ]
    assert r.complete
    stopped = Step(**{**msgspec.structs.asdict(UPDATE), "state": "stopped"})
    _, actions = run([stopped], [(Placed("w5~NEW", "w5"), 1), (Started("w5~NEW"), 2)], False)
    assert actions[-1] == DestroyMachine("w1~OLD")


def test_a_scale_down_drains_a_running_machine_before_its_destroy() -> None:
    """A machine a scale-down destroys that runs (the edges may be sending it requests) is
    drained first, as an update's old one; one that does not run is destroyed at once."""
    running = Step(region="mad", slot=1, role="primary", action="destroy", machine_id="w2~P",
                   worker_id="w2", state="started", detail="scaled down")  # fmt: skip
    r, actions = run([running, DESTROY], [(Drained("w2~P"), 1), (Destroyed("w2~P"), 2),
                                          (Destroyed("w3~S"), 3)])  # fmt: skip
    assert actions == [
        DrainMachine("w2~P"),
        DestroyMachine("w2~P"),
        DestroyMachine("w3~S"),
        Finished(),
    ]
    assert r.complete and [o.step.machine_id for o in r.outcomes] == ["w2~P", "w3~S"]


def test_no_other_worker_places_beside_the_old_one_and_no_room_stops() -> None:
    _, actions = run([UPDATE], [(Unfilled("no_offers"), 1), (Placed("w1~NEW", "w1"), 2)])
    assert actions[1] == Place(UPDATE, "app.g2.mad.0.b", ())  # the old one's worker allowed
    r, actions = run(
        [UPDATE, UPDATE_SPARE, CREATE], [(Unfilled("no_offers"), 1), (Unfilled("no_offers"), 2)]
    )
    assert actions[-1] == Finished() and r.stopped and not r.complete
    assert [(o.step.slot, o.result) for o in r.outcomes] == [
        (0, "unfilled"), (1, "skipped"), (0, "skipped")
    ]  # fmt: skip
    assert r.outcomes[0].detail == "no room for the new machine in mad: no_offers"


def test_checks_not_passing_in_time_stop_the_rollout_and_the_old_one_serves() -> None:
    r, actions = run(
        [UPDATE, UPDATE_SPARE],
        [
            (Placed("w5~NEW", "w5"), 1),
            (Started("w5~NEW"), 10),
            (Health("critical", "HTTP 500"), 2000),
            (Tick(), 4999),
            (Tick(), 5010),
        ],
    )
    assert actions[-2:] == [WatchHealth("w5~NEW"), Finished()]
    assert DestroyMachine("w1~OLD") not in actions  # the old one keeps serving
    assert r.stopped and [o.result for o in r.outcomes] == ["stopped", "skipped"]
    assert r.outcomes[0].detail == (
        "checks not passing after 5 s (critical: HTTP 500); w1~OLD keeps serving"
    )
    assert r.outcomes[0].machine_id == "w5~NEW"


def test_a_start_that_fails_stops_the_rollout() -> None:
    r, actions = run([UPDATE, CREATE], [(Placed("w5~N", "w5"), 1), (StartFailed("exit 1"), 2)])
    assert actions[-1] == Finished() and r.stopped
    assert [o.result for o in r.outcomes] == ["failed", "skipped"]


@pytest.mark.parametrize(
    ("steps", "script", "checks", "expected"),
    [
        pytest.param(
            [UPDATE_SPARE], [(Placed("w6~S", "w6"), 1), (Destroyed("w2~OLDS"), 2)], True,
            [Place(UPDATE_SPARE, "app.g2.mad.1", ("w2",)), DestroyMachine("w2~OLDS"), Finished()],
            id="a spare is placed, not started, then the old one destroyed",
        ),
        pytest.param(
            [UPDATE], [(Placed("w5~N", "w5"), 1), (Started("w5~N"), 2), (Destroyed("w1~OLD"), 3)],
            False,
            [Place(UPDATE, "app.g2.mad.0", ("w1",)), StartMachine("w5~N"),
             DestroyMachine("w1~OLD"), Finished()],
            id="no checks: started is enough",
        ),
        pytest.param(
            [DESTROY, CREATE],
            [(Destroyed("w3~S"), 1), (Placed("a1~N", "a1"), 2), (Started("a1~N"), 3),
             (Health("passing"), 4)], True,
            [DestroyMachine("w3~S"), Place(CREATE, "app.g2.ams.0", ()), StartMachine("a1~N"),
             WatchHealth("a1~N"), Finished()],
            id="a destroy, then a create that waits for its checks",
        ),
        pytest.param(
            [CREATE, DESTROY], [(Unfilled("no_workers"), 1), (Destroyed("w3~S"), 2)], True,
            [Place(CREATE, "app.g2.ams.0", ()), DestroyMachine("w3~S"), Finished()],
            id="an unfilled create leaves its slot empty and the rollout goes on",
        ),
        pytest.param(
            [START], [(Started("w1~R"), 1), (Health("passing"), 2)], True,
            [StartMachine("w1~R"), WatchHealth("w1~R"), Finished()],
            id="a placed primary is started",
        ),
        pytest.param([KEEP], [], True, [Finished()], id="nothing to do"),
    ],
)  # fmt: skip
def test_the_steps_table(
    steps: list[Step], script: list[tuple[Event, int]], checks: bool, expected: list[Action]
) -> None:
    _, actions = run(steps, script, checks)
    assert actions == expected


def test_an_unfilled_create_is_said_and_the_rollout_not_stopped() -> None:
    r, _ = run([CREATE, DESTROY], [(Unfilled("no_workers"), 1), (Destroyed("w3~S"), 2)])
    assert not r.stopped and not r.complete
    assert [o.result for o in r.outcomes] == ["unfilled", "done"]
    assert r.outcomes[0].detail == "unfilled in ams: no_workers"
