"""DiffusionGemma's per-head query/key norm and rotary as one function (`_norm_rope`): in eager
(CPU, the exactness path) it is the separate norm and rotary bit for bit; compiled (as on the
GPU) it stays compiled across the layer kinds' shapes and agrees with eager to rounding, and
so does a whole model forward."""

from __future__ import annotations

import pytest
import torch

from dlm_engine.models import diffusion_gemma as dg
from dlm_engine.models.common import FusedKernels
from dlm_engine.models.diffusion_gemma import GemmaRMSNorm, _norm_rope, _rope

pytest.importorskip("transformers")


def _tables(b: int, t: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(b * t, dtype=torch.float32).view(b, t, 1) * torch.linspace(0, 1, d)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_equals_the_norm_then_the_rotary(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = GemmaRMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 3, 16).to(dtype)
    cos, sin = _tables(2, 5, 16, dtype)
    expected = _rope(norm(x), cos, sin)
    assert torch.equal(_norm_rope(x, norm.weight, norm.eps, cos, sin), expected)


def test_compiled_stays_compiled_over_layer_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FusedKernels, "enabled", True)
    monkeypatch.setattr(FusedKernels, "fallbacks", [])
    kernel = FusedKernels(_norm_rope)
    weight = torch.rand(8) + 0.5
    # batch 1 and 3, sliding and full layers' head counts, a canvas and a prompt span
    for b, t, heads in ((1, 16, 4), (3, 16, 4), (3, 16, 1), (1, 37, 4), (1, 37, 1)):
        x = torch.randn(b, t, heads, 8)
        cos, sin = _tables(b, t, 8, torch.float32)
        torch.testing.assert_close(
            kernel(x, weight, 1e-6, cos, sin), _norm_rope(x, weight, 1e-6, cos, sin)
        )
    assert not kernel.failed and FusedKernels.fallbacks == []


def test_model_forward_compiled_agrees(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dlm_engine.loader import load_checkpoint
    from dlm_lab.testing_diffusion_gemma import make_tiny_diffusion_gemma

    model = load_checkpoint(make_tiny_diffusion_gemma(tmp_path), dtype="float32").model
    canvas = torch.randint(3, model.vocab_size, (2, model.canvas_length))
    prompt = torch.randint(3, model.vocab_size, (9,))

    def logits() -> torch.Tensor:
        caches = [dg.RowCache(len(model.model.decoder.layers)) for _ in range(2)]
        model.encode([(prompt, caches[0]), (prompt[:5], caches[1])])
        return model.decode(canvas, [None, None], caches)

    eager = logits()
    monkeypatch.setattr(FusedKernels, "enabled", True)
    monkeypatch.setattr(FusedKernels, "fallbacks", [])
    torch.testing.assert_close(logits(), eager, rtol=1e-4, atol=1e-4)
    assert not dg.norm_rope_q.failed and not dg.norm_rope_k.failed
