"""Page hashes (tandem_protocol/prefix.py) and the prefix cache (engine_adapters/prefix_cache.py)
on their own: a hash names one whole prefix of one model; the cache finds the longest cached
prefix, stays within its budget and shortens chains from their tails."""

from __future__ import annotations

import numpy as np

from engine_adapters.prefix_cache import PrefixCache
from tandem_protocol.prefix import chain_seed, page_hashes

P = 4  # tokens a page, small so the chains stay readable
A, B = b"contract-a", b"contract-b"


def page(value: int) -> np.ndarray:
    return np.full((1, 2, P, 1, 2), value, dtype=np.float16)


def test_equal_prefixes_have_equal_hashes_and_only_full_pages_have_one():
    ids = list(range(10))
    hashes = page_hashes(A, ids, P)
    assert len(hashes) == 2 and len(set(hashes)) == 2  # 10 tokens: two full pages, the rest none
    assert page_hashes(A, ids + [99, 98], P) == page_hashes(A, ids, P) + [page_hashes(A, ids + [99, 98], P)[2]]
    assert page_hashes(A, ids, P, pages=1) == hashes[:1]
    assert all(len(h) == 16 for h in hashes)


def test_a_hash_covers_every_token_before_it_and_the_contract():
    ids = list(range(12))
    changed_first = [7] + ids[1:]
    assert not set(page_hashes(A, ids, P)) & set(page_hashes(A, changed_first, P))  # the whole chain moves
    swapped = ids[:4] + [ids[5], ids[4]] + ids[6:]
    same, *different = zip(page_hashes(A, ids, P), page_hashes(A, swapped, P), strict=True)
    assert same[0] == same[1] and all(a != b for a, b in different)  # order within a page counts
    assert not set(page_hashes(A, ids, P)) & set(page_hashes(B, ids, P))  # another model: nothing shared


def test_the_longest_cached_prefix_is_found_and_counted():
    cache = PrefixCache(capacity_bytes=10 * page(0).nbytes, page_bytes=page(0).nbytes)
    chain = page_hashes(A, list(range(16)), P)
    cache.add(chain[:3], [page(0), page(1), page(2)])
    found = cache.match(chain)
    assert [int(p.flat[0]) for p in found] == [0, 1, 2]
    other = page_hashes(A, [1] + list(range(1, 16)), P)
    assert cache.match(other) == []
    assert cache.match(page_hashes(B, list(range(16)), P)) == []  # same tokens, other contract
    cache.count(15, 12)
    s = cache.status()
    assert (s["lookups"], s["lookup_tokens"], s["hit_tokens"], s["pages"]) == (1, 15, 12, 3)
    assert s["bytes"] == 3 * page(0).nbytes and s["capacity"] == 10 * page(0).nbytes


def test_adding_pages_after_cached_ones_extends_the_chain():
    cache = PrefixCache(capacity_bytes=10 * page(0).nbytes, page_bytes=page(0).nbytes)
    chain = page_hashes(A, list(range(16)), P)
    cache.add(chain[:2], [page(0), page(1)])
    cache.add(chain, [page(2), page(3)], start=2)
    assert [int(p.flat[0]) for p in cache.match(chain)] == [0, 1, 2, 3]


def test_eviction_keeps_the_budget_and_shortens_chains_from_the_tail():
    one = page(0).nbytes
    cache = PrefixCache(capacity_bytes=6 * one, page_bytes=one)
    first = page_hashes(A, list(range(16)), P)
    second = page_hashes(A, list(range(100, 116)), P)
    cache.add(first, [page(i) for i in range(4)])
    cache.add(second, [page(10 + i) for i in range(4)])
    assert cache.bytes == 6 * one and cache.status()["evicted_pages"] == 2
    assert len(cache.match(first)) == 2  # the older chain lost its last two pages, not its head
    assert len(cache.match(second)) == 4
    cache.match(first)  # used again: now the second chain is the older one
    cache.add(page_hashes(A, list(range(200, 208)), P), [page(20), page(21)])
    assert len(cache.match(first)) == 2 and len(cache.match(second)) == 2
    cache.resize(0)
    assert cache.bytes == 0 and cache.match(first) == []


def test_a_tail_serves_the_tokens_a_prompt_shares_with_it_and_goes_first():
    one = page(0).nbytes
    cache = PrefixCache(capacity_bytes=4 * one, page_bytes=one)
    chain = page_hashes(A, list(range(8)), P)
    cache.add_tail(chain[-1], [8, 9, 10], page(7)[:, :, :3])
    cache.add(chain, [page(0), page(1)])
    assert cache.match_tail(chain[-1], [8, 9, 99])[0] == 2  # shares two of its three tokens
    assert cache.match_tail(chain[-1], [8, 9, 10, 11])[0] == 3
    assert cache.match_tail(chain[0], [8, 9, 10]) == (0, None)  # another place in the chain
    assert cache.match_tail(chain_seed(A), [0, 1]) == (0, None)
    cache.add_tail(chain_seed(A), [0, 1], page(9)[:, :, :2])  # a prompt shorter than a page
    assert cache.match_tail(chain_seed(A), [0, 1, 2])[0] == 2
    cache.add(page_hashes(A, list(range(50, 54)), P), [page(5)])  # over budget: tails go first
    assert cache.match_tail(chain_seed(A), [0, 1, 2]) == (0, None)
    assert cache.match_tail(chain[-1], [8, 9, 10])[0] == 3
    cache.add(page_hashes(A, list(range(60, 64)), P), [page(6)])
    assert cache.match_tail(chain[-1], [8, 9, 10]) == (0, None)
    assert len(cache.match(chain)) == 2 and cache.bytes == 4 * one
