"""FP8 weights: quantized at load or read from a published FP8 checkpoint as stored.

On this CPU the layers compute the FP8 scheme by dequantizing (tokens quantized per row as the
GPU path quantizes them); the GPU path's speed is measured by benchmarks/gpu_bench.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from dlm_engine import Engine, EngineConfig
from dlm_engine.fp8 import E4M3, Fp8Experts, Fp8Linear, quantize_rows
from dlm_engine.loader import load_checkpoint
from dlm_engine.models.common import ForwardBatch
from dlm_lab.testing import make_tiny_checkpoint, write_checkpoint


@torch.no_grad()
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fp8_linear_keeps_the_product_within_fp8_rounding() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    x = torch.randn(3, 5, 256)
    q = Fp8Linear.from_linear(linear)
    assert q.weight.dtype == E4M3 and q.weight_scale.shape == (96,)
    err = _rel(q(x), linear(x))
    assert 0 < err < 0.08, err  # e4m3 keeps 3 mantissa bits: a few percent, never zero


def test_fused_fp8_layers_compute_the_separate_layers() -> None:
    torch.manual_seed(1)
    layers = [Fp8Linear.from_linear(nn.Linear(64, n, bias=False)) for n in (32, 16, 16)]
    fused = Fp8Linear.concat(layers)
    x = torch.randn(4, 64)
    torch.testing.assert_close(fused(x), torch.cat([layer(x) for layer in layers], -1))


def test_fp8_experts_dequantize_to_the_stacked_weights() -> None:
    torch.manual_seed(2)
    w = torch.randn(4, 32, 48)  # [E, K, N], the grouped GEMM's layout
    experts = Fp8Experts.from_stacked(w)
    assert experts.shape == w.shape and experts.weight.dtype == E4M3
    assert _rel(experts.dense(torch.float32), w) < 0.05


@torch.no_grad()
def _logits(lm, n: int = 24) -> torch.Tensor:
    ids = torch.full((1, n), lm.mask_id)
    ids[0, :8] = torch.arange(3, 11)
    return lm.model(ForwardBatch(ids, torch.arange(n)[None], None, None))


@pytest.mark.parametrize("family", ["llada", "llada2"])
def test_quantized_at_load_runs_every_block_in_fp8(tmp_path: Path, family: str) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / family, family, seed=4)
    full = load_checkpoint(ckpt)
    fp8 = load_checkpoint(ckpt, quantization="fp8")
    n_fp8 = sum(isinstance(m, Fp8Linear | Fp8Experts) for m in fp8.model.modules())
    n_linear = sum(isinstance(m, nn.Linear) for m in fp8.model.modules())
    assert n_fp8 > 0 and n_linear <= 1  # only the output head stays (or none when tied)
    err = _rel(_logits(fp8), _logits(full))
    # the tiny checkpoints' attention is sharpened on purpose, which amplifies rounding:
    # bounded here, measured on the published architectures by benchmarks/gpu_bench.py
    assert 0 < err < 0.3, err
    engine = Engine(EngineConfig(model=str(ckpt), quantization="fp8", max_rows=4))
    out = engine.generate([[3, 4, 5, 6]], {"max_tokens": 8, "steps": 8})[0]
    assert out.finished and out.token_ids


_INDEX = "model.safetensors.index.json"


def _as_published_fp8(src: Path, dst: Path, strategy: str) -> dict[str, torch.Tensor]:
    """`src` rewritten as compressed-tensors FP8 (weights e4m3, `weight_scale` float32) the way
    llm-compressor publishes it; returns the stored e4m3 weights by name."""
    config = json.loads((src / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    stored: dict[str, torch.Tensor] = {}
    kept = ("wte", "embed", "lm_head", "norm", "gate.weight", "model.transformer.ff_out.weight")
    for name in list(state):
        w = state[name]
        if not name.endswith(".weight") or w.dim() != 2 or any(k in name for k in kept):
            continue
        if strategy == "tensor":
            scale = (w.abs().max() / 448.0).reshape(1)
            q = (w / scale).clamp(-448, 448).to(E4M3)
        else:
            q, s = quantize_rows(w)
            scale = s[:, None]
        state[name], state[name.removesuffix("weight") + "weight_scale"] = q, scale
        state[name.removesuffix("weight") + "input_scale"] = torch.ones(1)
        stored[name] = q
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }
    write_checkpoint(dst, config, state)
    for f in src.iterdir():  # tokenizer and generation config as they are
        if f.suffix != ".safetensors" and f.name not in ("config.json", _INDEX):
            (dst / f.name).write_bytes(f.read_bytes())
    return stored


@pytest.mark.parametrize("family", ["llada", "llada2"])
def test_published_fp8_checkpoint_loads_its_weights_as_stored(tmp_path: Path, family: str) -> None:
    src = make_tiny_checkpoint(tmp_path / "src", family, seed=5)
    stored = _as_published_fp8(src, tmp_path / "fp8", "channel")
    lm = load_checkpoint(tmp_path / "fp8")
    on_the_fly = load_checkpoint(src, quantization="fp8")
    loaded = {n: b for n, b in lm.model.named_buffers() if n.endswith("weight") and b.dtype == E4M3}
    assert loaded, "no layer kept in FP8"

    # every stored e4m3 value is in the model (fused layers concatenate them), none re-quantized
    def total(ts) -> tuple[int, int]:
        return sum(t.numel() for t in ts), sum(int(t.view(torch.uint8).sum()) for t in ts)

    assert total(loaded.values()) == total(stored.values())
    # the same weights and scales as quantizing the full checkpoint at load: the same logits
    torch.testing.assert_close(_logits(lm), _logits(on_the_fly))


def test_per_tensor_scales_load_as_per_channel(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path / "src", "llada", seed=6)
    _as_published_fp8(src, tmp_path / "fp8", "tensor")
    lm = load_checkpoint(tmp_path / "fp8")
    full = load_checkpoint(src)
    err = _rel(_logits(lm), _logits(full))
    assert 0 < err < 0.3, err


def test_unsupported_quantization_method_is_named(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path / "src", "llada", seed=7)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "bits": 4}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'hqq'"):
        load_checkpoint(src)


@torch.no_grad()
def test_diffusion_gemma_experts_in_fp8(tmp_path: Path) -> None:
    """DiffusionGemma's stacked experts (`F.linear` layout) become FP8 experts too, not only
    its linear layers: each layer's grouped experts then compute their dequantized weights'
    products (to the bit in float32 here, as the per-expert loop over them within rounding),
    and the engine serves the model quantized."""
    from dlm_engine.models.diffusion_gemma import GemmaExperts
    from dlm_lab.testing_diffusion_gemma import make_tiny_diffusion_gemma

    ckpt = make_tiny_diffusion_gemma(tmp_path / "dg")
    fp8 = load_checkpoint(ckpt, dtype="float32", quantization="fp8")
    experts = [m for m in fp8.model.modules() if isinstance(m, GemmaExperts)]
    assert experts and all(
        isinstance(m.gate_up_proj, Fp8Experts) and isinstance(m.down_proj, Fp8Experts)
        for m in experts
    )
    assert not any(isinstance(m, nn.Linear) for m in fp8.model.modules())  # head is tied
    full = load_checkpoint(ckpt, dtype="float32")
    ref = next(m for m in full.model.modules() if isinstance(m, GemmaExperts))
    q = experts[0]
    e = ref.gate_up_proj.shape[0]
    torch.manual_seed(3)
    x = torch.randn(10, ref.gate_up_proj.shape[-1])
    index = torch.stack([torch.randperm(e)[:2] for _ in range(10)])
    weights = torch.rand(10, 2)
    for name in ("gate_up_proj", "down_proj"):  # the reference over the dequantized weights
        deq = getattr(q, name).dense(torch.float32).transpose(-2, -1)
        assert _rel(deq, getattr(ref, name)) < 0.05  # e4m3 rounding of the stored weights
        getattr(ref, name).copy_(deq)
    assert torch.equal(q(x, index, weights), ref(x, index, weights))
    torch.testing.assert_close(q(x, index, weights), ref.loop(x, index, weights))
    engine = Engine(EngineConfig(model=str(ckpt), quantization="fp8", max_rows=2))
    out = engine.generate([[3, 4, 5, 6]], {"max_tokens": 8, "seed": 1})[0]
    assert out.finished and out.error is None and out.token_ids
