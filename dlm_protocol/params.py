"""Every request key: its name, type, range, default, aliases and meaning — written once.

The engine (`dlm_engine.sampling_params`) parses requests with `parse_params`; the proxy builds
its request fields from `PARAMS` and checks each value with the same `Param.check`; the Triton
adapter passes the JSON through untouched; the CLI makes a flag per key; docs/api.md's table is
generated from here (`python -m dlm_protocol.docgen`). Checks are strict, as OpenAI's API is: a
string is never read as a number or a boolean, a boolean never as a number.

What lives here is what can be checked from the value alone. Rules that need the model or other
keys (`steps <= max_tokens`, `block_length` divides `max_tokens`, `origin` is Dream's, the
server's `max_canvas`) live in the engine's `resolve`, the one place that knows the model.

Adding a key: append a `Param` to `PARAMS` (and use it in the engine); see docs/architecture.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import logit_bias, structure_shapes
from .errors import InvalidRequestError

# the commit rules of block-diffusion models (SDAR `remasking_strategy`)
BLOCK_ALGORITHMS = (
    "low_confidence_dynamic",
    "low_confidence_static",
    "sequential",
    "entropy_bounded",
    "joint_threshold",  # LLaDA2.1 token editing (SGLang JointThreshold)
    "multi_bd",  # Diffulex Multi-Block Diffusion: several blocks in one forward
)
# keys that only block-diffusion models take, by the algorithm that reads them
# (LLaDA2.1 token editing, Diffulex's multi_bd); other models refuse them by name
BLOCK_ALGORITHM_KEYS = {
    "joint_threshold": ("edit_threshold", "max_post_edit_steps"),
    "multi_bd": ("buffer_size", "add_block_threshold", "semi_complete_threshold"),
}
BLOCK_DIFFUSION_ONLY = tuple(k for keys in BLOCK_ALGORITHM_KEYS.values() for k in keys)
# Diffulex's published defaults (diffulex/config.py: Config.buffer_size, DecodingThresholds)
DEFAULT_BUFFER_SIZE = 4
DEFAULT_ADD_BLOCK_THRESHOLD = 0.1
DEFAULT_SEMI_COMPLETE_THRESHOLD = 0.9
MAX_BUFFER_SIZE = 64
ALGORITHMS = (
    "low_confidence",
    "random",
    "origin",
    "maskgit_plus",
    "topk_margin",
    "entropy",
    "threshold",
    # accelerated commit rules (dlm_engine/decoding/commit_rules.py)
    "factor",
    "local_leap",
    "entropy_threshold",
    # block-diffusion families (SDAR's remasking strategies; LLaDA2's threshold rule
    # is low_confidence_dynamic)
    *BLOCK_ALGORITHMS,
)
# What each algorithm commits in a step, and where it was published: one line each, for the
# CLI's help and the docs (k = the step schedule's count of positions to commit).
ALGORITHM_SUMMARIES = {
    "low_confidence": "LLaDA: the k masked positions whose sampled token is most probable",
    "random": "LLaDA: k random masked positions",
    "origin": "Dream: each masked position with probability 1 / (steps left)",
    "maskgit_plus": "Dream: the k positions with the highest top-1 probability",
    "topk_margin": "Dream: the k positions with the widest margin between the top two tokens",
    "entropy": "Dream: the k positions with the lowest entropy",
    "threshold": "Fast-dLLM: every position with confidence >= threshold (at least one)",
    "factor": "Fast-dLLM: the n most confident while c_i >= 1 - factor / (i + 2)",
    "local_leap": "LocalLeap (LLaDA): confident anchors and their confident neighbours",
    "entropy_threshold": "d3LLM: every position with entropy below threshold (at least one)",
    "low_confidence_dynamic": "SDAR / LLaDA2 / Fast-dLLM v2: every confidence above threshold "
    "when at least k "
    "pass, else the k most confident",
    "low_confidence_static": "SDAR: the k most confident positions",
    "sequential": "SDAR: the k masked positions nearest the block's start",
    "entropy_bounded": "SDAR: the lowest entropies while their sum stays below threshold",
    "joint_threshold": "LLaDA2.1: masks above threshold, and rewrites of decoded tokens "
    "above edit_threshold",
    "multi_bd": "Diffulex: several blocks refined in one forward, each by threshold",
}
STREAM_MODES = ("delta", "denoise")
CACHE_MODES = ("none", "prefix", "dual")
MAX_STOP_STRINGS = 16
SEED_MAX = 2**63 - 1
# Default threshold when `algorithm: threshold` is asked for without a value (Fast-dLLM's 0.9).
DEFAULT_THRESHOLD = 0.9
# d3LLM's entropy threshold is in nats; ln(vocab) of any real tokenizer is below this
MAX_ENTROPY_THRESHOLD = 20.0
# Numeric safety: every accepted value keeps a step finite for every row of the batch. A positive
# temperature or alg_temp below MIN_POSITIVE_TEMPERATURE runs as that floor (dividing logits by
# 1e-300 overflows to inf and NaN; at 1e-4 the draw is already the argmax); alg_temp and
# cfg_scale are capped ((scale + 1) * (cond - uncond) overflows half precision; a float32
# confidence divided by 1e300 is 0, and -inf / inf is NaN).
MIN_POSITIVE_TEMPERATURE = 1e-4
MAX_ALG_TEMP = 100.0
MAX_CFG_SCALE = 100.0
# request priority, lower = admitted first (vLLM's convention); the range is wide
# enough for any tiering and small enough to stay an ordinary integer everywhere
MAX_PRIORITY = 100

# Value kinds. "stop" is OpenAI's `stop`: a string or a list of strings (normalised to a list).
INT, FLOAT, BOOL, STR, STOP = "int", "float", "bool", "str", "stop"
# a JSON value checked by the engine (structure constraints)
JSON = "json"


@dataclass(frozen=True)
class Param:
    """One request key. `check` enforces type and static range; docs and schemas read the rest."""

    name: str
    kind: str
    doc: str
    default: Any = None  # what the engine uses when the key is absent (None: computed, see doc)
    default_doc: str = "none"
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[str, ...] = ()
    # Other names for the key (peer servers' and papers' names), accepted everywhere.
    aliases: tuple[str, ...] = ()
    # Other names for a value (e.g. Diffulex's stream_mode `block_append` = our `delta`).
    value_aliases: tuple[tuple[str, str], ...] = ()
    # Constraints that need the model or other keys (checked by the engine), for the docs.
    relations: str = ""
    # An OpenAI request field too (the proxy documents it as such).
    openai: bool = False
    examples: tuple[Any, Any] = field(default=(None, None))  # (valid, invalid) for tests
    # JSON keys: the value's shape, checked here (reason or None); its content (a schema or
    # grammar that compiles) is the engine's to check.
    shape: Callable[[Any], str | None] | None = None

    # -- checking ------------------------------------------------------------------------------

    def check(self, value: Any) -> Any:
        """The value, type-checked (strictly) and range-checked; raises naming `self.name`."""
        kind = self.kind
        if kind == INT:
            if isinstance(value, bool) or not isinstance(value, int):
                self._fail(f"must be an integer, got {_show(value)}")
        elif kind == FLOAT:
            if isinstance(value, bool) or not isinstance(value, int | float):
                self._fail(f"must be a number, got {_show(value)}")
            if not math.isfinite(value):
                self._fail("must be finite")
            value = float(value)
        elif kind == BOOL:
            if not isinstance(value, bool):
                self._fail(f"must be true or false, got {_show(value)}")
        elif kind == STR:
            if not isinstance(value, str):
                self._fail(f"must be a string, got {_show(value)}")
            value = dict(self.value_aliases).get(value, value)
            reason = self.shape(value) if self.shape is not None else None
            if reason:
                self._fail(reason)
        elif kind == STOP:
            value = self._check_stop(value)
        elif kind == JSON and self.shape is not None:
            reason = self.shape(value)
            if reason:
                self._fail(reason)
        if self.choices and value not in self.choices:
            self._fail(f"must be one of {', '.join(self.choices)}, got {_show(value)}")
        if kind in (INT, FLOAT) and not self._in_range(value):
            self._fail(f"must be {self.range_text()}")
        return value

    def _check_stop(self, value: Any) -> list[str]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            self._fail("must be a string or a list of strings")
        if len(value) > MAX_STOP_STRINGS:
            self._fail(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in value):
            self._fail("stop strings must not be empty")
        return list(value)

    def _in_range(self, value: float) -> bool:
        if self.minimum is not None:
            if self.exclusive_minimum and not value > self.minimum:
                return False
            if not self.exclusive_minimum and not value >= self.minimum:
                return False
        return self.maximum is None or value <= self.maximum

    def _fail(self, reason: str) -> None:
        raise InvalidRequestError(self.name, reason)

    # -- describing ----------------------------------------------------------------------------

    def range_text(self) -> str:
        """`in [0, 2]`, `in (0, 1]`, `>= 1` ... as used in error messages and docs."""
        lo, hi = _num(self.minimum), _num(self.maximum)
        if self.minimum is not None and self.maximum is not None:
            return f"in {'(' if self.exclusive_minimum else '['}{lo}, {hi}]"
        if self.minimum is not None:
            return f"{'>' if self.exclusive_minimum else '>='} {lo}"
        if self.maximum is not None:
            return f"<= {hi}"
        return "any value"

    def values_text(self) -> str:
        """The accepted values, for the docs table."""
        if self.choices:
            text = ", ".join(f"`{c}`" for c in self.choices)
        elif self.kind == BOOL:
            text = "`true`, `false`"
        elif self.kind == STOP:
            text = f"a string or up to {MAX_STOP_STRINGS} non-empty strings"
        elif self.kind == STR:
            text = "a string"
        else:
            text = f"{self.kind} {self.range_text()}"
        if self.value_aliases:
            text += " (" + ", ".join(f"`{a}` = `{b}`" for a, b in self.value_aliases) + ")"
        return text + (f"; {self.relations}" if self.relations else "")

    def json_schema(self) -> dict[str, Any]:
        """JSON schema of the value (nullable: absent or null = the default)."""
        if self.kind == STOP:
            items = {"type": "string", "minLength": 1}
            value: dict[str, Any] = {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": items, "maxItems": MAX_STOP_STRINGS},
                ]
            }
            return {"anyOf": [*value["anyOf"], {"type": "null"}]}
        if self.kind == JSON:  # any JSON value, checked by the engine
            return {}
        types = {INT: "integer", FLOAT: "number", BOOL: "boolean", STR: "string"}
        schema: dict[str, Any] = {"type": types[self.kind]}
        if self.choices:
            schema["enum"] = list(self.choices) + [a for a, _ in self.value_aliases]
        if self.minimum is not None:
            key = "exclusiveMinimum" if self.exclusive_minimum else "minimum"
            schema[key] = self.minimum
        if self.maximum is not None:
            schema["maximum"] = self.maximum
        return {"anyOf": [schema, {"type": "null"}]}

    def description(self) -> str:
        """One line for OpenAPI: meaning, default, aliases."""
        text = f"{self.doc} Default: {self.default_doc}."
        if self.aliases:
            text += f" Aliases: {', '.join(self.aliases)}."
        return text


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _num(value: float | None) -> str:
    if value is None:
        return ""
    if value == SEED_MAX:
        return "2^63-1"
    return str(int(value)) if float(value).is_integer() else str(value)


PARAMS: tuple[Param, ...] = (
    Param(
        "max_tokens",
        INT,
        "Canvas length: tokens generated at most.",
        default_doc="the model's published generation length: its generation_config.json "
        "`max_new_tokens`, else LLaDA 128, Dream 512, SDAR 128, LLaDA2 512 (tiny-dlm, tiny-sdar "
        "64); at most the model's `max_canvas`",
        minimum=1,
        aliases=("max_new_tokens", "gen_length", "max_completion_tokens"),
        relations="at most the model's `max_canvas` (tiny-dlm 512, 8B models 1024); "
        "the proxy also caps it at `--max-tokens-limit`",
        openai=True,
        examples=(16, 0),
    ),
    Param(
        "steps",
        INT,
        "Denoising steps: the schedule's forwards at most. Fewer steps = faster, more tokens "
        "committed per step.",
        default_doc="= `max_tokens` (one token per step)",
        minimum=1,
        aliases=(
            "num_denoising_steps",
            "diffusion_steps",
            "denoising_steps",
            "max_denoising_steps",
        ),
        relations="at most `max_tokens`, divisible by the number of blocks "
        "(`max_tokens / block_length`); block-diffusion models (SDAR, LLaDA2, Fast-dLLM v2): steps per "
        "block, at most `block_length`, default `block_length`; DiffusionGemma: "
        "`max_denoising_steps` per canvas, default the checkpoint's",
        examples=(8, 0),
    ),
    Param(
        "block_length",
        INT,
        "Semi-autoregressive block: blocks are filled left to right, steps split evenly among "
        "them.",
        default_doc="LLaDA: the largest divisor of `max_tokens` <= 32 whose block count divides "
        "`steps`; Dream: `max_tokens`",
        minimum=1,
        aliases=("block_size",),
        relations="must divide `max_tokens`; block-diffusion models (SDAR, LLaDA2, Fast-dLLM v2): "
        "the model's block (its `block_size` / `bd_size`, LLaDA2 32) unless given, blocks aligned to absolute "
        "positions so the canvas runs to the end of the last block",
        examples=(8, 0),
    ),
    Param(
        "algorithm",
        STR,
        "Which masked positions a step commits (see the algorithms below).",
        default_doc="LLaDA `low_confidence`, Dream `entropy` (`threshold` when only "
        "`threshold` is given)",
        choices=ALGORITHMS,
        aliases=("remasking", "alg", "remasking_strategy", "decoding_strategy"),
        relations="`origin` is Dream's only; block-diffusion models (SDAR, LLaDA2, Fast-dLLM v2) "
        "take "
        "`low_confidence_dynamic` (their default), `low_confidence_static`, `sequential`, "
        "`entropy_bounded`, `joint_threshold`, `multi_bd`; other models refuse all six by name",
        examples=("random", "beam"),
    ),
    Param(
        "threshold",
        FLOAT,
        "Commit every masked position of the active block whose confidence is at least this, "
        "at least one per step (parallel decoding: fewer forwards than `steps`).",
        default_doc=f"none ({DEFAULT_THRESHOLD} when `algorithm` is `threshold`; setting it "
        "alone selects `algorithm: threshold`; 0.5 with `entropy_threshold` / `multi_block`; "
        "`multi_bd`: SDAR 0.95, LLaDA2 0.9, as Diffulex's samplers)",
        minimum=0,
        maximum=MAX_ENTROPY_THRESHOLD,
        exclusive_minimum=True,
        relations="in (0, 1] for confidence rules; with `entropy_threshold` (and `multi_block`) "
        f"an entropy bound in nats, (0, {MAX_ENTROPY_THRESHOLD:g}]; not with `random`, `origin` "
        "or `entropy` (no confidence in [0, 1]); DiffusionGemma: its sampler's "
        "`entropy_bound`, default the checkpoint's",
        aliases=("confidence_threshold", "eb_threshold", "accept_threshold", "entropy_bound"),
        examples=(0.9, 25),
    ),
    Param(
        "temperature",
        FLOAT,
        "Sampling temperature of the token at each position; 0 = greedy. A positive value "
        "below 1e-4 runs as 1e-4 (the same argmax, no overflow).",
        default=0.0,
        default_doc="0 (greedy)",
        minimum=0,
        maximum=2,
        openai=True,
        examples=(0.5, 2.5),
    ),
    Param(
        "top_p",
        FLOAT,
        "Nucleus filtering before sampling.",
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
        openai=True,
        examples=(0.9, 0),
    ),
    Param(
        "top_k",
        INT,
        "Top-k filtering before sampling (absent or null = off).",
        minimum=1,
        examples=(5, 0),
    ),
    Param(
        "alg_temp",
        FLOAT,
        "Dream: sample *positions* by confidence at this temperature instead of taking the top "
        "ones (0 = off). A positive value below 1e-4 runs as 1e-4.",
        minimum=0,
        maximum=MAX_ALG_TEMP,
        examples=(0.5, -1),
    ),
    Param(
        "cfg_scale",
        FLOAT,
        "Classifier-free guidance scale (one extra unconditioned row per step); 0 = off.",
        default=0.0,
        default_doc="0 (off)",
        minimum=0,
        maximum=MAX_CFG_SCALE,
        relations="LLaDA only; not with `cache`",
        examples=(0.0, -0.5),
    ),
    Param(
        "seed",
        INT,
        "Per-request RNG seed: the same tokens batched or alone. Proxy with `n > 1`: choice i "
        "uses seed + i.",
        minimum=0,
        maximum=SEED_MAX,
        aliases=("random_seed",),
        openai=True,
        examples=(7, -1),
    ),
    Param(
        "stop",
        STOP,
        "The text ends before the first match; `finish_reason` is `stop`.",
        default=(),
        default_doc="`[]`",
        openai=True,
        examples=(["END"], [""]),
    ),
    Param(
        "stream_mode",
        STR,
        "`delta`: only stable committed text. `denoise`: each step also sends the whole canvas "
        "(token strings, null = still masked), for visualisation.",
        default="delta",
        default_doc="`delta`",
        choices=STREAM_MODES,
        value_aliases=(("block_append", "delta"),),
        relations="proxy: `denoise` needs `stream: true`",
        examples=("delta", "tokens"),
    ),
    Param(
        "suppress_eos",
        BOOL,
        "LLaDA: forbid EOS while denoising (`logits_eos_inf`), so the canvas is filled.",
        default=False,
        default_doc="`false`",
        examples=(False, "yes"),
    ),
    Param(
        "cache",
        STR,
        "`none` is exact; `prefix` / `dual` reuse keys and values across steps (Fast-dLLM), "
        "approximate, the GPU fast path. With `multi_block`, `prefix` is d3LLM's delayed "
        "KV cache (`cache_delay_iter`); `dual` does not apply.",
        default="none",
        default_doc="`none`",
        choices=CACHE_MODES,
        relations="not with `cfg_scale`; `dual` not with `multi_block`",
        examples=("none", "paged"),
    ),
    Param(
        "max_nfe",
        INT,
        "Forwards (NFE) the request may use at most. The forward that reaches the cap commits "
        "every still-masked position of the active block by its current prediction; the request "
        "then ends with the text so far (`finish_reason` `length`, or `stop` if it holds EOS or "
        "a stop string); later blocks are never computed.",
        default_doc="none (the schedule's `steps`)",
        minimum=1,
        examples=(4, 0),
    ),
    Param(
        "edit_threshold",
        FLOAT,
        "LLaDA2.1 token editing (`algorithm: joint_threshold`): an already decoded position of "
        "the active block is rewritten when the model's new proposal differs and has at least "
        "this probability.",
        default_doc="0.0 (SGLang's JointThreshold)",
        minimum=0,
        maximum=1,
        relations="block-diffusion models with `joint_threshold` only",
        examples=(0.9, 1.5),
    ),
    Param(
        "max_post_edit_steps",
        INT,
        "LLaDA2.1 token editing: forwards a block may still spend on edits once it has no mask.",
        default_doc="16 (SGLang's JointThreshold)",
        minimum=0,
        maximum=1024,
        relations="block-diffusion models with `joint_threshold` only",
        examples=(4, -1),
    ),
    Param(
        "buffer_size",
        INT,
        "Diffulex multi-block diffusion (`algorithm: multi_bd`): at most this many consecutive "
        "blocks in the running set, refined together in one forward (1 = one block at a "
        "time). A completed front block keeps its place for the step that stores its keys.",
        default_doc=f"{DEFAULT_BUFFER_SIZE} (Diffulex)",
        minimum=1,
        maximum=MAX_BUFFER_SIZE,
        relations="block-diffusion models with `multi_bd` only",
        examples=(2, 0),
    ),
    Param(
        "add_block_threshold",
        FLOAT,
        "`multi_bd`: the next block enters the running set once the last one has decoded at "
        "least this fraction of its positions (one block a step at most).",
        default_doc=f"{DEFAULT_ADD_BLOCK_THRESHOLD} (Diffulex)",
        minimum=0,
        maximum=1,
        relations="block-diffusion models with `multi_bd` only",
        examples=(0.5, 1.5),
    ),
    Param(
        "semi_complete_threshold",
        FLOAT,
        "`multi_bd`: a running block commits at least its most confident mask each step once "
        "its predecessor has decoded at least this fraction (otherwise only masks above "
        "`threshold`).",
        default_doc=f"{DEFAULT_SEMI_COMPLETE_THRESHOLD} (Diffulex)",
        minimum=0,
        maximum=1,
        relations="block-diffusion models with `multi_bd` only",
        examples=(0.75, -0.1),
    ),
    Param(
        "priority",
        INT,
        "Admission order when requests wait for room: lower = served first (vLLM's "
        "convention), arrival order among equals. Strict, no aging; a running request is never "
        "preempted; never changes the tokens.",
        default=0,
        default_doc="0",
        minimum=-MAX_PRIORITY,
        maximum=MAX_PRIORITY,
        relations="Triton gRPC and HTTP `infer`: send it in `sampling_parameters` (a `priority` "
        "request parameter there is Triton's own scheduler's and never reaches the model)",
        examples=(-5, 101),
    ),
    Param(
        "cache_salt",
        STR,
        "Mixed into the hash of the prompt's first KV page (vLLM's meaning): only requests "
        "with the same salt share cached prompt pages, so nobody without the salt can tell "
        "from cache hits (`cached_tokens`, timing) what another prompt held.",
        default_doc="none (proxy with API keys: a salt derived from the caller's key)",
        relations="not empty; applies to block-diffusion models and DiffusionGemma (the "
        "others keep no prompt cache between requests); the proxy with API keys combines it "
        "with the key's own salt",
        examples=("tenant-a", ""),
        shape=structure_shapes.non_empty_string,
    ),
)

# ---- accelerated decoding — Fast-dLLM's factor rule (NVlabs/Fast-dLLM
# llada/generate.py), LocalLeap (dlmserve 0.1.1, arXiv 2510.07081), d3LLM multi-block decoding
# (hao-ai-lab/d3LLM, SGLang PR #20615). Defaults are the published ones (applied by the engine,
# dlm_engine/sampling_params.py); absent reads as None so a checkpoint's defaults can apply.
ACCELERATION_PARAMS: tuple[Param, ...] = (
    Param(
        "factor",
        FLOAT,
        "Fast-dLLM's factor rule (LLaDA): commit the n most confident masks while "
        "c_i >= 1 - factor / (i + 2). Given alone it selects `algorithm: factor`.",
        default_doc="1.0 with `algorithm: factor`",
        minimum=0,
        maximum=100,
        exclusive_minimum=True,
        relations="only with `algorithm: factor`",
        examples=(1.0, 0),
    ),
    Param(
        "use_local_leap",
        BOOL,
        "dlmserve's switch: `true` selects `algorithm: local_leap` (LocalLeap anchor "
        "propagation, LLaDA).",
        default_doc="`false`",
        examples=(True, "yes"),
    ),
    Param(
        "anchor_threshold",
        FLOAT,
        "LocalLeap kappa: an anchor this confident also commits its confident neighbours.",
        default_doc="0.9 with `local_leap`",
        minimum=0,
        maximum=1,
        aliases=("local_leap_anchor_threshold",),
        relations="only with `local_leap`",
        examples=(0.9, 1.5),
    ),
    Param(
        "neighbor_threshold",
        FLOAT,
        "LocalLeap tau: a masked neighbour of a strong anchor commits at this confidence.",
        default_doc="0.75 with `local_leap`",
        minimum=0,
        maximum=1,
        aliases=("local_leap_neighbor_threshold",),
        relations="only with `local_leap`",
        examples=(0.75, -0.1),
    ),
    Param(
        "leap_radius",
        INT,
        "LocalLeap W: how far (positions either side) an anchor's neighbours reach.",
        default_doc="4 with `local_leap`",
        minimum=1,
        maximum=16,
        aliases=("local_leap_radius",),
        relations="only with `local_leap`",
        examples=(4, 0),
    ),
    Param(
        "multi_block",
        BOOL,
        "d3LLM multi-block decoding: several blocks in flight at once, with a commit rule "
        "(`entropy_threshold` by default, or `threshold`, `factor`).",
        default_doc="`false` (`true` for d3LLM checkpoints)",
        relations="not with `cache: dual` or `cfg_scale`; `cache: prefix` is d3LLM's delayed KV "
        "cache",
        examples=(True, "yes"),
    ),
    Param(
        "block_add_threshold",
        FLOAT,
        "multi_block: add the next block once the last one has decoded this fraction.",
        default_doc="0.1 with `multi_block`",
        minimum=0,
        maximum=1,
        relations="only with `multi_block`",
        examples=(0.1, 2),
    ),
    Param(
        "decoded_token_threshold",
        FLOAT,
        "multi_block: fully activate a block once its predecessor has decoded this fraction.",
        default_doc="0.95 with `multi_block`",
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
        relations="only with `multi_block`",
        examples=(0.95, 0),
    ),
    Param(
        "max_active_blocks",
        INT,
        "multi_block: at most this many blocks in flight.",
        default_doc="unlimited (as d3LLM)",
        minimum=1,
        relations="only with `multi_block`",
        examples=(4, 0),
    ),
    Param(
        "early_stop",
        BOOL,
        "multi_block: once the canvas holds the end-of-text token, every position after the "
        "first one becomes end-of-text and the blocks past it close (d3LLM's `early_stop`), "
        "which can change the tokens before it (without, the output is only cut there).",
        default_doc="`false` (`true` for d3LLM checkpoints, as published)",
        relations="only with `multi_block` (`true` implies it when `multi_block` is not "
        "given); not with `cache: prefix`",
        examples=(True, "yes"),
    ),
    Param(
        "cache_delay_iter",
        INT,
        "multi_block with `cache: prefix` (d3LLM's delayed KV cache): a decoded block's keys "
        "are cached once it has stayed decoded this many steps.",
        default_doc="2 (d3LLM-LLaDA's published chat setting; its Dream coder eval uses 32)",
        minimum=1,
        relations="only with `multi_block` and `cache: prefix` (implies both when `cache` "
        "and `multi_block` are not given)",
        examples=(2, 0),
    ),
    Param(
        "refresh_interval",
        INT,
        "multi_block with `cache: prefix`: also recompute the delayed cache with a full forward "
        "every this many steps.",
        default_doc="never (d3LLM's 10000)",
        minimum=1,
        relations="only with `multi_block` and `cache: prefix` (implies both when `cache` "
        "and `multi_block` are not given)",
        examples=(3, 0),
    ),
    Param(
        "force_single_batch",
        BOOL,
        "dlmserve's field, accepted and unnecessary: batching never changes a request's tokens.",
        default_doc="`false`",
        examples=(True, "yes"),
    ),
)
# ---- structure constraints (dlm_engine/decoding/grammar.py checks the values) ----
STRUCTURE_PARAMS = (
    Param(
        "response_format",
        JSON,
        "OpenAI's {type: text | json_object | json_schema, json_schema: {name, schema}}; "
        "the output parses and validates (llguidance). A JSON string is accepted too.",
        openai=True,
        examples=({"type": "json_object"}, "xml"),
        shape=structure_shapes.response_format,
    ),
    Param(
        "regex",
        JSON,
        "The output matches this regular expression.",
        examples=("[a-z]+", 5),
        shape=structure_shapes.non_empty_string,
    ),
    Param(
        "choice",
        JSON,
        "The output is one of these strings.",
        examples=(["a", "b"], "yes"),
        shape=structure_shapes.string_list,
    ),
    Param(
        "grammar",
        JSON,
        "The output is in this context-free grammar (Lark, or GBNF `root ::= ...`).",
        examples=('start: "x"', ["start"]),
        shape=structure_shapes.non_empty_string,
    ),
)
# ---- log-probabilities of committed tokens (dlm_engine/decoding/logprobs.py) ----
MAX_LOGPROBS = 20
LOGPROB_PARAMS = (
    Param(
        "logprobs",
        INT,
        "Report each completion token's log-probability under the model's distribution at its "
        "position in the step that committed it (logits / temperature, before `logit_bias`, "
        "top-p / top-k, EOS suppression or grammar masks; temperature 0 reads as 1), the step, "
        "and this many most likely alternatives (0 = the token alone). Absent = off (no cost).",
        default_doc="none (off)",
        minimum=0,
        maximum=MAX_LOGPROBS,
        relations="proxy: chat `logprobs: true` + `top_logprobs`, completions `logprobs: N`",
        openai=True,
        examples=(2, 21),
    ),
)
# ---- tool calls (dlm_engine/tools.py: the chat template, the constraint, parsing) ----
TOOL_PARAMS = (
    Param(
        "tools",
        JSON,
        "OpenAI's function tools [{type: function, function: {name, description, parameters}}]: "
        "given to the model through the checkpoint's chat template (or a system message when "
        "the template has no tools); calls come back as `tool_calls`.",
        openai=True,
        examples=(
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "f",
        ),
        shape=structure_shapes.tools,
    ),
    Param(
        "tool_choice",
        JSON,
        "`none` (no tools), `auto` (the model may call), `required` (at least one call) or "
        "{type: function, function: {name}} (that call); `required` and a named function "
        "constrain the output so the arguments parse and validate against the parameters' schema.",
        default_doc="`auto` with tools",
        relations="`required` or a function need `tools`; not with `response_format`, "
        "`regex`, `choice` or `grammar`",
        openai=True,
        examples=("none", "sometimes"),
        shape=structure_shapes.tool_choice,
    ),
    Param(
        "parallel_tool_calls",
        BOOL,
        "Allow several calls in one answer (`false`: at most one).",
        default=True,
        default_doc="`true`",
        openai=True,
        examples=(False, "yes"),
    ),
)
# ---- scoring a text under the masked-diffusion objective (dlm_engine/scoring.py) ----
MAX_MC_SAMPLES = 1024
SCORING_PARAMS = (
    Param(
        "score",
        BOOL,
        "Generate nothing: estimate the prompt's log-likelihood under the masked-diffusion "
        "objective (Monte-Carlo over mask ratios, as LLaDA's get_log_likelihood), per token with "
        "its variance, in `logprobs`, and the total in `score`.",
        default=False,
        default_doc="`false`",
        relations="proxy: completions `echo: true` with `max_tokens: 0`",
        examples=(False, "yes"),
    ),
    Param(
        "mc_samples",
        INT,
        "Scoring: Monte-Carlo samples (masked copies of the text, one forward row each); the "
        "variance falls as 1 / mc_samples. Ignored when generating.",
        default_doc="32",
        minimum=1,
        maximum=MAX_MC_SAMPLES,
        examples=(8, 0),
    ),
)
# ---- OpenAI's logit_bias: added to every canvas position's logits before the commit rule ----
BIAS_PARAMS = (
    Param(
        "logit_bias",
        JSON,
        "Map of token id (a string or an integer) to a bias in [-100, 100], added to that "
        "token's logit at every canvas position of every step, before temperature, top-p / "
        "top-k, EOS suppression, grammar masks and the commit rule (OpenAI's meaning: -100 bans "
        "a token, +100 all but forces it). `logprobs` stay the model's own distribution.",
        default_doc="none",
        relations=f"ids below the model's vocabulary size; at most {logit_bias.MAX_ENTRIES} "
        "entries; not with scoring",
        openai=True,
        examples=({"42": -100}, "x"),
        shape=logit_bias.shape,
    ),
)
PARAMS = (
    PARAMS
    + ACCELERATION_PARAMS
    + STRUCTURE_PARAMS
    + LOGPROB_PARAMS
    + TOOL_PARAMS
    + SCORING_PARAMS
    + BIAS_PARAMS
)

# ---- DiffusionGemma's sampler (dlm_engine/decoding/uniform_diffusion.py); `steps` is its
# max_denoising_steps per canvas and `threshold` its entropy_bound ----
UNIFORM_PARAMS = (
    Param(
        "t_min",
        FLOAT,
        "DiffusionGemma: the temperature of a canvas's last denoising step (the schedule falls "
        "linearly from `t_max`).",
        default_doc="the checkpoint's generation_config `t_min` (0.4)",
        minimum=0,
        maximum=10,
        relations="below `t_max`; DiffusionGemma only",
        examples=(0.4, -1),
    ),
    Param(
        "t_max",
        FLOAT,
        "DiffusionGemma: the temperature of a canvas's first denoising step.",
        default_doc="the checkpoint's generation_config `t_max` (0.8)",
        minimum=0,
        maximum=10,
        exclusive_minimum=True,
        relations="above `t_min`; DiffusionGemma only",
        examples=(0.8, 0),
    ),
    Param(
        "stability_threshold",
        INT,
        "DiffusionGemma: a canvas may stop once its argmax has not changed for this many steps "
        "(and `stop_entropy` holds).",
        default_doc="the checkpoint's generation_config `stability_threshold` (1)",
        minimum=0,
        maximum=1024,
        relations="DiffusionGemma only",
        examples=(1, -1),
    ),
    Param(
        "stop_entropy",
        FLOAT,
        "DiffusionGemma: a canvas may stop once its mean token entropy (nats, at the step's "
        "temperature) is below this and it is stable.",
        default_doc="the checkpoint's generation_config `confidence_threshold` (0.005)",
        minimum=0,
        maximum=100,
        exclusive_minimum=True,
        relations="DiffusionGemma only",
        examples=(0.005, 0),
    ),
)
PARAMS = PARAMS + UNIFORM_PARAMS
UNIFORM_ONLY = tuple(p.name for p in UNIFORM_PARAMS)  # other families refuse them

BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}
# alias -> canonical name (canonical names map to themselves)
ALIASES: dict[str, str] = {
    **{p.name: p.name for p in PARAMS},
    **{a: p.name for p in PARAMS for a in p.aliases},
}
PARAM_NAMES: tuple[str, ...] = tuple(BY_NAME)


def canonical(key: str) -> str | None:
    """The canonical name of a key or alias, None when unknown."""
    return ALIASES.get(key)


def conflict_reason(name: str, keys: Iterable[str]) -> str:
    """One key sent under two names with different values: a client bug worth naming."""
    return f"conflicting values for {name} via {', '.join(sorted(keys))}"


def parse_params(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """Canonical key -> checked value; aliases resolved, null = absent, unknown keys rejected.

    Two names for one key with different values is an error (a client bug worth naming).
    """
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise InvalidRequestError("sampling_parameters", "must be a JSON object")
    values: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in raw.items():
        name = ALIASES.get(key)
        if name is None:
            raise InvalidRequestError(key, "unknown parameter")
        if value is None:
            continue
        checked = BY_NAME[name].check(value)
        if name in values and values[name] != checked:
            raise InvalidRequestError(name, f"conflicting values via {given_as[name]} and {key}")
        values[name], given_as[name] = checked, key
    return values
