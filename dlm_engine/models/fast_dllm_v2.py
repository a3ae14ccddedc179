"""Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_7B, _1.5B): Qwen2.5 run as block diffusion.

The checkpoint is Qwen2.5-Instruct fine-tuned for blocks of `bd_size` tokens (32): tensor names
are Qwen2's (`model.embed_tokens`, `model.layers.N.self_attn.{q,k,v,o}_proj` with biases on
q/k/v, `mlp.{gate,up,down}_proj`, `model.norm`, `lm_head`), checked against NVlabs/Fast-dLLM
`v2/modeling.py` (`Fast_dLLM_QwenForCausalLM`) and `v2/configuration.py`
(`model_type` "Fast_dLLM_Qwen"). At inference a block attends to itself and every block before
it (its `eval_block_diff_mask`); the training-only complementary mask ("bd_size" x0/xt halves)
never applies to generation.

Two things set it apart from SDAR, both in its published `generate()`:
- token shift: a masked position is predicted from the hidden state one position before it
  (`logits_shift = 1`, as Dream); the first token of each new block is therefore the argmax of
  the finished block's last position, committed alone before the block's other tokens;
- sub-blocks: inside a block, `small_block_size` (8) tokens at a time are decoded, each step
  committing every mask of the sub-block whose probability exceeds `threshold`, plus the most
  probable one (decoding/sub_blocks.py).
"""

from __future__ import annotations

from typing import Any

from ..tokenizer_build import DREAM_CHAT_TEMPLATE, CharTokenizer
from .dream import DreamArch, DreamModel
from .family import Family
from .shard_rules import QWEN_RULES

# published generate(): small_block_size 8, block_size 32 (config `bd_size`), mask 151665
SUB_BLOCK_LENGTH = 8
MASK_TOKEN = "|<MASK>|"

# test checkpoints: Qwen2.5's specials and chat template, plus the added mask token
FAST_DLLM_V2_TOKENIZER = CharTokenizer(
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN), MASK_TOKEN, DREAM_CHAT_TEMPLATE
)


class FastDLLMv2Model(DreamModel):
    """`Fast_dLLM_QwenForCausalLM` weights: Qwen2's layout (Dream's modules, the same names),
    logits shifted by one, attention block-causal (by the engine's key mask)."""

    def __init__(self, arch: DreamArch, block_size: int) -> None:
        super().__init__(arch)
        self._block_size = block_size

    @property
    def block_size(self) -> int:
        """The block the checkpoint was trained with (config `bd_size`)."""
        return self._block_size


def build(config: dict[str, Any]) -> FastDLLMv2Model:
    """The model of a Fast-dLLM v2 `config.json` (Qwen2 keys plus `bd_size`)."""
    if config.get("rope_scaling"):
        raise ValueError(f"unsupported Fast-dLLM v2 rope_scaling {config['rope_scaling']!r}")
    if config.get("use_sliding_window"):
        raise ValueError("unsupported Fast-dLLM v2 use_sliding_window=true")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported Fast-dLLM v2 hidden_act {config.get('hidden_act')!r}")
    return FastDLLMv2Model(DreamArch.from_config(config), block_size(config))


def block_size(config: dict[str, Any]) -> int:
    """The trained block: `bd_size` (Fast_dLLM_QwenConfig's default 32)."""
    return int(config.get("bd_size") or 32)


def _is_fast_dllm_v2(config: dict[str, Any]) -> bool:
    archs = [str(a).lower() for a in config.get("architectures") or []]
    return (
        str(config.get("model_type", "")).lower() == "fast_dllm_qwen"
        or "fast_dllm_qwenforcausallm" in archs
    )


# Fast-dLLM v2: Qwen2.5 tokenizer and chat template; blocks of 32, sub-blocks of 8 decoded with
# the published threshold rule (the model card's and demo's threshold 0.9; generate()'s own
# default 1 commits one token a step); stops at <|im_end|> (generate()'s stop_token 151645).
FAMILY = Family(
    name="fast_dllm_v2",
    label="Fast-dLLM v2",
    detect=_is_fast_dllm_v2,
    build=build,
    default_algorithm="low_confidence_dynamic",
    uses_blocks_by_default=True,
    mask_token=MASK_TOKEN,
    end_of_turn_tokens=("<|im_end|>", "<|endoftext|>"),
    block_diffusion=True,
    default_block_length=32,
    published_mask_id=151665,  # generate()'s mask_id
    generation_length=512,  # the model card's max_new_tokens
    char_tokenizer=FAST_DLLM_V2_TOKENIZER,
    default_thresholds={"low_confidence_dynamic": 0.9},
    sub_block_length=SUB_BLOCK_LENGTH,
    shard_rules=QWEN_RULES,
)
