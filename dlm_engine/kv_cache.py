"""The key/value pool of cached mode (Fast-dLLM's prefix and dual caches).

A pool holds every row's keys and values per layer while a step has cached rows. At a block
start a cached row runs over its whole sequence and so refreshes its whole slot; inside the
block only a span is recomputed: the block (dual cache) or the block and everything after it
(prefix cache). The span's fresh keys/values overwrite that span of the slot; the rest is read
from the cache, which is what makes the mode approximate. Exact rows in the same step write
their whole sequence too, so they read only their own fresh keys (dlm_engine/ragged.py).

The pool has one spare row and one spare position: padded rows and padded span positions
write there, so they can never touch a live row.

Block-diffusion rows (SDAR, LLaDA2) do not use it: their exact cache lives in pages shared
by reference count (dlm_engine/paged_kv.py).
"""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K/V buffers [rows + 1, length + 1, kv_heads, head_dim]: position-major, as
    the packed forward produces keys (token-major), so a row's span is written by one indexed
    copy and a slot is read as [length + 1, kv_heads, head_dim]."""

    def __init__(
        self,
        n_layers: int,
        rows: int,
        kv_heads: int,
        head_dim: int,
        length: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (rows + 1, length + 1, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.rows = rows
        self.length = length
        self.trash_row = rows
        self.trash_pos = length
        self.free = list(range(rows))

    def allocate(self) -> int:
        return self.free.pop(0)

    def release(self, slot: int) -> None:
        self.free.append(slot)
        self.free.sort()

    def grown(self, length: int) -> KVPool:
        """A pool for longer rows holding this pool's contents (graphs must be recaptured)."""
        kv_heads, head_dim = self.k[0].shape[2], self.k[0].shape[3]
        new = KVPool(
            len(self.k), self.rows, kv_heads, head_dim, length, self.k[0].dtype, self.k[0].device
        )
        for old, fresh in zip(self.k + self.v, new.k + new.v, strict=False):
            fresh[:, : self.length].copy_(old[:, : self.length])
        new.free = list(self.free)
        return new

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
