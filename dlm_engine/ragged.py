"""One forward per step, whatever phase each row is in.

A step's rows differ in what they feed the model: an exact row (and a cached row at a block
start, which refreshes its cache) feeds its whole sequence; a cached row inside a block feeds
only a span (its block for the dual cache, block and suffix for the prefix cache) and reads the
rest of its keys and values from the pool. Running each kind as its own forward reads every
weight once per kind; here the query tokens of all rows are packed into one sequence, so every
linear layer runs once over exactly the tokens the step needs, and only attention, which has
no weights, works per row:

* packed q/k/v are gathered into a padded per-row layout ``[rows, heads, Tq, head_dim]``,
  one layout per attention group;
* rows whose query is their whole sequence (exact rows, cached rows at a block start, the
  unconditional rows of classifier-free guidance) attend over their own fresh keys with a
  key-padding mask (none when nothing is padded, so the flash kernel applies); a cached row
  among them also stores its keys and values in its pool slot (a refresh);
* cached rows inside a block write their span's fresh keys and values into their slot at
  their absolute positions (padding goes to the pool's spare position) and attend over the
  slot up to their length: the span is overwritten every step of the block, the rest is the
  cache (Fast-dLLM's approximation, unchanged); laid out at their own slots (empty slots as
  padding rows) they read the pool as a view, unless the empty slots would outnumber them
  (then one gather a layer);
* block-diffusion rows keep their keys in pages (dlm_engine/paged_kv.py): their
  fresh keys are written through their page tables, then each query attends block-causally
  (keys before its block's end), either over the row's pages gathered into a per-row key
  layout (`paged_attention` `gather`) or read in place through the page table by
  FlexAttention (`flex`, dlm_engine/paged_flex.py: the plan carries its index tensors);
* the per-row outputs are gathered back into packed order.

Index tensors (page tables included) are made on the host and copied before the forward is
queued; the forward itself is a pure function of its inputs, so on CUDA it replays a graph
captured per bucketed shape (packed length, rows, query width, pages per row). An in-block
step (span rows only) pads its packed length to its row bucket times its query width, so all
row counts of one bucket share one graph (17 to 24 rows: one capture, not eight); steps that
feed whole sequences keep the finer packed buckets (they are bound by arithmetic, and the
largest run eagerly: `cuda_graphs.worth_a_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from . import paged_flex
from .kv_cache import KVPool
from .models.common import additive_mask, attention
from .paged_kv import PagePool


@dataclass(frozen=True)
class RowQuery:
    """What one forward row feeds and reads: its query tokens start at absolute position
    `pos0`; its keys cover positions [0, length); its logit window starts at `window_start`.
    A row whose query is its whole sequence attends over its own fresh keys; a span row reads
    the rest of its keys from its pool `slot`. `slot` is where fresh keys are stored (a cached
    row's own slot, or None: not stored). A block-diffusion row (`block` > 0) has no slot: its
    keys are in the pages of `pages` (page i: positions [i * page, (i + 1) * page))."""

    tokens: torch.Tensor  # device, 1-D: the query tokens
    pos0: int
    length: int
    window_start: int
    slot: int | None = None
    block: int = 0  # block-diffusion rows: block-causal attention over its pages
    pages: list[int] | None = None  # block rows: their page table, covering [0, length)

    @property
    def span(self) -> bool:
        return self.pos0 > 0 or self.tokens.numel() < self.length

    @property
    def group(self) -> str:
        if self.block:
            return "block"
        return "span" if self.span else "fresh"


# attention groups: over own fresh keys, over the pool, block-causal over pages
GROUPS = ("fresh", "span", "block")


def packed_bucket(n: int) -> int:
    """Packed-length bucket for CUDA graphs: at most 8 buckets per doubling (<= 12.5% pad)."""
    if n <= 64:
        return 64
    step = max(64, 1 << (n.bit_length() - 4))
    return -(-n // step) * step


class GroupLayout(NamedTuple):
    """The shape of one attention group in a packed forward (part of a CUDA graph's key)."""

    group: str  # one of GROUPS
    rows: int  # padded rows
    tq: int  # padded query width
    identity: bool  # the packed order is already the padded order: views, no gather
    keys: int = 0  # the block group's key span
    # the span group's rows are laid out at their own pool slots (slot s: row s; empty slots
    # are padding rows): their keys are read as a view of the pool's first `rows` slots, not
    # gathered (a gather is a measurable share of a batch-1 in-block step)
    slots_in_place: bool = False


Layout = tuple[GroupLayout, ...]


def block_query_bucket(n: int) -> int:
    """Query-width bucket of the block group: powers of two up to 32 (SDAR's blocks are 4-32
    tokens, so a decoding step pads little), then multiples of 32 (first steps: prompts)."""
    if n <= 32:
        return 1 << max(0, (n - 1).bit_length())
    return -(-n // 32) * 32


class PackedAttention:
    """The attention context of a packed forward (see the module docstring). Per group of the
    layout: its padded query index (none when the packed order is already the padded one), an
    optional key mask, and optionally pool slots and write positions; the block group reads
    and writes the page pool `pages` through its page tables."""

    def __init__(
        self,
        x: dict[str, torch.Tensor],
        pool: KVPool | None,
        layout: Layout,
        pages: PagePool | None = None,
    ) -> None:
        self.x = x
        self.pool = pool
        self.layout = layout
        self.pages = pages
        # additive key masks, made once per forward: SDPA turns a boolean mask into one on
        # every call (three small kernels a layer)
        self.masks: dict[str, torch.Tensor] = {}
        self.flex_mask = None  # the block group's BlockMask (flex path), made once per forward

    def _mask(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        if name not in self.masks and name in self.x:
            self.masks[name] = additive_mask(self.x[name], dtype)
        return self.masks.get(name)

    def attend(self, layer: int, q, k, v, key_mask=None) -> torch.Tensor:
        """q [1, H, N, D], k/v [1, KV, N, D] packed -> attention output [1, H, N, D]."""
        qt, kt, vt = (t[0].transpose(0, 1) for t in (q, k, v))  # token-major [N, heads, D]
        outs = []
        for g, rows, tq, identity, keys, in_place in self.layout:
            if g == "block":
                outs.append(self._block(layer, qt, kt, vt, rows, tq, keys))
                continue
            if identity:  # packed order is the padded order: views, no gather
                qp, kp, vp = (t.reshape(rows, tq, *t.shape[1:]) for t in (qt, kt, vt))
            else:
                idx = self.x[f"{g}_q_index"]  # [rows, Tq]
                qp, kp, vp = qt[idx], kt[idx], vt[idx]  # [rows, Tq, heads, D]
            slots = self.x.get(f"{g}_slots")
            if slots is not None:  # store fresh keys/values at their absolute positions
                flat = self.x[f"{g}_write_flat"].reshape(-1)
                for pool, fresh in ((self.pool.k[layer], kp), (self.pool.v[layer], vp)):
                    pool.view(-1, *pool.shape[2:]).index_copy_(0, flat, fresh.flatten(0, 1))
            mask = self._mask(f"{g}_key_mask", q.dtype)
            if g == "span" and in_place:  # row r is slot r: the layout a gather would make
                keys, values = self.pool.k[layer][:rows], self.pool.v[layer][:rows]
            elif g == "span":  # over the slot: the span just written, the cache around it
                keys = self.pool.k[layer].index_select(0, slots)
                values = self.pool.v[layer].index_select(0, slots)
            else:
                keys, values = kp, vp
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [rows, KV, S, D]
            out = attention(qp.transpose(1, 2), keys, values, mask)  # [rows, H, Tq, D]
            outs.append(out.transpose(1, 2).reshape(rows * tq, out.shape[1], out.shape[3]))
        flat = outs[0] if len(outs) == 1 else torch.cat(outs)
        if "out_index" in self.x:
            flat = flat[self.x["out_index"]]
        return flat[None].transpose(1, 2)

    def _block(self, layer: int, qt, kt, vt, rows: int, tq: int, keys: int) -> torch.Tensor:
        """Block-causal rows over the page pool: fresh keys are written through the page
        table (page id, offset), then each row's pages are gathered into [rows, keys] (one
        indexed read a layer) and each query attends to the keys before its own block's end."""
        pages = self.pages
        idx = self.x["block_q_index"]  # [rows, Tq] packed index of row r's query j
        qp, kp, vp = qt[idx], kt[idx], vt[idx]  # [rows, Tq, heads, D]
        where = (self.x["block_write_page"], self.x["block_write_off"])
        pages.k[layer][where] = kp
        pages.v[layer][where] = vp
        if paged_flex.PAGES in self.x and paged_flex.usable():  # in place, through the table
            out = self._block_flex(layer, qp, rows, tq)
            if out is not None:
                return out
        if "block_pages" in self.x:
            table = self.x["block_pages"]  # [rows, P] page ids (trash past a row's end)
        else:  # a flex plan whose compiled call failed: the same table, gathered
            table = self.x[paged_flex.PAGES].view(rows, -1).long()
        kv, dim = kp.shape[2], kp.shape[3]
        span = table.shape[1] * pages.page_tokens
        k = pages.k[layer][table].view(rows, span, kv, dim)[:, :keys].transpose(1, 2)
        v = pages.v[layer][table].view(rows, span, kv, dim)[:, :keys].transpose(1, 2)
        # GQA folded into the query axis: the heads sharing a KV head become more queries of
        # one attention over that KV head (SDPA's enable_gqa with a mask falls back to the
        # slow math kernel)
        heads = qp.shape[2]
        rep = heads // kv
        q = qp.view(rows, tq, kv, rep, dim).permute(0, 2, 3, 1, 4).reshape(rows, kv, rep * tq, dim)
        if "block" not in self.masks:  # the same for every layer: made once per forward
            limit = self.x["block_limit"]  # [rows, Tq]: keys before this position are visible
            mask = torch.arange(keys, device=limit.device)[None, None, :] < limit[:, :, None]
            mask = mask.repeat(1, rep, 1)[:, None]  # [rows, 1, rep * Tq, S]
            self.masks["block"] = additive_mask(mask, q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.masks["block"])
        out = out.view(rows, kv, rep, tq, dim).permute(0, 3, 1, 2, 4)
        return out.reshape(rows * tq, heads, dim)

    def _block_flex(self, layer: int, qp, rows: int, tq: int) -> torch.Tensor | None:
        """The block group over the pool in place (dlm_engine/paged_flex.py): no gather."""
        k_pages, v_pages = self.pages.k[layer], self.pages.v[layer]
        heads, dim = qp.shape[2], qp.shape[3]
        if self.flex_mask is None:  # the same for every layer
            pt = k_pages.shape[1]
            rep = heads // k_pages.shape[2]
            self.flex_mask = paged_flex.block_mask(self.x, pt, k_pages.shape[0] * pt, rep)
        out = paged_flex.attend(qp.transpose(1, 2), k_pages, v_pages, self.flex_mask)
        if out is None:  # the compiled call failed: the caller gathers
            return None
        return out.transpose(1, 2).reshape(rows * tq, heads, dim)


@dataclass
class PackedPlan:
    """Index tensors of one packed forward, padded to their buckets, on the device."""

    inputs: dict[str, torch.Tensor]
    current_index: torch.Tensor  # [rows, width] packed index of each row's window tokens
    layout: Layout
    rows: int  # real forward rows
    tokens: int  # real packed tokens
    attn_pairs: int  # (query, key) pairs attention computes for real rows


def plan_packed(
    queries: list[RowQuery],
    *,
    width: int,
    shift: int,
    pad_id: int,
    device: torch.device,
    pool: KVPool | None,
    bucket: bool,
    query_multiple: int,
    pages: PagePool | None = None,
    paged_attention: str = "gather",
) -> PackedPlan:
    """Build the inputs of one packed forward over `queries` (see `packed_forward_fn`).

    `bucket` pads rows and the packed length to CUDA-graph buckets; padded rows read a token
    that exists, attend to one key and (with a pool) write only to the pool's spare row.
    `paged_attention` picks how block rows read their pages (`paged_flex.MODES`)."""
    from .cuda_graphs import bucket_rows, round_up

    n_rows = len(queries)
    qlens = torch.tensor([q.tokens.numel() for q in queries])
    offsets = torch.cumsum(qlens, 0) - qlens
    n_real = int(qlens.sum())
    n_packed = packed_bucket(n_real) if bucket else n_real
    kinds = [q.group for q in queries]
    if bucket and set(kinds) == {"span"}:  # an in-block step: one shape per row bucket,
        # exactly rows x width (rows of one width then need no gather: one row's 32-token
        # block is not padded to 64)
        n_packed = bucket_rows(n_rows) * round_up(int(qlens.max()), query_multiple)
    tail = n_packed - n_real
    pos0 = torch.tensor([q.pos0 for q in queries])
    lengths = torch.tensor([q.length for q in queries])
    inputs: dict[str, torch.Tensor] = {}
    flat_of_row = torch.zeros(n_rows, dtype=torch.long)  # where each row's outputs start
    base, attn_pairs = 0, 0
    layout: list[GroupLayout] = []
    for g in GROUPS:
        members = [i for i, kind in enumerate(kinds) if kind == g]
        if not members:
            continue
        if g == "block":
            base, attn_pairs = _plan_block(
                queries, members, inputs, layout, flat_of_row, base, attn_pairs,
                qlens=qlens, offsets=offsets, pages=pages, bucket=bucket,
                flex=paged_attention == "flex",
            )  # fmt: skip
            continue
        sel = torch.tensor(members)
        gl = qlens[sel]
        n = len(members)
        rows = bucket_rows(n) if bucket else n
        place = torch.arange(n)  # each member's row in the group's padded layout
        stored = [queries[i].slot for i in members]
        slots_in_place = False
        if g == "span":  # rows placed at their own slot: keys are a view of the pool's
            top = max(stored) + 1  # first `rows` slots, no gather (span rows all have one)
            span_rows = min(bucket_rows(top) if bucket else top, pool.rows + 1)
            # worth it while the empty slots read along (masked) are no more than the rows:
            # a gather copies each row's keys and values once more than a view reads them
            if span_rows - n <= n:
                rows, place, slots_in_place = span_rows, torch.tensor(stored), True
        in_order = rows == n and bool((place == torch.arange(n)).all())
        tq = round_up(int(gl.max()), query_multiple)
        ar = torch.arange(tq)
        identity = len(set(kinds)) == 1 and in_order and not tail and bool((gl == tq).all())
        layout.append(GroupLayout(g, rows, tq, identity, 0, slots_in_place))
        empty = torch.ones(rows, dtype=torch.bool)  # padding rows: no member
        empty[place] = False

        def placed(t: torch.Tensor, value, in_order: bool = in_order, place=place, rows=rows):
            """Per-member rows `t` laid out at their places, `value` in the padding rows."""
            if in_order:
                return t
            out = t.new_full((rows, *t.shape[1:]), value)
            out[place] = t
            return out

        if not identity:
            q_index = offsets[sel, None] + torch.minimum(ar, gl[:, None] - 1)
            inputs[f"{g}_q_index"] = placed(q_index, 0)
        flat_of_row[sel] = base + place * tq
        base += rows * tq
        if g == "span":  # keys: the row's pool slot up to its length
            keys = torch.arange(pool.length + 1)
            mask = placed(keys[None, :] < lengths[sel, None], False)
            attn_pairs += int((gl * lengths[sel]).sum())
        elif not in_order or bool((gl != tq).any()) or not bucket:
            mask = placed(ar[None, :] < gl[:, None], False)  # keys: its own fresh tokens
            attn_pairs += int((gl * gl).sum())
        else:  # no padding anywhere: unmasked attention (the flash kernel applies)
            mask = None
            attn_pairs += int((gl * gl).sum())
        if mask is not None:
            mask[empty, 0] = True  # a padding row attends to one key (no empty softmax)
            inputs[f"{g}_key_mask"] = mask
        if pool is not None and any(s is not None for s in stored):
            trash = pool.trash_row
            inputs[f"{g}_slots"] = placed(
                torch.tensor([trash if s is None else s for s in stored]), trash
            )
            keep = torch.tensor([s is not None for s in stored])[:, None] & (ar < gl[:, None])
            write = torch.where(keep, pos0[sel, None] + ar, pool.trash_pos)
            # flat (slot, position) of each key in the pool's [slots * (length + 1)] rows: one
            # index_copy_ a layer (an index_put over two index tensors cost twice as much)
            write = placed(write, pool.trash_pos)
            inputs[f"{g}_write_flat"] = inputs[f"{g}_slots"][:, None] * (pool.length + 1) + write
    # numpy's repeat: torch's repeat_interleave and searchsorted cost far more on CPU
    row_of = torch.from_numpy(np.repeat(np.arange(n_rows), qlens.numpy()))
    j_of = torch.arange(n_real) - offsets[row_of]
    zeros = torch.zeros(tail, dtype=torch.long)
    if not all(group.identity for group in layout):
        inputs["out_index"] = torch.cat([flat_of_row[row_of] + j_of, zeros])
    inputs["positions"] = torch.cat([pos0[row_of] + j_of, zeros])[None]
    wstart = torch.tensor([q.window_start for q in queries])
    w = torch.arange(width)

    def window(delta: int) -> torch.Tensor:
        rel = (wstart - delta - pos0)[:, None] + w[None, :]
        return offsets[:, None] + torch.minimum(rel.clamp(min=0), qlens[:, None] - 1)

    logit_rows = bucket_rows(n_rows) if bucket else n_rows
    logits_index = window(shift)
    if logit_rows > n_rows:
        logits_index = torch.cat(
            [logits_index, logits_index.new_zeros((logit_rows - n_rows, width))]
        )
    inputs["logits_index"] = logits_index.reshape(1, -1)
    moved = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
    moved["ids"] = packed_ids(queries, tail, pad_id)
    current = window(0).to(device, non_blocking=True)
    return PackedPlan(moved, current, tuple(layout), n_rows, n_real, attn_pairs)


def packed_ids(queries: list[RowQuery], tail: int, pad_id: int) -> torch.Tensor:
    """The packed query tokens [1, N] (a device op over the rows' own token tensors)."""
    ids = torch.cat([q.tokens for q in queries])
    if tail:
        ids = torch.cat([ids, ids.new_full((tail,), pad_id)])
    return ids[None]


def plan_key(queries: list[RowQuery]) -> tuple | None:
    """What a plan's index tensors are a function of, beyond the step's settings (width,
    pool, bucketing): per row its query length, positions, window and slot. Equal keys, equal
    index tensors, so a step whose rows did not move (a cached in-block step: only tokens
    change) reuses the last plan and feeds new tokens. None for block-diffusion rows, whose
    page tables grow between steps."""
    if any(q.block for q in queries):
        return None
    return tuple((q.tokens.numel(), q.pos0, q.length, q.window_start, q.slot) for q in queries)


def with_new_tokens(plan: PackedPlan, queries: list[RowQuery], pad_id: int) -> PackedPlan:
    """`plan` (made for rows with the same `plan_key`) over these rows' current tokens."""
    tail = plan.inputs["ids"].shape[1] - plan.tokens
    return replace(plan, inputs={**plan.inputs, "ids": packed_ids(queries, tail, pad_id)})


def _plan_block(
    queries: list[RowQuery],
    members: list[int],
    inputs: dict[str, torch.Tensor],
    layout: list,
    flat_of_row: torch.Tensor,
    base: int,
    attn_pairs: int,
    *,
    qlens: torch.Tensor,
    offsets: torch.Tensor,
    pages: PagePool,
    bucket: bool,
    flex: bool = False,
) -> tuple[int, int]:
    """Index tensors of the block group: its rows' page tables [rows, P], where each fresh
    key goes (page id, offset) and each query's key limit. Padded rows and positions write
    to the trash page and read one key. With `bucket` every shape is a bucket (rows, query
    width, pages), so the forward stays capturable as a CUDA graph. With `flex` the page
    table goes in FlexAttention's form (`paged_flex.host_inputs`) instead."""
    from .cuda_graphs import bucket_rows, round_up

    n_rows = len(members)
    rows = bucket_rows(n_rows) if bucket else n_rows
    gl = [int(qlens[i]) for i in members]
    tq = block_query_bucket(max(gl)) if bucket else max(gl)
    keys = max(queries[i].length for i in members)
    pt = pages.page_tokens
    if bucket:
        keys = -(-round_up(keys, 64) // pt) * pt
    n_pages = -(-keys // pt)
    # numpy, vectorised over rows: a Python loop of small torch ops pays their dispatch per row
    table = np.full((rows, n_pages), pages.trash, dtype=np.int64)
    for r, i in enumerate(members):  # host lists into one array (no per-layer work)
        row_pages = queries[i].pages[:n_pages]
        table[r, : len(row_pages)] = row_pages
    n = np.array(gl)
    pos = np.array([queries[i].pos0 for i in members])[:, None] + np.arange(tq)[None, :]
    blk = np.array([queries[i].block for i in members])[:, None]
    end = np.array([queries[i].length for i in members])[:, None]
    valid = np.arange(tq)[None, :] < n[:, None]
    off = offsets.numpy()[members][:, None]
    q_index = np.zeros((rows, tq), dtype=np.int64)
    q_index[:n_rows] = off + np.minimum(np.arange(tq)[None, :], n[:, None] - 1)
    page_of = np.take_along_axis(table[:n_rows], np.minimum(pos // pt, n_pages - 1), axis=1)
    write_page = np.full((rows, tq), pages.trash, dtype=np.int64)
    write_page[:n_rows] = np.where(valid, page_of, pages.trash)
    write_off = np.zeros((rows, tq), dtype=np.int64)
    write_off[:n_rows] = np.where(valid, pos % pt, 0)
    limit = np.ones((rows, tq), dtype=np.int64)  # padding: key 0 only (no empty softmax)
    limit[:n_rows] = np.where(valid, np.minimum((pos // blk + 1) * blk, end), 1)
    flat_of_row[members] = base + torch.arange(n_rows) * tq
    attn_pairs += int((n * end[:, 0]).sum())
    arrays = {
        "block_q_index": q_index,
        "block_write_page": write_page,
        "block_write_off": write_off,
        "block_limit": limit,
    }
    if flex and tq <= paged_flex.MAX_QUERY:  # a prompt's step gathers (paged_flex.MAX_QUERY)
        arrays.update(paged_flex.host_inputs(table, limit, pt, pages.trash))
    else:
        arrays["block_pages"] = table
    for name, a in arrays.items():
        inputs[name] = torch.from_numpy(a)
    layout.append(GroupLayout("block", rows, tq, False, keys))
    return base + rows * tq, attn_pairs


def packed_forward_fn(
    model: torch.nn.Module,
    pool: KVPool | None,
    width: int,
    layout: Layout,
    pages: PagePool | None = None,
):
    """The forward of a packed plan up to the output head: the hidden states of every row's
    window [rows, width, hidden] (graph-capturable). The head runs outside a captured graph,
    so a graph keeps hidden states, not vocabulary-wide logits, as its static output."""
    from .models.common import ForwardBatch, gather_positions

    def fn(x: dict[str, torch.Tensor]) -> torch.Tensor:
        ctx = PackedAttention(x, pool, layout, pages)
        batch = ForwardBatch(x["ids"], x["positions"], None, x["logits_index"], ctx)
        hidden = gather_positions(model.hidden_states(batch), x["logits_index"])
        return hidden.reshape(-1, width, hidden.shape[-1])

    # what a tensor-parallel rank 0 tells the other ranks to build the same forward
    # (dlm_engine/parallel/graphs.py)
    fn.parts = (pool, width, layout, pages)  # type: ignore[attr-defined]
    return fn
