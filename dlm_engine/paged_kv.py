"""The page pool of block-diffusion rows' keys and values.

A block-diffusion row's keys and values live in fixed-size pages of one shared pool instead
of one contiguous slot a row: a row holds only the pages its sequence covers, and pages of
an identical prompt prefix are shared between rows by reference count (the prefix cache,
dlm_engine/prefix_cache.py). Per layer the pool is ``[pages + 1, page_tokens, kv_heads,
head_dim]``; the extra page is the trash page, where padded query positions write and which
padded page-table entries read (always masked out).

Page size: the smallest multiple of the model's block length that is at least 16 tokens, so
a page boundary is a block boundary for rows at the model's block (prefix sharing needs
whole blocks: the keys of a block depend on every token of that block).

Pool size: `EngineConfig.kv_cache_tokens` when given; otherwise, on CUDA, the share
`kv_cache_memory_fraction` of the device memory free when the engine is made (after the
weights, before any forward: activations and CUDA graphs need the rest), and on CPU
CPU_POOL_TOKENS (the whole pool is allocated at once: a budget, not all of the machine's
memory), raised to one longest row (max_prompt + max_canvas) and capped at `max_rows` of them.

Lifetime: a page is free, in use (reference count >= 1), or idle (count 0, its content
indexed by the prefix cache: kept for reuse, least recently used first out). Taking a page
prefers free ones and evicts the oldest idle page only when none is free.

Exhaustion policy: a row *reserves* its worst case at admission (every page up to the end of
its last block, less the pages it shares from the cache) and takes the pages from that
reservation as its sequence grows. A row that is running can therefore never run out of
pages mid-request: no preemption, no recompute, tokens unchanged. A request whose
reservation does not fit waits in the queue (requests behind it wait too: admission order is
kept) until running rows end and give their pages back; one whose worst case exceeds the
whole pool is refused when it is added.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

MIN_PAGE_TOKENS = 16
CPU_POOL_TOKENS = 32768  # SDAR-4B in bf16: 4.8 GB


def page_size(block: int) -> int:
    """The smallest multiple of `block` holding at least MIN_PAGE_TOKENS tokens."""
    return block * -(-MIN_PAGE_TOKENS // block)


def cpu_pool_tokens(max_rows: int, row_tokens: int) -> int:
    """The CPU pool's default size: CPU_POOL_TOKENS, at least one longest row (so every
    request the limits accept can run), at most `max_rows` of them (all rows at once)."""
    return min(max_rows * row_tokens, max(row_tokens, CPU_POOL_TOKENS))


def pool_pages(
    *,
    page_tokens: int,
    bytes_per_token: int,
    device: torch.device,
    tokens: int,
    memory_fraction: float,
    cpu_tokens: int,
) -> int:
    """Pages of the pool: `tokens` when > 0, else sized from free memory (CUDA) or
    `cpu_tokens` (CPU). Memory the caching allocator holds unused counts as free."""
    if tokens <= 0:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            tokens = int(free * memory_fraction) // bytes_per_token
        else:
            tokens = cpu_tokens
    return max(1, tokens // page_tokens)


class PagePool:
    """K/V pages per layer plus their reference counts, free list, idle (cached) LRU and the
    reservations of admitted rows. Host bookkeeping only touches Python containers; the
    tensors are written and read by the packed forward (dlm_engine/ragged.py)."""

    def __init__(
        self,
        n_layers: int,
        pages: int,
        page_tokens: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        idle_limit: int = 0,
    ) -> None:
        # zeros, not empty: a masked key still multiplies its value by 0, and NaN * 0 = NaN
        shape = (pages + 1, page_tokens, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.pages = pages
        self.page_tokens = page_tokens
        self.trash = pages
        self.idle_limit = idle_limit  # idle cached pages kept at most (the prefix budget)
        self.refs = [0] * pages
        self.free: deque[int] = deque(range(pages))
        self.idle: OrderedDict[int, None] = OrderedDict()  # count 0, cached: oldest first
        self.cached: set[int] = set()  # pages whose content the prefix cache indexes
        self.reserved = 0  # pages promised to admitted rows, not taken yet
        self.on_evict: Callable[[int], None] | None = None  # the prefix cache forgets a page

    @property
    def available(self) -> int:
        """Pages a new reservation may claim: free or idle, less those already promised."""
        return len(self.free) + len(self.idle) - self.reserved

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def reserve(self, n: int) -> None:
        if n > self.available:
            raise RuntimeError(f"reserving {n} pages, {self.available} available")
        self.reserved += n

    def unreserve(self, n: int) -> None:
        self.reserved -= n

    def take(self) -> int:
        """One page out of a reservation: a free one, else the least recently used idle."""
        if self.reserved <= 0:
            raise RuntimeError("take() without a reservation")
        self.reserved -= 1
        page = self.free.popleft() if self.free else self._evict_oldest()
        self.refs[page] = 1
        return page

    def share(self, page: int) -> None:
        """One more reader of a cached page (an idle one is in use again)."""
        if self.refs[page] == 0:
            del self.idle[page]
        self.refs[page] += 1

    def drop(self, page: int) -> None:
        """One reader fewer; at none the page is idle (cached content) or free."""
        self.refs[page] -= 1
        if self.refs[page]:
            return
        if page not in self.cached:
            self.free.append(page)
            return
        self.idle[page] = None
        while len(self.idle) > self.idle_limit:
            self.free.append(self._evict_oldest())

    def uncache(self, page: int) -> None:
        """The prefix cache no longer indexes `page` (an idle one becomes free)."""
        self.cached.discard(page)
        if page in self.idle:
            del self.idle[page]
            self.free.append(page)

    def _evict_oldest(self) -> int:
        page, _ = self.idle.popitem(last=False)
        self.cached.discard(page)
        if self.on_evict is not None:
            self.on_evict(page)
        return page

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
