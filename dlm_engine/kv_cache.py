"""Approximate KV caches for cached mode (Fast-dLLM's prefix and dual caches).

A pool holds every cached row's keys and values per layer. At a block start a row runs a full
forward that refreshes its whole cache (`RefreshKV`); inside the block only a span is
recomputed (`SpanKV`): the block (dual cache) or the block and everything after it (prefix
cache). The span's fresh keys/values replace the cached ones for that step; the rest is read
from the cache, which is what makes the mode approximate.

The pool has one spare row and one spare position: padded rows and padded span positions
write there, so they can never touch a live row.
"""

from __future__ import annotations

import torch

from .models.common import attention


class KVPool:
    """Per-layer K/V buffers [rows + 1, kv_heads, length + 1, head_dim]."""

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
        shape = (rows + 1, kv_heads, length + 1, head_dim)
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
        kv_heads, head_dim = self.k[0].shape[1], self.k[0].shape[3]
        new = KVPool(
            len(self.k), self.rows, kv_heads, head_dim, length, self.k[0].dtype, self.k[0].device
        )
        for old, fresh in zip(self.k + self.v, new.k + new.v, strict=False):
            fresh[:, :, : self.length].copy_(old[:, :, : self.length])
        new.free = list(self.free)
        return new

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class RefreshKV:
    """Full forward at a block start: attend exactly, store each row's keys/values."""

    def __init__(self, pool: KVPool, slots: torch.Tensor) -> None:
        self.pool = pool
        self.slots = slots

    def attend(self, layer: int, q, k, v, key_mask):
        t = k.shape[2]
        self.pool.k[layer][self.slots, :, :t] = k
        self.pool.v[layer][self.slots, :, :t] = v
        return attention(q, k, v, key_mask)


class SpanKV:
    """Forward over a span: fresh span keys/values over the cached rest of the row."""

    def __init__(
        self, pool: KVPool, slots: torch.Tensor, write_pos: torch.Tensor, cache_mask: torch.Tensor
    ) -> None:
        self.pool = pool
        self.slots = slots  # [n]
        self.write_pos = write_pos  # [n, S] absolute positions (trash position for padding)
        self.cache_mask = cache_mask  # [n, length + 1]

    def attend(self, layer: int, q, k, v, key_mask):
        keys = self.pool.k[layer][self.slots]
        values = self.pool.v[layer][self.slots]
        idx = self.write_pos[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        keys.scatter_(2, idx, k)
        values.scatter_(2, idx, v)
        return attention(q, keys, values, self.cache_mask)
