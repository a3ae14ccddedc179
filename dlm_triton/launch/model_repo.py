"""One template for every Triton model folder: the committed ``model_repository/`` and the
runtime repositories the launcher writes for ``--model DIR``.

``python -m dlm_triton.launch.model_repo`` regenerates ``model_repository/``; ``--check`` exits
1 when the committed files differ (a test runs it), so no folder is edited by hand.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from dlm_protocol import settings, tensors

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMITTED_REPOSITORY = REPO_ROOT / "model_repository"
CPU_CONFIG_NAME = "config_cpu"


def _dims(spec: tensors.TensorSpec) -> str:
    return "[ " + ", ".join(str(d) for d in spec.dims) + " ]"


SHIM = '''"""Triton Python backend entry point; the adapter lives in dlm_triton.backend.triton_model."""

from dlm_triton.backend.triton_model import TritonPythonModel  # noqa: F401
'''

# (name, type, dims) from the request contract (dlm_protocol.tensors).
INPUTS = [(t.name, t.config_type, _dims(t)) for t in tensors.INPUTS]
OUTPUTS = [(t.name, t.config_type, _dims(t)) for t in tensors.OUTPUTS]


class ModelSpec:
    """What differs between served models: the checkpoint and any server setting
    (``dlm_protocol.settings``, by config parameter name) that is not the default."""

    def __init__(self, name: str, checkpoint: str, **values: Any) -> None:
        unknown = sorted(set(values) - set(settings.BY_PARAM) | {"checkpoint"} & set(values))
        if unknown:
            raise ValueError(f"model {name}: no server setting named {', '.join(unknown)}")
        for param, value in values.items():  # a bad value fails here, not at the model's load
            setting = settings.BY_PARAM[param]
            if isinstance(value, str):
                setting.parse(value)
            else:
                setting.check(value)
        self.name, self.checkpoint, self.values = name, checkpoint, values

    def value(self, param: str) -> Any:
        """A setting's value in this model's config: given, else the registry's default."""
        return self.values.get(param, settings.BY_PARAM[param].default)

    def parameters(self, device: str) -> dict[str, str]:
        """The ``config.pbtxt`` parameters (see ``dlm_protocol.settings.config_parameters``)."""
        return settings.config_parameters(device, {"checkpoint": self.checkpoint, **self.values})


# The committed repository. Hub ids are resolved by the engine's loader (local HF cache);
# "tiny-dlm" and "tiny-sdar" (block diffusion) are embedded in dlm_engine/assets/.
MODELS = [
    ModelSpec("tiny-dlm", "tiny-dlm", max_rows=16, max_canvas=512, max_prompt=1024),
    ModelSpec("tiny-sdar", "tiny-sdar", max_rows=16, max_canvas=512, max_prompt=1024),
    ModelSpec("llada-8b-instruct", "GSAI-ML/LLaDA-8B-Instruct", dtype="bfloat16"),
    ModelSpec("llada-1.5", "GSAI-ML/LLaDA-1.5", dtype="bfloat16"),
    ModelSpec("dream-v0-instruct-7b", "Dream-org/Dream-v0-Instruct-7B", dtype="bfloat16"),
    # d3LLM: LLaDA / Dream layouts; multi-block decoding is their default
    ModelSpec("d3llm-llada", "d3LLM/d3LLM_LLaDA", dtype="bfloat16"),
    ModelSpec("d3llm-dream", "d3LLM/d3LLM_Dream", dtype="bfloat16"),
    # block diffusion: exact KV cache of finished blocks, steps counted per block
    ModelSpec("llada2-mini", "inclusionAI/LLaDA2.0-mini", dtype="bfloat16"),
    ModelSpec("llada2.1-mini", "inclusionAI/LLaDA2.1-mini", dtype="bfloat16"),
    # LLaDA2 flash: the mini's layout at ~100B parameters (206 GB bf16): 4 GPUs, experts
    # spread whole over them
    ModelSpec(
        "llada2-flash",
        "inclusionAI/LLaDA2.0-flash",
        dtype="bfloat16",
        tensor_parallel_size=4,
        expert_parallel=True,
    ),
    ModelSpec(
        "llada2.1-flash",
        "inclusionAI/LLaDA2.1-flash",
        dtype="bfloat16",
        tensor_parallel_size=4,
        expert_parallel=True,
    ),
    ModelSpec("sdar-4b-chat", "JetLM/SDAR-4B-Chat", dtype="bfloat16", max_rows=64),
    ModelSpec("sdar-8b-chat", "JetLM/SDAR-8B-Chat", dtype="bfloat16", max_rows=64),
    # SDAR-30B-A3B: SDAR's blocks on Qwen3-MoE (61 GB bf16: one 80 GB GPU)
    ModelSpec("sdar-30b-a3b-chat", "JetLM/SDAR-30B-A3B-Chat", dtype="bfloat16", max_rows=32),
    # Fast-dLLM v2: Qwen2.5-7B as block diffusion (blocks of 32, sub-blocks of 8)
    ModelSpec(
        "fast-dllm-v2-7b", "Efficient-Large-Model/Fast_dLLM_v2_7B", dtype="bfloat16", max_rows=64
    ),
    # DiffusionGemma: uniform-state diffusion over 256-token canvases (text only)
    ModelSpec(
        "diffusiongemma-26b-a4b-it",
        "google/diffusiongemma-26B-A4B-it",
        dtype="bfloat16",
        max_rows=16,
    ),
]


def sanitize_name(text: str) -> str:
    """A Triton-safe model name from a directory name (``My Ckpt`` -> ``my-ckpt``)."""
    name = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")
    return name or "model"


def render_config(spec: ModelSpec, kind: str) -> str:
    """``config.pbtxt`` text; ``kind`` is ``KIND_GPU`` (one engine per GPU) or ``KIND_CPU``."""
    device = "cuda" if kind == "KIND_GPU" else "cpu"
    lines = [
        "# Generated by `python -m dlm_triton.launch.model_repo` from dlm_triton/launch/model_repo.py: do not edit.",
        f'name: "{spec.name}"',
        'backend: "python"',
        # tensors carry a leading batch dimension of 1; no dynamic batching: each request
        # gets an execute() of its own, so that with several instances (one per GPU) the load
        # board (dlm_triton/instance_load.py) steers every request of a burst, where a
        # dynamic batcher hands a queued burst to one instance whole. The engine gathers a
        # burst into one step itself (EngineConfig.admission_window_ms).
        f"max_batch_size: {int(spec.value('max_rows'))}",
        "model_transaction_policy { decoupled: true }",
        "",
        "input [",
    ]
    lines += _tensor_block(INPUTS, optional=True)
    lines += ["]", "output ["]
    lines += _tensor_block(OUTPUTS, optional=False)
    lines += ["]", "", f"instance_group [ {{ count: 1, kind: {kind} }} ]", ""]
    for key, value in spec.parameters(device).items():
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    return "\n".join(lines) + "\n"


_INSTANCE_GROUP = re.compile(r"^instance_group \[.*\]$", re.MULTILINE)


def instance_gpus(
    visible: int, tensor_parallel: int, data_parallel: int | None = None
) -> list[int]:
    """The first GPU of each instance: `data_parallel` groups (default: as many as fit) of
    `tensor_parallel` consecutive GPUs, the group's engine on its first GPU (rank 0)."""
    if tensor_parallel < 1 or visible < tensor_parallel:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel} needs {tensor_parallel} GPUs; "
            f"{visible} visible"
        )
    fit = visible // tensor_parallel
    groups = fit if data_parallel is None else data_parallel
    if not 1 <= groups <= fit:
        raise ValueError(
            f"data_parallel_size {data_parallel} x tensor_parallel_size {tensor_parallel} "
            f"needs {groups * tensor_parallel} GPUs; {visible} visible"
        )
    return [g * tensor_parallel for g in range(groups)]


def place_instances(
    config_text: str, model: str, gpus: list[int] | None = None, count: int = 1
) -> str:
    """`config_text` with one KIND_GPU instance on each GPU of `gpus` (Triton hands each its
    GPU as its device; a tensor-parallel engine takes the next ones too), or, without `gpus`,
    `count` KIND_CPU instances. Each GPU gets a group of its own: Triton names an instance by
    its group and its index in it, so one group over several GPUs would name every replica
    `<model>_0_0`, and their metrics (labelled by instance) would merge."""
    if gpus is not None:
        groups = ", ".join(f"{{ count: 1, kind: KIND_GPU, gpus: [ {g} ] }}" for g in gpus)
        line, kind = f"instance_group [ {groups} ]", "GPU"
    else:
        line, kind = f"instance_group [ {{ count: {count}, kind: KIND_CPU }} ]", "CPU"
    found = _INSTANCE_GROUP.findall(config_text)
    if len(found) != 1 or f"KIND_{kind}" not in found[0] or found[0].count("{") != 1:
        raise ValueError(
            f"{model}: its config has an instance_group of its own; place the instances there "
            "instead of with data_parallel_size / tensor_parallel_size"
        )
    return _INSTANCE_GROUP.sub(line, config_text)


_PARAMETER = re.compile(r'parameters \{ key: "([^"]+)" value: \{ string_value: "([^"]*)" \} \}')


def read_parameters(config: Path) -> dict[str, str]:
    """The ``parameters`` of a ``config.pbtxt`` written by :func:`render_config`."""
    return dict(_PARAMETER.findall(config.read_text()))


def _tensor_block(tensors: list[tuple[str, str, str]], optional: bool) -> list[str]:
    out = []
    for i, (name, dtype, dims) in enumerate(tensors):
        opt = " optional: true" if optional else ""
        comma = "," if i < len(tensors) - 1 else ""
        out.append(f'  {{ name: "{name}" data_type: {dtype} dims: {dims}{opt} }}{comma}')
    return out


def model_files(spec: ModelSpec) -> dict[str, str]:
    """Relative path -> content for one model folder."""
    return {
        "config.pbtxt": render_config(spec, "KIND_GPU"),
        f"configs/{CPU_CONFIG_NAME}.pbtxt": render_config(spec, "KIND_CPU"),
        "1/model.py": SHIM,
    }


def write_model(repository: Path, spec: ModelSpec) -> Path:
    """Write (or overwrite) one model folder; returns it."""
    folder = repository / spec.name
    for rel, text in model_files(spec).items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def diff_repository(repository: Path = COMMITTED_REPOSITORY) -> list[str]:
    """Paths whose committed content differs from the template (missing counts)."""
    bad = []
    for spec in MODELS:
        for rel, text in model_files(spec).items():
            path = repository / spec.name / rel
            if not path.exists() or path.read_text() != text:
                bad.append(str(path))
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repository", type=Path, default=COMMITTED_REPOSITORY)
    parser.add_argument("--check", action="store_true", help="exit 1 if files differ")
    args = parser.parse_args(argv)
    if args.check:
        bad = diff_repository(args.repository)
        for path in bad:
            print(f"out of date: {path}", file=sys.stderr)
        return 1 if bad else 0
    for spec in MODELS:
        print(write_model(args.repository, spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
