"""The supplier's price for a bid: a short pipeline of small pure stages.

    feasibility  -> a reason, or go on            (supplier/feasible.py: the chain of checks)
    utilization  -> u_r after placement, per resource the order asks for
    utility      -> f_r(u_r), piecewise-linear curves (preset spread / binpack, overridable)
    combine      -> weighted mean of f_r(u_r) = "utility"
    image term   -> score = (1 - image_weight) * utility + image_weight * image

The image term says what starting the image costs the worker. An image named by content
(a digest, docs/protocol.md §4.3a) costs its expected pull time: the bytes of its layers the
worker lacks (shared layers once) over the worker's measured pull throughput, mapped by
:func:`image_term` (1 when nothing is lacking, 1/2 at ``image_half_s``). A catalog image
(a name the worker's config maps to a command) is 1 when cached, else 0.

Every stage contributes a named subscore so an Offer (and the Placed it turns into) explains
itself: {"cpus": .., "memory_mb": .., "utility": .., "image": ..}, and for a content image
"pull_bytes" and "pull_s" (expected seconds).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Annotated, Literal

import msgspec

from bourse.wire.resources import PRICED, Vec

# Resources scored even when the order asks for none of them is impossible: cpus and memory
# are always >= 1. Disk and gpus count only when asked for, so a GPU worker is not "empty"
# (and so attractive under spread) to orders that need no GPU.
DEFAULT_WEIGHTS = {"cpus": 1.0, "memory_mb": 1.0, "disk_mb": 0.5, "gpus": 1.0}
PRESET_CURVES: dict[str, tuple[tuple[float, float], ...]] = {
    "spread": ((0.0, 1.0), (1.0, 0.0)),  # prefer emptier workers
    "binpack": ((0.0, 0.0), (1.0, 1.0)),  # prefer fuller workers
}

# The expected pull time at which a content image's term is one half (pricing.image_half_s).
DEFAULT_IMAGE_HALF_S = 10.0


Preset = Literal["spread", "binpack"]
# A curve as configured: [utilization, desirability] points, utilization ascending in [0, 1].
CurvePoints = Annotated[
    list[Annotated[list[float], msgspec.Meta(min_length=2, max_length=2)]],
    msgspec.Meta(min_length=2, max_length=32),
]


class PricingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A worker's utility function (the formula is this module's doc); :func:`build_curves`
    says whether its curves and weights make one."""

    preset: Preset = "spread"
    curves: dict[str, CurvePoints] = {}  # per resource, overriding the preset's curve
    weights: dict[str, Annotated[float, msgspec.Meta(ge=0)]] = {}
    image_weight: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.3
    image_half_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = DEFAULT_IMAGE_HALF_S
    spread_ms: Annotated[float, msgspec.Meta(ge=0, le=1000)] = 4.0


def image_term(pull_s: float, half_s: float = DEFAULT_IMAGE_HALF_S) -> float:
    """A content image's term from its expected pull seconds: ``1 / (1 + pull_s / half_s)``;
    1.0 when nothing is to be pulled, 0.5 at ``half_s``, towards 0 as the pull grows."""
    return 1.0 / (1.0 + max(0.0, pull_s) / half_s)


@dataclass(frozen=True, slots=True)
class ImageCost:
    """What starting an order's image costs a worker. ``content``: an image named by digest,
    priced by ``pull_bytes`` (its layers the worker lacks) and ``pull_s`` (those bytes over
    the worker's pull throughput); else a catalog image, cached or not."""

    cached: bool
    content: bool = False
    pull_bytes: int = 0
    pull_s: float = 0.0


CACHED = ImageCost(True)
NOT_CACHED = ImageCost(False)


class Curve:
    """Piecewise-linear f(u) through points (u ascending); clamped outside [u0, un]."""

    __slots__ = ("us", "vs")

    def __init__(self, points: Sequence[Sequence[float]]) -> None:
        pts = [(float(u), float(v)) for u, v in points]
        if len(pts) < 2:
            raise ValueError("a curve needs at least 2 points")
        for (u0, _), (u1, _) in pairwise(pts):
            if not u1 > u0:
                raise ValueError(f"curve points must have strictly ascending utilization: {pts}")
        for u, v in pts:
            if not (0.0 <= u <= 1.0 and 0.0 <= v <= 1.0):
                raise ValueError(f"curve point ({u}, {v}) is outside [0, 1] x [0, 1]")
        self.us = [u for u, _ in pts]
        self.vs = [v for _, v in pts]

    def __call__(self, u: float) -> float:
        us, vs = self.us, self.vs
        if u <= us[0]:
            return vs[0]
        if u >= us[-1]:
            return vs[-1]
        i = bisect_right(us, u)
        u0, u1, v0, v1 = us[i - 1], us[i], vs[i - 1], vs[i]
        return v0 + (v1 - v0) * (u - u0) / (u1 - u0)


class Pricer:
    """A worker's utility function, built once from its PricingConfig."""

    __slots__ = ("_terms", "curves", "image_half_s", "image_weight", "spread_ms", "weights")

    def __init__(self, cfg: PricingConfig) -> None:
        self.curves = build_curves(cfg)
        self.weights = {**DEFAULT_WEIGHTS, **cfg.weights}
        # (index, name, curve, weight) per resource, looked up once: price() runs for
        # every worker a bid reaches, and per-call dict lookups were a third of its time
        self._terms = tuple(
            (i, name, self.curves[name], self.weights[name]) for i, name in enumerate(PRICED)
        )
        self.image_weight = cfg.image_weight
        self.image_half_s = cfg.image_half_s
        self.spread_ms = cfg.spread_ms

    def image(self, cost: ImageCost | bool) -> float:
        """The image term: :func:`image_term` of a content image's pull seconds; a catalog
        image's (or a plain ``cached`` flag's) 1 or 0."""
        if isinstance(cost, bool):
            return 1.0 if cost else 0.0
        if cost.content:
            return image_term(cost.pull_s, self.image_half_s)
        return 1.0 if cost.cached else 0.0

    def price(
        self,
        capacity: Vec,
        used: Vec,
        want: Vec,
        image: ImageCost | bool,
        detail: bool = True,
    ) -> tuple[float, dict[str, float]]:
        """Score in [0, 1] and subscores for placing ``want`` on top of ``used``, ``image``
        costing what it says (a bool: a catalog image, cached or not). ``detail=False`` skips
        the subscores (the hot path prices every worker of a bid but offers only the best
        few; the score is the same either way)."""
        subscores: dict[str, float] = {}
        total = weight_sum = 0.0
        for i, name, curve, w in self._terms:
            wi = want[i]
            ci = capacity[i]
            if wi == 0 or ci == 0:
                continue
            f = curve((used[i] + wi) / ci)
            if detail:
                subscores[name] = round(f, 6)
            total += w * f
            weight_sum += w
        utility = total / weight_sum if weight_sum else 0.0
        term = self.image(image)
        score = (1.0 - self.image_weight) * utility + self.image_weight * term
        if detail:
            subscores["utility"] = round(utility, 6)
            subscores["image"] = round(term, 6)
            if isinstance(image, ImageCost) and image.content:
                subscores["pull_bytes"] = float(image.pull_bytes)
                subscores["pull_s"] = round(image.pull_s, 3)
        return round(min(1.0, max(0.0, score)), 6), subscores

    def delay_s(self, score: float) -> float:
        """Better offers answer first: wait (1 - score) * spread_ms."""
        return (1.0 - score) * self.spread_ms / 1000.0


def build_curves(cfg: PricingConfig) -> dict[str, Curve]:
    """Every priced resource's curve (the preset's unless overridden; ports are counted,
    not priced); ValueError names what in ``cfg`` makes no utility function (the fleet
    file's check calls this)."""
    unknown = set(cfg.curves) - set(PRICED)
    if unknown:
        raise ValueError(f"unknown resource(s) in curves: {sorted(unknown)}; use {PRICED}")
    unknown = set(cfg.weights) - set(PRICED)
    if unknown:
        raise ValueError(f"unknown resource(s) in weights: {sorted(unknown)}; use {PRICED}")
    base = PRESET_CURVES[cfg.preset]
    return {r: Curve(cfg.curves.get(r, base)) for r in PRICED}
