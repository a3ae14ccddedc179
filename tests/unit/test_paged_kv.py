"""The page pool's bookkeeping and the prefix cache's index (dlm_engine/paged_kv.py,
dlm_engine/prefix_cache.py), without a model: reference counts, reservations, idle pages
kept within their budget and evicted least recently used first, a match cut to whole units."""

from __future__ import annotations

import pytest
import torch

from dlm_engine.paged_kv import PagePool, page_size
from dlm_engine.prefix_cache import PrefixCache, page_hashes


def _pool(pages: int = 4, idle_limit: int = 8) -> PagePool:
    return PagePool(1, pages, 16, 1, 2, torch.float32, torch.device("cpu"), idle_limit)


def test_page_size_is_the_smallest_block_multiple_of_at_least_16() -> None:
    assert [page_size(b) for b in (1, 4, 5, 16, 32, 40)] == [16, 16, 20, 16, 32, 40]


def test_reservation_take_and_drop() -> None:
    pool = _pool()
    assert pool.k[0].shape == (5, 16, 1, 2)  # one trash page
    pool.reserve(3)
    assert pool.available == 1
    with pytest.raises(RuntimeError):
        pool.reserve(2)
    pages = [pool.take(), pool.take()]
    assert pool.reserved == 1 and all(pool.refs[p] == 1 for p in pages)
    pool.share(pages[0])
    pool.drop(pages[0])
    assert pool.refs[pages[0]] == 1  # still read by the other holder
    for p in pages:
        pool.drop(p)
    pool.unreserve(1)
    assert pool.available == 4 and len(pool.free) == 4


def test_idle_pages_are_cached_then_evicted_oldest_first() -> None:
    pool = _pool(pages=4, idle_limit=2)
    cache = PrefixCache(pool)
    ids = list(range(64))
    hashes = page_hashes(ids, 16, 4, 3)
    pool.reserve(3)
    pages = [pool.take() for _ in range(3)]
    cache.register(hashes, pages)
    assert cache.match(hashes, 1) == pages
    for p in reversed(pages):  # as a row ends: last page first
        pool.drop(p)
    # the idle budget is 2 pages: the first dropped (the tail) went back to the free list
    assert list(pool.idle) == pages[:2][::-1] and pages[2] in pool.free
    assert cache.match(hashes, 1) == pages[:2]
    pool.reserve(4)  # idle pages count as available; taking evicts them when none is free
    taken = [pool.take() for _ in range(4)]
    assert sorted(taken) == sorted(range(4))
    assert cache.match(hashes, 1) == [] and not pool.idle


def test_match_is_cut_to_whole_units_and_chains_from_the_first_page() -> None:
    pool = _pool(pages=4)
    cache = PrefixCache(pool)
    a = list(range(64))
    b = a[:40] + [999] * 24  # agrees for 2 whole pages and part of the third
    pool.reserve(4)
    pages = [pool.take() for _ in range(4)]
    cache.register(page_hashes(a, 16, 4, 4), pages)
    assert cache.match(page_hashes(b, 16, 4, 4), 1) == pages[:2]
    assert cache.match(page_hashes(a, 16, 4, 3), 2) == pages[:2]  # units of 2 pages
    assert cache.match(page_hashes(a, 16, 8, 4), 1) == []  # another block length: other keys
    c = [7] + a[1:]  # differs in page 0 only: later pages' hashes differ too (chained)
    assert cache.match(page_hashes(c, 16, 4, 4), 1) == []
    cache.clear()
    for p in pages:
        pool.drop(p)
    assert len(pool.free) == 4 and not pool.cached
