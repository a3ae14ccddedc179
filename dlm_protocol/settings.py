"""Every server setting: its name, type, default, range, env var, CLI flag, config parameter and
meaning — written once.

A setting is one field of the engine's ``EngineConfig`` (``dlm_engine/config.py`` gets its
fields from :func:`engine_fields`). The Triton model reads it from its ``config.pbtxt``
parameter, overridden by its env var (``dlm_triton/backend/settings.py``); the launcher turns
``dlm-triton serve``'s flag into that parameter or env var (``dlm_triton/launch/``); the
model-repository writer puts the ``in_config`` ones into every ``config.pbtxt``; docs/triton.md's
table is generated from here (``python -m dlm_protocol.docgen``).

Adding a setting: append a :class:`Setting` to :data:`SETTINGS` (and use it in the engine);
see docs/architecture.md, "Adding a server setting".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import limits

ROOT = Path(__file__).resolve().parent.parent
# checkpoints embedded in the repository: a `checkpoint` of one of these names loads it
ASSETS_DIR = ROOT / "dlm_engine" / "assets"
DTYPES = ("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32")
# weight quantization schemes the engine implements (dlm_engine/quantization.py)
QUANTIZATIONS = ("fp8", "int4", "int8", "nf4")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
KINDS = ("int", "float", "str", "bool")  # also the EngineConfig fields' types


@dataclass(frozen=True)
class Setting:
    """One server setting. ``name`` is its ``EngineConfig`` field; ``param`` its
    ``config.pbtxt`` key (the name unless given); ``env`` its override variable
    (``DLM_<PARAM>`` unless given); ``flag`` its ``dlm-triton serve`` flag (``--name-with-
    dashes`` unless given; ``""``: none, the launcher has its own)."""

    name: str
    kind: str  # int, float, str or bool
    default: Any
    doc: str
    param: str = ""
    env: str = ""
    flag: str | None = None
    required: bool = False  # no default: every config names it
    optional: bool = False  # None is a value (the engine then decides)
    none_text: str = ""  # the config text that means None (quantization's "none")
    minimum: float | None = None
    above: float | None = None  # exclusive lower bound
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    in_config: bool = False  # written into every generated config.pbtxt
    default_doc: str = ""  # the docs' default when the value alone does not say it

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"setting {self.name}: unknown kind {self.kind!r}")
        object.__setattr__(self, "param", self.param or self.name)
        object.__setattr__(self, "env", self.env or f"DLM_{self.param.upper()}")
        if self.flag is None:
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))

    @property
    def annotation(self) -> str:
        """The ``EngineConfig`` field's type."""
        return f"{self.kind} | None" if self.optional else self.kind

    def check(self, value: Any) -> Any:
        """``value`` if it is allowed; otherwise ValueError saying what is (without the name:
        the caller says where the value came from)."""
        if value is None:
            if self.optional:
                return None
            raise ValueError("must be set")
        if self.kind in ("int", "float") and isinstance(value, bool):
            raise ValueError(f"must be a number, not a boolean, got {value!r}")
        if self.kind == "int" and not isinstance(value, int):
            raise ValueError(f"must be an integer, got {value!r}")
        finite = isinstance(value, (int, float)) and math.isfinite(value)
        if self.kind == "float" and not finite:
            raise ValueError(f"must be a finite number, got {value!r}")
        if self.kind == "bool" and not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}")
        if self.kind == "str" and not isinstance(value, str):
            raise ValueError(f"must be a string, got {value!r}")
        if self.choices and value not in self.choices:
            raise ValueError(f"must be one of {', '.join(self.allowed)}, got {value!r}")
        if self.range_text and not self._in_range(value):
            raise ValueError(f"must be {self.range_text}")
        return value

    def _in_range(self, value: float) -> bool:
        return (
            (self.minimum is None or value >= self.minimum)
            and (self.above is None or value > self.above)
            and (self.maximum is None or value <= self.maximum)
        )

    @property
    def range_text(self) -> str:
        low = self.minimum if self.minimum is not None else self.above
        if low is None and self.maximum is None:
            return ""
        if self.maximum is None:
            return f"{'>=' if self.minimum is not None else '>'} {_num(low)}"
        if low is None:
            return f"<= {_num(self.maximum)}"
        left = "[" if self.minimum is not None else "("
        return f"in {left}{_num(low)}, {_num(self.maximum)}]"

    @property
    def allowed(self) -> tuple[str, ...]:
        """The choices as written in a config (with the text that means None first)."""
        return ((self.none_text,) if self.none_text else ()) + self.choices

    def parse(self, text: str) -> Any:
        """A config parameter's or env var's text as a checked value; ValueError naming the
        parameter and the env var otherwise."""
        raw = text.strip()
        try:
            if self.optional and raw == self.none_text:
                return self.check(None)
            if self.kind == "int":
                value: Any = _parse_int(raw)
            elif self.kind == "float":
                value = _parse_float(raw)
            elif self.kind == "bool":
                value = _parse_bool(raw)
            else:
                value = raw
            return self.check(value)
        except ValueError as exc:
            raise ValueError(f"parameter {self.param} {exc} (config or {self.env})") from None

    def text(self, value: Any) -> str:
        """``value`` as config / env text (what :meth:`parse` reads back)."""
        if value is None:
            return self.none_text
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)

    @property
    def default_text(self) -> str:
        if self.default_doc:
            return self.default_doc
        if self.required:
            return "required"
        if self.default is None:
            return f"`{self.none_text}`" if self.none_text else "unset"
        return f"`{self.text(self.default)}`"

    @property
    def values_text(self) -> str:
        if self.choices:
            return ", ".join(f"`{c}`" for c in self.allowed)
        if self.kind == "bool":
            return "`true`, `false`"
        kind = {"int": "integer", "float": "number", "str": "text"}[self.kind]
        return f"{kind} {self.range_text}".strip()


def _num(x: float | None) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _parse_int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"must be an integer, got {raw!r}") from None


def _parse_float(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"must be a number, got {raw!r}") from None


def _parse_bool(raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"must be true or false, got {raw!r}")


def _ms(name: str, default: float, doc: str) -> Setting:
    """A wait in milliseconds, at most a minute."""
    return Setting(name, "float", default, doc, minimum=0.0, maximum=60_000.0)


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "model",
        "str",
        None,
        "checkpoint directory (absolute, relative to the model folder, or a name under "
        "`dlm_engine/assets/`), Hugging Face Hub id (downloaded into `HF_HOME` by the "
        "launcher, or by the model if Triton is started by hand), or `random:<preset>`",
        param="checkpoint",
        flag="",  # `dlm-triton serve --model` also names models of the repository
        required=True,
        in_config=True,
    ),
    Setting(
        "revision",
        "str",
        None,
        "Hub branch, tag or commit of a Hub id (pin a commit in production)",
        optional=True,
        default_doc="`main`",
    ),
    Setting(
        "dtype",
        "str",
        "auto",
        "weight and activation dtype; `auto` = the checkpoint's `torch_dtype` (float32 on CPU)",
        choices=DTYPES,
        in_config=True,
    ),
    Setting(
        "device",
        "str",
        "cpu",
        "`cuda` (pinned to the instance's GPU) or `cpu`; unset: the instance group's kind",
        flag="",  # `dlm-triton serve --device auto|cpu|cuda` picks the config kind too
        in_config=True,
    ),
    Setting(
        "quantization",
        "str",
        None,
        "weight quantization: `fp8` (e4m3: native on Ada/Hopper GPUs, dequantized elsewhere), "
        "`int4` (groups of 128: Triton kernels on CUDA, dequantized elsewhere), "
        "`int8`, `nf4` (bitsandbytes, CUDA); with tensor_parallel_size > 1 only `fp8`",
        optional=True,
        none_text="none",
        choices=QUANTIZATIONS,
        in_config=True,
    ),
    Setting(
        "max_rows", "int", limits.MAX_ROWS, "rows per denoising step", minimum=1, in_config=True
    ),  # fmt: skip
    Setting(
        "max_canvas", "int", limits.MAX_CANVAS, "`max_tokens` ceiling", minimum=1, in_config=True
    ),  # fmt: skip
    Setting(
        "max_prompt", "int", limits.MAX_PROMPT, "prompt-token ceiling", minimum=1, in_config=True
    ),  # fmt: skip
    Setting(
        "max_queue",
        "int",
        limits.MAX_QUEUE,
        "requests in flight (waiting or running) at most; one more is refused at once with an "
        "`overloaded:` error (HTTP 503 + Retry-After from the proxy)",
        minimum=1,
        in_config=True,
    ),
    Setting(
        "max_step_tokens",
        "int",
        65536,
        "prompt and canvas tokens of all rows in one forward (DiffusionGemma: each row's "
        "canvas; its encoder has `encode_step_tokens`)",
        minimum=1,
    ),
    Setting(
        "default_max_tokens",
        "int",
        limits.DEFAULT_MAX_TOKENS,
        "canvas length of a request that gives no `max_tokens`; 0 = the checkpoint's "
        "published generation length",
        minimum=0,
    ),
    Setting(
        "phase_wait_steps",
        "int",
        8,
        "steps a waiting cached (`cache` prefix/dual) request may be held so it joins when the "
        "running cached rows start a block (one forward a step instead of a refresh plus a "
        "span forward); 0 admits at once (docs/architecture.md)",
        minimum=0,
    ),
    _ms(
        "admission_window_ms",
        250.0,
        "an idle engine that receives a cached request keeps gathering "
        "arrivals for at most this long before the first step, so a burst starts its first "
        "block together; 0 turns it off; exact requests never wait (docs/architecture.md, "
        '"Gathering a burst")',
    ),
    _ms("admission_gap_ms", 8.0, "... and stops gathering once no request arrived for this long"),
    _ms(
        "admission_burst_gap_ms",
        40.0,
        "... or, once a second request has come, for this long (a "
        "burst's arrivals through the proxy can pause mid-way, while a lone request pays only "
        "the short gap)",
    ),
    Setting(
        "score_step_tokens",
        "int",
        0,
        "scoring requests (completions `echo` + `max_tokens: 0`, the contract's `score`) feed "
        "at most this many tokens a forward (one text at least) and, beside generation rows, "
        "half the rows' tokens a step at most this many, so a generation neighbour's steps "
        'cost at most about 1.5x (docs/architecture.md, "Scoring")',
        minimum=0,
        default_doc="`0` = `max_step_tokens` / 64, i.e. 1,024",
    ),
    Setting(
        "encode_step_tokens",
        "int",
        8192,
        "DiffusionGemma: prompt and finished-canvas tokens the encoder runs in a step at most, "
        "one packed forward for all rows that have some; a longer prompt is encoded in chunks "
        "over several steps while the running rows keep denoising (chunked prefill)",
        minimum=1,
    ),
    Setting(
        "encoder_prefix_cache_bytes",
        "int",
        None,
        "DiffusionGemma: bytes of encoder keys and values of prompt prefixes kept for reuse "
        "across requests (chunks of 256 tokens, shared only under the same `cache_salt`, "
        "least recently used first out): a prompt starting with a cached prefix encodes only "
        "the rest; 0 turns it off (off too with `tensor_parallel_size` > 1)",
        optional=True,
        none_text="auto",
        minimum=0,
        default_doc="`auto` = 64 MiB on CPU, 5% of the GPU's memory on CUDA",
    ),
    Setting(
        "cuda_graphs",
        "bool",
        True,
        "replay captured CUDA graphs for the forwards on CUDA devices",
    ),
    Setting(
        "max_cuda_graphs",
        "int",
        96,
        "CUDA graph shapes kept captured (one shared activation pool)",
        minimum=0,
    ),
    Setting(
        "cuda_graph_max_tokens",
        "int",
        1536,
        "a step that feeds whole sequences (exact rows, cached rows at a block start) with "
        "more packed tokens than this runs eagerly instead of capturing a CUDA graph (a "
        "capture costs far more than one eager forward and such shapes rarely repeat); 0 "
        "captures every shape; in-block steps always replay graphs",
        minimum=0,
    ),
    Setting(
        "fused_kernels",
        "bool",
        True,
        "`torch.compile` the elementwise pieces on CUDA devices",
    ),
    Setting(
        "paged_attention",
        "str",
        "gather",
        "block-diffusion models (SDAR, LLaDA2, Fast-dLLM v2): how attention reads the KV page "
        "pool; `gather` copies each row's pages into one contiguous block a layer, then runs "
        "SDPA; `flex` reads the pages in place through the page table with FlexAttention "
        "(compiled on CUDA, once per batch shape; a step feeding a prompt wider than 128 "
        "tokens, a page no 16-token kernel tile divides, or a failed compile gathers; on the "
        "CPU the unfused reference, slow: for checks only); both attend over the same keys",
        choices=("gather", "flex"),
    ),
    Setting(
        "expert_gemm",
        "str",
        "aten",
        "MoE families (LLaDA2, SDAR-MoE, DiffusionGemma) on CUDA: the kernel of the experts' "
        "grouped products; `aten` runs `torch._grouped_mm` (CUTLASS); `triton` compiles it "
        "with `torch.compile` max-autotune, which times inductor's Triton grouped-GEMM "
        "templates against aten once per weight shape at warm-up (tens of seconds) and keeps "
        "the fastest; a failed compile falls back to aten and is reported; no effect on the "
        "CPU",
        choices=("aten", "triton"),
    ),
    Setting(
        "warmup",
        "bool",
        True,
        "on a CUDA device, run one short request before the model reports ready, so the first "
        "client's request does not wait while the fused kernels compile and the first CUDA "
        "graphs are captured (no effect on the CPU, where nothing is compiled)",
    ),
    Setting(
        "engine_threads",
        "int",
        0,
        "torch CPU threads of the thread that steps the engine; 0: every core on the CPU, at "
        "most 4 on a GPU, where a step's CPU work is bookkeeping on small tensors and replicas "
        "that share the host's cores (one per GPU) would each take every core",
        minimum=0,
    ),
    Setting(
        "lookahead",
        "bool",
        True,
        "queue the next in-block forward before a step's copy (CUDA only; "
        "`dlm_engine/lookahead.py`)",
    ),
    Setting(
        "kv_cache_tokens",
        "int",
        0,
        "block-diffusion models (SDAR, LLaDA2, Fast-dLLM v2): tokens of the KV page pool; "
        "0 = a share of the GPU memory free after loading (`kv_cache_memory_fraction`), "
        "32,768 on CPU (at least one row of `max_prompt` + `max_canvas`, at most `max_rows` "
        "of them)",
        minimum=0,
    ),
    Setting(
        "kv_cache_memory_fraction",
        "float",
        0.5,
        "that share when `kv_cache_tokens` is 0",
        above=0.0,
        maximum=1.0,
    ),
    Setting(
        "prefix_cache_tokens",
        "int",
        16384,
        "idle prompt pages kept for reuse across requests, in tokens, least recently used "
        "first out (they also give way whenever the pool needs pages); 0 turns prefix "
        "caching off",
        minimum=0,
    ),
    Setting(
        "tensor_parallel_size",
        "int",
        1,
        "ranks the weights are split over (vLLM's `tensor_parallel_size`): the instance's "
        "engine is rank 0 and starts N-1 worker processes, one device each (CUDA: consecutive "
        'GPUs; CPU: gloo; docs/deployment.md, "Tensor parallel: one model over several GPUs")',
        minimum=1,
    ),
    Setting(
        "tensor_parallel_nodes",
        "int",
        1,
        "hosts the `tensor_parallel_size` ranks span, size / nodes ranks (GPUs) each: the "
        "engine's host runs ranks 0..size/nodes-1, every other host runs `dlm-triton tp-node "
        "--leader HOST --node K` (ranks K*size/nodes onwards); must divide "
        '`tensor_parallel_size` (docs/deployment.md, "Tensor parallel across hosts")',
        minimum=1,
    ),
    Setting(
        "tensor_parallel_port",
        "int",
        29500,
        "with `tensor_parallel_nodes` > 1: the port of rank 0's store (on every interface) "
        "that the other hosts' `tp-node` join; one engine per host then",
        minimum=1,
        maximum=65535,
    ),
    Setting(
        "expert_parallel",
        "bool",
        False,
        "with `tensor_parallel_size` N, spread a mixture-of-experts model's routed experts "
        "whole over the N ranks (num_experts / N each) instead of splitting every expert N "
        "ways (LLaDA2; DiffusionGemma, whose other layers are then replicated; one device: "
        "no effect)",
    ),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
BY_PARAM: dict[str, Setting] = {s.param: s for s in SETTINGS}
BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS}


def engine_fields(cls: type) -> type:
    """Make ``cls`` a dataclass with one field per setting, in registry order (the required
    ones have no default); the class keeps its own methods and docstring."""
    own = dict(cls.__dict__.get("__annotations__", {}))
    clash = set(own) & set(BY_NAME)
    if clash:
        raise TypeError(f"{cls.__name__}: {sorted(clash)} come from dlm_protocol.settings")
    fields = {s.name: s.annotation for s in SETTINGS}
    cls.__annotations__ = {**fields, **own}
    for s in SETTINGS:
        if not s.required:
            setattr(cls, s.name, s.default)
    return dataclass(cls)


def check_values(values: Any, where: str) -> None:
    """Every setting's value on ``values`` (an ``EngineConfig``) checked; ValueError
    ``<where>.<name> must be ...`` at the first bad one, then the checks across settings."""
    for s in SETTINGS:
        try:
            s.check(getattr(values, s.name))
        except ValueError as exc:
            raise ValueError(f"{where}.{s.name} {exc}") from None
    size, nodes = values.tensor_parallel_size, values.tensor_parallel_nodes
    if size % nodes:
        raise ValueError(
            f"{where}.tensor_parallel_nodes {nodes} must divide tensor_parallel_size {size} "
            "(each host runs tensor_parallel_size / tensor_parallel_nodes ranks)"
        )


def parse_parameters(params: Mapping[str, str]) -> dict[str, Any]:
    """``config.pbtxt`` parameters (merged with env overrides) as checked values by setting
    name; an unknown parameter or a bad value raises ValueError naming it."""
    out: dict[str, Any] = {}
    for key, text in params.items():
        setting = BY_PARAM.get(key)
        if setting is None:
            known = ", ".join(sorted(BY_PARAM))
            raise ValueError(f"parameter {key!r} is no server setting (known: {known})")
        out[setting.name] = setting.parse(text)
    return out


def config_parameters(device: str, given: Mapping[str, Any]) -> dict[str, str]:
    """The ``parameters`` of a generated ``config.pbtxt``: every ``in_config`` setting (given
    or its default), then the other given ones, in registry order. ``given`` maps config
    parameter names to values (or their text); an unknown name raises ValueError."""
    unknown = set(given) - set(BY_PARAM)
    if unknown:
        raise ValueError(f"no server setting named {', '.join(sorted(unknown))}")
    values = {"device": device, **given}
    out = {}
    for s in SETTINGS:
        if s.param in values and values[s.param] is not None:
            value = values[s.param]
            out[s.param] = value if isinstance(value, str) else s.text(value)
        elif s.in_config and not s.required:
            out[s.param] = s.text(s.default)
        elif s.in_config:
            raise ValueError(f"config parameter {s.param!r} is required")
    return out


def resolve_checkpoint(value: str, model_dir: Path | None = None) -> str:
    """The ``checkpoint`` setting as the loader takes it: a path if one exists (absolute,
    relative to the model folder, or an embedded asset); otherwise the value unchanged (a Hub
    id or a ``random:`` spec)."""
    candidates = [Path(value).expanduser()]
    if model_dir is not None:
        candidates.append(model_dir / value)
    candidates.append(ASSETS_DIR / value)
    for path in candidates:
        if path.is_dir():
            return str(path.resolve())
    return value


def serve_flags() -> list[Setting]:
    """The settings ``dlm-triton serve`` has a flag for."""
    return [s for s in SETTINGS if s.flag]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """docs/triton.md's settings table."""
    rows = [
        "| parameter | env var | `serve` flag | default | values | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        flag = f"`{s.flag}`" if s.flag else "—"
        rows.append(
            f"| `{s.param}` | `{s.env}` | {flag} | {_cell(s.default_text)} | "
            f"{_cell(s.values_text)} | {_cell(s.doc)} |"
        )
    return "\n".join(rows) + "\n"
