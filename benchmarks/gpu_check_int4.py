"""Is PyTorch's own int4 weight-only kernel a fast 4-bit path for diffusion steps?

    python benchmarks/gpu_check_int4.py

`torch._weight_int4pack_mm` (the "tinygemm" kernel in PyTorch core: int4 weights in groups of
128 with a bf16 scale and zero each, bf16 activations) against the bf16 product it would
replace, for LLaDA-8B-sized layers at the token counts a step feeds: 1-4 (an autoregressive
step, SDAR at batch 1), 32 (one block), 128, 320 (LLaDA's whole prompt + canvas). Prints the
error against the dequantized weights (bf16 rounding only when the packing is right) and the
time of each product captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from gpu_check_fp8 import timed  # a product captured in a CUDA graph, microseconds a replay

GROUP = 128


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of GROUP inputs, packed for the kernel: (packed weight,
    scales and zeros [K/GROUP, N, 2] bf16, the dequantized weight in float32)."""
    n, k = w.shape
    wg = w.float().view(n, k // GROUP, GROUP)
    hi, lo = wg.amax(-1), wg.amin(-1)
    scales = (hi - lo).clamp(min=1e-6) / 15
    zeros = lo + scales * 8  # the kernel computes (q - 8) * scale + zero
    q = ((wg - lo[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.int32)
    deq = ((q.float() - 8) * scales[..., None] + zeros[..., None]).view(n, k)
    q = q.view(n, k)
    packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    scales_zeros = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()
    return packed, scales_zeros.to(torch.bfloat16), deq


def main() -> None:
    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__}")
    for n, k in ((24576, 4096), (4096, 12288)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed, scales_zeros, deq = quantize(w)
        for m in (1, 4, 32, 128, 320):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch._weight_int4pack_mm(x, packed, GROUP, scales_zeros)
            ref = x.float() @ deq.t()
            err = float((y.float() - ref).norm() / ref.norm())
            bf16_us = timed(lambda x=x, w=w: x @ w.t())
            int4_us = timed(
                lambda x=x, p=packed, sz=scales_zeros: torch._weight_int4pack_mm(x, p, GROUP, sz)
            )
            print(f"{n}x{k} m={m:4d} err vs dequantized {err:.4f}  bf16 {bf16_us:7.1f} us  "
                  f"int4 {int4_us:7.1f} us  int4/bf16 {int4_us / bf16_us:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
