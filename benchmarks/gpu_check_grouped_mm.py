"""The MoE experts' grouped GEMMs on the GPU: each stored weight layout and each kernel, timed
at the row counts of a step and checked against a per-expert float32 product.

    python benchmarks/gpu_check_grouped_mm.py [--cases NAME,...] [--out FILE]

A batch-1 step of a MoE diffusion model routes a whole canvas (or block) through the experts,
so each expert sees a handful of rows and the product is a read of every expert's weights:
its time against the weight bytes over the measured copy bandwidth says how far the kernel is
from the read floor. Ways:
- `view`: `torch._grouped_mm` over the published [E, out, in] weights as a transposed view
  (what `models/moe.py` runs for stacked published experts);
- `contiguous`: the same over weights stored [E, in, out];
- `inductor`: `torch._grouped_mm` compiled with max-autotune (inductor's Triton grouped-GEMM
  templates) for this one shape, over the [E, out, in] view;
- `engine_triton`: the engine's `expert_gemm` `triton` path (`models/expert_gemm.py`): one
  compile per weight shape with the row count dynamic, tuned at the first case that meets it
  (a model's batch-1 case, then reused at its larger batch, as in a server).
Rows are routed uniformly at random (top-k distinct experts per token), as random weights do.
"""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import torch

from dlm_engine.models.expert_gemm import ExpertGemm, grouped_mm

CASES = {
    # name: experts, hidden, intermediate, top-k, tokens
    "diffusiongemma_b1": (128, 2816, 704, 8, 256),
    "diffusiongemma_b32": (128, 2816, 704, 8, 8192),
    "llada2_mini_b1": (256, 2048, 512, 8, 32),
    "llada2_mini_b128": (256, 2048, 512, 8, 4096),
    "sdar_30b_b1": (128, 2048, 768, 8, 4),
    "sdar_30b_b128": (128, 2048, 768, 8, 512),
}


def _product(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


def timed_us(fn, runs: int = 30) -> float:
    """Mean microseconds a call over `runs` back-to-back calls, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / runs


def copy_bandwidth() -> float:
    """Bytes a second of a 2 GiB device-to-device copy (read + write)."""
    a = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    us = timed_us(lambda: b.copy_(a), runs=10)
    return 2 * a.numel() * 2 / (us * 1e-6)


def routed_offsets(experts: int, top_k: int, tokens: int) -> torch.Tensor:
    """Cumulative row counts [E] int32 of `tokens` tokens each routed to top_k distinct experts."""
    chosen = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices.reshape(-1)
    counts = torch.bincount(chosen, minlength=experts)
    return counts.cumsum(0).to(torch.int32)


def reference(x: torch.Tensor, w_in_out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Each expert's rows times its weight, in float32."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end].float() @ w_in_out[e].float())
        start = end
    return torch.cat(out)


def run_case(name: str, bandwidth: float, ways: list[str]) -> list[dict]:
    experts, hidden, inter, top_k, tokens = CASES[name]
    offs = routed_offsets(experts, top_k, tokens)
    rows = tokens * top_k
    used = int((torch.diff(offs, prepend=offs.new_zeros(1)) > 0).sum())
    results = []
    for product, k, n in (("gate_up", hidden, 2 * inter), ("down", inter, hidden)):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        published = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        weights = {
            "view": published.transpose(-2, -1),
            "contiguous": published.transpose(-2, -1).contiguous(),
            "inductor": published.transpose(-2, -1),
            "engine_triton": published.transpose(-2, -1),
        }
        want = reference(x, weights["contiguous"], offs)
        floor_us = used * n * k * 2 / bandwidth * 1e6
        for way in ways:
            w = weights[way]
            if way == "engine_triton":
                ExpertGemm.set_mode("triton")
                fn = grouped_mm
            elif way == "inductor":
                # a code object of its own: a fresh compile for this shape alone
                own = types.FunctionType(_product.__code__.replace(), _product.__globals__)
                fn = torch.compile(own, mode="max-autotune-no-cudagraphs", dynamic=False)
            else:
                fn = _product
            entry = {"case": name, "product": product, "way": way, "rows": rows, "k": k, "n": n,
                     "experts_used": used, "read_floor_us": round(floor_us, 1)}  # fmt: skip
            try:
                got = fn(x, w, offs)
                entry["rel_error"] = float((got.float() - want).norm() / want.norm())
                us = timed_us(lambda fn=fn, w=w, x=x: fn(x, w, offs))
                entry["us"] = round(us, 1)
                entry["x_floor"] = round(us / floor_us, 2)
                entry["tb_s"] = round(used * n * k * 2 / (us * 1e-6) / 1e12, 2)
            except Exception as exc:  # a way this build lacks: recorded
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(entry), flush=True)
            results.append(entry)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--ways", default="view,contiguous,inductor,engine_triton")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_tb_s": round(bandwidth / 1e12, 2), "results": []}  # fmt: skip
    print(f"device={report['device']} copy bandwidth={report['copy_tb_s']} TB/s", flush=True)
    for name in args.cases.split(","):
        report["results"] += run_case(name, bandwidth, args.ways.split(","))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
