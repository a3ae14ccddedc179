"""Mixture-of-experts pieces for LLaDA2 (BailingMoeV2 layout): group-limited sigmoid routing
and the experts as grouped GEMMs.

Routing follows inclusionAI's published `modeling_llada2_moe.py` (`LLaDA2MoeGate`) step by
step, in float32: sigmoid scores; `expert_bias` added only to choose experts; a group's score
is the sum of its two best biased scores; the `topk_group` best groups stay eligible; the top-k
experts among them are chosen; their weights are the *unbiased* scores, renormalised (when
k > 1) and scaled by `routed_scaling_factor`.

The experts run as two grouped GEMMs over tokens sorted by expert (`torch._grouped_mm`, which
also runs on CPU, or on CUDA its Triton-tuned compile: `expert_gemm.py`), never as a Python
loop over experts. No step waits on the host (no `.item()`, no data-dependent shapes), so the
layer can be captured in a CUDA graph. Where `_grouped_mm` is unavailable for a device and dtype, a per-row gathered
`torch.bmm` computes the same products.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .common import silu_mul
from .expert_gemm import grouped_mm

log = logging.getLogger(__name__)

_GROUPED_MM_FAILED: set[tuple[str, torch.dtype]] = set()
_BMM_CHUNK_ELEMENTS = 1 << 26  # gathered expert weights per fallback chunk (bounds memory)


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    expert_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen experts [N, k] (int64) and their weights [N, k] (float32) for tokens x [N, H]."""
    logits = F.linear(x.float(), gate_weight.float())
    scores = torch.sigmoid(logits)
    biased = scores + expert_bias.float()
    n, n_experts = biased.shape
    grouped = biased.view(n, n_group, n_experts // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    keep_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
    eligible = group_mask[..., None].expand_as(grouped).reshape(n, n_experts)
    chosen = biased.masked_fill(~eligible, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if top_k > 1 and normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen, weights * routed_scaling_factor


def _gathered_bmm(x: torch.Tensor, w: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
    """x [M, in] times w[expert_of_row[m]] [in, out] per row, in bounded chunks of rows."""
    out = x.new_empty(x.shape[0], w.shape[-1])
    step = max(1, _BMM_CHUNK_ELEMENTS // (w.shape[1] * w.shape[2]))
    for s in range(0, x.shape[0], step):
        e = expert_of_row[s : s + step]
        out[s : s + step] = torch.bmm(x[s : s + step, None], w[e]).squeeze(1)
    return out


def in_out(w: torch.Tensor | Any) -> torch.Tensor | Any:
    """Stacked expert weights in `F.linear` layout [E, out, in] (as DiffusionGemma publishes
    them) as `grouped_linear`'s [E, in, out]: a view of a tensor; FP8 experts
    (`Fp8Experts`) already answer in that layout."""
    return w.transpose(-2, -1) if isinstance(w, torch.Tensor) else w


def grouped_linear(
    x: torch.Tensor, w: torch.Tensor | Any, offs: torch.Tensor, expert_of_row: torch.Tensor
) -> torch.Tensor:
    """Rows of x [M, in] sorted by expert, times w [E, in, out]; `offs` [E] int32 holds the
    cumulative row counts (group e is rows offs[e-1]:offs[e])."""
    if not isinstance(w, torch.Tensor):  # FP8 experts (dlm_engine/fp8.py `Fp8Experts`)
        y = w.grouped(x, offs)
        if y is not None:
            return y
        w = w.dense(x.dtype)
    key = (x.device.type, x.dtype)
    if key not in _GROUPED_MM_FAILED:
        try:
            return grouped_mm(x, w, offs)
        except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
            log.warning("torch._grouped_mm unavailable for %s %s (%s): gathered bmm", *key, exc)
            _GROUPED_MM_FAILED.add(key)
    return _gathered_bmm(x, w, expert_of_row)


def stack_experts(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate/up and down weights of `experts` (modules with `gate_proj`, `up_proj`,
    `down_proj` linear layers) stacked for `run_experts`: [E, H, 2I] and [E, I, H], each a
    transposed view of the published rows ([E, 2I, H], [E, H, I]), so the grouped kernels read
    every expert's weights along the inputs, the layout they read fastest
    (`benchmarks/gpu_check_grouped_mm.py`)."""
    gate_up = torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight)) for e in experts])
    down = torch.stack([e.down_proj.weight for e in experts])
    return gate_up.transpose(-2, -1), down.transpose(-2, -1)


def run_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    first_expert: int | None = None,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_mul,
) -> torch.Tensor:
    """Sum over each token's chosen experts of weight * down(act(gate(x), up(x))) (`act`:
    silu(gate) * up unless given).

    x [N, H]; chosen/weights [N, k]; w_gate_up [E, H, 2I] (gate columns, then up);
    w_down [E, I, H]. The weighted sum is taken in float32, as published.

    `first_expert` (expert parallel, dlm_engine/parallel/): the stacked weights hold only
    experts first_expert .. first_expert + E - 1 of the model; the (token, expert) pairs of
    other experts sort after every group, are left out of the grouped GEMMs and add nothing,
    so the ranks' outputs sum to the whole. The shapes stay those of every pair (no host
    sync), so the layer is still capturable in a CUDA graph."""
    n, k = chosen.shape
    if n == 0:
        return x.new_zeros(x.shape)
    n_local = w_gate_up.shape[0]
    flat = chosen.reshape(-1)
    mine: torch.Tensor | None = None
    if first_expert is not None:
        flat = flat - first_expert
        mine = (flat >= 0) & (flat < n_local)
        flat = torch.where(mine, flat, n_local)  # past the last group: computed by no GEMM
    order = flat.argsort(stable=True)
    expert_of_row = flat[order]
    counts = torch.zeros(n_local + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts[:n_local].cumsum(0, dtype=torch.int32)
    if mine is not None:  # the fallback's per-row gather must index a held expert
        expert_of_row = expert_of_row.clamp(max=n_local - 1)
    xs = x[order // k]
    gate, up = grouped_linear(xs, w_gate_up, offs, expert_of_row).chunk(2, dim=-1)
    ys = grouped_linear(act(gate, up), w_down, offs, expert_of_row)
    unsorted = torch.empty_like(ys)
    unsorted[order] = ys
    if mine is not None:  # rows past the last group hold whatever the GEMM left there
        unsorted = torch.where(mine[:, None], unsorted, 0)
    out = (unsorted.view(n, k, -1).float() * weights[..., None].float()).sum(dim=1)
    return out.to(x.dtype)
