"""Load a local Hugging Face checkpoint directory of a supported family.

Reads the published files only (`config.json`, `generation_config.json`, `*.safetensors`
with or without an index, tokenizer files) and never executes checkpoint code.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .decoding.checkpoint_defaults import decoding_defaults
from .fp8_checkpoint import fp8_format, install_fp8_layers
from .gptq_checkpoint import install_int4_layers, int4_format
from .hub import resolve_checkpoint, weight_files
from .models import LLADA, Family, build_model, detect_family
from .models.diffusion_gemma import drop_unused
from .quantization import quantize_linears

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    """A model ready to run plus what decoding needs to know about its vocabulary."""

    model: nn.Module
    family: Family
    config: dict[str, Any]
    tokenizer: PreTrainedTokenizerBase
    mask_id: int
    eos_id: int
    stop_ids: frozenset[int]
    dtype: torch.dtype
    device: torch.device
    path: Path
    decoding_defaults: dict[str, Any] = field(default_factory=dict)  # e.g. d3LLM's
    dtype_reason: str = ""  # why `dtype` was chosen (choose_dtype), for logs and metrics


class ShardReader(Protocol):
    """Makes a meta-device model one rank's shard and returns that rank's weights."""

    def __call__(
        self,
        model: nn.Module,
        path: Path,
        config: dict[str, Any],
        family: Family,
        device: torch.device,
        dtype: torch.dtype,
    ) -> dict[str, torch.Tensor]: ...


# On CPU a denoising step runs slower in bfloat16 than in float32, even with native
# AVX512-BF16, and much slower where bf16 is emulated (AVX2 only); bf16 on CPU also grows the
# process with every new tensor shape (oneDNN caches kernels per shape), while float32 stays
# flat (figures in docs/benchmarks.md). So `auto` on CPU is float32 whatever the checkpoint
# stores.
CPU_AUTO_REASON = (
    "auto on CPU: float32 (measured faster than bf16 even with native AVX512-BF16, and bf16 "
    "kernels are cached per shape, so memory grows)"
)


def choose_dtype(name: str, config: dict[str, Any], device: str = "cpu") -> tuple[str, str]:
    """(dtype name, why): an explicit dtype wins; `auto` is the checkpoint's own `torch_dtype`
    (as transformers' `torch_dtype="auto"`) on accelerators and float32 on CPU."""
    if name != "auto":
        chosen, why = name, "asked for"
    else:
        stored = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        if torch.device(device).type == "cpu" and stored != "float32":
            chosen, why = "float32", f"{CPU_AUTO_REASON}; the checkpoint stores {stored}"
        else:
            chosen, why = stored, "auto: the checkpoint's torch_dtype"
    if chosen not in DTYPES:
        raise ValueError(f"unsupported dtype {chosen!r}; choose one of {sorted(DTYPES)} or auto")
    return chosen, why


def _read_state(path: Path, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    target = "cpu" if device.type == "cpu" else str(device)
    for f in weight_files(path):
        with safe_open(str(f), framework="pt", device=target) as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = sf.get_tensor(name)
                state[name] = t.to(dtype) if _takes_model_dtype(name, t) else t
    return state


def _takes_model_dtype(name: str, t: torch.Tensor) -> bool:
    """Floating tensors are cast to the model dtype, except FP8 weights and their float32
    scales, which a published FP8 checkpoint keeps as stored (`fp8_checkpoint.py`), and the
    float16 group scales of a GPTQ/AWQ checkpoint (`gptq_checkpoint.py`)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return False
    return t.is_floating_point() and not name.endswith(_FP8_SCALE_SUFFIXES)


_FP8_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale", ".scales")


def _special_ids(
    family: Family, config: dict[str, Any], gen: dict[str, Any], tok: PreTrainedTokenizerBase
) -> tuple[int, int, frozenset[int]]:
    vocab = tok.get_vocab()
    mask_id = config.get("mask_token_id", gen.get("mask_token_id"))
    if family.uniform_diffusion:  # no mask token; -1 marks canvas positions not yet final
        mask_id = -1
    if mask_id is None:
        mask_id = vocab.get(family.mask_token)
    published = family.published_mask_id  # the id the published code hard-codes
    if mask_id is None and published is not None and published < int(config.get("vocab_size", 0)):
        mask_id = published
    if mask_id is None:
        raise ValueError("checkpoint names no mask token (config mask_token_id)")
    eos: list[int] = []
    for src in (gen.get("eos_token_id"), config.get("eos_token_id"), tok.eos_token_id):
        if src is None:
            continue
        eos.extend(src if isinstance(src, list) else [src])
    if not eos:
        raise ValueError("checkpoint names no end-of-text token (eos_token_id)")
    stops = set(eos) | {vocab[t] for t in family.end_of_turn_tokens if t in vocab}
    return int(mask_id), int(eos[0]), frozenset(int(i) for i in stops)


def random_checkpoint(
    name: str, dtype: str = "auto", device: str = "cpu", quantization: str | None = None
) -> LoadedModel:
    """A published architecture (see `presets.py`) with random weights, for benchmarks.

    Built directly on the device; the tokenizer is a small character-level one (token ids
    beyond it decode to nothing) and the stop set is empty: fixed decoding schedules.
    """
    import tempfile

    from .presets import PRESETS
    from .tokenizer_build import build_char_tokenizer

    if name not in PRESETS:
        raise ValueError(f"unknown random preset {name!r}; choose one of {sorted(PRESETS)}")
    config = dict(PRESETS[name])
    family = detect_family(config)
    dtype_name, dtype_reason = choose_dtype(dtype, config, device)
    torch_dtype = DTYPES[dtype_name]
    dev = torch.device(device)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)  # materialise straight in the target dtype
    try:
        with torch.device("meta"):
            model = build_model(family, config)
        model = model.to_empty(device=dev)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith("ln_f.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        for b in model.buffers():  # e.g. LLaDA2's expert_bias: to_empty left them unset
            b.zero_()
    model.eval().requires_grad_(False)
    model.fuse_projections()
    if quantization:
        quantize_linears(model, quantization, dev)
    tok_dir = Path(tempfile.mkdtemp(prefix="dlm-random-tok-"))
    build_char_tokenizer(tok_dir, family.name)
    tok = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=False)
    mask_id, eos_id = int(config["mask_token_id"]), int(config["eos_token_id"])
    return LoadedModel(
        model,
        family,
        config,
        tok,
        mask_id,
        eos_id,
        frozenset(),
        torch_dtype,
        dev,
        tok_dir,
        dtype_reason=dtype_reason,
    )


def load_checkpoint(
    path: str | Path,
    dtype: str = "auto",
    device: str = "cpu",
    quantization: str | None = None,
    revision: str | None = None,
    weights: ShardReader | None = None,
) -> LoadedModel:
    """Build the family's model from `path`, load its weights, tokenizer and special ids.

    `path` is a checkpoint directory or a Hugging Face Hub id (`org/name`, fetched at
    `revision` into the Hub cache: see `hub.py`); `random:<preset>` builds a published
    architecture with random weights (benchmarks). `weights`, for a tensor-parallel rank,
    turns the model built on the meta device into its shard and reads only its slices
    (dlm_engine/parallel/)."""
    if str(path).startswith("random:"):
        return random_checkpoint(str(path).removeprefix("random:"), dtype, device, quantization)
    path = resolve_checkpoint(path, revision)  # a complete local folder, or a clear error
    config = json.loads((path / "config.json").read_text())
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    family = detect_family(config)
    dtype_name, dtype_reason = choose_dtype(dtype, config, device)
    log.info("dtype %s for %s on %s: %s", dtype_name, path, device, dtype_reason)
    torch_dtype = DTYPES[dtype_name]
    dev = torch.device(device)
    with torch.device("meta"):
        model = build_model(family, config)
    if weights is not None:
        state = weights(model, path, config, family, dev, torch_dtype)
    else:
        state = _read_state(path, dev, torch_dtype)
    int4 = int4_format(config)
    fp8 = None if int4 is not None else fp8_format(config)
    if int4 is not None:
        if quantization not in (None, "int4"):
            raise ValueError(
                f"a 4-bit checkpoint cannot be loaded with quantization={quantization}"
            )
        install_int4_layers(model, state, int4, torch_dtype)
    if fp8 is not None:
        if quantization not in (None, "fp8"):
            raise ValueError(f"an FP8 checkpoint cannot be loaded with quantization={quantization}")
        install_fp8_layers(model, state, fp8)
    expected = set(model.state_dict())
    if family.uniform_diffusion:  # DiffusionGemma: text only, encoder tied to decoder
        drop_unused(state, expected)
    unexpected = sorted(set(state) - expected)
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"checkpoint {path} lacks tensors {missing[:5]} (of {len(missing)})")
    for name in unexpected:  # e.g. a tied lm_head saved anyway, rotary buffers
        del state[name]
    model.load_state_dict(state, assign=True, strict=True)
    model.eval().requires_grad_(False)
    model.fuse_projections()
    if quantization:
        quantize_linears(model, quantization, dev)
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    mask_id, eos_id, stop_ids = _special_ids(family, config, gen, tok)
    if family is LLADA and "mask_token_id" not in config and mask_id != 126336:
        raise ValueError("LLaDA checkpoint without mask_token_id")
    return LoadedModel(
        model,
        family,
        config,
        tok,
        mask_id,
        eos_id,
        stop_ids,
        torch_dtype,
        dev,
        path,
        decoding_defaults(path, family, config, gen),
        dtype_reason,
    )
