"""The Triton model's tensors: names, wire datatypes and shapes, written once.

`dlm_triton.launch.model_repo` writes them into every `config.pbtxt`, the adapter reads and writes
them, the proxy and `dlm_client` build requests and read responses with them, and docs/api.md's
tables are generated from them. Shapes leave out the batch dimension (Triton adds it).
"""

from __future__ import annotations

from dataclasses import dataclass

# Triton wire datatype -> (config.pbtxt data_type, numpy dtype name)
_DATATYPES = {
    "BYTES": ("TYPE_STRING", "object"),
    "BOOL": ("TYPE_BOOL", "bool"),
    "INT32": ("TYPE_INT32", "int32"),
    "INT64": ("TYPE_INT64", "int64"),
    "FP32": ("TYPE_FP32", "float32"),
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # Triton wire datatype (what tritonclient's InferInput takes)
    dims: tuple[int, ...]
    doc: str

    @property
    def config_type(self) -> str:
        """`data_type` in config.pbtxt."""
        return _DATATYPES[self.datatype][0]

    @property
    def numpy_dtype(self) -> str:
        """numpy dtype name of the array (`object` for BYTES)."""
        return _DATATYPES[self.datatype][1]


TEXT_INPUT = TensorSpec("text_input", "BYTES", (1,), "raw prompt, no chat template")
MESSAGES = TensorSpec(
    "messages",
    "BYTES",
    (1,),
    "JSON list of chat messages `{role, content}` (roles: system, user, assistant, tool; an "
    "assistant message may carry OpenAI's `tool_calls`, a tool message its `tool_call_id`); the "
    "checkpoint's chat template is applied",
)
INPUT_IDS = TensorSpec("input_ids", "INT64", (-1,), "prompt token ids, used as given")
STREAM = TensorSpec("stream", "BOOL", (1,), "send partial responses (default false: one response)")
SAMPLING_PARAMETERS = TensorSpec(
    "sampling_parameters", "BYTES", (1,), "JSON object of the request keys above"
)

PROMPT_INPUTS: tuple[TensorSpec, ...] = (TEXT_INPUT, MESSAGES, INPUT_IDS)
INPUTS: tuple[TensorSpec, ...] = (*PROMPT_INPUTS, STREAM, SAMPLING_PARAMETERS)
PROMPT_INPUT_NAMES: tuple[str, ...] = tuple(t.name for t in PROMPT_INPUTS)

TEXT_OUTPUT = TensorSpec(
    "text_output",
    "BYTES",
    (1,),
    "streaming: the new stable text (delta); otherwise the whole completion",
)
FINISH_REASON = TensorSpec(
    "finish_reason",
    "BYTES",
    (1,),
    '`""` until the last response, then `stop`, `length`, `tool_calls` or `abort`',
)
PROMPT_TOKENS = TensorSpec("prompt_tokens", "INT32", (1,), "prompt length in tokens")
COMPLETION_TOKENS = TensorSpec(
    "completion_tokens", "INT32", (1,), "completion tokens committed so far"
)
STEPS = TensorSpec("steps", "INT32", (1,), "forwards used so far (the older name of `forwards`)")
FORWARDS = TensorSpec(
    "forwards", "INT32", (1,), "forwards (NFE, denoising steps) the request has used so far"
)
TOKENS_PER_FORWARD = TensorSpec(
    "tokens_per_forward", "FP32", (1,), "`completion_tokens / forwards` (0 before the first)"
)
CANVAS = TensorSpec(
    "canvas",
    "BYTES",
    (1,),
    '`denoise` mode: JSON list (token strings, `null` = masked); otherwise `""`',
)

# only for requests with the `logprobs` key (dlm_protocol.response.LOGPROB_FIELDS)
LOGPROBS = TensorSpec(
    "logprobs",
    "BYTES",
    (1,),
    "with the `logprobs` key: JSON list, one object per token of this response's text "
    '(`token_id`, `token`, `bytes`, `logprob`, `step`, `top_logprobs`); otherwise `""`',
)

# requests with `tools` (dlm_engine/tools.py)
TOOL_CALLS = TensorSpec(
    "tool_calls",
    "BYTES",
    (1,),
    "with `tools`, on the last response: JSON list of OpenAI tool calls "
    '(`{id, type: "function", function: {name, arguments}}`, arguments a JSON string) when the '
    'model called tools (`finish_reason` `tool_calls`); otherwise `""`',
)

# scoring requests (`score`; dlm_engine/scoring.py)
SCORE = TensorSpec(
    "score",
    "BYTES",
    (1,),
    "with `score`, on the last response: JSON `{log_likelihood, variance, mc_samples, tokens}` "
    "(the prompt's estimated log-likelihood bound and the variance of the estimate; per-token "
    'values are in `logprobs`); otherwise `""`',
)

# prefix caching (dlm_engine/prefix_cache.py): OpenAI's `usage.prompt_tokens_details.cached_tokens`
CACHED_TOKENS = TensorSpec(
    "cached_tokens",
    "INT32",
    (1,),
    "prompt tokens whose keys and values came from the prefix cache (shared only between "
    "requests with the same `cache_salt`); 0 for models without one",
)

OUTPUTS: tuple[TensorSpec, ...] = (
    TEXT_OUTPUT,
    FINISH_REASON,
    PROMPT_TOKENS,
    COMPLETION_TOKENS,
    STEPS,
    FORWARDS,
    TOKENS_PER_FORWARD,
    CANVAS,
    LOGPROBS,
    TOOL_CALLS,
    SCORE,
    CACHED_TOKENS,
)
OUTPUT_NAMES: tuple[str, ...] = tuple(t.name for t in OUTPUTS)
BY_NAME: dict[str, TensorSpec] = {t.name: t for t in (*INPUTS, *OUTPUTS)}
