"""Reuse of prompt prefixes across DiffusionGemma requests: the encoder's keys and values of a
prompt's leading chunks, copied into a new row's cache instead of being encoded again.

The encoder is causal, so the keys and values it writes for positions 0..P-1 depend only on
the tokens 0..P-1: two prompts sharing their first P tokens (a system prompt, a multi-turn
history) leave the same keys and values there. DiffusionGemma rows own their caches
(`models/diffusion_gemma.py`, `RowCache`), so sharing is a copy, not a page table: a row's
prompt is cut into chunks of `chunk_tokens`; once its prompt is encoded, the chunks it
encoded itself are stored here (every layer's keys and values of the chunk's positions),
keyed by the chain hash the block-diffusion prefix cache uses (`prefix_cache.page_hashes`,
chunk i's hash covers chunks 0..i and the request's `cache_salt`, so tenants never share).
A new row's longest cached run of chunks is copied into its cache and only the rest of its
prompt goes through the encoder.

Sliding-window layers: a row's cache keeps only their last `sliding_window - 1` positions,
and an encode drops older ones, so the chunks are recorded as they are encoded
(`RowCache.record_upto`), not read back from the cache afterwards. Every chunk holds every
position of every layer; a hit of P positions fills full layers with positions 0..P-1 and
sliding layers with the last `sliding_window - 1` of them, what an encode of those P tokens
keeps.

The store is bounded in bytes, least recently used out first; a lookup touches its chunks
deepest first, so a chain is evicted from its tail and its head stays reachable.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .prefix_cache import page_hashes

CHUNK_TOKENS = 256  # prompt tokens a cached chunk holds
CPU_BYTES = 64 << 20  # the `auto` budget on CPU
GPU_FRACTION = 0.05  # the `auto` budget on a GPU: this share of its memory


def auto_budget(device: torch.device) -> int:
    """`encoder_prefix_cache_bytes: auto`: 64 MiB on CPU, 5% of the GPU's memory on CUDA."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * GPU_FRACTION)
    return CPU_BYTES


@dataclass
class Chunk:
    """One chunk's keys and values per layer, each [KV heads, chunk_tokens, d]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    nbytes: int


class EncoderPrefixCache:
    """Chain hash -> `Chunk`, at most `budget_bytes` of them, plus the hit counters the
    engine's prefix-cache metrics read (`lookup_tokens`, `hit_tokens`, as `PrefixCache`)."""

    def __init__(self, budget_bytes: int, chunk_tokens: int = CHUNK_TOKENS) -> None:
        if budget_bytes <= 0 or chunk_tokens <= 0:
            raise ValueError("an encoder prefix cache needs a positive budget and chunk size")
        self.budget_bytes = budget_bytes
        self.chunk_tokens = chunk_tokens
        self.chunks: OrderedDict[bytes, Chunk] = OrderedDict()
        self.bytes = 0
        self.evictions = 0
        self.lookup_tokens = 0  # whole-chunk prompt tokens looked up
        self.hit_tokens = 0  # of those, copied from the cache instead of encoded

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def tokens(self) -> int:
        """Prompt tokens of the chunks held now."""
        return len(self.chunks) * self.chunk_tokens

    def hashes(self, prompt: list[int], salt: str | None) -> list[bytes]:
        """Chain hashes of the prompt's whole chunks (salted as the block families' pages)."""
        n, c = len(prompt) // self.chunk_tokens, self.chunk_tokens
        return page_hashes(prompt, c, c, n, salt)

    def match(self, hashes: list[bytes]) -> list[Chunk]:
        """The longest cached run of `hashes` from the first, touched (most recent) deepest
        first; counted in the hit counters."""
        hit = []
        for h in hashes:
            chunk = self.chunks.get(h)
            if chunk is None:
                break
            hit.append(chunk)
        for h in reversed(hashes[: len(hit)]):
            self.chunks.move_to_end(h)
        self.lookup_tokens += len(hashes) * self.chunk_tokens
        self.hit_tokens += len(hit) * self.chunk_tokens
        return hit

    def insert(
        self,
        hashes: list[bytes],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        start: int = 0,
    ) -> None:
        """Store a prompt's chunks `start`.. under their `hashes` (all the prompt's, from its
        first chunk) from per-layer keys and values [KV, (len(hashes) - start) * chunk, d],
        evicting least recently used chunks of other prompts to stay in budget. A hash already
        held keeps its chunk (a twin prompt encoded at the same time); a chain whose head is
        gone, or that would evict its own head, stores no more (its tail is unreachable)."""
        c, own = self.chunk_tokens, set(hashes)
        for j, h in enumerate(hashes):
            if h in self.chunks:
                continue
            if j < start:
                break
            at = (j - start) * c
            ks = [k[:, at : at + c].clone() for k in keys]
            vs = [v[:, at : at + c].clone() for v in values]
            nbytes = sum(t.nbytes for t in ks) + sum(t.nbytes for t in vs)
            while self.chunks and self.bytes + nbytes > self.budget_bytes:
                oldest = next(iter(self.chunks))
                if oldest in own:
                    break
                self.bytes -= self.chunks.pop(oldest).nbytes
                self.evictions += 1
            if self.bytes + nbytes > self.budget_bytes:
                break
            self.chunks[h] = Chunk(ks, vs, nbytes)
            self.bytes += nbytes
        for h in reversed(hashes):  # the head of the chain stays longest
            if h in self.chunks:
                self.chunks.move_to_end(h)

    def clear(self) -> None:
        self.chunks.clear()
        self.bytes = 0


def fill(cache, hit: list[Chunk], sliding: list[bool], window: int) -> int:
    """Write a hit's positions into an empty row cache as an encode of them would leave it
    (sliding layers: the last `window - 1`); returns the positions filled."""
    if not hit:
        return 0
    assert cache.length == 0
    c = hit[0].keys[0].shape[1]
    need = max(1, -(-(window - 1) // c))  # chunks holding what sliding layers keep
    tail = hit[-need:]
    for i, is_sliding in enumerate(sliding):
        part = tail if is_sliding else hit
        k = torch.cat([h.keys[i] for h in part], 1) if len(part) > 1 else part[0].keys[i]
        v = torch.cat([h.values[i] for h in part], 1) if len(part) > 1 else part[0].values[i]
        drop = max(0, k.shape[1] - (window - 1)) if is_sliding else 0
        cache.store(i, k[:, drop:], v[:, drop:])
    cache.length = c * len(hit)
    return cache.length
