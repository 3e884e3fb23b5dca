"""Started by the request (edge/starts.py): which machine a request starts (pure), and
Starts with a start injected and a real listening socket as the started machine's port:
concurrent requests share one start and are released once its port answers (routed as
started by this edge before the table says so), held requests are bounded per app, and a
failed start is said to every held request, then not tried again for its backoff."""

from __future__ import annotations

import anyio
import pytest

from bourse.wire.messages import Machine, Resources
from edge.routing import STARTED, AppRoute, Backend, Choice, Router, RouteTable
from edge.starts import Starts, failing_over, to_start


def b(mid: str, region: str = "mad", state: str = "stopped", **kw: object) -> Backend:
    return Backend(mid, region, {}, state, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("backends", "want"),
    [
        ([b("m2"), b("m1")], "m1"),  # the lowest id
        ([b("m1", "fra"), b("m2")], "m2"),  # the edge's region first
        ([b("m1", "fra"), b("m2", "fra")], "m1"),  # else another region's
        ([b("m1", state="reserved")], "m1"),  # placed, never started
        ([b("m1", role="spare"), b("m2", state="started")], None),  # a spare: healing's
        ([b("m1", worker_gone=True)], None),
        ([b("m1", state="failed"), b("m2", state="destroyed")], "m1"),  # killed: again
        ([b("m1", state="destroyed"), b("m2", state="started")], None),
        # a failover replaced the primary (its worker gone), the spare it started stopped
        # since when idle: the spares are the slot's machines now
        ([b("p", state="started", worker_gone=True, replaced=True), b("s", role="spare")], "s"),
        (
            [b("p", "fra", "started", worker_gone=True, replaced=True), b("s", role="spare")],
            None,
        ),  # not in the spare's region: the spare stays the slot's spare
        (
            [
                b("p", state="started", worker_gone=True, replaced=True),
                b("a", role="spare"),
                b("z"),
            ],
            "z",
        ),  # a machine that is no spare first
    ],
)
def test_which_machine_a_request_starts(backends: list[Backend], want: str | None) -> None:
    got = to_start(AppRoute("web", tuple(backends)), "mad")
    assert (got.machine_id if got else None) == want


def test_a_failed_machine_already_replaced_is_due_no_failover() -> None:
    failed = b("p", state="started", worker_gone=True)
    spare = b("s", role="spare")
    assert failing_over(AppRoute("web", (failed, spare)), "mad")
    replaced = b("p", state="started", worker_gone=True, replaced=True)
    assert not failing_over(AppRoute("web", (replaced, spare)), "mad")


PORT = 8080


def machine(mid: str, port: int) -> Machine:
    return Machine(
        machine_id=mid, order_id="o1", worker_id="mad-1", region="mad", state="started",
        resources=Resources(cpus=1, memory_mb=64), image="web",
        addresses={"http": f"127.0.0.1:{port}"},
    )  # fmt: skip


class Held:
    """Held requests' releases: what each was told, and when ``n`` were."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.told: list[str | None] = []
        self.done = anyio.Event()

    def __call__(self, why: str | None) -> None:
        self.told.append(why)
        if len(self.told) == self.n:
            self.done.set()

    async def all(self) -> list[str | None]:
        with anyio.fail_after(5):
            await self.done.wait()
        return self.told


def router_of(*backends: Backend) -> Router:
    router = Router("mad")
    router.update(RouteTable({"web": AppRoute("web", backends)}))
    return router


async def test_concurrent_requests_share_one_start_and_are_released_when_it_answers() -> None:
    router = router_of(b("mad-1~m1"))
    asked: list[str] = []
    gate = anyio.Event()

    async def start(mid: str) -> Machine:
        asked.append(mid)
        await gate.wait()
        return machine(mid, PORT)

    probed: list[tuple[str, int]] = []

    async def probe(address: tuple[str, int], timeout_s: float) -> bool:
        probed.append(address)
        return len(probed) == 3  # the machine's port answers at the third probe

    starts = Starts(router, start, max_held=3, probe=probe, probe_every_s=0.001)
    release = Held(3)
    assert [starts.hold("web", release) for _ in range(3)] == [None, None, None]
    full = starts.hold("web", release)
    assert full == "3 requests of app 'web' already wait for machine mad-1~m1 to start"
    gate.set()
    assert (asked, await release.all()) == (["mad-1~m1"], [None, None, None])
    assert probed == [("127.0.0.1", PORT)] * 3
    # routed as started by this edge, the table still saying stopped
    got = router.pick("web")
    assert isinstance(got, Choice) and got.address == ("127.0.0.1", PORT)
    # the table says started: the override is no longer needed, and is dropped
    router.update(RouteTable({"web": AppRoute("web", (b("mad-1~m1", state=STARTED),))}))
    assert router.started_here == {}
    await starts.close()


async def test_a_failed_start_is_said_to_every_held_request_then_backs_off() -> None:
    router = router_of(b("mad-1~m1"))
    now = [100.0]

    async def start(mid: str) -> Machine:
        raise RuntimeError("no room on mad-1")

    starts = Starts(router, start, clock=lambda: now[0])
    release = Held(2)
    assert starts.hold("web", release) is None and starts.hold("web", release) is None
    why = "the start of machine mad-1~m1 of app 'web' failed: no room on mad-1"
    assert await release.all() == [why, why]
    assert starts.hold("web", release) == f"{why} (started again in 1.0 s)"
    now[0] += 1.5  # past the backoff: started again (and failing again, twice as long)
    assert starts.hold("web", release) is None
    await starts.tasks.wait()
    assert starts.failed["web"].backoff_s == 2.0
    assert starts.hold("other", release) == ""  # no such app: nothing to start
    await starts.close()


def test_a_machine_started_here_is_routed_until_the_table_moves_on() -> None:
    now = [0.0]
    router = Router("mad", clock=lambda: now[0])
    here = Backend("m1", "mad", {"http": ("127.0.0.1", PORT)}, STARTED, "passing")

    def table(state: str) -> None:
        router.update(RouteTable({"web": AppRoute("web", (b("m1", state=state),))}))

    def routed() -> bool:
        return isinstance(router.pick("web"), Choice)

    table("stopped")
    router.started(here)
    assert routed()  # the table's row older than the start
    table("starting")
    assert routed()
    table("stopped")  # started, then stopped again: the table's word now
    assert not routed() and router.started_here == {}

    router.started(here)
    now[0] += 11.0
    table("stopped")  # the table never moved: routed for STARTED_HERE_S at most
    assert not routed()

    table("started")
    router.started(here)  # the table has it already: nothing to remember
    assert router.started_here == {}


async def test_a_request_no_machine_can_take_now_waits_until_one_can() -> None:
    """The app's one machine is started but skipped after a failure: nothing is started
    (the spec wants one running), the request waits; a change (a probe passed, a new
    table) releases it to route again; one still waiting at its deadline gets a 503."""
    now = [0.0]
    router = Router("mad", clock=lambda: now[0])
    router.update(RouteTable({"web": AppRoute("web", (b("m1", state=STARTED),
                                                      b("m2")))}))  # fmt: skip
    router.failed("m1", ("127.0.0.1", PORT))

    async def start(mid: str) -> Machine:
        raise AssertionError("a second machine is not started beside the skipped one")

    starts = Starts(router, start, clock=lambda: now[0], wanted=lambda app, region: 1)
    release = Held(1)
    assert starts.hold("web", release, deadline=5.0) is None
    assert starts.pending == {} and len(starts.waiting["web"]) == 1
    router.probed("m1", ok=True)  # its probe passed: the request routes again
    assert release.told == [None] and starts.waiting == {}
    await starts.close()


async def test_no_request_starts_a_machine_while_a_failover_is_due() -> None:
    """The primary's worker is gone and the slot has a spare: the controller's to start; a
    request starts no stopped machine meanwhile (not a second primary), it waits."""
    router = router_of(b("m1", state=STARTED, worker_gone=True), b("m2"),
                       b("m3", role="spare"))  # fmt: skip

    async def start(mid: str) -> Machine:
        raise AssertionError("nothing started by a request")

    starts = Starts(router, start)
    assert starts.hold("web", Held(1)) is None and len(starts.waiting["web"]) == 1
    await starts.close()


async def test_a_waiting_request_past_its_deadline_gets_a_503() -> None:
    router = router_of(b("m1", state="starting"))

    async def start(mid: str) -> Machine:
        raise AssertionError("nothing to start")

    starts = Starts(router, start, timeout_s=0.05)
    release = Held(1)
    assert starts.hold("web", release) is None
    assert await release.all() == ["no machine of app 'web' could take it within 0.05 s"]
    assert starts.hold("other", release) == ""  # no such app
    await starts.close()


def test_a_machine_started_here_is_routed_while_its_check_has_not_passed_yet() -> None:
    """Its row says started, its check not passed yet: this edge's probe answered, so it is
    routed; once the row's check passes the table's word is enough."""
    router = Router("mad")
    here = Backend("m1", "mad", {"http": ("127.0.0.1", PORT)}, STARTED, "passing")

    def table(health: str) -> None:
        row = b("m1", state=STARTED, health=health)
        router.update(RouteTable({"web": AppRoute("web", (row,))}))

    table("pending")
    assert not isinstance(router.pick("web"), Choice)  # no address in the row, not passed
    router.started(here, "web")
    assert isinstance(router.pick("web"), Choice)
    table("passing")
    assert router.started_here == {}
