"""Page tables of block-diffusion rows: admission, growth, prefix registration, release.

The glue between the engine's rows and the page pool (dlm_engine/paged_kv.py) and its prefix
cache (dlm_engine/prefix_cache.py): the policies are written in those modules' docstrings;
this one applies them per row.

* admit: the longest cached run of the prompt's whole pages is shared (its forward starts
  after it, `Sequence.kv_upto`), the rest of the row's worst case is reserved; a row whose
  reservation does not fit is not admitted (it waits);
* grow: before each forward a row takes pages from its reservation until its table covers
  its active block;
* prefilled: after a row's first forward its whole prompt pages hold final keys; they are
  indexed for later requests;
* release: a finished, cancelled or failed row drops its pages (last page first, so a
  cached prompt's tail is evicted before its head) and gives back what it had not taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .paged_kv import PagePool
from .prefix_cache import PrefixCache, page_hashes
from .sequence import Sequence


@dataclass
class RowPages:
    """One row's page table (page i holds positions [i * page, (i + 1) * page))."""

    table: list[int]
    reserved: int  # pages of its worst case not taken yet
    shared: int  # leading pages that came from the prefix cache
    hashes: list[bytes] = field(default_factory=list)  # its indexable prompt pages' hashes


class BlockPages:
    """Every block row's page table over one pool (and its prefix cache, if on)."""

    def __init__(self, pool: PagePool, cache: PrefixCache | None, shift: int = 0) -> None:
        self.pool = pool
        self.cache = cache
        self.shift = shift  # shifted logits (Fast-dLLM v2): the query starts a token earlier
        self.rows: dict[str, RowPages] = {}

    def worst_case(self, seq: Sequence) -> int:
        """Pages up to the end of the row's last block."""
        return self.pool.pages_for(seq.layout.total_len)

    def _indexable(self, seq: Sequence) -> tuple[int, int]:
        """(pages, unit): the prompt's whole pages made of whole prompt blocks, and the
        pages in lcm(page, block) tokens (a match is cut to a multiple of it). With shifted
        logits the position before the first decoded one is read, so it is never cached."""
        pt, block = self.pool.page_tokens, seq.layout.block
        span = math.lcm(pt, block)
        tokens = min(seq.layout.first_block * block, seq.prompt_len - self.shift) // span * span
        return tokens // pt, span // pt

    def admit(self, seq: Sequence) -> bool:
        """Share the cached prefix and reserve the rest; False (nothing changed) when the
        pool cannot hold the row's worst case now."""
        pages, unit = self._indexable(seq)
        hashes, hit = [], []
        if self.cache is not None and pages:
            block = seq.layout.block
            pt, salt = self.pool.page_tokens, seq.params.cache_salt
            hashes = page_hashes(seq.prompt_ids, pt, block, pages, salt)
            hit = self.cache.match(hashes, unit)
        own = self.worst_case(seq) - len(hit)
        idle_hits = sum(1 for p in hit if self.pool.refs[p] == 0)  # they stop being available
        if own + idle_hits > self.pool.available:
            return False
        for page in hit:
            self.pool.share(page)
        self.pool.reserve(own)
        self.rows[seq.request_id] = RowPages(list(hit), own, len(hit), hashes)
        seq.kv_upto = seq.cached_tokens = len(hit) * self.pool.page_tokens
        if self.cache is not None:
            self.cache.record(seq.layout.first_block * seq.layout.block, seq.kv_upto)
        return True

    def grow(self, seq: Sequence) -> list[int]:
        """The row's table, covering its active block (taken from its reservation)."""
        row = self.rows[seq.request_id]
        need = self.pool.pages_for(seq.block_end)
        while len(row.table) < need:
            row.table.append(self.pool.take())
            row.reserved -= 1
        return row.table

    def prefilled(self, seq: Sequence) -> None:
        """After the row's first forward: index its own whole prompt pages."""
        row = self.rows[seq.request_id]
        if self.cache is not None and len(row.hashes) > row.shared:
            end = len(row.hashes)
            self.cache.register(row.hashes[row.shared :], row.table[row.shared : end])

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        for page in reversed(row.table):
            self.pool.drop(page)
        self.pool.unreserve(row.reserved)
