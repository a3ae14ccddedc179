"""Where a block-diffusion request's blocks lie, and what its next forward feeds.

SDAR and LLaDA2 split the whole sequence, prompt included, into blocks of `block_length`
aligned to absolute position 0: attention is causal across blocks and bidirectional inside
one. Decoding starts at the block holding the prompt's end (its prompt tokens stay, only its
masks are decoded) and runs to the end of the block holding position prompt + max_tokens, so
the canvas may run up to block_length - 1 tokens past `max_tokens`; those positions take part
in attention as upstream's do, and the text stops at `max_tokens`.

The KV cache is exact: a finished block's keys and values never change. A row's forward feeds
its tokens from `kv_upto` (the first position whose stored keys are not final) to the end of
its active block; everything before is read from its KV pages (dlm_engine/paged_kv.py; the
first ones may be a cached prompt prefix shared with other requests). After the first step
that is the active block alone, plus the block just completed (its keys stored once more,
now with its final tokens: upstream's separate "store KV" forward, folded into the next step).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockLayout:
    """Block geometry of one request: prompt length, block size, canvas end."""

    prompt_len: int
    block: int
    max_tokens: int

    @property
    def first_block(self) -> int:
        """The block decoding starts in: the one holding the prompt's end (prefill covers the
        whole blocks before it)."""
        return self.prompt_len // self.block

    @property
    def num_blocks(self) -> int:
        return -(-(self.prompt_len + self.max_tokens) // self.block)

    @property
    def total_len(self) -> int:
        return self.num_blocks * self.block

    @property
    def canvas_len(self) -> int:
        return self.total_len - self.prompt_len

    def window(self, block: int) -> tuple[int, int]:
        """Absolute [start, end) of block `block`'s positions that are decoded (not prompt)."""
        return max(self.prompt_len, block * self.block), (block + 1) * self.block
