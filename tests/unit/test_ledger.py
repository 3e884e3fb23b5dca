"""Capacity accounting (supplier/ledger.py): holds, TTLs, commits, and I1."""

from __future__ import annotations

import random
from typing import cast

import pytest

from bourse.wire.resources import ZERO, Vec, add, leq, sub
from supplier.ledger import EXPIRED_MEMORY, Hold, Ledger

CAP: Vec = (8, 8192, 100, 1, 0)


def hold(
    order_id: str,
    want: Vec = (2, 2048, 0, 0, 0),
    expires_at: float = 10.0,
    auction_id: str = "",
) -> Hold:
    return Hold(order_id, want, expires_at, 0.5, {"utility": 0.5}, False, auction_id)


def held_sum(ledger: Ledger) -> Vec:
    total = ZERO
    for h in ledger.holds.values():
        total = add(total, h.want)
    return total


# -- vector helpers ----------------------------------------------------------------------------


def test_vector_helpers() -> None:
    assert add((1, 2, 3, 4, 0), (10, 20, 30, 40, 0)) == (11, 22, 33, 44, 0)
    assert sub((11, 22, 33, 44, 0), (1, 2, 3, 4, 0)) == (10, 20, 30, 40, 0)
    assert leq((1, 2, 3, 4, 0), (1, 2, 3, 4, 0)) is True
    assert leq((1, 2, 3, 5, 0), (1, 2, 3, 4, 0)) is False
    assert leq((0, 3, 0, 0, 0), (9, 2, 9, 9, 0)) is False


# -- hold --------------------------------------------------------------------------------------


def test_new_ledger_is_empty() -> None:
    ledger = Ledger(CAP)
    assert ledger.committed == ZERO
    assert ledger.held == ZERO
    assert ledger.free == CAP
    assert ledger.used == ZERO
    assert ledger.free_of_committed == CAP


def test_hold_that_fits() -> None:
    ledger = Ledger(CAP)
    h = hold("a", (3, 1000, 10, 1, 0))
    assert ledger.hold(h) is True
    assert ledger.holds == {"a": h}
    assert ledger.held == (3, 1000, 10, 1, 0)
    assert ledger.free == (5, 7192, 90, 0, 0)
    assert ledger.used == (3, 1000, 10, 1, 0)
    assert ledger.free_of_committed == CAP


def test_hold_exactly_the_rest() -> None:
    ledger = Ledger(CAP)
    assert ledger.hold(hold("a", (6, 6000, 0, 0, 0)))
    assert ledger.hold(hold("b", (2, 2192, 100, 1, 0)))
    assert ledger.free == ZERO
    ledger.check()


@pytest.mark.parametrize(
    "want", [(9, 1, 0, 0, 0), (1, 8193, 0, 0, 0), (1, 1, 101, 0, 0), (1, 1, 0, 2, 0)]
)
def test_hold_that_does_not_fit(want: Vec) -> None:
    ledger = Ledger(CAP)
    assert ledger.hold(hold("a", want)) is False
    assert ledger.holds == {}
    assert ledger.held == ZERO


def test_hold_does_not_fit_on_top_of_others() -> None:
    ledger = Ledger(CAP)
    assert ledger.hold(hold("a", (6, 1000, 0, 0, 0)))
    assert ledger.hold(hold("b", (3, 1000, 0, 0, 0))) is False  # 6 + 3 > 8 CPUs
    assert ledger.held == (6, 1000, 0, 0, 0)
    assert list(ledger.holds) == ["a"]


def test_hold_does_not_fit_on_top_of_committed() -> None:
    ledger = Ledger(CAP)
    ledger.load_committed((7, 1000, 0, 0, 0))
    assert ledger.free == (1, 7192, 100, 1, 0)
    assert ledger.hold(hold("a", (2, 1, 0, 0, 0))) is False
    assert ledger.hold(hold("a", (1, 1, 0, 0, 0))) is True
    assert ledger.free == (0, 7191, 100, 1, 0)
    assert ledger.free_of_committed == (1, 7192, 100, 1, 0)


def test_rehold_same_order_replaces_earlier_hold() -> None:
    ledger = Ledger(CAP)
    assert ledger.hold(hold("a", (2, 2048, 0, 0, 0), expires_at=5.0))
    assert ledger.hold(hold("a", (3, 1024, 0, 0, 0), expires_at=9.0))
    assert ledger.held == (3, 1024, 0, 0, 0) == held_sum(ledger)


# -- drop --------------------------------------------------------------------------------------


def test_drop_frees_capacity() -> None:
    ledger = Ledger(CAP)
    h = hold("a")
    ledger.hold(h)
    ledger.hold(hold("b", (1, 1, 0, 0, 0)))
    assert ledger.drop("a") is h
    assert ledger.held == (1, 1, 0, 0, 0)
    assert list(ledger.holds) == ["b"]
    assert ledger.drop("a") is None  # already gone
    assert ledger.drop("zzz") is None
    assert ledger.held == (1, 1, 0, 0, 0)


def test_drop_respects_committing_pin() -> None:
    ledger = Ledger(CAP)
    h = hold("a")
    ledger.hold(h)
    h.committing = True
    assert ledger.drop("a") is None
    assert ledger.holds == {"a": h}
    assert ledger.held == (2, 2048, 0, 0, 0)


def test_drop_respects_auction_id() -> None:
    ledger = Ledger(CAP)
    h = hold("a", auction_id="run-2")
    ledger.hold(h)
    assert ledger.drop("a", auction_id="run-1") is None  # a Release from an older run
    assert ledger.holds == {"a": h}
    assert ledger.drop("a", auction_id="run-2") is h
    assert ledger.held == ZERO


def test_drop_without_auction_id_drops_any_run() -> None:
    ledger = Ledger(CAP)
    ledger.hold(hold("a", auction_id="run-2"))
    assert ledger.drop("a") is not None
    assert ledger.holds == {}


def test_a_replaced_hold_that_outlives_its_replacer_comes_back_when_that_expires() -> None:
    ledger, w, _ = _replacing(expires_w=20.0)
    assert ledger.expire(11.0) == []  # not announced: the order still holds here (W's)
    assert ledger.holds == {"a": w} and ledger.held == (2, 2048, 0, 0, 0)
    assert ledger.expire(20.0) == [w] and ledger.held == ZERO


# (case, the replacing hold's want, a step: ("expire", now) or ("drop", auction id), whose
# hold is left, and whether capacity came back): the order still holds here afterwards, so
# nothing is announced (expire returns nothing, drop None), but ``freer_than`` tells.
BIGGER: Vec = (6, 4096, 0, 0, 0)
EQUAL: Vec = (2, 2048, 0, 0, 0)
GIVES_WAY = [
    ("a bigger replacing hold expires: freed", BIGGER, ("expire", 11.0), "W", True),
    ("a bigger replacing hold is released: freed", BIGGER, ("drop", "L"), "W", True),
    ("an equal replacing hold expires: nothing freed", EQUAL, ("expire", 11.0), "W", False),
    ("an equal replacing hold is released: nothing freed", EQUAL, ("drop", "L"), "W", False),
    ("nothing due: nothing freed", BIGGER, ("expire", 10.5), "L", False),
]


@pytest.mark.parametrize(
    ("case", "want", "step", "left", "freed"), GIVES_WAY, ids=[c[0] for c in GIVES_WAY]
)
def test_a_replaced_hold_put_back_frees_what_the_replacing_one_held_more(
    case: str, want: Vec, step: tuple[str, object], left: str, freed: bool
) -> None:
    ledger, _, _ = _replacing(expires_w=20.0, want=want)
    before = ledger.free
    if step[0] == "expire":
        assert ledger.expire(cast(float, step[1])) == []
    else:
        assert ledger.drop("a", cast(str, step[1]), now=5.0) is None
    assert ledger.freer_than(before) is freed
    assert ledger.holds["a"].auction_id == left
    assert ledger.held == held_sum(ledger) == ledger.holds["a"].want


def test_freer_than_reads_any_resource() -> None:
    ledger = Ledger(CAP)
    before = ledger.free
    assert not ledger.freer_than(before)  # unchanged: the same tuple
    ledger.hold(hold("a"))
    assert not ledger.freer_than(before)  # less free
    held = ledger.free
    ledger.drop("a")
    assert ledger.freer_than(held) and not ledger.freer_than(before)  # back to equal


def _replacing(
    expires_w: float = 10.0, want: Vec = (2, 2048, 0, 0, 0)
) -> tuple[Ledger, Hold, Hold]:
    """Auction W held order a; a concurrent duplicate's auction L re-bid and took its place
    (the desk drops W's hold, then L's keeps it as ``replaced``)."""
    ledger = Ledger(CAP)
    w = hold("a", expires_at=expires_w, auction_id="W")
    ledger.hold(w)
    assert ledger.drop("a") is w
    replacing = hold("a", want, expires_at=11.0, auction_id="L")
    replacing.replaced = w
    assert ledger.hold(replacing)
    return ledger, w, replacing


# (case, releases in order as (auction id, now): what the ledger then holds for "a", and
# whether the last release freed anything)
REPLACED = [
    ("the replacing auction releases: the other's hold is back", [("L", 5.0)], "W", False),
    ("the replaced auction releases: only forgotten", [("W", 5.0)], "L", False),
    ("then the replacing one releases: nothing held", [("W", 5.0), ("L", 5.0)], None, True),
    ("the replaced hold's TTL has passed: not back", [("L", 10.5)], None, True),
    ("a release of whatever auction drops both", [("", 5.0)], None, True),
    ("another auction's release: nothing", [("X", 5.0)], "L", False),
]


@pytest.mark.parametrize(
    ("case", "releases", "left", "freed"), REPLACED, ids=[c[0] for c in REPLACED]
)
def test_a_hold_that_took_another_auctions_place_gives_it_back(
    case: str, releases: list[tuple[str, float]], left: str | None, freed: bool
) -> None:
    ledger, _, _ = _replacing()
    dropped, before = None, ledger.free
    for auction_id, now in releases:
        before = ledger.free
        dropped = ledger.drop("a", auction_id, now=now)
    h = ledger.holds.get("a")
    assert (h.auction_id if h else None) == left
    assert (dropped is not None) is freed
    assert ledger.freer_than(before) is freed  # what the worker tells waiting bids by
    assert ledger.held == held_sum(ledger) == ((2, 2048, 0, 0, 0) if left else ZERO)
    if h is not None and left == "W":  # back with its own TTL, and it expires by it
        assert h.expires_at == 10.0
        assert ledger.expire(10.0) == [h] and ledger.held == ZERO


# -- expire ------------------------------------------------------------------------------------


def test_expire_drops_only_past_ttl() -> None:
    ledger = Ledger(CAP)
    a, b, c = hold("a", expires_at=10.0), hold("b", expires_at=20.0), hold("c", expires_at=30.0)
    for h in (c, a, b):
        ledger.hold(h)
    assert ledger.expire(now=9.999) == []
    assert ledger.held == (6, 6144, 0, 0, 0)
    assert ledger.expire(now=10.0) == [a]  # expires_at <= now
    assert ledger.held == (4, 4096, 0, 0, 0)
    assert ledger.expire(now=25.0) == [b]
    assert ledger.expire(now=25.0) == []
    assert list(ledger.holds) == ["c"]
    assert ledger.expire(now=1e9) == [c]
    assert ledger.held == ZERO
    assert ledger.holds == {}


def test_expire_returns_in_expiry_order() -> None:
    ledger = Ledger(CAP)
    for oid, t in (("x", 3.0), ("y", 1.0), ("z", 2.0)):
        ledger.hold(hold(oid, (1, 1, 0, 0, 0), expires_at=t))
    assert [h.order_id for h in ledger.expire(now=5.0)] == ["y", "z", "x"]


def test_expire_skips_dropped_holds() -> None:
    ledger = Ledger(CAP)
    ledger.hold(hold("a", expires_at=1.0))
    ledger.drop("a")
    assert ledger.expire(now=2.0) == []
    assert "a" not in ledger.recently_expired


def test_stale_heap_entry_after_rehold() -> None:
    ledger = Ledger(CAP)
    ledger.hold(hold("a", expires_at=1.0))
    ledger.drop("a")
    fresh = hold("a", (1, 512, 0, 0, 0), expires_at=5.0)
    ledger.hold(fresh)
    # The old (1.0, "a") heap entry must not expire the fresh hold.
    assert ledger.expire(now=2.0) == []
    assert ledger.holds == {"a": fresh}
    assert ledger.held == (1, 512, 0, 0, 0)
    assert "a" not in ledger.recently_expired
    assert ledger.expire(now=5.0) == [fresh]
    assert ledger.held == ZERO


def test_rehold_with_earlier_expiry() -> None:
    ledger = Ledger(CAP)
    ledger.hold(hold("a", expires_at=9.0))
    ledger.drop("a")
    fresh = hold("a", expires_at=3.0)
    ledger.hold(fresh)
    assert ledger.expire(now=3.0) == [fresh]
    assert ledger.expire(now=9.0) == []  # the old entry is stale, nothing to remove twice
    assert ledger.held == ZERO


def test_expire_skips_pinned_hold() -> None:
    ledger = Ledger(CAP)
    h = hold("a", expires_at=1.0)
    ledger.hold(h)
    h.committing = True
    assert ledger.expire(now=100.0) == []
    assert ledger.holds == {"a": h}
    assert ledger.held == (2, 2048, 0, 0, 0)
    assert "a" not in ledger.recently_expired


def test_recently_expired() -> None:
    ledger = Ledger(CAP)
    ledger.hold(hold("a", (1, 1, 0, 0, 0), expires_at=1.0))
    ledger.hold(hold("b", (1, 1, 0, 0, 0), expires_at=2.0))
    ledger.expire(now=1.5)
    assert list(ledger.recently_expired) == ["a"]
    ledger.expire(now=2.5)
    assert list(ledger.recently_expired) == ["a", "b"]


def test_recently_expired_is_bounded() -> None:
    ledger = Ledger((EXPIRED_MEMORY + 10, 10**9, 0, 0, 0))
    for i in range(EXPIRED_MEMORY + 3):
        assert ledger.hold(hold(f"o{i}", (1, 1, 0, 0, 0), expires_at=float(i)))
    gone = ledger.expire(now=1e9)
    assert len(gone) == EXPIRED_MEMORY + 3
    assert len(ledger.recently_expired) == EXPIRED_MEMORY
    assert next(iter(ledger.recently_expired)) == "o3"  # the oldest three were forgotten
    assert "o2" not in ledger.recently_expired
    assert f"o{EXPIRED_MEMORY + 2}" in ledger.recently_expired


def test_expire_default_now_uses_monotonic_clock() -> None:
    ledger = Ledger(CAP)
    ledger.hold(hold("past", expires_at=-1.0))  # before any monotonic reading
    ledger.hold(hold("future", expires_at=float("inf")))
    assert [h.order_id for h in ledger.expire()] == ["past"]
    assert list(ledger.holds) == ["future"]


# -- what a bid would find free (a "why not" asks it) -------------------------------------------


def _holding() -> Ledger:
    """Committed 1 CPU; holds: the order o (2 CPUs), x (1 CPU), p (1 CPU, being committed),
    all expiring at 10, and a replacing hold of order a (3 CPUs, expires at 11) carrying
    the 2-CPU hold it replaced (expires at 20)."""
    ledger, _, _ = _replacing(expires_w=20.0, want=(3, 0, 0, 0, 0))
    ledger.load_committed((1, 0, 0, 0, 0))
    for h in (hold("o", (2, 0, 0, 0, 0)), hold("x", (1, 0, 0, 0, 0)), hold("p", (1, 0, 0, 0, 0))):
        assert ledger.hold(h)
    ledger.holds["p"].committing = True
    return ledger


# (now, the order bid for, the CPUs the bid finds free): 8 - committed 1 - the holds left
FREE_FOR = [
    (5.0, "o", 8 - 1 - (1 + 1 + 3)),  # its own hold does not count: the bid replaces it
    (5.0, "n", 8 - 1 - (2 + 1 + 1 + 3)),  # another order's bid: every hold counts
    (10.0, "n", 8 - 1 - (1 + 3)),  # o and x expired; p is pinned by its commit
    (11.0, "n", 8 - 1 - (1 + 2)),  # a's replacing hold too: the one it replaced is back
    (20.0, "n", 8 - 1 - 1),  # only the pinned one is left
]


@pytest.mark.parametrize(("now", "order_id", "cpus"), FREE_FOR)
def test_free_for_is_what_a_bid_would_find_and_changes_nothing(
    now: float, order_id: str, cpus: int
) -> None:
    ledger = _holding()
    holds, held, expiry = dict(ledger.holds), ledger.held, list(ledger._expiry)
    assert ledger.free_for(order_id, now)[0] == cpus
    assert (ledger.holds, ledger.held, ledger._expiry) == (holds, held, expiry)
    # the same steps on the ledger itself (what the desk does for a bid) agree
    ledger.drop(order_id)
    ledger.expire(now)
    assert ledger.free[0] == cpus


# -- convert and unpin -------------------------------------------------------------------------


def test_convert_moves_hold_to_committed() -> None:
    ledger = Ledger(CAP)
    h = hold("a", (2, 2048, 10, 0, 0))
    ledger.hold(h)
    h.committing = True
    ledger.convert(h, (2, 2048, 10, 0, 0))
    assert ledger.holds == {}
    assert ledger.held == ZERO
    assert ledger.committed == (2, 2048, 10, 0, 0)
    assert ledger.free == (6, 6144, 90, 1, 0)
    ledger.check()


def test_convert_less_than_hold_frees_the_rest() -> None:
    ledger = Ledger(CAP)
    h = hold("a", (4, 4096, 0, 0, 0))
    ledger.hold(h)
    ledger.convert(h, (1, 1024, 0, 0, 0))
    assert ledger.held == ZERO
    assert ledger.committed == (1, 1024, 0, 0, 0)
    assert ledger.free == (7, 7168, 100, 1, 0)


def test_convert_of_a_hold_no_longer_present_only_commits() -> None:
    ledger = Ledger(CAP)
    old = hold("a")
    ledger.hold(old)
    ledger.drop("a")
    new = hold("a", (1, 1, 0, 0, 0))
    ledger.hold(new)
    ledger.convert(old, (2, 2048, 0, 0, 0))  # `old` is not the hold on record: leave `new` alone
    assert ledger.holds == {"a": new}
    assert ledger.held == (1, 1, 0, 0, 0)
    assert ledger.committed == (2, 2048, 0, 0, 0)


def test_unpin_removes_the_hold() -> None:
    ledger = Ledger(CAP)
    h = hold("a")
    ledger.hold(h)
    h.committing = True
    ledger.unpin(h)
    assert h.committing is False
    assert ledger.holds == {}
    assert ledger.held == ZERO
    assert ledger.committed == ZERO


def test_unpin_leaves_a_newer_hold() -> None:
    ledger = Ledger(CAP)
    old = hold("a")
    ledger.hold(old)
    ledger.drop("a")
    new = hold("a", (1, 1, 0, 0, 0))
    ledger.hold(new)
    ledger.unpin(old)
    assert ledger.holds == {"a": new}
    assert ledger.held == (1, 1, 0, 0, 0)


def test_load_and_free_committed() -> None:
    ledger = Ledger(CAP)
    ledger.load_committed((2, 100, 0, 0, 0))
    ledger.load_committed((3, 200, 5, 1, 0))
    assert ledger.committed == (5, 300, 5, 1, 0)
    ledger.free_committed((2, 100, 0, 0, 0))
    assert ledger.committed == (3, 200, 5, 1, 0)
    assert ledger.free == (5, 7992, 95, 0, 0)


# -- check (I1) --------------------------------------------------------------------------------


def test_check_passes_at_capacity() -> None:
    ledger = Ledger(CAP)
    ledger.load_committed((4, 4096, 50, 1, 0))
    ledger.hold(hold("a", (4, 4096, 50, 0, 0)))
    ledger.check()


def test_check_raises_on_overcommit() -> None:
    ledger = Ledger(CAP)
    ledger.load_committed((9, 1, 0, 0, 0))  # recovery may find more than the capacity
    with pytest.raises(AssertionError) as info:
        ledger.check()
    assert str(info.value) == (
        "overcommitted: committed (9, 1, 0, 0, 0) + held (0, 0, 0, 0, 0) > (8, 8192, 100, 1, 0)"
    )


def test_check_raises_on_overcommit_with_holds() -> None:
    ledger = Ledger(CAP)
    ledger.hold(hold("a", (1, 8000, 0, 0, 0)))
    ledger.load_committed((1, 200, 0, 0, 0))
    with pytest.raises(AssertionError, match=r"held \(1, 8000, 0, 0, 0\)"):
        ledger.check()


# -- property: I1 under random operations ------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_never_overcommit(seed: int) -> None:
    rng = random.Random(seed)
    cap: Vec = (16, 16384, 200, 2, 8)
    ledger = Ledger(cap)
    now = 0.0
    committed_orders: dict[str, Vec] = {}
    counts = {"hold": 0, "refused": 0, "drop": 0, "expire": 0, "convert": 0, "free": 0}
    counts["back"] = 0
    for step in range(400):
        now += rng.uniform(0.0, 0.3)
        op = rng.choice(["hold", "hold", "hold", "drop", "expire", "convert", "unpin", "free"])
        if op == "hold":
            oid = f"o{rng.randrange(40)}"
            if ledger.holds and rng.random() < 0.3:  # a re-bid of a held order
                oid = rng.choice(sorted(ledger.holds))
            if oid in committed_orders:
                continue
            old = ledger.holds.get(oid)
            if old is not None and ledger.drop(oid) is None:
                continue  # pinned: the worker does not re-hold a committing order
            want = (
                rng.randint(1, 6),
                rng.randint(1, 6000),
                rng.randint(0, 80),
                rng.randint(0, 1),
                rng.randint(0, 2),
            )
            if old is not None and rng.random() < 0.5:
                want = old.want  # a concurrent duplicate's re-bid (the desk keeps the old one)
            fits = leq(want, ledger.free)
            replaced = old if old is not None and old.expires_at > now else None
            ok = ledger.hold(
                Hold(oid, want, now + rng.uniform(0.1, 2.0), 0.5, {}, False, f"run{step}", replaced)
            )
            assert ok is fits
            counts["hold" if ok else "refused"] += 1
        elif op == "drop" and ledger.holds:
            oid = rng.choice(sorted(ledger.holds))
            h = ledger.holds[oid]
            back = h.replaced.auction_id if h.replaced else "other-run"
            if h.replaced is not None:  # mostly the replacing auction's: puts one back
                aid = rng.choice(["", h.auction_id, h.auction_id, h.auction_id, back])
            else:
                aid = rng.choice(["", h.auction_id, "other-run"])
            dropped = ledger.drop(oid, aid, now=now)
            counts["drop"] += dropped is not None
            counts["back"] += dropped is None and ledger.holds.get(oid) not in (None, h)
        elif op == "expire":
            counts["expire"] += len(ledger.expire(now=now))
        elif op == "convert" and ledger.holds:
            h = ledger.holds[rng.choice(sorted(ledger.holds))]
            h.committing = True
            # The commit may ask for less than the hold, never more.
            c, m, d, g, p = (rng.randint(min(1, x), x) for x in h.want)
            want = (c, m, d, g, p)
            ledger.convert(h, want)
            committed_orders[h.order_id] = want
            counts["convert"] += 1
        elif op == "unpin" and ledger.holds:
            h = ledger.holds[rng.choice(sorted(ledger.holds))]
            h.committing = True
            ledger.unpin(h)
        elif op == "free" and committed_orders:
            oid = rng.choice(sorted(committed_orders))
            ledger.free_committed(committed_orders.pop(oid))
            counts["free"] += 1
        # I1 and the bookkeeping behind it, after every step.
        ledger.check()
        assert leq(ledger.used, cap)
        assert ledger.held == held_sum(ledger)
        committed = ZERO
        for v in committed_orders.values():
            committed = add(committed, v)
        assert ledger.committed == committed
        assert all(x >= 0 for x in ledger.free)
    # Every hold left, a replaced one put back included, expires by its own TTL.
    ledger.expire(now=now + 10.0)
    assert ledger.holds == {} and ledger.held == ZERO
    # The loop exercised every path (so the checks above were not vacuous).
    assert counts["hold"] > 20
    assert counts["refused"] > 0
    assert counts["expire"] > 0
    assert counts["convert"] > 0
    assert counts["back"] > 0  # a replaced hold was put back


# -- fractional CPUs (millicores) ----------------------------------------------------------------


def test_two_half_cpu_holds_fit_a_one_cpu_worker_and_a_third_does_not() -> None:
    ledger = Ledger((1000, 4096, 0, 0, 0))  # 1 CPU, in millicores
    half: Vec = (500, 256, 0, 0, 0)
    assert ledger.hold(hold("a", half)) is True
    assert ledger.hold(hold("b", half)) is True
    assert ledger.free == (0, 3584, 0, 0, 0)
    assert ledger.hold(hold("c", half)) is False  # I1: no third half
    assert ledger.hold(hold("d", (1, 1, 0, 0, 0))) is False  # not even a millicore
    ledger.check()
    ledger.convert(ledger.holds["a"], half)  # a commits; b's hold lapses
    assert [h.order_id for h in ledger.expire(now=100.0)] == ["b"]
    assert ledger.committed == (500, 256, 0, 0, 0) and ledger.held == ZERO
    assert ledger.hold(hold("c", (250, 1, 0, 0, 0), expires_at=200.0)) is True
    assert ledger.hold(hold("e", (250, 1, 0, 0, 0), expires_at=200.0)) is True
    assert ledger.hold(hold("f", (1, 1, 0, 0, 0), expires_at=200.0)) is False
    ledger.check()
