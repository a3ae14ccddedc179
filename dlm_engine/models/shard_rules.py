"""How a family's published tensors are split over tensor-parallel ranks (`ShardRules`), and
the one layout several families share (Qwen's). Each family's table lives in its model file and
is named by its `Family` value (`shard_rules`); `dlm_engine/parallel/sharding.py` applies them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"
# a row-split layer whose partial output is summed over ranks by its module's all-reduce
# (`ShardRules.summed`), not its own: LLaDA2's MLPs, where the routed experts and the shared
# expert add up before one all-reduce a layer
PARTIAL = "partial"
# a published fused q/k/v projection: each rank takes its heads of q, of k and of v
QKV = "qkv"
# one routed expert's tensor under expert parallel: whole on the rank that holds the expert
EXPERT = "expert"
# a stacked experts tensor [E, ...] under expert parallel: this rank's E/N experts
EXPERT_ROWS = "expert_rows"
# a stacked experts tensor [E, 2I, H] (gate rows, then up rows) under tensor parallel: this
# rank's 1/N of every expert's intermediate size, of its gate rows and of its up rows alike
EXPERT_COLUMN = "expert_column"
# a stacked experts tensor [E, H, I] under tensor parallel: this rank's 1/N of every expert's
# inputs (the intermediate size); its module's all-reduce (`ShardRules.summed`) sums the ranks
EXPERT_ROW = "expert_row"
NEVER = r"(?!)"  # a pattern no name matches (the root module's empty name included)


@dataclass(frozen=True)
class ShardRules:
    """How one family's published tensors are split (first matching pattern wins; the rest
    is replicated), which modules' outputs are all-reduced, and the q / k-or-v rows of a
    fused q/k/v tensor."""

    tensors: tuple[tuple[str, str], ...]
    summed: tuple[str, ...] = ()
    qkv_rows: Callable[[dict[str, Any]], tuple[int, int]] | None = None
    # expert parallel: the routed experts' module list (its parent gets `first_expert`), a
    # pattern of one expert's published tensors (group 1: the expert's number) and the
    # config key of their count; None: no routed experts to spread
    expert_list: str | None = None
    expert_tensor: str | None = None
    expert_count_key: str = "num_experts"
    # expert parallel over stacked experts: the module (replaced by `gemma.LocalExperts`) and
    # a pattern of its published tensors, sliced by expert
    expert_stack: str | None = None
    expert_stack_tensor: str | None = None
    # False: under expert parallel only the experts are spread, the rest stays whole
    split_with_experts: bool = True
    skip: tuple[str, ...] = ()  # published tensors never read (a vision tower)


# The Qwen layout (Dream: Qwen2; SDAR: Qwen3, whose per-head q/k norms are replicated).
QWEN_RULES = ShardRules(
    (
        (r"\.self_attn\.(q_proj|k_proj|v_proj)\.(weight|bias)$", COLUMN),
        (r"\.mlp\.(gate_proj|up_proj)\.weight$", COLUMN),
        (r"\.self_attn\.o_proj\.(weight|bias)$", ROW),
        (r"\.mlp\.down_proj\.weight$", ROW),
        (r"^lm_head\.weight$", VOCAB),
    )
)
