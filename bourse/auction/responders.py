"""Which supplier processes answer a region's bids, as the auctions found out (pure: the
time is given).

Prompt answers (docs/protocol.md §4.4.3) name their process: an auction waits for every
process known in its region (or, for a sampled bid, §5.3a, in each of its shards) before it
commits, and bids and releases go in batches (§4.4.4) where every known process takes
them. ``Responders`` learns those processes from each auction's ``Tally`` as it ends and
forgets a process not heard for ``RESPONDER_MEMORY_S`` (a restarted process answers under
a new name). A region where some supplier answers without a name (an older or foreign one)
has no known processes for as long: no quorum, no batches there.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from bourse.auction.core import Tally

# A supplier process not seen answering a region's bids for this long is no longer waited
# for; a supplier seen answering without a name turns the quorum off in its region this long.
RESPONDER_MEMORY_S = 10.0


@dataclass(frozen=True, slots=True)
class _Seen:
    """A supplier process seen answering: when, and whether it takes batches."""

    at: float
    batches: bool


class Responders:
    """Per region (and per shard of a region), the supplier processes seen answering."""

    __slots__ = ("_region", "_shards", "_unranked_until")

    def __init__(self) -> None:
        self._region: dict[str, dict[str, _Seen]] = {}
        self._shards: dict[str, dict[int, dict[str, _Seen]]] = {}
        self._unranked_until: dict[str, float] = {}  # region -> monotonic

    def learn(self, region: str, tally: Tally, now: float) -> None:
        """An auction in ``region`` ended at ``now``; ``tally`` says who answered it."""
        if tally.anonymous:
            self._unranked_until[region] = now + RESPONDER_MEMORY_S
        if not tally.responders:
            return
        _remember(self._region.setdefault(region, {}), tally.responders, tally, now)
        if tally.shard_responders:
            shards = self._shards.setdefault(region, {})
            for k, names in tally.shard_responders.items():
                _remember(shards.setdefault(k, {}), names, tally, now)

    def expected(self, region: str, now: float) -> frozenset[str]:
        """The processes that answer a bid to the whole of ``region`` (empty: not known,
        or some supplier there does not answer promptly)."""
        if self._unranked_until.get(region, 0.0) > now:
            return frozenset()
        return _recent(self._region.get(region, {}), now)

    def expected_per_shard(self, region: str, now: float) -> Mapping[int, frozenset[str]] | None:
        """Per shard of ``region``, the processes that answer a sampled bid there (a shard
        with none is not in it), found when asked: an auction asks about its own shards
        only. None where some supplier does not answer promptly, or none is known."""
        if self._unranked_until.get(region, 0.0) > now:
            return None
        shards = self._shards.get(region)
        return _RecentPerShard(shards, now) if shards else None

    def take_batches(self, region: str, now: float) -> bool:
        """Every process known in ``region`` takes Batch messages (and one is known)."""
        if self._unranked_until.get(region, 0.0) > now:
            return False
        seen = [s for s in self._region.get(region, {}).values() if now - s.at < RESPONDER_MEMORY_S]
        return bool(seen) and all(s.batches for s in seen)


class _RecentPerShard(Mapping[int, frozenset[str]]):
    """Per shard, the supplier processes seen answering there within RESPONDER_MEMORY_S
    of ``now``, found on lookup (a region of 10,000 single-worker processes would
    otherwise be walked whole for every auction); a shard with none is absent."""

    def __init__(self, shards: dict[int, dict[str, _Seen]], now: float) -> None:
        self._shards, self._now = shards, now

    def __getitem__(self, shard: int) -> frozenset[str]:
        n = _recent(self._shards.get(shard, {}), self._now)
        if not n:
            raise KeyError(shard)
        return n

    def __iter__(self) -> Iterator[int]:
        return (k for k in list(self._shards) if k in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _recent(seen: dict[str, _Seen], now: float) -> frozenset[str]:
    """The processes of ``seen`` that answered within RESPONDER_MEMORY_S of ``now``."""
    return frozenset(r for r, s in seen.items() if now - s.at < RESPONDER_MEMORY_S)


def _remember(seen: dict[str, _Seen], names: set[str], tally: Tally, now: float) -> None:
    """``names`` answered at ``now``; forget the processes of ``seen`` gone quiet for
    RESPONDER_MEMORY_S (restarted under a new name, or stopped)."""
    for r in names:
        seen[r] = _Seen(now, r in tally.batching)
    if len(seen) > len(names):
        for r in [r for r, s in seen.items() if now - s.at >= RESPONDER_MEMORY_S]:
            del seen[r]
