"""Reuse of block-aligned prompt prefixes across block-diffusion requests (issue 16).

With block-causal attention the keys and values of a whole prompt block depend only on the
tokens up to that block's end, so two requests whose prompts share their first j blocks (the
same system prompt, a multi-turn history) have bit-for-bit the same keys and values there
whenever they are computed the same way. After a row's first forward (its prefill) the keys
and values of its whole prompt blocks are copied from its pool slot into this cache; a new
request looks up the longest cached run of its prompt's blocks, has those keys and values
copied into its slot, and its first forward starts after them.

Entries are keyed by a chain hash over blocks (the hash of block i covers blocks 0..i and the
block length), as vLLM's prefix caching keys its pages, so a prompt that shares only some
leading blocks of a cached one reuses those. Memory is bounded by a token budget, least
recently used first out. The reuse is by copy into the row's own slot (the pool keeps one
slot a row, read as a contiguous view by the attention), not by sharing pages in place: it
saves the prefill's compute, not the slot's memory.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class _Entry:
    k: list[torch.Tensor]  # per layer [tokens, kv_heads, head_dim]
    v: list[torch.Tensor]
    tokens: int
    ids: list[int]  # the prompt tokens it covers: a hash match is checked against them


def block_hashes(ids: list[int], block: int, blocks: int) -> list[int]:
    """Chain hashes of the first `blocks` whole blocks of `ids` (index i covers 0..i)."""
    out, h = [], hash(("block", block))
    for i in range(blocks):
        h = hash((h, tuple(ids[i * block : (i + 1) * block])))
        out.append(h)
    return out


class PrefixCache:
    """Keys/values of whole prompt blocks, by chain hash, within a token budget (LRU)."""

    def __init__(self, budget_tokens: int) -> None:
        self.budget = budget_tokens
        self.entries: OrderedDict[int, _Entry] = OrderedDict()  # by the last block's hash
        self.where: dict[int, tuple[int, int]] = {}  # block hash -> (entry key, tokens)
        self.tokens = 0
        # counters for metrics: prompt tokens looked up, and of those reused from the cache
        self.lookup_tokens = 0
        self.hit_tokens = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def load(self, ids: list[int], block: int, blocks: int, pool, slot: int) -> int:
        """Copy the longest cached run of `ids`' first `blocks` blocks into pool `slot`;
        returns the number of tokens now in the slot (0 when nothing matched)."""
        self.lookup_tokens += blocks * block
        best = None
        for h in reversed(block_hashes(ids, block, blocks)):
            if h in self.where:
                best = self.where[h]
                break
        if best is None:
            return 0
        key, n = best
        entry = self.entries[key]
        if entry.ids[:n] != ids[:n]:  # a hash collision: never reuse another prompt's keys
            return 0
        self.entries.move_to_end(key)
        for layer, (k, v) in enumerate(zip(entry.k, entry.v, strict=True)):
            pool.k[layer][slot, :n] = k[:n]
            pool.v[layer][slot, :n] = v[:n]
        self.hit_tokens += n
        return n

    def store(self, ids: list[int], block: int, blocks: int, pool, slot: int) -> None:
        """Keep the keys/values of `ids`' first `blocks` whole blocks from pool `slot`."""
        n = blocks * block
        if blocks == 0 or n > self.budget:
            return
        hashes = block_hashes(ids, block, blocks)
        key = hashes[-1]
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        while self.tokens + n > self.budget and self.entries:
            self._evict()
        k = [layer[slot, :n].clone() for layer in pool.k]
        v = [layer[slot, :n].clone() for layer in pool.v]
        self.entries[key] = _Entry(k, v, n, list(ids[:n]))
        self.tokens += n
        for i, h in enumerate(hashes):  # the newest entry serves its shorter prefixes too
            self.where[h] = (key, (i + 1) * block)

    def _evict(self) -> None:
        key, entry = self.entries.popitem(last=False)
        self.tokens -= entry.tokens
        for h in [h for h, (k, _) in self.where.items() if k == key]:
            del self.where[h]

    def clear(self) -> None:
        self.entries.clear()
        self.where.clear()
        self.tokens = 0
