"""The load-test workload and the oracle: seeded, deterministic, exact on small cases."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import msgspec
import pytest
import structlog

from bourse.wire.messages import PlaceOrder, Resources
from loadtest.oracle import run_oracle
from loadtest.workload import SCENARIOS, Profile, Shape, TraceOrder, fleet, trace


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """`bourse loadtest` configures logging for the whole process (a refused run raises
    the level to warning or error): left so, it would empty later tests' captured logs."""
    config = structlog.get_config()
    yield
    structlog.configure(**config)


def test_same_seed_same_trace_and_fleet_other_seed_other_trace() -> None:
    p = SCENARIOS["smoke"]
    assert trace(p) == trace(p)
    assert fleet(p) == fleet(p)
    other = msgspec.structs.replace(p, seed=2)
    assert [t.order.image for t in trace(other)] != [t.order.image for t in trace(p)]


def test_trace_is_poisson_at_the_rate_and_spread_over_regions() -> None:
    p = Profile(rate=200, duration_s=20, regions=4, workers=8)
    t = trace(p)
    assert len(t) == 4000
    assert all(a.due_s < b.due_s for a, b in pairwise(t))
    assert t[-1].due_s == pytest.approx(20.0, rel=0.05)  # 4000 arrivals at 200/s
    per_region = {r: sum(x.order.region == r for x in t) for r in p.region_names()}
    assert all(abs(n - 1000) < 100 for n in per_region.values())


def test_offered_load_formula() -> None:
    # 10/s x 4 s x 2 cpus / (2 workers x 8 cpus) = 5.0
    p = Profile(rate=10, lifetime_s=4, shapes=[Shape(2, 64)], workers=2, worker_cpus=8)
    assert p.offered_load() == pytest.approx(5.0)
    assert SCENARIOS["quality-90"].offered_load() == pytest.approx(0.9, abs=0.001)


def _order(i: int, region: str = "r0", cpus: int = 1, image: str = "img000") -> PlaceOrder:
    return PlaceOrder(
        order_id=f"o{i}", region=region, resources=Resources(cpus=cpus, memory_mb=1), image=image
    )


def test_oracle_fills_what_fits_and_frees_capacity_when_machines_leave() -> None:
    p = Profile(workers=1, regions=1, worker_cpus=2, cached_per_worker=0, images=2)
    orders = [
        TraceOrder(0.0, _order(0), lifetime_s=10.0),
        TraceOrder(1.0, _order(1), lifetime_s=10.0),
        TraceOrder(2.0, _order(2), lifetime_s=10.0),  # full: unfilled
        TraceOrder(11.0, _order(3), lifetime_s=1.0),  # the first one has left: fits
        TraceOrder(12.0, _order(4, region="r9"), lifetime_s=1.0),  # no such region
    ]
    r = run_oracle(p, orders)
    assert (r.orders, r.placed) == (5, 3)
    # nothing cached at start; the first placement pulls img000, the next ones hit it
    assert r.image_hits == 2


def test_oracle_chooses_like_the_suppliers_spread_vs_binpack() -> None:
    # Two empty 16-cpu workers, no image pulls (a cached image would outweigh the curves).
    # The first order ties (the first worker wins); the second
    # goes to the emptier worker under spread and to the fuller one under binpack.
    orders = [TraceOrder(float(i), _order(i, image="none"), 100.0) for i in range(2)]
    base = Profile(workers=2, regions=1, cached_per_worker=0, start_machines=False)
    spread = run_oracle(base, orders).chosen
    binpack = run_oracle(msgspec.structs.replace(base, preset="binpack"), orders).chosen
    assert spread == {"o0": "r0-w0000", "o1": "r0-w0001"}
    assert binpack == {"o0": "r0-w0000", "o1": "r0-w0000"}


def test_every_override_reaches_the_profile_and_unknown_ones_are_refused() -> None:
    from loadtest.workload import resolve_profile

    overrides = {
        "workers": 7,
        "regions": 3,
        "rate": 11.0,
        "duration_s": 2.5,
        "mode": "closed",
        "concurrency": 5,
        "lifetime_s": 1.5,
        "supplier_processes": 2,
        "exchanges": 3,
        "seed": 9,
        "spread_ms": 1.0,
        "bid_shards": 4,
        "bid_sample": 1,
        "exchange_max_inflight": 50,
    }
    p = resolve_profile("smoke", None, overrides)
    assert {k: getattr(p, k) for k in overrides} == overrides
    assert resolve_profile("smoke", None, {"rate": None}).rate == SCENARIOS["smoke"].rate
    with pytest.raises(ValueError, match="not profile fields"):
        resolve_profile("smoke", None, {"bid_shard": 4})
    with pytest.raises(ValueError, match="unknown scenario"):
        resolve_profile("nope")


def test_every_loadtest_flag_reaches_the_profile_the_run_gets(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Guards against a CLI flag that is accepted and silently dropped (it happened).
    from typer.testing import CliRunner

    import loadtest.harness
    from ops import cli as bourse

    got: list[Profile] = []
    options: list[dict[str, object]] = []

    async def fake_run(profile: Profile, *args: object, **kwargs: object) -> dict[str, object]:
        got.append(profile)
        options.append(kwargs)
        return {"violations": [], "plots": []}

    # `bourse loadtest` imports the harness when it runs (its extra may be missing)
    monkeypatch.setattr(loadtest.harness, "run_loadtest", fake_run)
    flags = {
        "--workers": ("workers", 7),
        "--regions": ("regions", 3),
        "--rate": ("rate", 11.0),
        "--duration-s": ("duration_s", 2.5),
        "--mode": ("mode", "closed"),
        "--concurrency": ("concurrency", 5),
        "--lifetime-s": ("lifetime_s", 1.5),
        "--processes": ("supplier_processes", 2),
        "--exchanges": ("exchanges", 3),
        "--seed": ("seed", 9),
        "--spread-ms": ("spread_ms", 1.0),
        "--bid-shards": ("bid_shards", 4),
        "--bid-sample": ("bid_sample", 1),
        "--max-inflight": ("exchange_max_inflight", 50),
        "--max-offers": ("max_offers", 2),
        "--quote-sample": ("quote_sample", 5),
        "--target-auction-ms": ("exchange_target_ms", 12.5),
        "--direct": ("direct", True),
        "--no-claims": ("claims", False),
        "--no-prompt-offers": ("prompt_offers", False),
        "--no-batches": ("batches", False),
        "--no-jetstream": ("jetstream", False),
    }
    args = [
        a
        for flag, (_, v) in flags.items()
        for a in ((flag,) if isinstance(v, bool) else (flag, str(v)))
    ]
    result = CliRunner().invoke(
        bourse.app, ["loadtest", *args, "--tap", "--json", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    [profile] = got
    assert {field: getattr(profile, field) for field, _ in flags.values()} == dict(flags.values())
    assert options[0]["tap"] is True  # a run option, not the profile's
    # and every option of the command is either such a flag or one of the run's own
    import inspect

    own = {"scenario", "profile_file", "out", "ceiling", "oracle", "nats", "supplier_nats", "json"}
    own |= {"soak", "fault_every_s", "nats_nodes", "duplicates"}  # soak mode (test_soak.py)
    own |= {"nats_monitor"}  # the --nats server's /varz: messages per placement
    own |= {"tap"}  # messages by kind (loadtest/tap.py)
    own |= {"images", "image_mb"}  # the pulls scenario's (test_pulls_plan.py)
    own |= {"starts", "machines"}  # the starts scenario's (loadtest/starts.py)
    own |= {"changes_per_s", "build_machines", "cli_runs"}  # the view scenario's (views.py)
    from ops.loadtest_cli import loadtest

    params = set(inspect.signature(loadtest).parameters) - own
    assert len(params) == len(flags)


@pytest.mark.parametrize(
    "args", [["--nats", "nats://127.0.0.1:4222"], ["--soak", "5"]], ids=["nats", "soak"]
)
def test_no_jetstream_is_refused_where_the_run_does_not_start_its_own_server(
    args: list[str],
) -> None:
    from typer.testing import CliRunner

    from ops import cli as bourse

    result = CliRunner().invoke(bourse.app, ["loadtest", "--no-jetstream", *args])
    assert result.exit_code == 1
    assert "--no-jetstream is for the embedded server of a plain run" in result.output


def test_the_run_passes_sampling_and_admission_to_its_processes(tmp_path: Path) -> None:
    from loadtest.runner import exchange_args, supplier_args
    from loadtest.workload import resolve_profile

    p = resolve_profile(
        "smoke",
        None,
        {"bid_shards": 8, "bid_sample": 3, "exchange_max_inflight": 77, "reclaim_after_s": 1.5}
        | {"exchange_quiet_ms": 250.0},
    )
    sup = supplier_args(p, tmp_path / "f.json", tmp_path / "d", ["--nats", "x"])
    ex = exchange_args(p, ["--nats", "x"])
    assert sup[sup.index("--bid-shards") + 1] == "8"
    assert sup[sup.index("--reclaim-after-s") + 1] == "1.5"
    assert ex[ex.index("--bid-shards") + 1] == "8" and ex[ex.index("--bid-sample") + 1] == "3"
    assert ex[ex.index("--max-inflight") + 1] == "77"
    assert ex[ex.index("--quiet-ms") + 1] == "250.0"
    # and the programs accept them
    from typer.testing import CliRunner

    from exchange.cli import app as exchange_app
    from supplier.cli import app as supplier_app

    for app, args in ((supplier_app, [*sup, "--help"]), (exchange_app, [*ex, "--help"])):
        assert CliRunner().invoke(app, args).exit_code == 0


def test_a_shard_lives_in_one_supplier_process_under_sampled_bidding() -> None:
    from bourse.wire.subjects import shard_of
    from loadtest.runner import split_fleet
    from loadtest.workload import fleet, resolve_profile

    p = resolve_profile("smoke", None, {"workers": 60, "bid_shards": 6})
    workers = fleet(p)
    shares = split_fleet(workers, 3, p.bid_shards)
    assert sorted(str(w["worker_id"]) for s in shares for w in s) == sorted(
        str(w["worker_id"]) for w in workers
    )
    homes = {shard_of(str(w["worker_id"]), 6): i for i, s in enumerate(shares) for w in s}
    for i, share in enumerate(shares):
        assert all(homes[shard_of(str(w["worker_id"]), 6)] == i for w in share)
    # broadcast (or fewer shards than processes): dealt round-robin
    assert [len(s) for s in split_fleet(workers, 3, 0)] == [20, 20, 20]
    assert [len(s) for s in split_fleet(workers, 4, 2)] == [15, 15, 15, 15]


def test_no_supplier_process_is_left_without_workers() -> None:
    from bourse.wire.subjects import shard_of
    from loadtest.runner import split_fleet
    from loadtest.workload import SCENARIOS, fleet

    # the soak fleet (12 workers, 3 processes) with 3 shards: one shard is empty, so whole
    # shards would leave a process with nothing to serve (it refuses to start)
    workers = fleet(SCENARIOS["soak"])
    assert len({shard_of(str(w["worker_id"]), 3) for w in workers}) < 3
    shares = split_fleet(workers, 3, 3)
    assert all(shares) and sum(map(len, shares)) == len(workers)
    # with more shards than processes, whole shards, balanced
    for n in (4, 6, 8):
        shares = split_fleet(workers, 3, n)
        assert all(shares) and sum(map(len, shares)) == len(workers)


def test_fractional_shapes_and_workers_reach_the_trace_fleet_and_oracle() -> None:
    from bourse.wire.resources import vec

    p = Profile(
        workers=1,
        regions=1,
        worker_cpus=1,
        cached_per_worker=0,
        images=1,
        shapes=[Shape(0.5, 64)],
        rate=10,
        duration_s=0.3,
    )
    t = trace(p)
    assert {x.order.resources for x in t} == {Resources(cpus=1, cpu_millis=500, memory_mb=64)}
    assert fleet(msgspec.structs.replace(p, worker_cpus=1.5))[0]["capacity"] == {
        "cpus": 2,
        "cpu_millis": 1500,
        "memory_mb": 65536,
    }
    # two halves fit the one 1-CPU worker, a third does not (I1 in the oracle too)
    orders = [TraceOrder(float(i), x.order, 100.0) for i, x in enumerate(t)]
    assert len(orders) == 3 and vec(orders[0].order.resources)[0] == 500
    assert run_oracle(p, orders).placed == 2
    # 10/s x 20 s x 0.5 cpus / 1 cpu
    assert p.offered_load() == pytest.approx(100.0)


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ({"worker_cpus": 0}, "worker_cpus: '0.0' is not more than 0 CPUs"),
        (
            {"shapes": [{"cpus": 1.0005, "memory_mb": 64}]},
            "shapes[0].cpus: '1.0005' is finer than a millicore",
        ),
    ],
)
def test_a_profile_with_an_impossible_cpu_amount_is_refused(
    override: dict[str, object], error: str
) -> None:
    from loadtest.workload import resolve_profile

    with pytest.raises(ValueError) as info:
        resolve_profile("smoke", overrides=override)
    assert str(info.value).startswith(error)


def test_a_run_directory_loses_an_earlier_runs_state_and_keeps_the_rest(tmp_path: Path) -> None:
    # an earlier soak's SQLite files, recovered by this run's suppliers, made the audit
    # count each order id's machines of both runs: "I3 order ... has 2 machines"
    from loadtest.runner import RUN_STATE_DIRS, fresh_run_dir

    out = tmp_path / "out"
    for d in RUN_STATE_DIRS:
        (out / d / "s0").mkdir(parents=True)
        (out / d / "s0" / "state.db").write_text("an earlier run's")
    (out / "soak-report.json").write_text("{}")
    fresh_run_dir(out)
    assert sorted(p.name for p in out.iterdir()) == ["soak-report.json"]
    fresh_run_dir(tmp_path / "new")
    assert (tmp_path / "new").is_dir()
