"""GPU benchmark of block-diffusion models: the engine against the plain no-cache
restatement of each upstream loop and against the weight-read floor of a step.

    python benchmarks/gpu_bench_block.py --models sdar-4b,sdar-8b,llada2-mini \
        --batches 1,8,32,128 --out results/block

`--paged-attention gather,flex` runs every model and batch once per way of reading the KV
page pool (the `paged_attention` setting), in one process over the same weights.

Random bf16 weights of the published architectures (`dlm_engine/presets.py`), built on the
GPU. Random weights make fixed schedules honest: every row decodes `--canvas` tokens with
`low_confidence_static` at `steps = block_length / tokens-per-forward`, so tokens per forward
are known and nothing stops early (a random model has no end of text). Timed after one
untimed run of the same shapes (CUDA graphs captured).

- engine tok/s: generated tokens of all rows / wall time of the batch, prompt prefill
  included (each row's first step feeds its prompt and first block);
- reference tok/s: `reference_block.sdar_generate` / `llada2_generate` at batch 1 (the
  upstream loops are batch 1), whole sequence up to the block's end every step;
- floor: bytes of the weights one step reads (dense: all of them; MoE: attention, dense
  layers, shared experts, the router and the distinct experts the step's tokens select,
  expected for uniform routing of the step's tokens) / measured HBM copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import time
from pathlib import Path

import torch
from step_timeline import StepTimeline

from dlm_engine import Engine, EngineConfig
from dlm_engine.loader import random_checkpoint
from dlm_lab.reference_block import llada2_generate, sdar_generate


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device) -> float:
    """Measured device memory bandwidth (bytes/s): read + write of a 1 GiB copy."""
    n = 1 << 29 if device.type == "cuda" else 1 << 24
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync()
    return 10 * 2 * a.numel() * a.element_size() / (time.perf_counter() - t)


def expected_distinct_experts(n_experts: int, per_token: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens select when each picks `per_token` of `n_experts` at
    random: a random-weight router routes close to uniformly (group limits ignored)."""
    return n_experts * (1 - (1 - per_token / n_experts) ** tokens)


def weight_bytes(model: torch.nn.Module, expert_share: float | None) -> float:
    """Bytes one step reads: every weight except the embedding table (a gather) and, for MoE,
    only `expert_share` of the stacked experts [E, in, out] (the share of all experts the
    step's tokens select: whole experts of an unsharded or expert-parallel model, a slice of
    each under tensor parallel). FP8 weights and scales are buffers and count too."""
    total = 0.0
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if "embed" in name or "word_embeddings" in name:
            continue
        if t.dim() < 2 or not t.is_floating_point():
            continue
        nbytes = t.numel() * t.element_size()
        if expert_share is not None and t.dim() == 3:
            nbytes *= expert_share
        total += nbytes
    return total


def run_engine(
    engine: Engine, prompts: list[list[int]], params: dict, timeline: bool = False
) -> dict:
    """One untimed run (graphs and allocations), then the timed one with its step count;
    with `timeline`, one more run under the profiler: host time per step and the
    device-busy fraction (`step_timeline.py`), beside the timed figures."""
    engine.generate(prompts, params)
    f0 = engine.runner.forward_passes
    res = run_engine_once(engine, prompts, params)
    steps = engine.runner.forward_passes - f0
    res = {**res, "steps": steps, "ms_per_step": res["seconds"] / steps * 1e3}
    if timeline:
        with StepTimeline() as t:
            engine.generate(prompts, params)
        res["timeline"] = t.report(steps)
    return res


def run_reference(engine: Engine, prompt: list[int], family: str, p: dict) -> dict:
    model = engine.loaded.model
    x = torch.tensor(prompt, device=engine.loaded.device)
    kw = dict(mask_id=engine.mask_id, gen_length=p["max_tokens"], block_length=p["block_length"])
    if family == "sdar":

        def call():
            return sdar_generate(
                model, x, **kw, denoising_steps=p["steps"], temperature=0.0,
                remasking_strategy="low_confidence_static",
            )  # fmt: skip
    else:

        def call():
            return llada2_generate(
                model, x, **kw, eos_id=None, steps=p["steps"], threshold=2.0, temperature=0.0
            )

    call()
    sync()
    t = time.perf_counter()
    run = call()
    sync()
    secs = time.perf_counter() - t
    n = min(len(run.tokens), p["max_tokens"])
    return {"seconds": secs, "tokens": n, "tok_s": n / secs, "forwards": run.forwards}


def prefix_section(args, dev: torch.device) -> list[dict]:
    """Prefix caching: `--requests` short questions behind one shared system prompt of
    `--shared-prefix` tokens, answered with and without the prefix cache. The system prompt
    has been seen once before the timed batch (as on a server that has served it)."""
    preset = args.models.split(",")[0]
    lm = random_checkpoint(preset, args.dtype, args.device)
    block = int(lm.config.get("block_size") or lm.family.default_block_length)
    gen = torch.Generator().manual_seed(1)
    vocab = min(int(lm.model.vocab_size), 30000)
    system = torch.randint(100, vocab, (args.shared_prefix,), generator=gen).tolist()
    prompts = [
        system + torch.randint(100, vocab, (16,), generator=gen).tolist()
        for _ in range(args.requests)
    ]
    params = {"max_tokens": 32, "block_length": block, "algorithm": "low_confidence_static"}
    rows = []
    print(f"\n== prefix cache: {preset}, {args.requests} requests, shared prompt "
          f"{args.shared_prefix} tokens + 16, answers of 32 tokens, block {block}")  # fmt: skip
    for budget in (0, 4 * (args.shared_prefix + 64)):
        cfg = EngineConfig(
            model=f"random:{preset}", device=args.device, dtype=args.dtype,
            max_rows=args.requests, max_canvas=64 + block, max_prompt=args.shared_prefix + 64,
            max_queue=4 * args.requests, prefix_cache_tokens=budget,
        )  # fmt: skip
        engine = Engine(cfg, lm)
        engine.generate(prompts, params)  # graphs and allocations (and the cache, if on)
        pc = engine.runner.prefix_cache
        if pc is not None:
            pc.clear()
        engine.generate(prompts[:1], params)  # the system prompt seen once before
        if pc is not None:  # the hit rate of the timed batch alone
            pc.lookup_tokens = pc.hit_tokens = 0
        res = run_engine_once(engine, prompts, params)
        pc = engine.runner.prefix_cache
        res.update(cache="on" if budget else "off", hit_rate=pc.hit_rate if pc else 0.0)
        rows.append(res)
        print(f"cache {res['cache']:3s}: {res['tok_s']:8.0f} tok/s  {res['req_s']:6.1f} req/s  "
              f"fed {res['fed_tokens']} tokens  hit rate {res['hit_rate']:.2f}")  # fmt: skip
        del engine
    print(f"throughput with the cache / without: {rows[1]['tok_s'] / rows[0]['tok_s']:.2f}x")
    return rows


def run_engine_once(engine: Engine, prompts: list[list[int]], params: dict) -> dict:
    r = engine.runner
    t0w = r.work["tokens"]
    sync()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync()
    secs = time.perf_counter() - t
    tokens = sum(o.completion_tokens for o in outs)
    return {
        "seconds": secs,
        "tokens": tokens,
        "tok_s": tokens / secs,
        "req_s": len(prompts) / secs,
        "fed_tokens": r.work["tokens"] - t0w,
    }


def _timeline_text(t: dict | None) -> str:
    if not t:
        return ""
    busy = "-" if t["device_busy"] is None else f"{100 * t['device_busy']:.0f}%"
    return f"  host {t['host_ms_per_step']:.2f} ms/step, device busy {busy}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="sdar-4b,llada2-mini")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--canvas", type=int, default=256)
    ap.add_argument("--tokens-per-forward", type=int, default=1)
    ap.add_argument("--ref-canvas", type=int, default=64, help="reference loop's gen_length")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", help="comma list of none,fp8,int8,nf4")
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="one more run per batch under the profiler: host ms a step, device-busy fraction",
    )
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--expert-gemm",
        default="aten",
        help="comma list of aten,triton: each runs every batch (the `expert_gemm` setting)",
    )
    ap.add_argument("--shared-prefix", type=int, default=0, help="run the prefix-cache section")
    ap.add_argument("--requests", type=int, default=32, help="prefix-cache section: requests")
    ap.add_argument(
        "--paged-attention",
        default="gather",
        help="comma list of gather,flex: each runs every batch (the `paged_attention` setting)",
    )
    args = ap.parse_args()
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    if args.shared_prefix:
        print(f"device={name} torch={torch.__version__} random {args.dtype} weights")
        rows = prefix_section(args, dev)
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "prefix.json").write_text(json.dumps({"device": name, "rows": rows}, indent=1))
        return
    bw = copy_bandwidth(dev)
    print(f"device={name} torch={torch.__version__} copy bandwidth={bw / 1e12:.2f} TB/s")
    print(f"random {args.dtype} weights, prompt {args.prompt}, canvas {args.canvas}, "
          f"{args.tokens_per_forward} token(s) per forward per row, low_confidence_static")  # fmt: skip
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict] = []
    runs = [(m, q) for m in args.models.split(",") for q in args.quantization.split(",")]
    modes = args.paged_attention.split(",")
    for preset, quant in runs:
        lm = random_checkpoint(preset, args.dtype, args.device, None if quant == "none" else quant)
        family = lm.family.name
        block = int(lm.config.get("block_size") or lm.family.default_block_length)
        steps = block // args.tokens_per_forward
        cfg = EngineConfig(
            model=f"random:{preset}", device=args.device, dtype=args.dtype,
            max_rows=max(batches), max_canvas=args.canvas + block,
            max_prompt=args.prompt + 8, max_queue=max(batches) * 2,
        )  # fmt: skip
        kernels = args.expert_gemm.split(",")
        engine = Engine(
            dataclasses.replace(cfg, paged_attention=modes[0], expert_gemm=kernels[0]), lm
        )
        params = {
            "max_tokens": args.canvas,
            "block_length": block,
            "steps": steps,
            "algorithm": "low_confidence_static",
        }
        gen = torch.Generator().manual_seed(0)
        vocab = min(int(lm.model.vocab_size), 30000)
        ref = run_reference(
            engine,
            torch.randint(100, vocab, (args.prompt,), generator=gen).tolist(),
            family,
            dict(params, max_tokens=args.ref_canvas),
        )
        print(f"\n== {preset} ({family}, block {block}, steps {steps}) quantization={quant} "
              f"weights {weight_bytes(lm.model, None) / 1e9:.2f} GB")  # fmt: skip
        print(f"reference (no cache, batch 1, gen {args.ref_canvas}): {ref['tok_s']:.1f} tok/s, "
              f"{ref['seconds'] / ref['forwards'] * 1e3:.2f} ms/forward")  # fmt: skip
        print(
            " batch    tok/s  ms/step  floor ms  x floor  x ref  steps  paged_attention expert_gemm"
        )
        for mode, kernel, b in itertools.product(modes, kernels, batches):
            setting = {"paged_attention": mode, "expert_gemm": kernel}
            if any(getattr(engine.config, k) != v for k, v in setting.items()):
                del engine  # one pool at a time on the device
                gc.collect()
                torch.cuda.empty_cache() if dev.type == "cuda" else None
                engine = Engine(dataclasses.replace(cfg, **setting), lm)
            prompts = [
                torch.randint(100, vocab, (args.prompt,), generator=gen).tolist() for _ in range(b)
            ]
            res = run_engine(engine, prompts, params, args.timeline)
            distinct = None
            if family == "llada2":
                cfg_e = lm.config
                distinct = expected_distinct_experts(
                    int(cfg_e["num_experts"]), int(cfg_e["num_experts_per_tok"]), b * block
                )
            share = None if distinct is None else distinct / int(lm.config["num_experts"])
            floor_ms = weight_bytes(lm.model, share) / bw * 1e3
            row = {
                "model": preset, "quantization": quant, "family": family, "batch": b, "block": block, "steps": steps,
                "paged_attention": mode, "expert_gemm": kernel,
                **res, "floor_ms": floor_ms, "x_floor": res["ms_per_step"] / floor_ms,
                "ref_tok_s": ref["tok_s"], "x_ref": res["tok_s"] / ref["tok_s"],
                "distinct_experts": distinct,
            }  # fmt: skip
            rows.append(row)
            print(f"{b:6d} {res['tok_s']:8.0f} {res['ms_per_step']:8.2f} {floor_ms:9.2f} "
                  f"{row['x_floor']:8.2f} {row['x_ref']:6.1f} {res['steps']:6d}  {mode} {kernel}"
                  + (f"  experts/layer {distinct:.0f}" if distinct else "")
                  + _timeline_text(res.get("timeline")))  # fmt: skip
        del engine, lm
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"device": name, "torch": torch.__version__, "bandwidth_Bps": bw}
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
