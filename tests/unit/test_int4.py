"""int4 weights: quantized at load (`--quantization int4`) or read from GPTQ/AWQ checkpoints in
their published layouts as stored.

On this CPU the layers dequantize once and multiply densely (the GPU runs the Triton kernels,
checked against the same dequantized weights by benchmarks/gpu_check_int4.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dlm_engine import Engine, EngineConfig
from dlm_engine.gptq_checkpoint import _awq_columns
from dlm_engine.int4 import Int4Linear, pack_rows, quantize_groups, quantize_int4, unpack_rows
from dlm_engine.loader import load_checkpoint
from dlm_engine.models.common import ForwardBatch
from dlm_engine.quantization import weight_bytes
from dlm_lab.int4_pack import _word, write_int4_checkpoint
from dlm_lab.testing import make_tiny_checkpoint


@torch.no_grad()
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_packed_words_follow_the_published_bit_order() -> None:
    # GPTQ: input 8i + j of a column in bits 4j..4j+3 of word i
    word = _word([torch.tensor(j) for j in range(8)])
    assert int(word) == 0x76543210
    assert unpack_rows(word.view(1, 1)).view(-1).tolist() == list(range(8))
    # the top nibble set makes the int32 negative: still unpacked as 15
    assert unpack_rows(torch.tensor([[-(2**31) + 0x0FFFFFFF]], dtype=torch.int32))[7, 0] == 8
    # AWQ: nibble j holds column (0, 2, 4, 6, 1, 3, 5, 7)[j]
    assert _awq_columns(word.view(1, 1)).view(-1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_pack_rows_round_trips() -> None:
    q = torch.randint(0, 16, (64, 24), dtype=torch.uint8)
    assert torch.equal(unpack_rows(pack_rows(q)), q)


def test_int4_layer_rounds_each_group_to_nearest() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 48, bias=True)
    layer = Int4Linear.from_linear(linear)
    assert layer.qweight.dtype == torch.int32 and layer.qweight.shape == (32, 48)
    assert layer.scales.shape == layer.zeros.shape == (2, 48) and layer.group_size == 128
    w = linear.weight.detach()
    deq = layer.dequantized()
    step = layer.scales.float().t().repeat_interleave(128, 1)  # [N, K]
    err = (deq - w).abs()
    # round to nearest on each group's grid: half a step inside it, at most one at its ends
    # (the zero point is an integer, so the grid may sit up to half a step off the range)
    assert bool((err <= step + 1e-6).all()) and float((err / step).mean()) < 0.3
    x = torch.randn(3, 5, 256)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, deq, linear.bias))
    assert 0 < _rel(layer(x), linear(x)) < 0.15  # 4 bits: a few percent, never zero


def test_zero_stays_exactly_zero_and_small_inputs_use_one_group() -> None:
    w = torch.randn(8, 96)
    w[:, :10] = 0
    q, scales, zeros = quantize_groups(w, 96)
    deq = (q.float() - zeros.float()) * scales.float()
    assert bool((deq[:, :10] == 0).all())
    layer = Int4Linear.from_linear(nn.Linear(96, 8, bias=False))  # 96 inputs: one group
    assert layer.group_size == 96


def test_layers_whose_inputs_do_not_pack_stay_dense() -> None:
    model = nn.Sequential(nn.Linear(12, 16), nn.Linear(16, 8), nn.Linear(8, 4))
    assert quantize_int4(model, head=model[2]) == 1
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], Int4Linear)
    assert isinstance(model[2], nn.Linear)  # the head


def test_fused_int4_layers_compute_the_separate_layers() -> None:
    torch.manual_seed(1)
    layers = [Int4Linear.from_linear(nn.Linear(128, n, bias=False)) for n in (32, 16, 16)]
    fused = Int4Linear.concat(layers)
    x = torch.randn(4, 128)
    torch.testing.assert_close(fused(x), torch.cat([layer(x) for layer in layers], -1))


@torch.no_grad()
def _logits(lm, n: int = 24) -> torch.Tensor:
    ids = torch.full((1, n), lm.mask_id)
    ids[0, :8] = torch.arange(3, 11)
    return lm.model(ForwardBatch(ids, torch.arange(n)[None], None, None))


def _tiny(tmp_path: Path, seed: int) -> Path:
    # 128-wide so the blocks' inputs make whole groups of 128
    return make_tiny_checkpoint(tmp_path / "src", "llada", seed=seed, d_model=128)


def test_quantized_at_load_runs_every_block_in_int4(tmp_path: Path) -> None:
    ckpt = _tiny(tmp_path, 3)
    full = load_checkpoint(ckpt)
    int4 = load_checkpoint(ckpt, quantization="int4")
    n_int4 = sum(isinstance(m, Int4Linear) for m in int4.model.modules())
    n_linear = sum(isinstance(m, nn.Linear) for m in int4.model.modules())
    assert n_int4 == 2 * 4 and n_linear == 1  # qkv, attn_out, gate_up, ff_out; the head stays
    assert weight_bytes(int4.model) < weight_bytes(full.model)
    err = _rel(_logits(int4), _logits(full))
    # the tiny checkpoints' attention is sharpened on purpose, which amplifies rounding
    assert 0 < err < 0.5, err
    engine = Engine(EngineConfig(model=str(ckpt), quantization="int4", max_rows=4))
    out = engine.generate([[3, 4, 5, 6]], {"max_tokens": 8, "steps": 8})[0]
    assert out.finished and out.token_ids


LAYOUTS = {
    "gptq": dict(method="gptq", sym=True, desc_act=False, checkpoint_format="gptq"),
    "gptq-act-order": dict(method="gptq", group=64, sym=True, desc_act=True),
    "gptq-v2-asym": dict(method="gptq", sym=False, desc_act=False, checkpoint_format="gptq_v2"),
    "awq": dict(method="awq", sym=False),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_published_int4_checkpoint_loads_as_stored(tmp_path: Path, layout: str) -> None:
    src = _tiny(tmp_path, 4)
    ref_dir = tmp_path / "dequantized"
    reference = write_int4_checkpoint(
        src, tmp_path / "int4", dequantized_dir=ref_dir, **LAYOUTS[layout]
    )
    stored = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]
    assert stored["quant_method"] == LAYOUTS[layout]["method"] and stored["bits"] == 4
    lm = load_checkpoint(tmp_path / "int4")
    dense = load_checkpoint(ref_dir)  # the same weights, dequantized by the writer
    layers = {n: m for n, m in lm.model.named_modules() if isinstance(m, Int4Linear)}
    assert sum(m.in_features * m.out_features for m in layers.values()) == sum(
        w.numel() for w in reference.values()
    )  # every stored layer kept in int4, none left dense
    if LAYOUTS[layout].get("desc_act"):
        assert all(m.perm is not None for m in layers.values())
    for name, layer in layers.items():  # fused as the dense model fuses: the same names
        torch.testing.assert_close(
            layer.dequantized(), dense.model.get_submodule(name).weight, rtol=0, atol=1e-6
        )
    torch.testing.assert_close(_logits(lm), _logits(dense), rtol=1e-4, atol=1e-4)
    # greedy decoding agrees token for token
    params = {"max_tokens": 12, "steps": 12, "temperature": 0.0}
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    got = Engine(EngineConfig(model=str(tmp_path / "int4"), max_rows=4)).generate(prompts, params)
    want = Engine(EngineConfig(model=str(ref_dir), max_rows=4)).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_bfloat16_forward_matches_the_dequantized_bfloat16_forward(tmp_path: Path) -> None:
    src = _tiny(tmp_path, 5)
    write_int4_checkpoint(src, tmp_path / "int4", dequantized_dir=tmp_path / "dequantized")
    lm = load_checkpoint(tmp_path / "int4", dtype="bfloat16")
    dense = load_checkpoint(tmp_path / "dequantized", dtype="bfloat16")
    assert _rel(_logits(lm), _logits(dense)) < 0.02


def test_4bit_checkpoints_refuse_what_they_cannot_compute(tmp_path: Path) -> None:
    src = _tiny(tmp_path, 6)
    write_int4_checkpoint(src, tmp_path / "int4")
    with pytest.raises(ValueError, match="quantization=fp8"):
        load_checkpoint(tmp_path / "int4", quantization="fp8")
    config_file = tmp_path / "int4" / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"]["bits"] = 8
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="bits 8"):
        load_checkpoint(tmp_path / "int4")
    config["quantization_config"].update(bits=4, checkpoint_format="marlin")
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="checkpoint_format 'marlin'"):
        load_checkpoint(tmp_path / "int4")


def test_moe_checkpoint_keeps_attention_in_int4_and_dequantizes_routed_experts(
    tmp_path: Path,
) -> None:
    src = make_tiny_checkpoint(tmp_path / "src", "llada2", seed=7)
    ref_dir = tmp_path / "dequantized"
    write_int4_checkpoint(src, tmp_path / "int4", group=32, dequantized_dir=ref_dir)
    lm = load_checkpoint(tmp_path / "int4")
    names = [n for n, m in lm.model.named_modules() if isinstance(m, Int4Linear)]
    assert any("attention" in n for n in names) and any("shared_experts" in n for n in names)
    assert not any(".experts." in n for n in names)  # stacked for the grouped GEMMs instead
    torch.testing.assert_close(_logits(lm), _logits(load_checkpoint(ref_dir)), rtol=1e-4, atol=1e-4)


def test_tensor_parallel_refuses_4bit_checkpoints_by_name(tmp_path: Path) -> None:
    from dlm_engine.models import LLADA
    from dlm_engine.parallel.start import check_supported

    src = _tiny(tmp_path, 8)
    write_int4_checkpoint(src, tmp_path / "int4")
    raw = json.loads((tmp_path / "int4" / "config.json").read_text())
    config = EngineConfig(model=str(tmp_path / "int4"), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="GPTQ/AWQ checkpoints are not supported"):
        check_supported(config, raw, LLADA)
