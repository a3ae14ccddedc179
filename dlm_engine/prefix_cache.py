"""Reuse of block-aligned prompt prefixes across block-diffusion requests.

With block-causal attention the keys and values of a whole prompt block depend only on the
tokens up to that block's end, so two requests whose prompts share their first j blocks (the
same system prompt, a multi-turn history) have the same keys and values there. Block rows
keep their keys in pages of one pool (dlm_engine/paged_kv.py); after a row's first forward
(its prefill) the pages holding its whole prompt blocks are indexed here by a chain hash, and
a new request whose prompt starts with the same pages gets those page ids in its page table,
reference count + 1, no copy: its first forward starts after them. The memory is shared, not
only the prefill's compute.

Keys: a SHA-256 chain over pages (page i's hash covers pages 0..i, the page size and the
block length), as vLLM keys its blocks, so a prompt sharing only some leading pages of a
cached one reuses exactly those; SHA-256 so that no two prompts can be made to collide.

Isolation: a request's `cache_salt` is mixed into the chain's seed, so page 0's hash (and with
it every later one) differs between salts. Requests share pages only under the same salt (or
none): a caller without another's salt can neither reuse nor detect its cached prompt, neither
by `cached_tokens` nor by the hit counter nor by timing. The proxy salts every request with
its API key's identity (openai_proxy/tenancy.py), so tenants never share pages.

Rules that keep it exact:
* only pages made entirely of whole prompt blocks are indexed or matched, and a match is cut
  to a multiple of lcm(page, block) tokens (a page cut through a block would hold keys that
  depend on the block's unshared tail);
* shared pages are read-only: a row writes only from its first non-final position on, which
  is at or after its prompt's whole blocks, hence never into an indexed page, and the first
  page after a match is always the row's own.

Pages no row references stay cached, idle, least recently used first out: evicted when the
pool needs a page, and at most `EngineConfig.prefix_cache_tokens` tokens of them are kept
(0 turns prefix caching off).
"""

from __future__ import annotations

import hashlib

import numpy as np

from .paged_kv import PagePool


def chain_seed(page_tokens: int, block: int, salt: str | None = None) -> bytes:
    """The hash page 0 chains from: the layout, and the salt when there is one (a salted
    seed is a second hash over the unsalted one, so no salt can reproduce another's seed or
    the unsalted one)."""
    seed = hashlib.sha256(f"dlm-kv page={page_tokens} block={block}".encode()).digest()
    if salt is None:
        return seed
    return hashlib.sha256(seed + b"\x00cache_salt\x00" + salt.encode()).digest()


def page_hashes(
    ids: list[int], page_tokens: int, block: int, pages: int, salt: str | None = None
) -> list[bytes]:
    """Chain hashes of the first `pages` whole pages of `ids` (index i covers 0..i), seeded
    with `salt` (only the same salt gives the same chain)."""
    h = chain_seed(page_tokens, block, salt)
    arr = np.asarray(ids[: pages * page_tokens], dtype=np.int64)
    out = []
    for i in range(pages):
        h = hashlib.sha256(h + arr[i * page_tokens : (i + 1) * page_tokens].tobytes()).digest()
        out.append(h)
    return out


class PrefixCache:
    """Chain hash -> page of the pool, plus hit counters for metrics."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.page_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        pool.on_evict = self._forget
        # counters for metrics: prompt tokens looked up, and of those reused from the cache
        self.lookup_tokens = 0
        self.hit_tokens = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def tokens(self) -> int:
        """Tokens of the pages indexed now (in use or idle)."""
        return len(self.hash_of) * self.pool.page_tokens

    def match(self, hashes: list[bytes], unit: int) -> list[int]:
        """Pages of the longest cached run of `hashes` from the first, cut to a multiple of
        `unit` pages."""
        pages = []
        for h in hashes:
            page = self.page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages[: len(pages) // unit * unit]

    def record(self, lookup_tokens: int, hit_tokens: int) -> None:
        self.lookup_tokens += lookup_tokens
        self.hit_tokens += hit_tokens

    def register(self, hashes: list[bytes], pages: list[int]) -> None:
        """Index `pages` (final, whole prompt blocks) under `hashes`. A hash already indexed
        keeps its page (a twin prompt prefilled in the same step keeps its own copy)."""
        for h, page in zip(hashes, pages, strict=True):
            if h in self.page_of or page in self.hash_of:
                continue
            self.page_of[h] = page
            self.hash_of[page] = h
            self.pool.cached.add(page)

    def _forget(self, page: int) -> None:
        h = self.hash_of.pop(page, None)
        if h is not None:
            del self.page_of[h]

    def clear(self) -> None:
        """Forget every page (idle ones go back to the free list)."""
        for page in list(self.hash_of):
            self.pool.uncache(page)
        self.page_of.clear()
        self.hash_of.clear()
