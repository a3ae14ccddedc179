"""Top-k experts as two grouped GEMMs over tokens sorted by expert (bf16 or float32).

A Python loop over experts costs a host wait per expert (which tokens chose it) and several
small kernels each; with 128 experts and 30 layers that is thousands of launches a step.
Here the (token, expert) pairs are sorted by expert once per layer, each expert's rows form
one group, and `torch._grouped_mm` runs every expert's product in one kernel (the gathered
`torch.bmm` fallback in `moe.grouped_linear` where it does not run). Nothing waits on the
host, so a layer can be captured in a CUDA graph.

Each output is weighted in the hidden dtype and a token's outputs are summed in ascending
expert order, the loop's order: in float32 (the CPU) the result is the loop's to the bit; in
bf16 (the GPU) the sum is accumulated in float32 and rounded once, where the loop rounds
after each expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .moe import grouped_linear, in_out


def sort_by_expert(
    index: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For chosen experts `index` [N, k]: the order of the flattened (token, slot) pairs by
    expert (stable), the expert of each sorted pair, and the cumulative pair counts [E]
    (int32, as `torch._grouped_mm` takes them)."""
    flat = index.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int32, device=index.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, flat[order], counts.cumsum(0, dtype=torch.int32)


def gated_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Sum over each token's experts of weight * down(act(gate(x), up(x))).

    x [N, H]; index/weights [N, k]; `gate_up` [E, 2I, H] (gate rows, then up) and `down`
    [E, H, I] in `F.linear` layout (output rows), as checkpoints store stacked experts, or
    their FP8 replacements (`fp8.Fp8Experts`)."""
    n, k = index.shape
    if n == 0:
        return torch.zeros_like(x)
    # each token's slots in ascending expert order: the order the per-expert loop adds them
    index, slot = index.sort(dim=-1, stable=True)
    weights = weights.gather(-1, slot).reshape(-1)
    order, expert_of_row, offs = sort_by_expert(index, gate_up.shape[0])
    xs = x[order // k]
    gate, up = grouped_linear(xs, in_out(gate_up), offs, expert_of_row).chunk(2, -1)
    ys = grouped_linear(act(gate, up), in_out(down), offs, expert_of_row)
    # weights in the hidden dtype: one pass, no float32 copy (the same product in float32)
    ys = ys * weights[order, None].to(ys.dtype)
    # back to (token, slot) order by a gather (a row copy; a scatter is slower on the GPU)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    # summed over the slots in slot (= expert) order, one pass
    return ys.index_select(0, back).view(n, k, -1).sum(dim=1)


__all__ = ["gated_experts", "sort_by_expert"]
