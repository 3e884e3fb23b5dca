"""The catalog's view of a worker's images: an LRU of names within a budget."""

from __future__ import annotations

from supplier.images import CatalogCache

SIZES = {"a": 40, "b": 40, "c": 40}


def test_adding_evicts_least_recently_used_until_it_fits() -> None:
    cache = CatalogCache(100, ["a", "b"], SIZES.__getitem__)
    cache.touch("a")  # b is now the least recently used
    assert cache.add("c") == ["b"]
    assert list(cache) == ["a", "c"] and cache.used_mb == 80


def test_an_image_in_use_is_never_evicted() -> None:
    cache = CatalogCache(100, ["a", "b"], SIZES.__getitem__)
    assert cache.add("c", in_use=lambda image: image == "a") == ["b"]
    assert "a" in cache
    # nothing left that may go: the cache runs over budget rather than evict a running image
    cache2 = CatalogCache(50, ["a"], SIZES.__getitem__)
    assert cache2.add("b", in_use=lambda image: True) == []
    assert list(cache2) == ["a", "b"] and cache2.used_mb == 80


def test_adding_a_cached_image_only_refreshes_it() -> None:
    cache = CatalogCache(100, ["a", "b"], SIZES.__getitem__)
    assert cache.add("a") == []
    assert list(cache) == ["b", "a"]


def test_the_listener_hears_evictions_then_the_new_image() -> None:
    heard: list[tuple[str, bool]] = []
    cache = CatalogCache(
        100, ["a", "b"], SIZES.__getitem__, lambda image, cached: heard.append((image, cached))
    )
    assert heard == []  # the initial images are not told: the host reads them
    cache.add("c")
    assert heard == [("a", False), ("c", True)]
    cache.add("c")  # already cached: nothing changes, nothing is told
    assert heard == [("a", False), ("c", True)]
