"""The cache's eviction policy and its pull throughput (pure: sizes, times and pins in,
decisions out; the clock is the caller's).

An entry is a layer or an image's root, with its bytes on disk and when it was last used.
Nothing happens while the cache holds at most the high watermark of its budget (85%, as
kubelet's image GC); past it, entries are evicted least recently used first until it holds
the low watermark (80%). An entry is never evicted while pinned (an image that a live or
reserved machine uses, and that image's layers) nor before ``delay_s`` (180 s, as Nomad's
image GC) has passed since its last use. A pull of ``incoming`` bytes is planned the same
way with those bytes counted as held; when it could not fit even with every evictable
entry gone, nothing is evicted and the plan says it does not fit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from bourse.images.errors import ImageError

DEFAULT_DELAY_S = 180.0
HIGH_WATERMARK = 0.85
LOW_WATERMARK = 0.80
# The pull throughput assumed before the first measured pull: 50 MiB/s (a 400 Mbit/s link).
DEFAULT_PULL_BYTES_PER_S = 50.0 * 1024 * 1024
# Pulls smaller than this say more about latency than throughput: not measured.
MIN_SAMPLE_BYTES = 1024 * 1024
# Weight of the newest pull in the moving average.
RATE_WEIGHT = 0.3


class BadCacheLimits(ImageError, ValueError):
    """Limits that cannot bound a cache (a budget of nothing, watermarks out of order)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """A cache's budget in bytes, its watermarks (fractions of it) and its delay."""

    budget_bytes: int
    high: float = HIGH_WATERMARK
    low: float = LOW_WATERMARK
    delay_s: float = DEFAULT_DELAY_S

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise BadCacheLimits(f"cache budget {self.budget_bytes} bytes: must be positive")
        if not 0 < self.low <= self.high <= 1:
            raise BadCacheLimits(
                f"cache watermarks low {self.low}, high {self.high}: need 0 < low <= high <= 1"
            )
        if self.delay_s < 0:
            raise BadCacheLimits(f"cache delay {self.delay_s} s: must not be negative")


@dataclass(frozen=True, slots=True)
class Entry:
    """One layer or image root, as the policy sees it."""

    key: str
    size: int
    last_used: float
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class Plan:
    """The entries to evict (in order), the bytes held after, and whether ``incoming``
    bytes then fit the budget."""

    evict: tuple[str, ...]
    used_after: int
    fits: bool


def evictable(entry: Entry, limits: Limits, now: float) -> bool:
    """Whether ``entry`` may go now: not pinned, and unused for ``delay_s``."""
    return not entry.pinned and now - entry.last_used >= limits.delay_s


def plan(entries: Iterable[Entry], limits: Limits, now: float, incoming: int = 0) -> Plan:
    """What to evict so that the cache, with ``incoming`` bytes more, is back within its
    watermarks."""
    entries = list(entries)
    used = sum(e.size for e in entries)
    budget = limits.budget_bytes
    if used + incoming <= limits.high * budget:
        return Plan((), used, used + incoming <= budget)
    candidates = sorted(
        (e for e in entries if evictable(e, limits, now)), key=lambda e: (e.last_used, e.key)
    )
    if used - sum(e.size for e in candidates) + incoming > budget:
        return Plan((), used, False)  # evicting all there is would not make room
    target = limits.low * budget - incoming
    evict = []
    for entry in candidates:
        if used <= target:
            break
        evict.append(entry.key)
        used -= entry.size
    return Plan(tuple(evict), used, used + incoming <= budget)


@dataclass(slots=True)
class PullRate:
    """Measured pull throughput: a moving average of real pulls (of at least
    ``MIN_SAMPLE_BYTES``), ``DEFAULT_PULL_BYTES_PER_S`` before the first."""

    bytes_per_s: float = DEFAULT_PULL_BYTES_PER_S
    samples: int = 0

    def observe(self, size: int, seconds: float) -> None:
        """Count a pull of ``size`` bytes that took ``seconds``."""
        if size < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        rate = size / seconds
        weight = RATE_WEIGHT if self.samples else 1.0
        self.bytes_per_s = weight * rate + (1 - weight) * self.bytes_per_s
        self.samples += 1

    def seconds_for(self, size: int) -> float:
        """How long pulling ``size`` bytes is expected to take."""
        return size / self.bytes_per_s
