"""Pydantic models of the OpenAI API subset we serve, plus the diffusion extensions.

Request models forbid unknown fields and reject OpenAI features a diffusion model cannot honour
(penalties, audio, ...) with a 400 naming the field, instead of silently ignoring
them. Structured output (`response_format`, `regex`, `choice`, `grammar`), `logprobs` and tool
calls (`tools`, `tool_choice`, `parallel_tool_calls`) are supported: those are keys of the
request contract, like the diffusion keys below (chat's boolean `logprobs` + `top_logprobs` map
onto the contract's count). Neutral values (`presence_penalty: 0`, ...) that chat UIs send by
default are accepted.
OpenAI's own fields are typed strictly, as OpenAI does (no string-to-bool or string-to-number
coercion). Every key of the request contract (`dlm_protocol.PARAMS`) is a field generated from
it: its aliases, its check (the engine's own, so the message and field are the same over every
surface) and its JSON schema for /openapi.json.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from dlm_protocol import BY_NAME, PARAM_NAMES, PARAMS, InvalidRequestError, Param
from dlm_protocol.params import MAX_LOGPROBS, conflict_reason
from dlm_protocol.response import (
    CHAT_ROLES,
    CHUNK_EXTRAS,
    LOGPROB_FIELDS,
    ROLE_ALIASES,
    USAGE_EXTRAS,
)
from dlm_protocol.structure_shapes import json_value
from dlm_protocol.tool_rules import check_tool_call_ids, check_tool_names

# OpenAI's own fields that share a name with a contract alias (handled by the proxy itself).
_OPENAI_OWN = frozenset({"max_completion_tokens"})

# Alias groups from the request contract; the first name is canonical.
ALIASES: dict[str, tuple[str, ...]] = {
    p.name: (p.name, *(a for a in p.aliases if a not in _OPENAI_OWN)) for p in PARAMS
}

# OpenAI fields we know but cannot honour. Value = the neutral values accepted silently.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "best_of": (None, 1),
    "suffix": (None, ""),
}

# alias -> contract key, to name the key (as the engine does) when a value sent by alias is bad.
KEY_OF_ALIAS: dict[str, str] = {a: name for name, names in ALIASES.items() for a in names[1:]}

# Contract keys forwarded to Triton's `sampling_parameters` JSON as they are (the converters
# handle max_tokens, seed and stop themselves: limits, seed + choice, string or list).
DIFFUSION_KEYS = tuple(
    name for name in PARAM_NAMES if name not in ("max_tokens", "seed", "stop", "logprobs")
)

_Unsupported = SkipJsonSchema[Any]

# OpenAI's `metadata` limits, and its service tiers (accepted; this server has one)
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")


def _check_metadata(value: Any) -> Any:
    """OpenAI's `metadata` shape; every error names the field itself, not an inner key."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object of string keys and string values")
    if len(value) > MAX_METADATA_KEYS:
        raise ValueError(f"at most {MAX_METADATA_KEYS} keys")
    for key, text in value.items():
        if not isinstance(key, str) or len(key) > MAX_METADATA_KEY:
            raise ValueError(f"keys are strings of at most {MAX_METADATA_KEY} characters")
        if not isinstance(text, str) or len(text) > MAX_METADATA_VALUE:
            raise ValueError(
                f"value of {key!r} must be a string of at most {MAX_METADATA_VALUE} characters"
            )
    return value


class StreamOptions(BaseModel):
    """OpenAI `stream_options`; unknown sub-fields (e.g. include_obfuscation) are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = Field(
        False, description="Send a last chunk with `usage` and empty `choices`."
    )


def _checked_as(name: str) -> Callable[[Any], Any]:
    """A validator applying the contract's check of key `name` (null = not given)."""
    param = BY_NAME[name]

    def check(value: Any) -> Any:
        if value is None:
            return None
        try:
            return param.check(value)
        except InvalidRequestError as exc:
            raise ValueError(exc.reason) from None

    return check


def _contract_field(param: Param) -> Any:
    """A request field for one contract key: checked by the contract's own `check` (the rule
    the engine applies), documented by the contract's JSON schema."""
    names = ALIASES[param.name]
    return (
        Annotated[
            Any, BeforeValidator(_checked_as(param.name)), WithJsonSchema(param.json_schema())
        ],
        Field(
            None,
            validation_alias=AliasChoices(*names) if len(names) > 1 else None,
            description=param.description(),
        ),
    )


# Every contract key as an optional field (a key added to the contract appears here).
_ContractFields: type[BaseModel] = create_model(
    "_ContractFields",
    __config__=ConfigDict(extra="forbid", populate_by_name=True, strict=True),
    **{p.name: _contract_field(p) for p in PARAMS},
)


class _RequestBase(_ContractFields):
    """Fields shared by chat and completions: OpenAI's own (strictly typed, as OpenAI does) plus
    every key of the request contract (`dlm_protocol.PARAMS`: max_tokens, temperature, top_p,
    seed, stop and the diffusion keys), each checked by the contract."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    model: str = Field(..., min_length=1, description="A model id from GET /v1/models.")
    n: int = Field(1, ge=1, le=128, description="Choices per prompt (bounded by --max-n).")
    stream: bool = Field(False, description="Server-sent events, OpenAI chunk format.")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="Accepted for compatibility; not used.")
    safety_identifier: str | None = Field(None, description="Accepted; not used.")
    prompt_cache_key: str | None = Field(None, description="Accepted; not used.")
    # What agent and chain frameworks send with every request (LangChain, the OpenAI Agents
    # SDK): accepted in OpenAI's shape and ignored, since they change no token.
    metadata: Annotated[
        Any,
        BeforeValidator(_check_metadata),
        WithJsonSchema(
            {
                "anyOf": [
                    {
                        "type": "object",
                        "additionalProperties": {
                            "type": "string",
                            "maxLength": MAX_METADATA_VALUE,
                        },
                        "maxProperties": MAX_METADATA_KEYS,
                    },
                    {"type": "null"},
                ]
            }
        ),
    ] = Field(
        None,
        description=f"Up to {MAX_METADATA_KEYS} string keys (at most {MAX_METADATA_KEY} "
        f"characters) with string values (at most {MAX_METADATA_VALUE}). Accepted; not used.",
    )
    store: bool | None = Field(None, description="Accepted; nothing is stored.")
    service_tier: Literal[SERVICE_TIERS] | None = Field(  # type: ignore[valid-type]
        None, description="Accepted; one tier here."
    )

    # Known OpenAI fields we reject unless neutral (hidden from the schema; see the docs).
    functions: _Unsupported = None
    function_call: _Unsupported = None
    presence_penalty: _Unsupported = None
    frequency_penalty: _Unsupported = None
    repetition_penalty: _Unsupported = None
    modalities: _Unsupported = None
    audio: _Unsupported = None
    prediction: _Unsupported = None
    reasoning_effort: _Unsupported = None
    web_search_options: _Unsupported = None

    @model_validator(mode="before")
    @classmethod
    def _no_conflicting_aliases(cls, data: Any) -> Any:
        """`steps` and `diffusion_steps` with different values is a client bug: say so."""
        if isinstance(data, dict):
            for canonical, names in ALIASES.items():
                given = {name: data[name] for name in names if name in data}
                # repr only where two names are given: a deep value (a schema) is checked
                # for its depth by the contract, and repr of it would recurse first
                if len(given) > 1 and len({repr(v) for v in given.values()}) > 1:
                    raise InvalidRequestError(canonical, conflict_reason(canonical, given))
                if len(given) > 1:  # same value twice: keep one, or the rest reads as extra
                    data = {k: v for k, v in data.items() if k not in given}
                    data[canonical] = next(iter(given.values()))
        return data

    @field_validator(*UNSUPPORTED_FIELDS.keys() - {"best_of", "suffix"}, mode="after")
    @classmethod
    def _reject_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return _check_unsupported(info.field_name or "", value)

    @model_validator(mode="after")
    def _denoise_needs_stream(self) -> _RequestBase:
        if self.stream_mode == "denoise" and not self.stream:
            raise ValueError("stream_mode 'denoise' needs stream=true")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    # -- helpers used by the converters ---------------------------------------------------------

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logprobs_key(self) -> int | None:
        """The contract's `logprobs` (alternatives per token; None = off). Completions send
        OpenAI's `logprobs: N` as it is; chat maps `logprobs: true` + `top_logprobs`."""
        return self.logprobs

    def is_scoring(self) -> bool:
        """Completions `echo: true` + `max_tokens: 0`: score the prompt."""
        return False


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """True when the value asks for nothing (None, 0, False, {}, the OpenAI default)."""
    if value is None:
        return True
    for ok in neutral:
        if ok is None:
            continue
        if isinstance(value, bool) or isinstance(ok, bool):
            if value is ok:
                return True
        elif isinstance(value, int | float) and isinstance(ok, int | float):
            if value == ok:
                return True
        elif type(value) is type(ok) and value == ok:
            return True
    return False


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_unsupported(name: str, value: Any) -> Any:
    if _is_neutral(value, UNSUPPORTED_FIELDS.get(name, (None,))):
        return value
    raise ValueError(f"'{name}' is not supported by the diffusion models served here")


# ----------------------------------------------------------------------------------------------
# Chat


# The engine's chat roles plus OpenAI's other names for them (`developer` = `system`).
OPENAI_ROLES = (*CHAT_ROLES[:1], *ROLE_ALIASES, *CHAT_ROLES[1:])


class TextContentPart(BaseModel):
    """Only text parts: the served models read no images or audio."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(..., min_length=1)
    arguments: str = Field(..., description="The arguments as a JSON string.")


class ToolCall(BaseModel):
    """OpenAI's tool call (an assistant message's `tool_calls`, and the answer's)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """An OpenAI chat message; content is a string or a list of text parts. An assistant
    message may carry `tool_calls` (and no content); a `tool` message answers one call."""

    model_config = ConfigDict(extra="ignore", strict=True)

    # The schema lists the accepted roles; the validator below gives `function` its own message.
    role: str = Field(
        ...,
        description=f"{', '.join(OPENAI_ROLES)} (`developer` = `system`).",
        json_schema_extra={"enum": list(OPENAI_ROLES)},
    )
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(
        None, description="assistant: the tool calls it made."
    )
    tool_call_id: str | None = Field(None, description="tool: the call this result answers.")
    # after role and tool_calls, so its check sees them
    content: str | list[TextContentPart] | None = Field(
        None,
        description="Text, or a list of {type: text, text} parts (null: an assistant message "
        "with tool_calls).",
        validate_default=True,
    )

    @field_validator("role")
    @classmethod
    def _check_role(cls, value: str) -> str:
        if value == "function":
            raise ValueError("'function' messages are OpenAI's deprecated form; send 'tool'")
        if value not in OPENAI_ROLES:
            raise ValueError(f"role must be one of {', '.join(OPENAI_ROLES)}")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content part type {kind!r} is not supported; only 'text'")
        return value

    @field_validator("content", mode="after")
    @classmethod
    def _content_or_calls(cls, value: Any, info: ValidationInfo) -> Any:
        role, calls = info.data.get("role"), info.data.get("tool_calls")
        if calls and role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if value is None and not (role == "assistant" and calls):
            raise ValueError("is required (null only for an assistant's tool_calls)")
        if role == "tool" and not info.data.get("tool_call_id"):
            raise ValueError("a tool message needs tool_call_id")
        return value

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _chat_logprobs(value: Any) -> Any:
    """`true` / `false` as OpenAI's chat sends it: a count is completions' form, and a client
    sending one here meant something this endpoint would not do."""
    if value is None or isinstance(value, bool):
        return value
    raise ValueError("chat takes true or false (with top_logprobs for alternatives), not a count")


class ChatCompletionRequest(_RequestBase):
    """POST /v1/chat/completions. The checkpoint's chat template is applied in Triton."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Annotated[
        Any,
        BeforeValidator(_checked_as("max_tokens")),
        WithJsonSchema(BY_NAME["max_tokens"].json_schema()),
    ] = Field(None, description="Same as max_tokens (newer OpenAI name).")

    @model_validator(mode="after")
    def _one_max_tokens(self) -> ChatCompletionRequest:
        if (
            self.max_completion_tokens is not None
            and self.max_tokens is not None
            and self.max_completion_tokens != self.max_tokens
        ):
            raise ValueError("max_tokens and max_completion_tokens disagree; send one")
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens

    # OpenAI's chat `logprobs` is a boolean (the count goes in `top_logprobs`)
    logprobs: Annotated[
        Any,
        BeforeValidator(_chat_logprobs),
        WithJsonSchema({"anyOf": [{"type": "boolean"}, {"type": "null"}]}),
    ] = Field(
        None,
        description="`true`: each completion token's log-probability under the model at the "
        "step that committed it, with `top_logprobs` alternatives; answered in "
        "`choices[].logprobs.content`, each token with its `step`. A boolean, as OpenAI's.",
    )
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Most likely alternatives per token (needs `logprobs: true`).",
    )

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and self.logprobs is not True:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        return self

    def logprobs_key(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs is True else None

    @model_validator(mode="after")
    def _tool_rules(self) -> ChatCompletionRequest:
        """OpenAI's function names, each once; every tool result answers an earlier call."""
        tools = json_value(self.tools)
        if isinstance(tools, list):
            check_tool_names(tools)
        check_tool_call_ids(
            {
                "role": m.role,
                "tool_calls": [{"id": c.id} for c in m.tool_calls or ()],
                "tool_call_id": m.tool_call_id,
            }
            for m in self.messages
        )
        return self


# ----------------------------------------------------------------------------------------------
# Completions

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def _completion_max_tokens(value: Any) -> Any:
    """The contract's check, plus 0 (with `echo: true`: scoring)."""
    if value == 0 and isinstance(value, int) and not isinstance(value, bool):
        return 0
    return _checked_as("max_tokens")(value)


class CompletionRequest(_RequestBase):
    """POST /v1/completions. A prompt is sent raw (no chat template)."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    ) = Field(
        ...,
        description="A string, a list of strings, a list of token ids, or a list of lists of "
        "token ids. Each prompt gets n choices, indexed prompt * n + i.",
    )
    best_of: _Unsupported = None
    suffix: _Unsupported = None
    # echo + max_tokens 0 scores the prompt (the contract's `score`, with `mc_samples`)
    echo: bool | None = Field(
        None,
        description="With `max_tokens: 0`: generate nothing and score the prompt under the "
        "masked-diffusion objective (per-token estimates in `logprobs`, totals in "
        "`log_likelihood`, `log_likelihood_variance`; see `mc_samples`).",
    )
    max_tokens: Annotated[
        Any,
        BeforeValidator(_completion_max_tokens),
        WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]}),
    ] = Field(
        None,
        validation_alias=AliasChoices(*ALIASES["max_tokens"]),
        description=BY_NAME["max_tokens"].description() + " 0 with `echo: true`: score the prompt.",
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, value: Any) -> Any:
        """One clear message instead of pydantic's four union branches."""
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if all(isinstance(v, str) for v in value):
                return value
            if all(_is_token_id(v) for v in value):
                return value
            if all(isinstance(v, list) and v and all(_is_token_id(t) for t in v) for v in value):
                return value
        raise ValueError(
            "prompt must be a string, a non-empty list of strings, a non-empty list of token "
            "ids (integers >= 0) or a non-empty list of such lists"
        )

    @field_validator("best_of", "suffix", mode="after")
    @classmethod
    def _reject_unsupported_completion(cls, value: Any, info: ValidationInfo) -> Any:
        return _check_unsupported(info.field_name or "", value)

    @field_validator("tools", "tool_choice", mode="after")
    @classmethod
    def _tools_are_chat_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, [], "none", "auto"):
            raise ValueError(f"'{info.field_name}' is a chat completions field")
        return value

    @model_validator(mode="after")
    def _echo_scores(self) -> CompletionRequest:
        if self.echo and self.max_tokens != 0:
            raise InvalidRequestError(
                "echo",
                "scores the prompt and needs max_tokens: 0 (echo with a generation is "
                "not supported)",
            )
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens", "0 needs echo: true (scoring the prompt)")
        return self

    def is_scoring(self) -> bool:
        return bool(self.echo)

    def prompts(self) -> list[str | list[int]]:
        """Normalise the four accepted shapes to a list of single prompts."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# Responses (non-streaming bodies and the documented chunk shapes)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        0,
        description="Prompt tokens reused from the prefix cache (block-diffusion models and "
        "DiffusionGemma; "
        "shared only between requests of the same API key and `cache_salt`).",
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    forwards: int | None = Field(None, description=USAGE_EXTRAS["forwards"])
    tokens_per_forward: float | None = Field(None, description=USAGE_EXTRAS["tokens_per_forward"])


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(
        None, description="With `tools`: the calls the model made (`finish_reason` `tool_calls`)."
    )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """OpenAI's per-token object plus `step`."""

    top_logprobs: list[TopLogprob]
    step: int = Field(..., description=LOGPROB_FIELDS["step"])


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = Field(None, description=LOGPROB_FIELDS["logprob"])
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions shape plus `steps`; for a scored prompt (echo +
    max_tokens 0) each token's estimated share of the log-likelihood bound and `variances`."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]
    steps: list[int] | None = Field(None, description=LOGPROB_FIELDS["step"])
    variances: list[float | None] | None = Field(
        None, description="scoring: the variance of each token's estimate"
    )


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChunkToolCall(ToolCall):
    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ChunkToolCall] | None = Field(
        None, description="With `tools`: every call whole, in one chunk before the last."
    )


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChatLogprobs | None = None
    canvas: list[str | None] | None = Field(
        None, description=f"stream_mode=denoise only: {CHUNK_EXTRAS['canvas']}."
    )
    steps: int | None = Field(
        None, description=f"stream_mode=denoise only: {CHUNK_EXTRAS['steps']}."
    )


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None
    log_likelihood: float | None = Field(
        None,
        description="scoring (echo + max_tokens 0): the prompt's estimated log-likelihood "
        "bound under the masked-diffusion objective",
    )
    log_likelihood_variance: float | None = Field(
        None, description="scoring: the variance of that estimate (null with one sample)"
    )
    mc_samples: int | None = Field(None, description="scoring: Monte-Carlo samples used")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dlm-triton"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
