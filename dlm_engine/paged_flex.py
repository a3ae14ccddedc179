"""Block-causal attention of block-diffusion rows read from the page pool in place.

The gather path (`ragged.PackedAttention._block`) copies every row's pages into a contiguous
``[rows, keys]`` layout each layer before attention. This path instead hands FlexAttention
(`torch.nn.attention.flex_attention`) the whole pool of one layer as a single key sequence,
``[1, kv_heads, (pages + 1) * page_tokens, head_dim]`` (a view, no copy), shared by every
query row (FlexAttention broadcasts a key batch of 1), and a BlockMask whose KV block is one
page: row r's KV block list is its page table, so the kernel loads exactly the row's pages.

The mask itself (``mask_mod``) is exact on its own, as FlexAttention's unfused CPU path
applies it to every (query, key) pair and ignores the block list: a key at physical index
``page * page_tokens + offset`` is visible to row r's query j when

* row r's page table holds ``page`` at its logical index ``logical[page]`` (a per-forward map
  page -> logical index; a page shared by rows sits at the same index in each, since the
  prefix cache shares a prompt's leading pages), and
* its logical position ``logical[page] * page_tokens + offset`` is below the query's limit
  (the end of its block, as in the gather path).

The trash page is never in a real row's table; a padding row's table is all trash and its
limit 1, so it reads the trash page's first key only (logical index 0), as the gather path
does, and its softmax is never empty.

Index tensors are made on the host with the rest of the plan (`host_inputs`); the BlockMask
is built from them once per forward (`block_mask`) and reused by every layer. On CUDA the
attention call is compiled (FlexAttention runs fast only compiled); the kernel's KV tile is
the page or a power of two dividing it (`kernel_block`): a page of 16 or 32 tokens (SDAR,
LLaDA2, Fast-dLLM v2) is one tile; a page that no tile of 16 divides stays on the gather
path (`supported`).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

MODES = ("gather", "flex")
RECOMPILE_LIMIT = 512  # compiled shapes of the flex call: (rows, query, table width) buckets
# the widest query a row may feed for its group to read in place: denoising steps feed a block
# (4-32 tokens; a few blocks under multi_bd), prompts up to thousands. Every query width
# compiles the call once (seconds), so a prompt's step gathers instead (there the arithmetic,
# not the copy, dominates) and the compiled shapes stay a handful of width buckets per row
# bucket, met in the first minutes of traffic.
MAX_QUERY = 128

# input names in a packed plan (ragged.py): their presence selects this path
BLOCKS = "block_flex_blocks"  # [rows, 1, 1] int32: pages each row reads
PAGES = "block_flex_pages"  # [rows, 1, 1, P] int32: each row's page table
LOGICAL = "block_flex_logical"  # [pages + 1] int32: page -> its logical index this forward


def host_inputs(table: np.ndarray, limit: np.ndarray, page_tokens: int, trash: int) -> dict:
    """The flex path's index arrays from a plan's page table [rows, P] (trash past each row's
    pages; all trash for padding rows) and key limits [rows, Tq] (1 for padding rows). The
    table is padded with trash to a power-of-two width, so every compiled shape is static and
    a few widths serve every length (the kernel reads only each row's `blocks` pages)."""
    rows, width = table.shape
    n_pages = 1 << max(0, (width - 1).bit_length())
    if n_pages != width:
        table = np.concatenate([table, np.full((rows, n_pages - width), trash, table.dtype)], 1)
    blocks = -(-limit.max(axis=1) // page_tokens)  # pages holding the row's visible keys
    logical = np.zeros(trash + 1, dtype=np.int32)  # the trash page: index 0 (padding rows)
    real = table != trash
    cols = np.broadcast_to(np.arange(n_pages, dtype=np.int32), table.shape)
    logical[table[real]] = cols[real]
    if not np.array_equal(logical[table[real]], cols[real]):
        raise RuntimeError("a page sits at two logical indices in one forward")
    return {
        BLOCKS: blocks.astype(np.int32).reshape(rows, 1, 1),
        PAGES: table.astype(np.int32).reshape(rows, 1, 1, n_pages),
        LOGICAL: logical,
    }


def q_block(tq: int, rep: int) -> int:
    """The BlockMask's query block: one block spans a row's queries. A multiple of every
    query tile the kernels pick (the decoding kernel tiles queries times grouped heads)."""
    return max(128, 1 << max(0, (tq * rep - 1).bit_length()))


def block_mask(x: dict[str, torch.Tensor], page_tokens: int, pool_tokens: int, rep: int):
    """The BlockMask of one forward's block group (see the module docstring)."""
    table, limit, logical = x[PAGES], x["block_limit"], x[LOGICAL]
    pt = page_tokens

    def visible(b, h, q_idx, kv_idx):
        page = kv_idx // pt
        index = logical[page]
        return (table[b, 0, 0, index] == page) & (index * pt + kv_idx % pt < limit[b, q_idx])

    tq = limit.shape[1]
    return BlockMask.from_kv_blocks(
        x[BLOCKS],
        table,
        BLOCK_SIZE=(q_block(tq, rep), pt),
        mask_mod=visible,
        seq_lengths=(tq, pool_tokens),
        compute_q_blocks=False,  # the backward's index: never needed here
    )


def kernel_block(page_tokens: int) -> int:
    """The compiled kernel's KV tile: the largest power of two dividing a page, at most 64;
    0 where none of at least 16 does (Triton's matrix tiles need 16)."""
    tile = min(page_tokens & -page_tokens, 64)
    return tile if tile >= 16 else 0


def supported(page_tokens: int, device: torch.device) -> bool:
    """The flex path runs for this page size on this device (any page on the CPU)."""
    return device.type != "cuda" or kernel_block(page_tokens) > 0


@functools.cache
def _compiled():
    """FlexAttention compiled with static shapes: the decoding kernel, which serves a row's few
    queries, needs a static batch, and a symbolic page-table width made Triton reject the
    kernel (an int64 length beside int32 block counts). Every (rows, query width, table
    width) bucket compiles once, so the per-function recompile limit is raised above the
    bucket count (once it is hit, dynamo would run the unfused path)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "accumulated_recompile_limit"):
        setattr(cfg, name, max(int(getattr(cfg, name)), RECOMPILE_LIMIT))
    return torch.compile(flex_attention, dynamic=False)


class _Compiled:
    """Whether the compiled call failed in this process: then every later forward gathers
    (reported with the fused kernels' fallbacks: the ready line and a metric)."""

    failed = False


def usable() -> bool:
    return not _Compiled.failed


def attend(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, mask
) -> torch.Tensor | None:
    """q [rows, heads, Tq, D] over one layer's pool [pages + 1, page_tokens, kv, D]
    -> [rows, heads, Tq, D]; None where the compiled call failed (the caller gathers)."""
    _, pt, kv, dim = k_pages.shape
    k = k_pages.view(1, -1, kv, dim).transpose(1, 2)  # [1, kv, pool tokens, D]: a view
    v = v_pages.view(1, -1, kv, dim).transpose(1, 2)
    gqa = q.shape[1] != kv
    try:
        if q.device.type == "cuda":
            options = {"BLOCK_N": kernel_block(pt)}
            return _compiled()(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=options)
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)  # unfused: for checks
    except Exception as exc:  # compiler missing or unsupported here: stay correct
        fall_back(exc)
        return None


def fall_back(exc: BaseException) -> None:
    """Gather from now on, and say so where the fused kernels' fallbacks are reported."""
    from .models.common import FusedKernels

    logging.getLogger(__name__).warning("paged_attention flex disabled, gathering: %s", exc)
    _Compiled.failed = True
    FusedKernels.fallbacks.append("paged_attention_flex")
