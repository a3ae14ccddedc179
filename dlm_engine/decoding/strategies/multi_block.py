"""d3LLM's multi-block decoding (hao-ai-lab/d3LLM, SGLang FullAttnMultiBlock): several blocks
of the canvas in flight, a block added when its predecessor's progress passes
`block_add_threshold` and activated past `decoded_token_threshold`, each step committing by
the row's rule (entropy_threshold, threshold or factor). Two variants: no cache (every step
a full forward), or d3LLM's delayed prefix cache (`cache: prefix`: a block's keys cached
`cache_delay_iter` steps after it is decoded).

Not an `algorithm`: a request selects it with `multi_block` (or its own keys); the row's
commit rule is still its algorithm's strategy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import InvalidRequestError
from .base import CANVAS, Strategy

if TYPE_CHECKING:
    from ...sampling_params import ResolvedParams
    from ...sequence import Sequence

DEFAULT_BLOCK_ADD_THRESHOLD = 0.1  # d3LLM eval scripts and SGLang FullAttnMultiBlock
DEFAULT_DECODED_TOKEN_THRESHOLD = 0.95  # idem
# d3LLM's delayed KV cache: d3LLM-LLaDA's published chat setting (chat/chat_d3llm_llada.py:
# cache_delay_iter=2; its Dream coder eval uses 32); refresh_interval upstream defaults to
# 10000, i.e. never (None here)
DEFAULT_CACHE_DELAY_ITER = 2
BLOCK_KEYS = ("block_add_threshold", "decoded_token_threshold", "max_active_blocks")
# the delayed cache's keys: they imply multi_block, and cache prefix unless `cache` is given
CACHE_KEYS = ("cache_delay_iter", "refresh_interval")
DEFAULT_RULE = "entropy_threshold"  # d3LLM's rule; its `threshold` is the entropy bound


def wants_multi_block(p) -> bool:
    """`multi_block: true`, or one of its own keys given without `multi_block: false`."""
    if p.multi_block is not None:
        return bool(p.multi_block)
    return bool(p.early_stop) or any(getattr(p, k) is not None for k in BLOCK_KEYS + CACHE_KEYS)


def resolve_cache(p) -> str:
    """The request's cache mode: as given; a delayed-cache key without `cache` means prefix."""
    if "cache" not in p.given and any(getattr(p, k) is not None for k in CACHE_KEYS):
        return "prefix"
    return p.cache


class MultiBlock(Strategy):
    name = "multi_block"
    summary = (
        "d3LLM: several blocks in flight, each step committing by the row's rule "
        "(entropy_threshold, threshold or factor); `cache: prefix` adds d3LLM's delayed cache"
    )
    source = "d3LLM multi-block generate (SGLang FullAttnMultiBlock)"
    models = CANVAS
    keys = ("multi_block", *BLOCK_KEYS, *CACHE_KEYS, "early_stop")
    selected_by_algorithm = False
    selection = "`multi_block: true`, or one of its keys"
    threshold_doc = "the rule's (d3LLM checkpoints: 0.5 LLaDA, 0.4 Dream)"

    def check_request(self, p, rule: Strategy) -> None:
        """The multi-block keys of a request that asks for it (`rule`: its commit rule)."""
        cache = resolve_cache(p)
        if not rule.multi_block_rule:
            from . import STRATEGIES

            rules = [s.name for s in STRATEGIES.values() if s.multi_block_rule]
            raise InvalidRequestError(
                "algorithm",
                f"multi_block needs a commit rule without a step schedule: {', '.join(rules)}",
            )
        if cache == "dual":
            raise InvalidRequestError(
                "cache",
                "multi_block has d3LLM's delayed prefix cache only (cache prefix) or none; "
                "d3LLM publishes no dual-cache variant",
            )
        if cache != "prefix":
            for key in CACHE_KEYS:
                if getattr(p, key) is not None:
                    raise InvalidRequestError(key, "applies to multi_block with cache prefix only")
        if p.cfg_scale > 0:
            raise InvalidRequestError("multi_block", "cannot be combined with cfg_scale")
        if p.early_stop and cache == "prefix":
            raise InvalidRequestError(
                "early_stop", "not with d3LLM's delayed cache (cache: prefix); send false"
            )

    @staticmethod
    def refuse_keys(p) -> None:
        """A request without multi-block decoding: its keys are an error (not `false`)."""
        for key in (*BLOCK_KEYS, *CACHE_KEYS, "early_stop"):
            if getattr(p, key) not in (None, False):
                raise InvalidRequestError(key, "applies to multi_block decoding only (not false)")

    def resolved_fields(self, p) -> dict[str, Any]:
        def pick(value, default):
            return default if value is None else value

        return {
            "multi_block": True,
            "block_add_threshold": pick(p.block_add_threshold, DEFAULT_BLOCK_ADD_THRESHOLD),
            "decoded_token_threshold": pick(
                p.decoded_token_threshold, DEFAULT_DECODED_TOKEN_THRESHOLD
            ),
            "max_active_blocks": p.max_active_blocks,
            "cache_delay_iter": pick(p.cache_delay_iter, DEFAULT_CACHE_DELAY_ITER),
            "refresh_interval": p.refresh_interval,
            "early_stop": bool(p.early_stop),
        }

    def init_row(self, seq: Sequence, *, eos_id: int | None, stop_ids: frozenset[int]) -> None:
        from ..multi_block import DelayedCache, MultiBlockState

        params = seq.params
        cache = None
        if params.cache == "prefix":  # the delayed cache's keys live in the row's KV slot
            cache = DelayedCache(
                seq.prompt_len,
                params.accel.cache_delay_iter,
                params.accel.refresh_interval,
                walk_stops=seq.family.d3llm_loop.cache_walk_stops,
            )
        seq.multi = MultiBlockState(
            params.max_tokens,
            params.block_length,
            params.accel,
            cache=cache,
            eos_id=eos_id if params.accel.early_stop else None,
        )

    def phased(self, params: ResolvedParams) -> bool:
        return False  # its cache follows its own blocks: no shared block start


MULTI_BLOCK = MultiBlock()
STRATEGIES = (MULTI_BLOCK,)
