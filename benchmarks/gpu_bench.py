"""GPU benchmark: the published reference loop vs the engine (exact and cached modes).

Builds LLaDA-8B and Dream-7B architectures with random bf16 weights directly on the GPU (no
download; the model code and layout are the real ones). Random weights make fixed decoding
schedules time honestly: every run here commits exactly `max_tokens` tokens over `steps`
forwards (random models have no end of text, so nothing stops early). Timings for one run:

    python benchmarks/gpu_bench.py --out results/ [--models llada-8b,dream-7b] [--batches 1,8,32]
    python benchmarks/gpu_bench.py --section algorithms --batches 1,8 --out results/algorithms

Prints tok/s, ms/step, achieved TFLOP/s as % of the measured bf16 matmul peak, and ratios
against the reference loop measured in the same run. Writes results.json, a log and a plot.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from step_timeline import StepTimeline

from dlm_engine import Engine, EngineConfig
from dlm_engine.loader import random_checkpoint
from dlm_engine.models.common import full_logits
from dlm_lab.reference import dream_generate, llada_generate

PROMPT, CANVAS, BLOCK = 64, 256, 32


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bf16_peak_tflops(device: torch.device) -> float:
    """Measured bf16 matmul throughput (8192^3 on GPU): the ceiling percentages refer to."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    return 10 * 2 * n**3 / (time.perf_counter() - t) / 1e12


def shrink_presets() -> None:
    """Tiny LLaDA-8B and Dream-7B presets: a CPU smoke run of the GPU benchmarks."""
    from dlm_engine.presets import PRESETS

    PRESETS["llada-8b"].update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=128)
    PRESETS["dream-7b"].update(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    )


def model_dims(engine: Engine) -> tuple[int, int, int, int]:
    """(linear weights in the blocks, layers, hidden size, vocab) for FLOP counting."""
    m = engine.loaded.model
    head_names = ("lm_head.weight", "transformer.ff_out.weight")
    lin = sum(
        p.numel()
        for n, p in m.named_parameters()
        if p.dim() == 2 and "embed" not in n and "wte" not in n and not n.endswith(head_names)
    )
    a = m.arch
    layers = getattr(a, "n_layers", None) or a.num_hidden_layers
    hidden = getattr(a, "d_model", None) or a.hidden_size
    return lin, layers, hidden, m.vocab_size


def work_flops(engine: Engine, work: dict[str, int]) -> float:
    lin, layers, hidden, vocab = model_dims(engine)
    return (
        2 * lin * work["tokens"]
        + 4 * layers * hidden * work["attn_pairs"]
        + 2 * hidden * vocab * work["logit_positions"]
    )


def reference_flops(engine: Engine, batch: int, steps: int) -> float:
    lin, layers, hidden, vocab = model_dims(engine)
    t = PROMPT + CANVAS
    return steps * batch * (2 * lin * t + 4 * layers * hidden * t * t + 2 * hidden * vocab * t)


def run_reference(engine: Engine, prompts: torch.Tensor, steps: int) -> float:
    lm = engine.loaded
    fn = full_logits(lm.model)
    sync()
    t = time.perf_counter()
    with torch.inference_mode():
        if lm.family.name == "llada":
            llada_generate(
                fn, prompts, mask_id=lm.mask_id, steps=steps, gen_length=CANVAS, block_length=BLOCK
            )
        else:
            dream_generate(
                fn, prompts, mask_id=lm.mask_id, steps=steps, gen_length=CANVAS, alg="entropy"
            )
    sync()
    return time.perf_counter() - t


def run_engine(engine: Engine, prompts: list[list[int]], params: dict) -> dict:
    """Time one batch to completion, step by step (refresh vs in-block steps apart)."""
    r = engine.runner
    engine.generate(
        prompts, dict(params, steps=CANVAS // params["block_length"] * 2)
    )  # capture graphs
    work0 = dict(r.work)
    ids = [engine.add_request(None, p, params) for p in prompts]
    per_kind: dict[str, list[float]] = {"refresh": [], "span": [], "full": []}
    sync()
    t0 = time.perf_counter()
    done = 0
    while done < len(ids):
        before = (r.refreshes, r.span_steps)
        ts = time.perf_counter()
        done += sum(o.finished for o in engine.step())
        dt = time.perf_counter() - ts
        kind = (
            "full"
            if (r.refreshes, r.span_steps) == before
            else ("refresh" if r.refreshes > before[0] else "span")
        )
        per_kind[kind].append(dt)
    total = time.perf_counter() - t0
    work = {k: r.work[k] - work0[k] for k in work0}
    steps = sum(len(v) for v in per_kind.values())
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in per_kind.items() if v}
    return {"seconds": total, "steps": steps, "flops": work_flops(engine, work), "median_ms": med}


def profile_steps(engine: Engine, prompts: list[list[int]], path: Path) -> None:
    """Kernel table of a batch-1 dual-cache block (1 refresh + 7 in-block steps)."""
    from torch.profiler import ProfilerActivity, profile

    params = dict(max_tokens=CANVAS, steps=64, block_length=BLOCK, cache="dual")
    engine.generate(prompts, dict(params, steps=16))
    engine.add_request("profiled", prompts[0], params)
    for _ in range(8):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            engine.step()
    engine.abort("profiled")
    engine.step()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    path.write_text(table)
    print(table[:6000], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="gpu_bench_out")
    ap.add_argument("--models", default="llada-8b,dream-7b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", default="64,256")
    ap.add_argument("--long-batches", default="1", help="batches also run with the longest steps")
    ap.add_argument("--modes", default="reference,exact,prefix,dual")
    ap.add_argument("--ref-max-batch", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quantization", default="none", help="comma list of none,int8,nf4")
    ap.add_argument(
        "--profile", action="store_true", help="profile dual-cache steps at batch 1 first"
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="one more run per engine row under the profiler: host ms a step, device busy",
    )
    ap.add_argument(
        "--tiny", action="store_true", help="shrunken presets: a CPU smoke run of this script"
    )
    ap.add_argument(
        "--section",
        choices=("modes", "algorithms", "structured"),
        default="modes",
        help="modes: reference vs engine modes; algorithms: per-forward cost of each decoding "
        "algorithm and multi-block step time vs blocks in flight (gpu_bench_algorithms.py)",
    )
    ap.add_argument("--iters", type=int, default=20, help="timed steps per algorithms point")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    if args.tiny:
        shrink_presets()
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = bf16_peak_tflops(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    header = (
        f"device={name} torch={torch.__version__} python={platform.python_version()} "
        f"measured bf16 peak={peak:.0f} TFLOP/s\nrandom bf16 weights, prompt {PROMPT}, canvas {CANVAS}, "
        f"block {BLOCK}, temperature 0, fixed schedules (no early stop)"
    )
    print(header, flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    steps_list = [int(s) for s in args.steps.split(",")]
    long_batches = {int(b) for b in args.long_batches.split(",")}
    modes = args.modes.split(",")
    rows: list[dict] = []
    gen = torch.Generator().manual_seed(0)
    runs = [(m, q) for m in args.models.split(",") for q in args.quantization.split(",")]
    for model_name, quant in runs:
        t_load = time.perf_counter()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            base_mem = torch.cuda.memory_allocated(dev)
        lm = random_checkpoint(
            model_name, "bfloat16", args.device, None if quant == "none" else quant
        )
        weights_gb = (
            (torch.cuda.memory_allocated(dev) - base_mem) / 1e9 if dev.type == "cuda" else 0.0
        )
        engine = Engine(
            EngineConfig(
                model=f"random:{model_name}",
                device=args.device,
                max_rows=max(batches),
                max_canvas=CANVAS,
                max_step_tokens=1 << 30,
            ),
            loaded=lm,
        )
        print(
            f"\n== {model_name} quantization={quant} weights on GPU {weights_gb:.2f} GB, "
            f"built in {time.perf_counter() - t_load:.0f}s",
            flush=True,
        )
        print(
            f"{'mode':<10}{'batch':>6}{'steps':>6}{'tok/s':>9}{'ms/step':>9}{'TFLOP/s':>9}{'%peak':>7}{'x ref':>7}  step medians (ms)"
        )
        if args.section == "algorithms":
            from gpu_bench_algorithms import run as run_algorithms

            rows += run_algorithms(engine, model_name, batches, args.iters, out)
            continue
        if args.section == "structured":  # grammar-constrained rows' step cost
            from gpu_bench_structured import run as run_structured

            rows += run_structured(engine, model_name, batches, out)
            continue
        all_prompts = torch.randint(0, 100000, (max(batches), PROMPT), generator=gen)
        if args.profile:
            profile_steps(engine, all_prompts[:1].tolist(), out / f"profile_{model_name}.txt")
        for steps in steps_list:
            for batch in batches:
                if steps == max(steps_list) and len(steps_list) > 1 and batch not in long_batches:
                    continue
                prompts = all_prompts[:batch]
                ref_tps = None
                for mode in modes:
                    if mode == "reference":
                        if batch > args.ref_max_batch:
                            continue
                        run_reference(engine, prompts[:1].to(dev), CANVAS // BLOCK)  # warm-up
                        dt = run_reference(engine, prompts.to(dev), steps)
                        res = {
                            "seconds": dt,
                            "steps": steps,
                            "flops": reference_flops(engine, batch, steps),
                            "median_ms": {},
                        }
                    else:
                        block = BLOCK if (lm.family.name == "llada" or mode != "exact") else CANVAS
                        params = dict(
                            max_tokens=CANVAS,
                            steps=steps,
                            block_length=block,
                            cache="none" if mode == "exact" else mode,
                        )
                        res = run_engine(engine, prompts.tolist(), params)
                        if args.timeline:  # beside the timed run (the profiler costs host time)
                            with StepTimeline() as t:
                                engine.generate(prompts.tolist(), params)
                            res["timeline"] = t.report(res["steps"])
                    tps = batch * CANVAS / res["seconds"]
                    if mode == "reference":
                        ref_tps = tps
                    tflops = res["flops"] / res["seconds"] / 1e12
                    row = {
                        "model": model_name,
                        "quantization": quant,
                        "weights_gb": weights_gb,
                        "mode": mode,
                        "batch": batch,
                        "steps": steps,
                        "tok_s": tps,
                        "ms_step": res["seconds"] / res["steps"] * 1e3,
                        "tflops": tflops,
                        "pct_peak": 100 * tflops / peak,
                        "x_ref": tps / ref_tps if ref_tps else None,
                        "median_ms": res["median_ms"],
                        "timeline": res.get("timeline"),
                        "block": BLOCK
                        if (lm.family.name == "llada" or mode != "exact")
                        else CANVAS,
                    }
                    rows.append(row)
                    xr = f"{row['x_ref']:.2f}" if row["x_ref"] else "-"
                    med = " ".join(f"{k}={v:.1f}" for k, v in res["median_ms"].items())
                    if res.get("timeline"):
                        t = res["timeline"]
                        busy = "-" if t["device_busy"] is None else f"{100 * t['device_busy']:.0f}%"
                        med += f"  host {t['host_ms_per_step']:.2f} ms/step, device busy {busy}"
                    print(
                        f"{mode:<10}{batch:>6}{steps:>6}{tps:>9.0f}{row['ms_step']:>9.1f}{tflops:>9.0f}"
                        f"{row['pct_peak']:>7.1f}{xr:>7}  {med}",
                        flush=True,
                    )
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
        del engine, lm
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    (out / "results.json").write_text(
        json.dumps({"header": header, "peak_tflops": peak, "rows": rows}, indent=2)
    )
    if args.section == "modes":
        plot(rows, out / "gpu_bench.png", name)


def plot(rows: list[dict], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for mode in ("reference", "exact", "prefix", "dual"):
            pts = sorted(
                (r["batch"], r["tok_s"])
                for r in rows
                if r["model"] == model
                and r["mode"] == mode
                and r["steps"] == 64
                and r["quantization"] == "none"
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (concurrent requests)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{model}, 64 steps, canvas 256 ({device})")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
