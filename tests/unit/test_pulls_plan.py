"""The pulls scenario's pure parts: its images' layers (sizes, shared bases), its order
stream (seeded), its options, and the bid of an order for content."""

from __future__ import annotations

from pathlib import Path

import pytest

import loadtest.pulls
from loadtest.pulls import MB, PullsProfile, image_plan, profile_of, stream


def test_each_image_is_its_size_with_a_base_shared_by_its_pair() -> None:
    profile = PullsProfile(images=5, image_mb=(20, 200), base_mb=10, seed=7)
    plans = image_plan(profile)
    assert len(plans) == 5
    for i, layers in enumerate(plans):
        assert 20 * MB <= sum(size for _, size in layers) <= 200 * MB
        assert layers[0] == (f"base{i // 2}", 10 * MB)
        assert len(layers) == (3 if i % 2 else 2)  # odd images have two layers of their own
    names = [name for layers in plans for name, _ in layers]
    assert names.count("base0") == 2 and names.count("base2") == 1
    assert image_plan(profile) == plans  # seeded


def test_the_stream_is_seeded_paced_and_prefers_popular_images() -> None:
    profile = PullsProfile(images=4, orders=400, rate=4.0, seed=3)
    orders = stream(profile)
    assert orders == stream(profile)
    assert [at for at, _ in orders[:3]] == [0.0, 0.25, 0.5]
    counts = [sum(1 for _, k in orders if k == i) for i in range(4)]
    assert counts[0] > counts[3] > 0


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ({}, PullsProfile()),
        ({"image_mb": "20-200"}, PullsProfile(image_mb=(20, 200))),
        ({"rate": 2.0, "duration_s": 10.0}, PullsProfile(rate=2.0, orders=20)),
        ({"workers": 5, "seed": 9}, PullsProfile(workers=5, seed=9)),
    ],
)
def test_the_commands_options_make_the_profile(
    given: dict[str, object], want: PullsProfile
) -> None:
    assert profile_of(given) == want


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"image_mb": "200"}, "expected MIN-MAX"),
        ({"image_mb": "60-20"}, "need 0 < base < min <= max"),
        ({"image_mb": "5-20"}, "need 0 < base < min <= max"),
    ],
)
def test_bad_options_are_named(given: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        profile_of(given)


def test_the_pulls_scenario_takes_its_options_from_the_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from ops import cli as bourse

    got: list[PullsProfile] = []

    async def fake_run(profile: PullsProfile, out: Path, say: object) -> dict[str, object]:
        got.append(profile)
        return {"scenario": "pulls", "out": str(out)}

    monkeypatch.setattr(loadtest.pulls, "run_pulls", fake_run)
    args = ["--workers", "2", "--rate", "3", "--duration-s", "2", "--lifetime-s", "1.5"]
    args += ["--seed", "4", "--images", "3", "--image-mb", "20-30"]
    result = CliRunner().invoke(
        bourse.app, ["loadtest", "--scenario", "pulls", *args, "--json", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert got == [
        PullsProfile(
            workers=2, rate=3.0, orders=6, lifetime_s=1.5, seed=4, images=3, image_mb=(20, 30)
        )
    ]
    bad = CliRunner().invoke(bourse.app, ["loadtest", "--scenario", "pulls", "--image-mb", "x"])
    assert bad.exit_code == 1 and "invalid pulls profile: --image-mb 'x'" in bad.output
