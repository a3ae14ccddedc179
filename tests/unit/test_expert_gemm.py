"""The `expert_gemm` setting: the experts' grouped products through a compile tuned once per
weight shape, with the row count dynamic so a new batch size never compiles again (on a GPU a
compile inside a CUDA graph capture is not possible), and the CPU path untouched."""

from __future__ import annotations

import itertools

import pytest
import torch

from dlm_engine.config import EngineConfig
from dlm_engine.models import expert_gemm, moe
from dlm_engine.models.expert_gemm import (
    MAX_ROWS_PER_EXPERT,
    MIN_ROWS,
    ExpertGemm,
    grouped_mm,
    takes_triton,
)


@pytest.fixture
def fresh_expert_gemm():
    saved = (ExpertGemm.mode, ExpertGemm.failed, dict(ExpertGemm.compiled))
    ExpertGemm.compiled = {}
    yield
    ExpertGemm.mode, ExpertGemm.failed, ExpertGemm.compiled = saved


def _offsets(rows: int, experts: int) -> torch.Tensor:
    """Cumulative counts of `rows` rows over `experts` groups, one group left empty."""
    counts = torch.full((experts,), rows // (experts - 1), dtype=torch.int32)
    counts[1] = 0
    counts[-1] += rows - int(counts.sum())
    return counts.cumsum(0, dtype=torch.int32)


def test_one_compile_per_weight_shape_serves_every_row_count(fresh_expert_gemm):
    torch.manual_seed(0)
    experts, k, n = 4, 32, 48
    published = torch.randn(experts, n, k, dtype=torch.bfloat16)  # [E, out, in]
    w = published.transpose(-2, -1)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for rows in (16, 40, 64, 100, 128):  # 4..32 rows an expert
        assert takes_triton(rows, experts)
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        offs = _offsets(rows, experts)
        compiled = ExpertGemm._compiled_for(x, w)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        got = compiled(x, w, offs)
        assert torch.equal(got, torch._grouped_mm(x, w, offs=offs))
    assert len(ExpertGemm.compiled) == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    down = torch.randn(experts, k, n, dtype=torch.bfloat16).transpose(-2, -1)  # another shape
    ExpertGemm._compiled_for(torch.randn(16, n, dtype=torch.bfloat16), down)
    assert len(ExpertGemm.compiled) == 2


def test_callers_in_any_mode_and_layout_share_one_compile(fresh_expert_gemm, monkeypatch):
    """The model's no-grad code and the CUDA graphs' inference-mode code, contiguous rows or
    not, all reach the one compiled product: a second compile under traffic would stall a
    step, and the compiler's recompile limit would silently turn the kernel off."""
    monkeypatch.setattr(expert_gemm, "_tunable", lambda x: x.dtype == torch.bfloat16)
    ExpertGemm.set_mode("triton")
    torch.manual_seed(2)
    experts, k, n = 4, 32, 48
    published = torch.nn.Parameter(torch.randn(experts, n, k, dtype=torch.bfloat16), False)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    modes = (torch.no_grad, torch.inference_mode)
    for caller, maker, contiguous, rows in itertools.product(modes, modes, (True, False), (64, 40)):
        with maker():  # where the inputs were made
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            x = x if contiguous else torch.randn(k, rows, dtype=torch.bfloat16).t()
            offs = _offsets(rows, experts)
        with caller():
            w = published.transpose(-2, -1)
            got = grouped_mm(x, w, offs)
            assert torch.equal(got * 1, torch._grouped_mm(x, w, offs=offs))  # usable here
    assert not ExpertGemm.failed
    assert len(ExpertGemm.compiled) == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1


def test_tiny_and_wide_products_stay_with_aten():
    assert not takes_triton(MIN_ROWS - 1, 4)
    assert takes_triton(MIN_ROWS, 4)
    assert takes_triton(4 * MAX_ROWS_PER_EXPERT, 4)
    assert not takes_triton(4 * MAX_ROWS_PER_EXPERT + 1, 4)


def test_cpu_rows_take_the_aten_product_whatever_the_setting(fresh_expert_gemm):
    torch.manual_seed(1)
    ExpertGemm.set_mode("triton")
    x = torch.randn(12, 16, dtype=torch.bfloat16)
    w = torch.randn(3, 16, 8, dtype=torch.bfloat16)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    assert torch.equal(grouped_mm(x, w, offs), torch._grouped_mm(x, w, offs=offs))
    assert ExpertGemm.compiled == {} and not ExpertGemm.failed
    chosen = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]])
    weights = torch.rand(4, 2)
    tokens = torch.randn(4, 16, dtype=torch.bfloat16)
    up = torch.randn(3, 16, 2 * 8, dtype=torch.bfloat16)
    down = torch.randn(3, 8, 16, dtype=torch.bfloat16)
    with_triton = moe.run_experts(tokens, chosen, weights, up, down)
    ExpertGemm.set_mode("aten")
    assert torch.equal(with_triton, moe.run_experts(tokens, chosen, weights, up, down))


def test_an_unknown_kernel_is_refused_naming_the_setting(fresh_expert_gemm):
    with pytest.raises(ValueError, match="expert_gemm"):
        ExpertGemm.set_mode("cublas")
    with pytest.raises(ValueError, match="expert_gemm"):
        EngineConfig(model="tiny-dlm", expert_gemm="cublas")
    assert EngineConfig(model="tiny-dlm", expert_gemm="triton").expert_gemm == "triton"
