"""DiffusionGemma's speed paths against the plain ones they replace: grouped-GEMM experts vs
transformers' per-expert loop, the cache with room for the canvas vs concatenation, and the
small self-conditioning state a row keeps between steps."""

from __future__ import annotations

import copy

import pytest
import torch

from dlm_engine.decoding.uniform_diffusion import UniformSettings, make_rows, step_rows
from dlm_engine.models.diffusion_gemma import (
    DiffusionGemmaArch,
    DiffusionGemmaModel,
    GemmaExperts,
    RowCache,
)
from dlm_engine.presets import PRESETS


def _arch(**text) -> DiffusionGemmaArch:
    cfg = copy.deepcopy(PRESETS["diffusiongemma-26b-a4b"])
    cfg["canvas_length"] = 8
    cfg["text_config"].update(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1,
        sliding_window=6,
        num_experts=16,
        top_k_experts=4,
        moe_intermediate_size=24,
        **text,
    )
    return DiffusionGemmaArch.from_config(cfg)


def _experts(dtype: torch.dtype) -> GemmaExperts:
    torch.manual_seed(0)
    e = GemmaExperts(_arch())
    with torch.no_grad():
        e.gate_up_proj.normal_()
        e.down_proj.normal_()
    return e.to(dtype)


def _routing(n: int, experts: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.randn(n, experts).softmax(-1)
    weights, index = torch.topk(probs, k, dim=-1)
    return weights, index


@pytest.mark.parametrize("n", [1, 7, 300])
def test_grouped_experts_equal_the_loop_to_the_bit_in_float32(n):
    e = _experts(torch.float32)
    x = torch.randn(n, 32)
    weights, index = _routing(n, 16, 4)
    assert torch.equal(e(x, index, weights), e.loop(x, index, weights))


def test_grouped_experts_with_unused_experts_and_bf16():
    e = _experts(torch.bfloat16)
    x = torch.randn(50, 32, dtype=torch.bfloat16)
    weights, index = _routing(50, 4, 4)  # only experts 0-3 of 16 chosen
    got, want = e(x, index, weights).float(), e.loop(x, index, weights).float()
    # bf16: the loop rounds after each expert's addition, the grouped sum once
    assert torch.allclose(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())


def test_cache_room_gives_what_concatenation_gives():
    cache = RowCache(1, room=4)
    k, v = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    cache.store(0, k, v)
    for length in (4, 3, 6):  # fits, fits shorter, does not fit (concatenated)
        ck, cv = torch.randn(2, length, 8), torch.randn(2, length, 8)
        kk, vv = cache.with_canvas(0, ck, cv)
        assert torch.equal(kk, torch.cat([k, ck], 1)) and torch.equal(vv, torch.cat([v, cv], 1))
        assert torch.equal(cache.keys[0], k) and torch.equal(cache.values[0], v)


def test_rows_keep_soft_embeddings_not_vocabulary_sized_logits():
    torch.manual_seed(0)
    model = DiffusionGemmaModel(_arch()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    settings = UniformSettings(
        steps=3,
        t_min=0.4,
        t_max=0.8,
        entropy_bound=0.1,
        stability_threshold=1,
        stop_entropy=0.005,
        canvases=2,
    )
    rows = make_rows(model, [[5, 6, 7], [9, 10]], [settings] * 2, [1, 2], [])
    step_rows(model, rows)
    for row in rows:
        assert row.soft is not None and row.soft.shape == (1, 8, 32)  # [1, L, H]
        assert row.last_logits is None and row.model_logits is None


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_attention_equals_sdpa(masked, monkeypatch):
    """The GPU's attention for wide heads and masked encoder spans, run here in float32 in
    small query chunks, against SDPA with repeated key heads."""
    import torch.nn.functional as F

    from dlm_engine.models import diffusion_gemma

    monkeypatch.setattr(diffusion_gemma, "_SCORES_PER_CHUNK", 3 * 8 * 30)  # 3 queries a chunk
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 10, 16), torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    mask = None
    if masked:
        pos, kpos = torch.arange(20, 30), torch.arange(30)
        mask = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - 6)
    got = diffusion_gemma._grouped_attention(q, k, v, mask)
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask, scale=1.0
    )
    assert torch.allclose(got, want, atol=1e-5)
