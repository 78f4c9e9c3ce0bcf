"""Content addresses of a prompt's KV pages: a hash chain over token ids.

Page i's hash covers its 64 token ids and page i-1's hash, and page 0's covers the model
contract's fingerprint, so a hash names the KV of one whole prefix of one model and nothing else:
equal hashes mean equal tokens from position 0 on the same weights, tokenizer and geometry (as
vLLM's block hashes). Only full pages have a hash: a partly filled page is recomputed, never
reused half-valid. Engines key their prefix caches with it; the router indexes nodes by it.

A request may carry a cache salt (the panel's, one per API key: control_panel/cache_salt.py),
chained into page 0's seed as vLLM's `cache_salt` is into its first block: every hash of a salted
prompt differs from the same prompt's unsalted or otherwise salted ones, so a request finds only
pages its own salt cached, and cached tokens or a shorter prefill tell one key nothing of
another's prompts. No salt is the chain every unsalted request shares.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash


def chain_seed(fingerprint: bytes, salt: str | None = None) -> bytes:
    """What page 0's hash chains from: the contract's own hash, then the request's cache salt
    (None or empty: no salt, the seed every unsalted request shares)."""
    seed = xxhash.xxh3_128_digest(fingerprint)
    if salt:
        seed = xxhash.xxh3_128_digest(seed + b"cache_salt:" + salt.encode())
    return seed


def page_hashes(
    fingerprint: bytes,
    token_ids: Sequence[int],
    page_tokens: int,
    pages: int | None = None,
    salt: str | None = None,
) -> list[bytes]:
    """The 16-byte hashes of the full pages of `token_ids` (at most `pages` of them), in the
    namespace of the cache salt `salt` (None: unsalted)."""
    full = len(token_ids) // page_tokens if pages is None else min(pages, len(token_ids) // page_tokens)
    ids = np.asarray(token_ids[: full * page_tokens], dtype="<i8")
    hashes, previous = [], chain_seed(fingerprint, salt)
    for i in range(full):
        previous = xxhash.xxh3_128_digest(previous + ids[i * page_tokens : (i + 1) * page_tokens].tobytes())
        hashes.append(previous)
    return hashes
