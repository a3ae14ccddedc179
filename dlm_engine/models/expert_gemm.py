"""Which kernel runs the MoE experts' grouped GEMMs on a CUDA device (the `expert_gemm` setting).

- `aten`: `torch._grouped_mm`, PyTorch's CUTLASS grouped kernel, as called.
- `triton`: the same product compiled by `torch.compile` in max-autotune mode, which times
  inductor's Triton grouped-GEMM templates against the aten kernel and keeps the fastest.

A batch-1 step of a MoE diffusion model routes a whole canvas or block through the experts, so
each expert sees a handful of rows and the product is a read of every expert's weights; there
the Triton templates come closer to the read floor than the CUTLASS kernel
(`benchmarks/gpu_check_grouped_mm.py`, docs/benchmarks.md).

Each weight shape is compiled and tuned once, when first run (the model's warm-up, before any
CUDA graph capture), at one size (`TUNE_ROWS_PER_EXPERT`: a 256-token canvas's rows) with the
row count dynamic, so later batch sizes reuse the kernel without compiling again. It gains most
at that size (DiffusionGemma at batch 1) and little or nothing at one row an expert (a 32-token
block at batch 1), so `aten` stays the default (docs/tuning.md). Products of more than
`MAX_ROWS_PER_EXPERT` rows an expert, where the kernels compute rather than read, stay with
aten. A product first met inside a graph capture, or one that fails to compile, runs through
aten; a failure turns the Triton path off for good and is reported like the fused kernels'
fallbacks.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch

from .common import FusedKernels

log = logging.getLogger(__name__)

MODES = ("aten", "triton")


def _product(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=offs)


# the memory-bound regime the Triton path is for: at most this many rows an expert on average
# (a batch-1 canvas, a few blocks); wider products, where the kernels compute more than they
# read, stay with aten
MAX_ROWS_PER_EXPERT = 32
TUNE_ROWS_PER_EXPERT = 16  # the row count a weight shape is tuned at (a 256-token canvas)
MIN_ROWS = 16  # fewer rows than this stay with aten (sizes 0 and 1 would compile anew)


def takes_triton(rows: int, experts: int) -> bool:
    """Whether a product of `rows` rows over `experts` experts is in that regime."""
    return MIN_ROWS <= rows <= MAX_ROWS_PER_EXPERT * experts


class ExpertGemm:
    """The process's choice (set by the engine, and each worker rank, from `expert_gemm`) and the
    compiled products, one per weight shape and layout."""

    mode = "aten"
    failed = False
    compiled: dict[tuple, Callable] = {}

    @classmethod
    def set_mode(cls, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"expert_gemm must be one of {MODES}, not {mode!r}")
        cls.mode = mode

    @classmethod
    def _compiled_for(cls, x: torch.Tensor, w: torch.Tensor) -> Callable | None:
        """The compiled product for w's shape and layout, compiled and tuned now (at
        `TUNE_ROWS_PER_EXPERT` rows an expert, the row count left dynamic) if it is new; None
        inside a CUDA graph capture, where nothing can compile."""
        key = (tuple(w.shape), w.stride(), x.dtype, w.dtype, x.device)
        fn = cls.compiled.get(key)
        if fn is None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            # a code object of its own per shape: the compiler counts recompiles per code
            # object, so shapes sharing one would evict each other (see FusedKernels)
            code = types.FunctionType(_product.__code__.replace(), _product.__globals__)
            fn = torch.compile(code, mode="max-autotune-no-cudagraphs", dynamic=False)
            experts = w.shape[0]
            probe = x.new_zeros(TUNE_ROWS_PER_EXPERT * experts, x.shape[1])
            offs = torch.arange(1, experts + 1, device=x.device, dtype=torch.int32)
            torch._dynamo.maybe_mark_dynamic(probe, 0)
            fn(probe, w, offs * TUNE_ROWS_PER_EXPERT)
            cls.compiled[key] = fn
        return fn


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """t as an inference tensor laid out contiguously (a copy only where it is not): the
    compiled product's guards check how inputs were made and laid out, so inputs from
    no-grad code and from inference-mode code would each compile it anew."""
    if t.is_inference() and t.is_contiguous():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _tunable(x: torch.Tensor) -> bool:
    """Rows the Triton path is for: bf16 (the compiled op takes no other) on a CUDA device."""
    return x.is_cuda and x.dtype == torch.bfloat16


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of x [M, in] sorted by expert times w [E, in, out] (`offs`: cumulative row counts
    [E], int32) through the chosen kernel."""
    if ExpertGemm.mode == "triton" and _tunable(x) and takes_triton(x.shape[0], w.shape[0]):
        try:
            with torch.inference_mode():  # one way in, whatever the caller's mode
                fn = ExpertGemm._compiled_for(x, w) if not ExpertGemm.failed else None
                if fn is not None:
                    x, offs = _canonical(x), _canonical(offs)
                    torch._dynamo.maybe_mark_dynamic(x, 0)
                    return fn(x, w, offs)
        except Exception as exc:  # compiler missing or unsupported: stay correct
            log.warning("expert_gemm triton disabled, using aten: %s", exc)
            ExpertGemm.failed = True
            FusedKernels.fallbacks.append("expert_gemm_triton")
    return torch._grouped_mm(x, w, offs=offs)
