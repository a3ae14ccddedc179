"""What a model family is to the engine: one `Family` value per family, defined at the end of
its model file (`models/<family>.py`) and registered once in `models/__init__.py`.

Everything that differs between families beyond tensor names lives here as data: how a
config is recognised, how the model is built, the special tokens, the block structure, the
decoding capabilities and published defaults, and the character tokenizer of its test
checkpoints. Code elsewhere asks the family (`family.supports_cfg`,
`family.default_thresholds`, ...) and never compares family names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn

from ..tokenizer_build import CharTokenizer
from .shard_rules import ShardRules


@dataclass(frozen=True)
class D3LLMLoop:
    """How d3LLM's published loop for this family compares entropies: the LLaDA and Dream
    variants differ in precision, strictness and when they stop (decoding/commit_rules.py,
    decoding/multi_block.py)."""

    strict: bool = False  # entropy < tau rather than <=
    single_block_f64: bool = True  # single-block entropy in float64 (else the logits' dtype)
    multi_block_keeps_best: bool = True  # multi-block: the lowest entropy always commits
    cache_walk_stops: bool = True  # delayed cache: the block walk breaks at the first miss


def _frozen(mapping: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True, eq=False, kw_only=True)
class Family:
    """One model family. Compared by identity: each family is one registered value.

    Block-diffusion families (SDAR, LLaDA2) attend block-causally: a token sees its own block
    and the blocks before it, in blocks of `default_block_length` tokens."""

    name: str  # as configs, logs and docs name it
    label: str  # as its authors write it (model cards, tables)
    # the README's served-models table, where it says more than `label` (MoE, text only)
    table_label: str = ""
    detect: Callable[[dict[str, Any]], bool]  # does this `config.json` describe the family?
    build: Callable[[dict[str, Any]], nn.Module]  # an uninitialised model of the layout
    default_algorithm: str
    uses_blocks_by_default: bool
    mask_token: str
    end_of_turn_tokens: tuple[str, ...]
    block_diffusion: bool = False
    default_block_length: int = 0
    uniform_diffusion: bool = False  # no mask token: canvases of random tokens (DiffusionGemma)
    # the tool-call syntax its chat template teaches (dlm_engine/tools.py `TOOL_FORMATS`)
    tool_format: str = "hermes"
    # mask id the published code hard-codes, for a checkpoint whose config and tokenizer
    # name none
    published_mask_id: int | None = None
    generation_length: int = 128  # max_tokens when neither request nor checkpoint name one
    char_tokenizer: CharTokenizer | None = None  # test checkpoints' tokenizer (None: Dream's)
    # ---- decoding capabilities ----
    own_algorithms: frozenset[str] = frozenset()  # rules published for this family only
    supports_cfg: bool = False  # classifier-free guidance (cfg_scale)
    # algorithm -> its threshold default where the family publishes its own
    default_thresholds: Mapping[str, float] = field(default_factory=_frozen)
    steps_capped_by_length: bool = False  # block rows: steps = min(steps, max_tokens)
    # block rows commit inside one sub-block of this many tokens at a time, one token a step at
    # least, and a block's first position alone when masked (Fast-dLLM v2; 0: anywhere)
    sub_block_length: int = 0
    gumbel_proposals: bool = False  # LLaDA's Gumbel-max proposals (else softmax sampling)
    linear_schedule: bool = True  # LLaDA's per-block linear step schedule (else Dream's)
    d3llm_loop: D3LLMLoop = D3LLMLoop()
    d3llm_defaults: Mapping[str, Any] | None = None  # a d3LLM checkpoint's published rule
    # request-key defaults from a generation config, when the family reads its own keys
    checkpoint_defaults: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # which published tensors tensor / expert parallel ranks split how (None: not supported)
    shard_rules: ShardRules | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "default_thresholds", _frozen(self.default_thresholds))
        if self.d3llm_defaults is not None:
            object.__setattr__(self, "d3llm_defaults", _frozen(self.d3llm_defaults))

    def __repr__(self) -> str:
        return f"Family({self.name})"
