"""The served-models table of README.md, generated from ``model_repository/`` so it cannot drift.

Each row reads a model folder's ``config.pbtxt`` (checkpoint, limits) and builds the checkpoint's
architecture on PyTorch's meta device (no weights, no download) to count its parameters and
the bytes its weights take per precision, exactly as the loader and ``quantization.py`` lay
them out: FP8 replaces the blocks' ``nn.Linear`` layers and the stacked MoE experts;
bitsandbytes replaces the ``nn.Linear`` layers only; embeddings and the output head stay bf16. ``dlm_protocol.docgen`` renders it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from dlm_protocol.settings import ASSETS_DIR as ASSETS

from .model_repo import COMMITTED_REPOSITORY, MODELS, read_parameters

# Published architecture (a `dlm_engine/presets.py` name) of each Hub checkpoint the committed
# repository names; a new model_repository/ entry without one fails the docs test.
HUB_ARCHITECTURES = {
    "GSAI-ML/LLaDA-8B-Instruct": "llada-8b",
    "GSAI-ML/LLaDA-1.5": "llada-8b",
    "Dream-org/Dream-v0-Instruct-7B": "dream-7b",
    "d3LLM/d3LLM_LLaDA": "llada-8b",
    "d3LLM/d3LLM_Dream": "dream-7b",
    "inclusionAI/LLaDA2.0-mini": "llada2-mini",
    "inclusionAI/LLaDA2.1-mini": "llada2-mini",  # the 2.0-mini layout
    "JetLM/SDAR-4B-Chat": "sdar-4b",
    "JetLM/SDAR-8B-Chat": "sdar-8b",
    "Efficient-Large-Model/Fast_dLLM_v2_7B": "fast-dllm-v2-7b",
    "JetLM/SDAR-30B-A3B-Chat": "sdar-30b-a3b",
    "inclusionAI/LLaDA2.0-flash": "llada2-flash",
    "inclusionAI/LLaDA2.1-flash": "llada2-flash",  # the 2.0-flash layout
    "google/diffusiongemma-26B-A4B-it": "diffusiongemma-26b-a4b",
}

# bitsandbytes storage per weight of a replaced linear layer, in bytes: LLM.int8 keeps one
# byte a weight plus a float32 scale per output row; NF4 half a byte plus, with its default
# double quantization, one byte of absmax per 64 weights and a float32 per 256 such blocks.
INT8_BYTES = 1.0
FP8_BYTES = 1.0  # e4m3, plus a float32 scale per output row (dlm_engine/fp8.py)
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


@dataclass(frozen=True)
class ModelRow:
    name: str
    checkpoint: str
    family: str
    parameters: int
    bytes_bf16: float
    bytes_fp8: float
    bytes_int8: float
    bytes_nf4: float
    max_prompt: int
    max_canvas: int
    max_rows: int


def architecture(checkpoint: str) -> dict[str, Any]:
    """The ``config.json`` of a committed checkpoint: an embedded asset or a known Hub id."""
    asset = ASSETS / checkpoint / "config.json"
    if asset.is_file():
        return json.loads(asset.read_text())
    if checkpoint not in HUB_ARCHITECTURES:
        raise KeyError(
            f"no architecture known for {checkpoint!r}: add it to HUB_ARCHITECTURES "
            "(dlm_triton/launch/model_table.py)"
        )
    presets = _load_presets()
    return dict(presets[HUB_ARCHITECTURES[checkpoint]])


def _load_presets() -> dict[str, dict[str, Any]]:
    from dlm_engine.presets import PRESETS

    return PRESETS


def weight_bytes(config: dict[str, Any]) -> tuple[str, int, float, float, float, float]:
    """(family, parameters, bf16, fp8, int8, nf4 bytes) of the model as served."""
    import torch
    from torch import nn

    from dlm_engine.fp8 import EXPERT_STACKS
    from dlm_engine.models import build_model, detect_family
    from dlm_engine.quantization import _output_head

    family = detect_family(config)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = build_model(family, config)
            model.fuse_projections()
    finally:
        torch.set_default_dtype(default)
    head = _output_head(model)
    total = sum(p.numel() for p in model.parameters())
    linear_weights = linear_rows = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not head:
            linear_weights += module.weight.numel()
            linear_rows += module.out_features
    # stacked MoE experts (the ones `quantize_fp8` swaps): FP8 quantizes them too (a float32
    # scale per expert and output channel), bitsandbytes does not
    expert_weights = expert_columns = 0
    for name, p in model.named_parameters():
        layout = EXPERT_STACKS.get(name.rsplit(".", 1)[-1])
        if p.dim() == 3 and layout is not None:
            expert_weights += p.numel()
            expert_columns += p.shape[0] * (p.shape[2] if layout == "in_out" else p.shape[1])
    rest = 2.0 * (total - linear_weights)  # bf16
    int8 = rest + INT8_BYTES * linear_weights + 4.0 * linear_rows
    nf4 = rest + NF4_BYTES * linear_weights
    fp8 = int8 - 2.0 * expert_weights + FP8_BYTES * expert_weights + 4.0 * expert_columns
    return family.name, total, 2.0 * total, fp8, int8, nf4


@cache
def _checkpoint_bytes(checkpoint: str) -> tuple[str, int, float, float, float, float]:
    return weight_bytes(architecture(checkpoint))


def _family_label(name: str) -> str:
    """The family as the table names it (`Family.table_label`, else its label)."""
    from dlm_engine.models import family_of

    family = family_of(name)
    return family.table_label or family.label


def rows(repository: Path = COMMITTED_REPOSITORY) -> list[ModelRow]:
    order = {spec.name: i for i, spec in enumerate(MODELS)}  # model_repo.py's order
    files = sorted(
        repository.glob("*/config.pbtxt"),
        key=lambda f: (order.get(f.parent.name, len(order)), f.parent.name),
    )
    out = []
    for config_file in files:
        params = read_parameters(config_file)
        checkpoint = params["checkpoint"]
        family, total, bf16, fp8, int8, nf4 = _checkpoint_bytes(checkpoint)
        label = _family_label(family)
        if "d3llm" in checkpoint.lower():
            label = f"d3LLM ({label})"
        out.append(
            ModelRow(
                name=config_file.parent.name,
                checkpoint=checkpoint,
                family=label,
                parameters=total,
                bytes_bf16=bf16,
                bytes_fp8=fp8,
                bytes_int8=int8,
                bytes_nf4=nf4,
                max_prompt=int(params["max_prompt"]),
                max_canvas=int(params["max_canvas"]),
                max_rows=int(params["max_rows"]),
            )
        )
    return out


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.1f}M"


def _size(b: float) -> str:
    if b >= 1e9:
        return f"{b / 1e9:.1f} GB"
    return f"{b / 1e6:.0f} MB"


def _cpu(row: ModelRow) -> str:
    # CPU runs float32 (`dtype: auto`), 4 bytes a parameter; bitsandbytes needs CUDA.
    if row.parameters < 1e8:
        return "yes (the CI model)"
    return f"runs, slowly: {_size(4.0 * row.parameters)} of RAM in float32"


def _hub(checkpoint: str) -> str:
    if "/" in checkpoint:
        return f"[`{checkpoint}`](https://huggingface.co/{checkpoint})"
    return "embedded (`dlm_engine/assets/`)"


def markdown(repository: Path = COMMITTED_REPOSITORY) -> str:
    lines = [
        "| `model` | Hub id | family | parameters | weights bf16 / fp8 / int8 / nf4 "
        "| max prompt / canvas tokens | rows a step | CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows(repository):
        lines.append(
            f"| `{r.name}` | {_hub(r.checkpoint)} | {r.family} | {_count(r.parameters)} | "
            f"{_size(r.bytes_bf16)} / {_size(r.bytes_fp8)} / {_size(r.bytes_int8)} / "
            f"{_size(r.bytes_nf4)} | "
            f"{r.max_prompt} / {r.max_canvas} | {r.max_rows} | {_cpu(r)} |"
        )
    return "\n".join(lines) + "\n"
