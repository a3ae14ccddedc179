"""Tensor parallelism on GPUs (NCCL): TP=N against TP=1 on the same checkpoint, same process.

    python benchmarks/gpu_bench_tp.py --tp 2 [--model llada-8b] [--out DIR]

Writes a random bf16 checkpoint of a published architecture (`dlm_engine/presets.py`) in the
published layout to local disk (tensor parallelism reads each rank's slices of the
safetensors), then for TP=1 and TP=N: one forward's logits over a prompt and masked canvas,
greedy tokens of a few requests (exact mode), and the throughput of the benchmark schedule
(prompt 64, canvas 256, block 32, 64 steps) at batch 1 and 32 in exact and dual mode.
Random weights make logits nearly flat, so rounding differences between one matmul and a
sharded one followed by an all-reduce can flip greedy tokens; the logits' relative error is
the figure that says whether the shards compute the same model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dlm_engine import Engine, EngineConfig
from dlm_engine.models import build_model, detect_family
from dlm_engine.models.common import full_logits
from dlm_engine.presets import PRESETS
from dlm_engine.tokenizer_build import build_char_tokenizer
from dlm_lab.testing import write_checkpoint

PROMPT, CANVAS, BLOCK, STEPS = 64, 256, 32, 64


def write_random_checkpoint(preset: str, out: Path, device: str) -> Path:
    """Random bf16 weights of `preset` under the published tensor names."""
    config = dict(PRESETS[preset])
    family = detect_family(config)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(family, config)
    model = model.to_empty(device=device).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith(("norm.weight", "ln_f.weight")) else p.normal_(0, 0.02)
        for b in model.buffers():
            b.zero_()
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    del model
    sync_empty(device)
    config["torch_dtype"] = "bfloat16"
    write_checkpoint(out, config, state, shards=4)
    build_char_tokenizer(out, family.name)
    return out


def sync_empty(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run(engine: Engine, batch: int, mode: str, prompts: list[list[int]]) -> float:
    params = {"max_tokens": CANVAS, "block_length": BLOCK, "steps": STEPS, "temperature": 0.0}
    if mode != "exact":
        params["cache"] = mode
    engine.generate(prompts[:batch], params)  # warm-up: allocations (and graphs at TP=1)
    sync_empty(engine.config.device)
    t = time.perf_counter()
    outs = engine.generate(prompts[:batch], params)
    sync_empty(engine.config.device)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llada-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--modes", default="exact,dual")
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="shrunken preset: a CPU smoke run")
    args = ap.parse_args()
    if args.tiny:
        PRESETS[args.model].update(
            d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=128
        )
    if args.device.startswith("cuda"):
        print(
            f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()} torch={torch.__version__}"
        )
    tmp = Path(tempfile.mkdtemp(prefix="tp-ckpt-"))
    ckpt = write_random_checkpoint(args.model, tmp, args.device)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 30000, (32, PROMPT), generator=gen).tolist()
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[int, dict] = {}
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    for tp in (1, args.tp):
        t0 = time.perf_counter()
        engine = Engine(
            EngineConfig(
                model=str(ckpt), device=args.device, dtype=dtype, tensor_parallel_size=tp,
                max_rows=max(batches), max_canvas=CANVAS, max_prompt=PROMPT + 8,
                max_step_tokens=1 << 30,
            )
        )  # fmt: skip
        res: dict = {"start_s": time.perf_counter() - t0}
        x = torch.tensor([prompts[0] + [engine.mask_id] * 64], device=args.device)
        with torch.no_grad():
            res["logits"] = full_logits(engine.runner.model)(x).float().cpu()
        greedy = {"max_tokens": 64, "block_length": BLOCK, "steps": 64, "temperature": 0.0}
        res["tokens"] = [o.token_ids for o in engine.generate(prompts[:4], greedy)]
        for mode in args.modes.split(","):
            for b in batches:
                res[f"{mode}_b{b}_tok_s"] = run(engine, b, mode, prompts)
                print(f"TP={tp} {mode:5s} batch {b:3d}: {res[f'{mode}_b{b}_tok_s']:8.1f} tok/s",
                      flush=True)  # fmt: skip
        results[tp] = res
        close = getattr(engine.runner.model, "close", None)
        if close is not None:
            close()
        del engine
        sync_empty(args.device)
    one, many = results[1], results[args.tp]
    rel = float((many["logits"] - one["logits"]).norm() / one["logits"].norm())
    agree = float((many["logits"].argmax(-1) == one["logits"].argmax(-1)).float().mean())
    same = sum(a == b for a, b in zip(one["tokens"], many["tokens"], strict=True))
    print(f"logits TP={args.tp} vs TP=1: relative error {rel:.4f}, argmax agreement {agree:.3f}")
    print(f"greedy requests with identical tokens: {same} of {len(one['tokens'])}")
    summary = {"model": args.model, "tp": args.tp, "logits_rel_error": rel,
               "argmax_agreement": agree, "identical_greedy": same}  # fmt: skip
    for key in one:
        if key.endswith("tok_s"):
            summary[key] = {"tp1": one[key], f"tp{args.tp}": many[key],
                            "speedup": many[key] / one[key]}  # fmt: skip
            print(f"{key}: {one[key]:.1f} -> {many[key]:.1f} ({many[key] / one[key]:.2f}x)")
    summary["start_s"] = {"tp1": one["start_s"], f"tp{args.tp}": many["start_s"]}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_bench_tp.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
