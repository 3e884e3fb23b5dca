"""Which workers of a big host price a bid (supplier/candidates.py)."""

from __future__ import annotations

import zlib

from supplier.candidates import BidGroup, window


class W:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def test_window_wraps_and_takes_all_of_a_short_list() -> None:
    items = list(range(10))
    assert window(items, 3, 4) == [3, 4, 5, 6]
    assert window(items, 8, 4) == [8, 9, 0, 1]
    assert window(items, 13, 2) == [3, 4]  # the start is taken mod len
    assert window([1, 2], 5, 4) == [1, 2]
    assert window([], 5, 4) == []


def test_a_small_group_prices_every_worker() -> None:
    ws = [W(f"w{i}") for i in range(16)]
    g = BidGroup(ws)
    assert g.candidates("o1", "img", None, 8) is ws  # 16 <= 2 x 8
    assert BidGroup(ws * 4).candidates("o1", "img", None, 0) == ws * 4  # 0: sampling off


def test_a_big_group_prices_the_owner_the_image_holders_and_a_window() -> None:
    ws = [W(f"w{i}") for i in range(100)]
    g = BidGroup(ws)
    for w in ws[40:43]:
        g.image_changed(w, "img", True)
    owner = ws[90]
    got = g.candidates("order-7", "img", owner, 4)
    pos = zlib.crc32(b"order-7")
    # the owner first, then every holder of the image (3 <= 4), then 4 at random
    assert got[0] is owner
    assert got[1:4] == ws[40:43]
    assert got[4:] == [w for w in window(ws, pos >> 8, 4) if w not in got[:4]]
    assert len(got) <= 1 + 4 + 4
    # the same order id draws the same sample (a post-mortem replays it)
    assert g.candidates("order-7", "img", owner, 4) == got


def test_an_owner_outside_the_group_is_not_priced_here() -> None:
    ws = [W(f"w{i}") for i in range(50)]
    other = W("elsewhere")
    got = BidGroup(ws).candidates("o", "img", other, 4)
    assert other not in got
    assert len(got) == 4


def test_the_image_index_follows_pulls_and_evictions() -> None:
    a, b = W("a"), W("b")
    g = BidGroup([a, b])
    g.image_changed(a, "img", True)
    g.image_changed(a, "img", True)  # twice: still once
    g.image_changed(b, "img", True)
    assert g.by_image == {"img": [a, b]}
    g.image_changed(a, "img", False)
    g.image_changed(b, "img", False)
    assert g.by_image == {}
