"""One forward per step, whatever phase each row is in (issue 14).

A step's rows differ in what they feed the model: an exact row (and a cached row at a block
start, which refreshes its cache) feeds its whole sequence; a cached row inside a block feeds
only a span (its block for the dual cache, block and suffix for the prefix cache) and reads the
rest of its keys and values from the pool. Running each kind as its own forward reads every
weight once per kind; here the query tokens of all rows are packed into one sequence, so every
linear layer runs once over exactly the tokens the step needs, and only attention, which has
no weights, works per row:

* packed q/k/v are gathered into a padded per-row layout ``[rows, heads, Tq, head_dim]``;
* without cached rows each row attends over its own fresh keys (a key-padding mask);
* with cached rows every row has a pool slot: its fresh keys and values are written at their
  absolute positions (padding goes to the pool's spare position), and it attends over its slot
  up to its length. An exact or refreshing row writes every position below its length, so it
  reads only fresh keys (exact) and leaves a refreshed cache behind; a span row overwrites the
  span it recomputes every step of the block and reads the cached rest (Fast-dLLM's
  approximation, unchanged);
* the per-row outputs are gathered back into packed order.

Index tensors are made on the host and copied before the forward is queued; the forward
itself is a pure function of its inputs, so on CUDA it replays a graph captured per bucketed
shape (packed length, rows, query width).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVPool
from .models.common import attention


@dataclass(frozen=True)
class RowQuery:
    """What one forward row feeds and reads: its query tokens start at absolute position
    `pos0`; its keys cover positions [0, length); its logit window starts at `window_start`."""

    tokens: torch.Tensor  # device, 1-D: the query tokens
    pos0: int
    length: int
    window_start: int
    slot: int  # pool slot (cached steps), else unused


def packed_bucket(n: int) -> int:
    """Packed-length bucket for CUDA graphs: at most 8 buckets per doubling (<= 12.5% pad)."""
    if n <= 64:
        return 64
    step = max(64, 1 << (n.bit_length() - 4))
    return -(-n // step) * step


class PackedAttention:
    """The attention context of a packed forward (see the module docstring)."""

    def __init__(
        self,
        q_index: torch.Tensor,
        out_index: torch.Tensor,
        key_mask: torch.Tensor | None,
        pool: KVPool | None = None,
        slots: torch.Tensor | None = None,
        write_pos: torch.Tensor | None = None,
    ) -> None:
        self.q_index = q_index  # [R, Tq] packed index of each padded query position
        self.out_index = out_index  # [N] flat padded index of each packed token
        self.key_mask = key_mask  # [R, Tq] (fresh keys) or [R, L + 1] (pool); None: no padding
        self.pool = pool
        self.slots = slots  # [R]
        self.write_pos = write_pos  # [R, Tq] absolute positions (spare position for padding)

    def attend(self, layer: int, q, k, v, key_mask=None) -> torch.Tensor:
        """q [1, H, N, D], k/v [1, KV, N, D] packed -> attention output [1, H, N, D]."""
        qp = q[0][:, self.q_index].transpose(0, 1)  # [R, H, Tq, D]
        kp = k[0][:, self.q_index].transpose(0, 1)
        vp = v[0][:, self.q_index].transpose(0, 1)
        if self.pool is None:
            out = attention(qp, kp, vp, self.key_mask)
        else:
            kc, vc = self.pool.k[layer], self.pool.v[layer]
            heads = torch.arange(kp.shape[1], device=kp.device)
            where = (self.slots[:, None, None], heads[None, :, None], self.write_pos[:, None, :])
            kc[where] = kp
            vc[where] = vp
            out = attention(qp, kc[self.slots], vc[self.slots], self.key_mask)
        r, h, tq, d = out.shape
        return out.transpose(0, 1).reshape(h, r * tq, d)[:, self.out_index][None]


@dataclass
class PackedPlan:
    """Host-made index tensors of one packed forward, already padded to their buckets."""

    inputs: dict[str, torch.Tensor]
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
) -> PackedPlan:
    """Build the inputs of one packed forward over `queries` (see `packed_forward_fn`).

    `bucket` pads rows and the packed length to CUDA-graph buckets; padded rows read a token
    that exists, attend to one key and (with a pool) write only to the pool's spare row."""
    from .cuda_graphs import bucket_rows, round_up

    n_rows = len(queries)
    qlens = torch.tensor([q.tokens.numel() for q in queries])
    offsets = torch.cumsum(qlens, 0) - qlens
    n_real = int(qlens.sum())
    rows = bucket_rows(n_rows) if bucket else n_rows
    tq = round_up(int(qlens.max()), query_multiple)
    n_packed = packed_bucket(n_real) if bucket else n_real
    pad_rows = rows - n_rows

    def padded(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((pad_rows, *t.shape[1:]), value)]) if pad_rows else t

    pos0 = torch.tensor([q.pos0 for q in queries])
    ar = torch.arange(tq)
    q_index = padded(offsets[:, None] + torch.minimum(ar[None, :], qlens[:, None] - 1), 0)
    row_of = torch.repeat_interleave(torch.arange(n_rows), qlens)
    j_of = torch.arange(n_real) - offsets[row_of]
    tail = n_packed - n_real
    out_index = torch.cat([row_of * tq + j_of, torch.zeros(tail, dtype=torch.long)])
    positions = torch.cat([pos0[row_of] + j_of, torch.zeros(tail, dtype=torch.long)])
    wstart = torch.tensor([q.window_start for q in queries])
    w = torch.arange(width)

    def window(delta: int) -> torch.Tensor:
        rel = (wstart - delta - pos0)[:, None] + w[None, :]
        return offsets[:, None] + torch.minimum(rel.clamp(min=0), qlens[:, None] - 1)

    logits_index = padded(window(shift), 0).reshape(1, -1)
    current_index = window(0)
    inputs = {
        "positions": positions[None],
        "q_index": q_index,
        "out_index": out_index,
        "logits_index": logits_index,
    }
    lengths = torch.tensor([q.length for q in queries])
    if pool is None:
        if bucket and pad_rows == 0 and bool((qlens == tq).all()):
            pass  # no padding anywhere: attention runs unmasked (the flash kernel applies)
        else:
            inputs["key_mask"] = padded(ar[None, :] < qlens[:, None], 0)
            if pad_rows:
                inputs["key_mask"][n_rows:, 0] = True
        attn_pairs = int((qlens * qlens).sum())
    else:
        keys = torch.arange(pool.length + 1)
        key_mask = padded(keys[None, :] < lengths[:, None], 0)
        if pad_rows:
            key_mask[n_rows:, 0] = True
        write = torch.where(ar[None, :] < qlens[:, None], pos0[:, None] + ar, pool.trash_pos)
        inputs["key_mask"] = key_mask
        inputs["write_pos"] = padded(write, pool.trash_pos)
        inputs["slots"] = padded(torch.tensor([q.slot for q in queries]), pool.trash_row)
        attn_pairs = int((qlens * lengths).sum())
    moved = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
    ids = torch.cat([q.tokens for q in queries])
    if tail:
        ids = torch.cat([ids, ids.new_full((tail,), pad_id)])
    moved["ids"] = ids[None]
    moved["current_index"] = current_index.to(device, non_blocking=True)
    return PackedPlan(moved, n_rows, n_real, attn_pairs)


def packed_forward_fn(model: torch.nn.Module, pool: KVPool | None, width: int):
    """The forward of a packed plan: logits [rows, width, vocab] (graph-capturable)."""
    from .models.common import ForwardBatch

    def fn(x: dict[str, torch.Tensor]) -> torch.Tensor:
        ctx = PackedAttention(
            x["q_index"],
            x["out_index"],
            x.get("key_mask"),
            pool,
            x.get("slots"),
            x.get("write_pos"),
        )
        batch = ForwardBatch(x["ids"], x["positions"], None, x["logits_index"], ctx)
        logits = model(batch)
        return logits.reshape(-1, width, logits.shape[-1])

    return fn
