"""int4 weights on the GPU: the kernels against their dequantized weights, the fastest kernel at
each token count, one forward's logits error and LLaDA-8B steps per precision, in one run.

    python benchmarks/gpu_check_int4.py --out DIR [--sections kernels,sweep,logits,steps]

1. kernels: each candidate product of `dlm_engine/int4_kernels.py` (fused W4A16 tiles, either
   operand order; fused W4A8 tiles: int4 weights with e4m3 activations; dequantize + cuBLAS) against x times its
   dequantized weight in float32, at token counts on and off the tiles. Exit 1 where one
   disagrees beyond rounding.
2. sweep: LLaDA-8B's four products (q/k/v 4096->12288, attention out 4096->4096, gate/up
   4096->24576, down 12288->4096) at 1 to 10240 tokens, each candidate captured in a CUDA graph,
   against bf16 and PyTorch's int4 "tinygemm" (`_weight_int4pack_mm`, up to 64 tokens). The
   fastest 16-bit-activation candidate at each token count becomes `int4_kernels.DISPATCH` for
   the sections below (printed, to be written into the module); "int4-a8" is the same with the
   W4A8 tiles allowed.
3. logits: one LLaDA-8B forward (random bf16 weights, 64 prompt tokens + 64 masks) in int4,
   int4-a8 and fp8 against bf16: relative error and argmax agreement; the int4 model
   against its own weights dequantized to bf16 (what the kernels must compute), and bf16
   against float32 as the yardstick.
4. steps: LLaDA-8B with gpu_bench.py's schedules (prompt 64, canvas 256, block 32, 64 steps):
   exact at batch 1, dual cache at batches 1 and 32, ms a step in bf16, int4, int4-a8 and fp8,
   nf4 (bitsandbytes) at batch 1, each model built and timed in this one process.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from gpu_check_fp8 import graphed  # a product captured in a CUDA graph
from torch import nn

from dlm_engine import int4_kernels as kern
from dlm_engine.int4 import Int4Linear
from dlm_engine.loader import random_checkpoint
from dlm_engine.models.common import ForwardBatch, FusedKernels
from dlm_engine.quantization import quantize_linears, weight_bytes

A16_TILES = [
    kern.Tile(64, 128, 64, warps=4, stages=4),
    kern.Tile(128, 128, 64, warps=8, stages=3),
    kern.Tile(16, 64, 128, split_k=4, warps=4, stages=3, swap=True),
    kern.Tile(32, 64, 128, split_k=4, warps=4, stages=3, swap=True),
    kern.Tile(64, 128, 128, warps=4, stages=3, swap=True),
    kern.Tile(128, 128, 64, warps=8, stages=3, swap=True),
    kern.Tile(16, 64, 128, split_k=4, warps=4, stages=3, swap=True, strided=True),
    kern.Tile(16, 64, 128, split_k=8, warps=4, stages=3, swap=True, strided=True),
    kern.Tile(16, 128, 128, split_k=4, warps=4, stages=3, swap=True, strided=True),
    kern.Tile(32, 64, 128, split_k=4, warps=4, stages=3, swap=True, strided=True),
    kern.Tile(32, 128, 128, split_k=2, warps=4, stages=3, swap=True, strided=True),
    kern.Tile(64, 128, 128, split_k=2, warps=4, stages=3, swap=True, strided=True),
    kern.Tile(128, 128, 128, warps=8, stages=3, swap=True, strided=True),
    kern.Tile(64, 128, 128, warps=4, stages=3, strided=True),
    kern.Tile(128, 128, 128, warps=8, stages=3, strided=True),
]
A8_TILES = [kern.Tile(64, 128, 128, warps=4, stages=4, a8=True)]
SHAPES = {"qkv": (12288, 4096), "attn_out": (4096, 4096), "gate_up": (24576, 4096)}
SHAPES["down"] = (4096, 12288)
MS = (1, 16, 32, 64, 128, 256, 320, 512, 1024, 10240)
DEQUANT = "dequant+cublas"
BROKEN: set[str] = set()  # candidates that failed to compile or run here


def name_of(tile: kern.Tile | None) -> str:
    if tile is None:
        return DEQUANT
    t = tile
    extra = (" swap" if t.swap else "") + (" strided" if t.strided else "")
    extra += " a8" if t.a8 else ""
    return f"{t.block_m}x{t.block_n}x{t.block_k}/s{t.split_k}/w{t.warps}/p{t.stages}{extra}"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def product(layer: Int4Linear, tile: kern.Tile | None):
    """x -> the int4 product through `tile` (None: dequantize + cuBLAS)."""
    args = (layer.qweight, layer.scales, layer.zeros, layer.group_size)
    if tile is None:
        return lambda x: x @ kern.dequantize(*args, x.dtype)
    return lambda x: kern.fused(x, *args, tile)


def timed_us(fn, target_ms: float = 20.0) -> float:
    """Microseconds per replay of `fn` captured in a CUDA graph (replays for ~target_ms)."""
    replay = graphed(fn)
    replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t) / 3
    iters = max(5, min(200, int(target_ms / 1e3 / max(est, 1e-6))))
    t = time.perf_counter()
    for _ in range(iters):
        replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e6


@torch.no_grad()
def kernels() -> tuple[list[dict], int]:
    rows, bad = [], 0
    torch.manual_seed(0)
    linear = nn.Linear(4096, 6144, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = Int4Linear.from_linear(linear)
    w = layer.dequantized()  # float32 [N, K]
    for tile in [None, *A16_TILES, *A8_TILES]:
        name = name_of(tile)
        for m in (1, 7, 64, 300):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ w.t()
            try:
                err = rel(product(layer, tile)(x), ref)
            except Exception as exc:  # a tile this GPU or compiler cannot run
                print(f"{name:32s} m={m:4d}  FAILED {type(exc).__name__}: {str(exc)[:200]}")
                rows.append({"kernel": name, "m": m, "error": str(exc)[:500]})
                BROKEN.add(name)
                break
            limit = 0.05 if tile is not None and tile.a8 else 0.01
            bad += err > limit
            rows.append({"kernel": name, "m": m, "vs_dequantized": err})
            print(f"{name:32s} m={m:4d}  vs dequantized {err:.5f}")
    return rows, bad


def tinygemm(w: torch.Tensor):
    """PyTorch's int4 weight-only kernel over the same kind of groups (for comparison)."""
    n, k = w.shape
    wg = w.float().view(n, k // 128, 128)
    hi, lo = wg.amax(-1), wg.amin(-1)
    scales = (hi - lo).clamp(min=1e-6) / 15
    zeros = lo + scales * 8
    q = ((wg - lo[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    sz = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return lambda x: torch._weight_int4pack_mm(x, packed, 128, sz)


def relevant(tile: kern.Tile | None, m: int) -> bool:
    if tile is None:
        return True
    return tile.block_m <= max(16, 2 * m) and m <= 128 * tile.block_m


@torch.no_grad()
def sweep() -> tuple[list[dict], list, list]:
    torch.manual_seed(1)
    layers = {}
    for shape, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        lin.weight.copy_(w)
        layers[shape] = (lin, Int4Linear.from_linear(lin), tinygemm(w))
    rows = []
    candidates = [c for c in [None, *A16_TILES, *A8_TILES] if name_of(c) not in BROKEN]
    for m in MS:
        total: dict[str, float] = {}
        for shape, (lin, q, tg) in layers.items():
            x = torch.randn(m, lin.in_features, device="cuda", dtype=torch.bfloat16)
            times = {"bf16": timed_us(lambda x=x, lin=lin: lin(x))}
            if m <= 64:
                times["tinygemm"] = timed_us(lambda x=x, tg=tg: tg(x))
            for tile in candidates:
                if not relevant(tile, m) or name_of(tile) in BROKEN:
                    continue
                fn = product(q, tile)
                try:
                    times[name_of(tile)] = timed_us(lambda x=x, fn=fn: fn(x))
                except Exception as exc:
                    print(f"{name_of(tile)} at m={m} {shape}: FAILED {str(exc)[:200]}")
                    BROKEN.add(name_of(tile))
            for key, us in times.items():
                total[key] = total.get(key, 0.0) + us
            rows.append({"m": m, "shape": shape, "us": times})
        total = {k: v for k, v in total.items() if k not in BROKEN}
        a16 = {k: v for k, v in total.items() if k not in ("bf16", "tinygemm") and "a8" not in k}
        a8 = {k: v for k, v in total.items() if k not in ("bf16", "tinygemm")}
        best16, best8 = min(a16, key=a16.get), min(a8, key=a8.get)
        rows.append({"m": m, "shape": "all four", "us": total, "best": best16, "best_a8": best8})
        print(f"m={m:5d} four products: bf16 {total['bf16']:8.1f} us | int4 {best16} "
              f"{a16[best16]:8.1f} us ({a16[best16] / total['bf16']:.2f}x) | with a8 {best8} "
              f"{a8[best8]:8.1f} us ({a8[best8] / total['bf16']:.2f}x)"
              + (f" | tinygemm {total['tinygemm'] / total['bf16']:.2f}x" if "tinygemm" in total else ""),
              flush=True)  # fmt: skip
    by_name = {name_of(t): t for t in [None, *A16_TILES, *A8_TILES]}
    tables = []
    for key in ("best", "best_a8"):
        picks = [(r["m"], by_name[r[key]]) for r in rows if r["shape"] == "all four"]
        table: list = []
        for i, (m, tile) in enumerate(picks):
            bound = (1 << 62) if i == len(picks) - 1 else m
            if table and table[-1][1] == tile:
                table[-1] = (bound, tile)
            else:
                table.append((bound, tile))
        tables.append(table)
    return rows, tables[0], tables[1]


def table_json(table: list) -> list:
    return [[bound, name_of(tile)] for bound, tile in table]


@torch.no_grad()
def logits(table16: list, table8: list) -> dict:
    lm = random_checkpoint("llada-8b", "bfloat16", "cuda")
    gen = torch.Generator().manual_seed(0)
    ids = torch.full((1, 128), lm.mask_id)
    ids[0, :64] = torch.randint(100, 30000, (64,), generator=gen)
    batch = ForwardBatch(ids.cuda(), torch.arange(128, device="cuda")[None], None, None)
    ref = lm.model(batch).float()
    out: dict = {}

    def record(key: str, y: torch.Tensor, against: torch.Tensor = ref) -> None:
        agree = float((y.argmax(-1) == against.argmax(-1)).float().mean())
        out[key] = {"rel_error": rel(y, against), "argmax_agreement": agree}
        print(f"logits {key:28s} rel. error {out[key]['rel_error']:.4f}  argmax agree {agree:.3f}")

    full = copy.deepcopy(lm.model).float()
    record("bf16_vs_fp32", ref, full(batch).float())
    del full
    torch.cuda.empty_cache()
    q = copy.deepcopy(lm.model)
    quantize_linears(q, "int4", torch.device("cuda"))
    kern.DISPATCH = table16
    y16 = q(batch).float()
    record("int4_vs_bf16", y16)
    best_a8 = [t for _, t in table8 if t is not None and t.a8] or A8_TILES[:1]
    kern.DISPATCH = [(1 << 62, best_a8[0])]  # every product in W4A8: its accuracy
    try:
        record("int4_a8_vs_bf16", q(batch).float())
    except Exception as exc:
        out["int4_a8_vs_bf16"] = {"error": str(exc)[:300]}
    kern.DISPATCH = table16
    dense = copy.deepcopy(q)
    for parent in list(dense.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int4Linear):
                lin = nn.Linear(child.in_features, child.out_features, bias=False, device="cuda")
                lin.weight.data = child.dequantized().to(torch.bfloat16)
                setattr(parent, name, lin)
    record("int4_vs_its_dequantized_bf16", y16, dense(batch).float())
    del q, dense
    torch.cuda.empty_cache()
    for scheme in ("fp8",):
        try:
            m = copy.deepcopy(lm.model)
            quantize_linears(m, scheme, torch.device("cuda"))
            record(f"{scheme}_vs_bf16", m(batch).float())
            del m
        except Exception as exc:
            out[f"{scheme}_vs_bf16"] = {"error": str(exc)[:300]}
            print(f"{scheme}: FAILED {exc}")
        torch.cuda.empty_cache()
    return out


def steps(table16: list, table8: list, steps_n: int, precisions: list[str]) -> list[dict]:
    from gpu_bench import CANVAS, PROMPT

    from dlm_engine import Engine, EngineConfig

    rows = []
    prompts = torch.randint(0, 100000, (32, PROMPT), generator=torch.Generator().manual_seed(0))
    plan = [("none", None), ("int4", table16), ("int4-a8", table8), ("fp8", None), ("nf4", None)]
    if [t for _, t in table8] == [t for _, t in table16]:
        plan = [p for p in plan if p[0] != "int4-a8"]  # W4A8 never won: nothing new to time
    plan = [p for p in plan if p[0] in precisions]
    for precision, table in plan:
        if table is not None:
            kern.DISPATCH = table
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        scheme = {"none": None, "int4-a8": "int4"}.get(precision, precision)
        try:
            lm = random_checkpoint("llada-8b", "bfloat16", "cuda", scheme)
        except Exception as exc:
            print(f"{precision}: FAILED to build: {exc}")
            rows.append({"quantization": precision, "error": str(exc)[:300]})
            continue
        gb = (torch.cuda.memory_allocated() - base) / 1e9
        engine = Engine(
            EngineConfig(
                model="random:llada-8b",
                device="cuda",
                max_rows=32,
                max_canvas=CANVAS,
                max_step_tokens=1 << 30,
            ),
            loaded=lm,
        )
        runs = [("exact", 1), ("dual", 1)] + ([] if precision == "nf4" else [("dual", 32)])
        try:
            timed_runs(engine, lm, precision, gb, runs, prompts, steps_n, rows)
        except Exception as exc:
            print(f"{precision}: FAILED: {exc}")
            rows.append({"quantization": precision, "error": str(exc)[:300]})
        del engine, lm
        torch.cuda.empty_cache()
    return rows


def timed_runs(engine, lm, precision: str, gb: float, runs, prompts, steps_n: int, rows) -> None:
    from gpu_bench import BLOCK, CANVAS, run_engine

    for mode, batch in runs:
        params = dict(
            max_tokens=CANVAS,
            steps=steps_n,
            block_length=BLOCK,
            cache="none" if mode == "exact" else mode,
        )
        res = run_engine(engine, prompts[:batch].tolist(), params)
        row = {
            "quantization": precision,
            "weights_gb": gb,
            "weight_bytes": weight_bytes(lm.model),
            "mode": mode,
            "batch": batch,
            "steps": res["steps"],
            "ms_step": res["seconds"] / res["steps"] * 1e3,
            "tok_s": batch * CANVAS / res["seconds"],
            "median_ms": res["median_ms"],
        }
        rows.append(row)
        print(f"steps {precision:8s} {mode:6s} batch {batch:3d}: {row['ms_step']:7.2f} ms a step "
              f"{row['tok_s']:8.0f} tok/s  weights {gb:.2f} GB", flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="kernels,sweep,logits,steps")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--precisions", default="none,int4,int4-a8,fp8,nf4", help="steps section")
    ap.add_argument("--bnb-path", default="gpu_wheels/bnb", help="bitsandbytes, if not installed")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        sys.path.append(args.bnb_path)
    FusedKernels.enabled = True
    sections = args.sections.split(",")
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(f"device={report['device']} torch={report['torch']}", flush=True)
    out = Path(args.out) if args.out else None

    def save() -> None:  # after every section: a run cut short keeps what it measured
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "gpu_check_int4.json").write_text(json.dumps(report, indent=1))

    bad = 0
    if "kernels" in sections:
        report["kernels"], bad = kernels()
        save()
    table16, table8 = list(kern.DISPATCH), list(kern.DISPATCH)
    if "sweep" in sections:
        report["sweep"], table16, table8 = sweep()
        report["dispatch"], report["dispatch_a8"] = table_json(table16), table_json(table8)
        print("measured DISPATCH:", table16, "\nwith a8:", table8, flush=True)
    report["broken"] = sorted(BROKEN)
    save()
    if "logits" in sections:
        report["logits"] = logits(table16, table8)
        save()
    if "steps" in sections:
        report["steps"] = steps(table16, table8, args.steps, args.precisions.split(","))
        save()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
