"""FP8 weights on the GPU: the kernels run, agree with bf16, and how fast one product is.

    python benchmarks/gpu_check_fp8.py [--models llada-8b,sdar-4b,llada2-mini] [--out DIR]

1. `Fp8Linear` (torch._scaled_mm, row-wise scales) against the bf16 layer it replaces, for
   token counts that are and are not multiples of 16; `Fp8Experts` (torch._scaled_grouped_mm)
   against its dequantized weights through the bf16 grouped GEMM.
2. For each published architecture with random bf16 weights: one forward's logits after
   quantizing the same weights to FP8, against bf16: relative error and the share of
   positions whose argmax agrees.
   A float32 copy against bf16, where it fits, is the yardstick: random weights make logits
   that rounding moves easily.
3. One LLaDA-8B-sized gate/up product (4096 x 24576) in bf16 and FP8 at several token counts,
   each captured in a CUDA graph as the engine runs it (activation quantization included).
Exits 1 when a kernel disagrees with its dequantized reference by more than rounding.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from dlm_engine.fp8 import Fp8Experts, Fp8Linear
from dlm_engine.loader import random_checkpoint
from dlm_engine.models.common import ForwardBatch, FusedKernels
from dlm_engine.models.moe import grouped_linear
from dlm_engine.quantization import quantize_linears


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.no_grad()
def kernels() -> tuple[list[dict], int]:
    rows, bad = [], 0
    torch.manual_seed(0)
    linear = nn.Linear(4096, 6144, bias=False, device="cuda", dtype=torch.bfloat16)
    q = Fp8Linear.from_linear(linear)
    for m in (1, 7, 64, 300):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        vs_bf16 = rel(q(x), linear(x))
        emulated = nn.functional.linear(x.float(), q.dequantized())
        vs_dequant = rel(q(x), emulated)
        rows.append({"kernel": "scaled_mm", "m": m, "vs_bf16": vs_bf16, "vs_dequant": vs_dequant})
        bad += vs_dequant > 0.05
        print(f"scaled_mm      m={m:4d}  vs bf16 {vs_bf16:.4f}  vs dequantized {vs_dequant:.4f}")
    w = torch.randn(8, 1024, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    experts = Fp8Experts.from_stacked(w)
    counts = torch.tensor([0, 5, 17, 0, 1, 40, 3, 9], device="cuda")
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), 1024, device="cuda", dtype=torch.bfloat16)
    expert_of_row = torch.repeat_interleave(torch.arange(8, device="cuda"), counts)
    y = grouped_linear(x, experts, offs, expert_of_row)
    ref = grouped_linear(x, experts.dense(torch.bfloat16), offs, expert_of_row)
    native = not experts._grouped_failed
    err = rel(y, ref)
    rows.append({"kernel": "scaled_grouped_mm", "native": native, "vs_dequant": err})
    bad += err > 0.05
    print(f"scaled_grouped_mm native={native}  vs dequantized {err:.4f}")
    return rows, bad


@torch.no_grad()
def logits_error(models: list[str]) -> list[dict]:
    rows = []
    for preset in models:
        lm = random_checkpoint(preset, "bfloat16", "cuda")
        gen = torch.Generator().manual_seed(0)
        vocab = min(int(lm.model.vocab_size), 30000)
        ids = torch.full((1, 128), lm.mask_id)
        ids[0, :64] = torch.randint(100, vocab, (64,), generator=gen)
        batch = ForwardBatch(ids.cuda(), torch.arange(128, device="cuda")[None], None, None)
        ref = lm.model(batch).float()
        row: dict = {"model": preset}
        try:  # yardstick: bf16 itself against float32, where a float32 copy fits
            full = copy.deepcopy(lm.model).float()
            row["bf16_vs_fp32"] = rel(ref, full(batch).float())
            del full
        except torch.OutOfMemoryError:
            row["bf16_vs_fp32"] = None
        torch.cuda.empty_cache()
        quantize_linears(lm.model, "fp8", torch.device("cuda"))
        out = lm.model(batch).float()
        row["fp8_vs_bf16"] = rel(out, ref)
        row["argmax_agreement"] = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
        rows.append(row)
        print(f"{preset:12s} logits rel. error: fp8 vs bf16 {row['fp8_vs_bf16']:.4f}, "
              f"bf16 vs fp32 {row['bf16_vs_fp32']}; argmax agree {row['argmax_agreement']:.3f}")  # fmt: skip
        del lm
        torch.cuda.empty_cache()
    return rows


def graphed(fn):
    """`fn` captured in a CUDA graph, as the engine runs a step (no Python between kernels)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def timed(fn, iters: int = 100) -> float:
    """Microseconds per replay of `fn` captured in a CUDA graph."""
    replay = graphed(fn)
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e6


@torch.no_grad()
def product_speed() -> list[dict]:
    rows = []
    linear = nn.Linear(4096, 12288 * 2, bias=False, device="cuda", dtype=torch.bfloat16)
    q = Fp8Linear.from_linear(linear)
    for m in (1, 32, 256, 2048, 8192):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        bf16_us, fp8_us = timed(lambda x=x: linear(x)), timed(lambda x=x: q(x))
        rows.append({"m": m, "bf16_us": bf16_us, "fp8_us": fp8_us, "ratio": fp8_us / bf16_us})
        print(f"4096x24576 m={m:5d}  bf16 {bf16_us:8.1f} us  fp8 {fp8_us:8.1f} us  "
              f"fp8/bf16 {fp8_us / bf16_us:.2f}")  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llada-8b,sdar-4b,llada2-mini")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    FusedKernels.enabled = True
    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__}")
    kernel_rows, bad = kernels()
    speed_rows = product_speed()
    error_rows = logits_error([m for m in args.models.split(",") if m])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "kernels": kernel_rows,
            "product_speed": speed_rows,
            "logits": error_rows,
        }
        (out / "gpu_check_fp8.json").write_text(json.dumps(report, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
