"""A block's residual add and norm compiled as one kernel, against the two apart, in bf16.

    python benchmarks/gpu_check_fused.py     # one line a shape; exits 1 on a mismatch

`RMSNorm.add_and_norm` (dlm_engine/models/common.py) compiles a block's residual add and the
norm after it into one kernel. The residual stream must not change: the sum it returns must
equal eager `x + y` bit for bit. The normalised output may differ in its last bit from the
compiled norm run apart (the fused kernel's reduction order and casts are the compiler's), as
the compiled norm already differs from the eager one: both differences are printed in bf16
units in the last place (ulp), and more than one ulp fails. The engine and its restated
reference loops run the same model code, so `gpu_check_algorithms.py` still checks exactness.
"""

from __future__ import annotations

import sys

import torch

from dlm_engine.models.common import FusedKernels, RMSNorm


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between two bf16 tensors in units in the last place."""
    ia, ib = (t.view(torch.int16).int() for t in (a, b))
    ia = torch.where(ia < 0, -32768 - ia, ia)  # sign-magnitude to an ordered integer line
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return int((ia - ib).abs().max())


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    FusedKernels.enabled = True
    torch.manual_seed(0)
    bad = 0
    for n in (1, 32, 64, 320, 2560):
        norm = RMSNorm(4096, 1e-5).cuda().to(torch.bfloat16)
        norm.weight.data = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, n, 4096, device="cuda", dtype=torch.bfloat16) * 3
        y = torch.randn(1, n, 4096, device="cuda", dtype=torch.bfloat16)
        fused_sum, fused_norm = norm.add_and_norm(x, y)
        apart_sum = x + y
        apart_norm = norm(apart_sum)
        FusedKernels.enabled = False
        eager_norm = norm(apart_sum)
        FusedKernels.enabled = True
        same_sum = torch.equal(fused_sum, apart_sum)
        fused_ulp, compiled_ulp = ulps(fused_norm, apart_norm), ulps(apart_norm, eager_norm)
        ok = same_sum and fused_ulp <= 1
        bad += not ok
        print(
            f"tokens {n:>5}: sum {'equal' if same_sum else 'DIFFERENT'}; norm vs compiled norm"
            f" apart: max {fused_ulp} ulp ({(fused_norm != apart_norm).float().mean():.2%} of"
            f" values differ); compiled vs eager norm: max {compiled_ulp} ulp"
        )
    print("sums equal, norms within one ulp" if not bad else "MISMATCH")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
