"""The supplier's price (supplier/pricing.py): curves and the score pipeline (the fit checks
before it are supplier/feasible.py's, tested in test_feasible.py).

Presets: spread f(u) = 1 - u, binpack f(u) = u. Default weights cpus 1, memory_mb 1,
disk_mb 0.5, gpus 1; image_weight 0.3, so score = 0.7 * utility + 0.3 * image, where image
is 1 or 0 for a catalog image (cached or not) and image_term(pull_s) = 1 / (1 + pull_s / 10)
for an image named by content (image_half_s 10 s).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from bourse.wire.resources import PRICED
from supplier.pricing import (
    CACHED,
    NOT_CACHED,
    Curve,
    ImageCost,
    Pricer,
    PricingConfig,
    build_curves,
    image_term,
)

# A 16-CPU, 32 GiB worker without disk or GPUs sold, already running 2 CPUs / 4 GiB.
CAP = (16, 32768, 0, 0)
USED = (2, 4096, 0, 0)
# The order: 2 CPUs / 12 GiB -> u_cpus = (2 + 2) / 16 = 0.25, u_mem = (4096 + 12288) / 32768 = 0.5
WANT = (2, 12288, 0, 0)


def pricer(**cfg: Any) -> Pricer:
    return Pricer(PricingConfig(**cfg))


# -- Curve -------------------------------------------------------------------------------------


def test_curve_interpolates_between_points() -> None:
    tent = Curve([(0.0, 0.0), (0.5, 1.0), (1.0, 0.0)])
    # f(u) = v0 + (v1 - v0) * (u - u0) / (u1 - u0)
    assert tent(0.25) == 0.5  # 0 + (1 - 0) * (0.25 - 0) / (0.5 - 0)
    assert tent(0.75) == 0.5  # 1 + (0 - 1) * (0.75 - 0.5) / (1 - 0.5)
    assert tent(0.125) == 0.25  # 0 + 1 * 0.125 / 0.5
    assert tent(0.875) == 0.25  # 1 - 1 * 0.375 / 0.5


def test_curve_exact_at_points() -> None:
    tent = Curve([(0.0, 0.0), (0.5, 1.0), (1.0, 0.0)])
    assert tent(0.0) == 0.0
    assert tent(0.5) == 1.0
    assert tent(1.0) == 0.0


def test_curve_on_inner_segment() -> None:
    c = Curve([(0.2, 0.1), (0.8, 0.7)])
    # 0.1 + (0.7 - 0.1) * (0.5 - 0.2) / (0.8 - 0.2) = 0.1 + 0.6 * 0.5 = 0.4
    assert c(0.5) == pytest.approx(0.4, abs=1e-12)
    # 0.1 + 0.6 * (0.35 - 0.2) / 0.6 = 0.25
    assert c(0.35) == pytest.approx(0.25, abs=1e-12)


def test_curve_clamps_outside_its_points() -> None:
    c = Curve([(0.2, 0.1), (0.8, 0.7)])
    assert c(0.2) == 0.1
    assert c(0.0) == 0.1
    assert c(-5.0) == 0.1
    assert c(0.8) == 0.7
    assert c(1.0) == 0.7
    assert c(3.0) == 0.7  # over-capacity utilization never leaves [0, 1]


def test_preset_shapes() -> None:
    spread = Curve([(0.0, 1.0), (1.0, 0.0)])
    binpack = Curve([(0.0, 0.0), (1.0, 1.0)])
    assert [spread(u) for u in (0.0, 0.25, 0.5, 1.0)] == [1.0, 0.75, 0.5, 0.0]
    assert [binpack(u) for u in (0.0, 0.25, 0.5, 1.0)] == [0.0, 0.25, 0.5, 1.0]


def test_curve_accepts_ints_and_lists() -> None:
    c = Curve([[0, 1], [1, 0]])
    assert c.us == [0.0, 1.0]
    assert c.vs == [1.0, 0.0]
    assert all(isinstance(x, float) for x in c.us + c.vs)


@pytest.mark.parametrize(
    ("points", "message"),
    [
        ([], "a curve needs at least 2 points"),
        ([(0.0, 1.0)], "a curve needs at least 2 points"),
        (
            [(0.0, 1.0), (0.0, 0.5)],
            "curve points must have strictly ascending utilization: [(0.0, 1.0), (0.0, 0.5)]",
        ),
        (
            [(0.0, 1.0), (0.6, 0.5), (0.4, 0.0)],
            "curve points must have strictly ascending utilization:"
            " [(0.0, 1.0), (0.6, 0.5), (0.4, 0.0)]",
        ),
        ([(0.0, 1.0), (1.5, 0.0)], "curve point (1.5, 0.0) is outside [0, 1] x [0, 1]"),
        ([(-0.1, 1.0), (1.0, 0.0)], "curve point (-0.1, 1.0) is outside [0, 1] x [0, 1]"),
        ([(0.0, 1.2), (1.0, 0.0)], "curve point (0.0, 1.2) is outside [0, 1] x [0, 1]"),
        ([(0.0, 1.0), (1.0, -0.5)], "curve point (1.0, -0.5) is outside [0, 1] x [0, 1]"),
    ],
)
def test_invalid_curve(points: list[tuple[float, float]], message: str) -> None:
    with pytest.raises(ValueError) as info:
        Curve(points)
    assert str(info.value) == message


# -- build_curves ------------------------------------------------------------------------------


def test_build_curves_preset_for_every_resource() -> None:
    curves = build_curves(PricingConfig(preset="binpack"))
    assert set(curves) == set(PRICED)
    assert all(c.us == [0.0, 1.0] and c.vs == [0.0, 1.0] for c in curves.values())


def test_build_curves_override_one_resource() -> None:
    curves = build_curves(PricingConfig(curves={"gpus": [[0.0, 0.0], [0.5, 1.0], [1.0, 0.0]]}))
    assert curves["gpus"].us == [0.0, 0.5, 1.0]
    assert curves["gpus"].vs == [0.0, 1.0, 0.0]
    assert curves["cpus"].vs == [1.0, 0.0]  # the spread preset elsewhere


def test_build_curves_rejects_unknown_curve_resource() -> None:
    with pytest.raises(ValueError) as info:
        build_curves(PricingConfig(curves={"cpu": [[0.0, 1.0], [1.0, 0.0]]}))
    assert str(info.value) == (
        "unknown resource(s) in curves: ['cpu']; use ('cpus', 'memory_mb', 'disk_mb', 'gpus')"
    )


def test_build_curves_rejects_unknown_weight_resource() -> None:
    with pytest.raises(ValueError) as info:
        build_curves(PricingConfig(weights={"ram": 1.0, "iops": 2.0}))
    assert str(info.value) == (
        "unknown resource(s) in weights: ['iops', 'ram'];"
        " use ('cpus', 'memory_mb', 'disk_mb', 'gpus')"
    )


def test_build_curves_rejects_invalid_override() -> None:
    with pytest.raises(ValueError, match=r"curve point \(2\.0, 0\.0\) is outside"):
        build_curves(PricingConfig(curves={"cpus": [[0.0, 1.0], [2.0, 0.0]]}))


def test_pricer_rejects_unknown_resource() -> None:
    with pytest.raises(ValueError, match=r"unknown resource\(s\) in curves: \['cpu'\]"):
        pricer(curves={"cpu": [[0.0, 1.0], [1.0, 0.0]]})


# -- Pricer.price ------------------------------------------------------------------------------


def test_spread_score() -> None:
    score, subs = pricer().price(CAP, USED, WANT, image=False)
    # f_cpus = 1 - 0.25 = 0.75; f_mem = 1 - 0.5 = 0.5
    # utility = (1 * 0.75 + 1 * 0.5) / 2 = 0.625
    # score = 0.7 * 0.625 + 0.3 * 0 = 0.4375
    assert score == 0.4375
    assert subs == {"cpus": 0.75, "memory_mb": 0.5, "utility": 0.625, "image": 0.0}


def test_binpack_score() -> None:
    score, subs = pricer(preset="binpack").price(CAP, USED, WANT, image=False)
    # f_cpus = 0.25; f_mem = 0.5; utility = (0.25 + 0.5) / 2 = 0.375; score = 0.7 * 0.375
    assert score == 0.2625
    assert subs == {"cpus": 0.25, "memory_mb": 0.5, "utility": 0.375, "image": 0.0}


def test_spread_prefers_emptier_and_binpack_fuller() -> None:
    empty, full = (0, 0, 0, 0), (12, 16384, 0, 0)
    spread, binpack = pricer(), pricer(preset="binpack")
    # spread: empty -> (0.875 + 0.625) / 2 = 0.75 -> 0.525; full -> (0.125 + 0.125) / 2 -> 0.0875
    assert spread.price(CAP, empty, WANT, False)[0] == 0.525
    assert spread.price(CAP, full, WANT, False)[0] == 0.0875
    # binpack: empty -> (0.125 + 0.375) / 2 = 0.25 -> 0.175; full -> (0.875 + 0.875) / 2 -> 0.6125
    assert binpack.price(CAP, empty, WANT, False)[0] == 0.175
    assert binpack.price(CAP, full, WANT, False)[0] == 0.6125


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("spread", 0.7375),  # 0.7 * 0.625 + 0.3 * 1
        ("binpack", 0.5625),  # 0.7 * 0.375 + 0.3 * 1
    ],
)
def test_image_bonus(preset: str, expected: float) -> None:
    score, subs = pricer(preset=preset).price(CAP, USED, WANT, image=True)
    assert score == expected
    assert subs["image"] == 1.0


def test_image_weight_extremes() -> None:
    # image_weight 0: the score is the utility alone; 1: only the image counts.
    assert pricer(image_weight=0.0).price(CAP, USED, WANT, True)[0] == 0.625
    assert pricer(image_weight=1.0).price(CAP, USED, WANT, True)[0] == 1.0
    assert pricer(image_weight=1.0).price(CAP, USED, WANT, False)[0] == 0.0


def test_disk_and_gpus_not_scored_unless_requested() -> None:
    cap = (16, 32768, 1000, 2)  # this worker also sells disk and GPUs
    score, subs = pricer().price(cap, USED, WANT, False)
    assert score == 0.4375  # same as a worker without them
    assert set(subs) == {"cpus", "memory_mb", "utility", "image"}


def test_disk_scored_with_half_weight() -> None:
    cap = (16, 32768, 1000, 2)
    want = (2, 12288, 250, 0)  # u_disk = 250 / 1000 = 0.25 -> f = 0.75
    score, subs = pricer().price(cap, USED, want, False)
    # utility = (1 * 0.75 + 1 * 0.5 + 0.5 * 0.75) / (1 + 1 + 0.5) = 1.625 / 2.5 = 0.65
    # score = 0.7 * 0.65 = 0.455
    assert subs == {
        "cpus": 0.75,
        "memory_mb": 0.5,
        "disk_mb": 0.75,
        "utility": 0.65,
        "image": 0.0,
    }
    assert score == 0.455


def test_gpus_scored_when_requested() -> None:
    cap = (16, 32768, 1000, 2)
    want = (2, 12288, 0, 1)  # u_gpus = 1 / 2 -> f = 0.5
    score, subs = pricer().price(cap, USED, want, False)
    # utility = (0.75 + 0.5 + 0.5) / 3 = 0.5833333.. -> 0.583333
    # score = 0.7 * 0.5833333.. = 0.4083333.. -> 0.408333
    assert subs == {
        "cpus": 0.75,
        "memory_mb": 0.5,
        "gpus": 0.5,
        "utility": 0.583333,
        "image": 0.0,
    }
    assert score == 0.408333


def test_resource_without_capacity_is_skipped() -> None:
    # the fits check refuses such an order first; price itself must not divide by zero.
    score, subs = pricer().price(CAP, USED, (2, 12288, 0, 1), False)
    assert "gpus" not in subs
    assert score == 0.4375


def test_weights_override() -> None:
    score, subs = pricer(weights={"memory_mb": 3.0}).price(CAP, USED, WANT, False)
    # utility = (1 * 0.75 + 3 * 0.5) / (1 + 3) = 2.25 / 4 = 0.5625; score = 0.7 * 0.5625
    assert subs["utility"] == 0.5625
    assert score == 0.39375


def test_zero_weights_give_zero_utility() -> None:
    score, subs = pricer(weights={"cpus": 0.0, "memory_mb": 0.0}).price(CAP, USED, WANT, True)
    assert subs["utility"] == 0.0
    assert score == 0.3  # only the image term remains


def test_custom_curve_in_price() -> None:
    tent = [[0.0, 0.0], [0.5, 1.0], [1.0, 0.0]]
    score, subs = pricer(curves={"cpus": tent}).price(CAP, USED, WANT, False)
    # f_cpus = tent(0.25) = 0.5; f_mem = spread(0.5) = 0.5; utility 0.5; score 0.35
    assert subs["cpus"] == 0.5
    assert subs["utility"] == 0.5
    assert score == 0.35


def test_subscores_rounded_to_six_places() -> None:
    score, subs = pricer().price((3, 3, 0, 0), (0, 0, 0, 0), (1, 1, 0, 0), False)
    # f = 1 - 1/3 = 0.6666..; score = 0.7 * 0.6666.. = 0.4666..
    assert subs["cpus"] == 0.666667
    assert subs["utility"] == 0.666667
    assert score == 0.466667


def test_full_worker_scores_zero_under_spread() -> None:
    score, subs = pricer().price(CAP, (14, 20480, 0, 0), WANT, False)
    assert subs["cpus"] == 0.0  # u = 16/16
    assert subs["memory_mb"] == 0.0  # u = 32768/32768
    assert score == 0.0


def test_score_always_in_unit_interval() -> None:
    p = pricer(preset="binpack", image_weight=0.5)
    for used_cpus in range(0, 15):
        score, _ = p.price(CAP, (used_cpus, 4096, 0, 0), WANT, True)
        assert 0.0 <= score <= 1.0


# -- delay_s -----------------------------------------------------------------------------------


def test_delay_s() -> None:
    p = pricer(spread_ms=4.0)
    # (1 - score) * spread_ms / 1000
    assert p.delay_s(1.0) == 0.0
    assert p.delay_s(0.0) == 0.004
    assert p.delay_s(0.75) == 0.001
    assert pricer(spread_ms=0.0).delay_s(0.1) == 0.0
    assert pricer(spread_ms=100.0).delay_s(0.5) == 0.05


@pytest.mark.parametrize("preset", ["spread", "binpack"])
@pytest.mark.parametrize("cached", [True, False])
def test_the_hot_path_price_without_detail_is_the_same_score(preset: str, cached: bool) -> None:
    p = Pricer(msgspec.convert({"preset": preset}, PricingConfig))
    for used in [(0, 0, 0, 0), (3, 1000, 10, 0), (7, 8000, 0, 1)]:
        full, subs = p.price((8, 8192, 100, 2), used, (1, 192, 5, 1), cached)
        fast, none = p.price((8, 8192, 100, 2), used, (1, 192, 5, 1), cached, detail=False)
        assert fast == full and none == {} and subs


# -- the image term of a content image ------------------------------------------------------


@pytest.mark.parametrize(
    ("pull_s", "half_s", "term"),
    [
        (0.0, 10.0, 1.0),  # nothing to pull: as a cached image
        (10.0, 10.0, 0.5),  # the half-time: 1 / (1 + 1)
        (30.0, 10.0, 0.25),  # 1 / (1 + 3)
        (2.0, 10.0, 1 / 1.2),
        (1.0, 1.0, 0.5),
        (-1.0, 10.0, 1.0),  # a clock's rounding below zero is nothing to pull
    ],
)
def test_image_term_is_one_over_one_plus_pull_over_half(
    pull_s: float, half_s: float, term: float
) -> None:
    assert image_term(pull_s, half_s) == pytest.approx(term)


def test_the_image_term_falls_as_the_pull_grows() -> None:
    terms = [image_term(s) for s in (0, 0.5, 1, 5, 20, 60, 600)]
    assert terms == sorted(terms, reverse=True) and len(set(terms)) == len(terms)
    assert 0 < terms[-1] < 0.02


def test_a_content_image_is_priced_by_its_pull_with_its_bytes_and_seconds() -> None:
    cost = ImageCost(False, True, pull_bytes=100 * 1024 * 1024, pull_s=10.0)
    score, subs = pricer().price(CAP, USED, WANT, cost)
    # utility 0.625 (test_spread_score); image = 1 / (1 + 10 / 10) = 0.5
    assert score == 0.4375 + 0.3 * 0.5  # 0.7 * 0.625 + 0.15 = 0.5875
    assert subs == {
        "cpus": 0.75,
        "memory_mb": 0.5,
        "utility": 0.625,
        "image": 0.5,
        "pull_bytes": 104857600.0,
        "pull_s": 10.0,
    }
    # a content image here already scores as a cached catalog image, and says it pulls nothing
    here, subs = pricer().price(CAP, USED, WANT, ImageCost(True, True))
    assert here == pricer().price(CAP, USED, WANT, True)[0] == 0.7375
    assert (subs["image"], subs["pull_bytes"], subs["pull_s"]) == (1.0, 0.0, 0.0)


def test_the_half_time_is_a_pricing_setting() -> None:
    cost = ImageCost(False, True, pull_bytes=1, pull_s=5.0)
    assert pricer(image_half_s=5.0).image(cost) == 0.5
    assert pricer(image_half_s=20.0).image(cost) == 0.8
    with pytest.raises(msgspec.ValidationError, match="image_half_s"):
        msgspec.convert({"image_half_s": 0}, PricingConfig)


def test_a_catalog_image_keeps_its_cached_or_not_term() -> None:
    p = pricer()
    assert (p.image(CACHED), p.image(NOT_CACHED), p.image(True), p.image(False)) == (1, 0, 1, 0)
    _, subs = p.price(CAP, USED, WANT, NOT_CACHED)
    assert "pull_bytes" not in subs and subs["image"] == 0.0
