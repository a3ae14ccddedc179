"""GPU check of `paged_attention=flex` (dlm_engine/paged_flex.py) against `gather`.

    python benchmarks/gpu_check_paged_attention.py --out $OUT               # on the GPU
    python benchmarks/gpu_check_paged_attention.py --device cpu --tiny --out /tmp/pa  # smoke

1. One layer's block attention (the page write, then attention over the pool) through the
   packed forward's own code (`ragged.plan_packed`, `PackedAttention`), on random pools
   shaped like SDAR-4B (page 16, its KV heads and head dim): rows of about `--keys` keys
   that share their first pages (a prompt prefix) and end mid-page, each feeding one block
   of queries; bucketed shapes, as the CUDA-graph path feeds them. Per batch: the largest
   difference between the two outputs, and the time of one call (replayed as a captured
   CUDA graph on CUDA, as the engine runs it; the BlockMask is built once per forward, so
   it is made before the timed calls as the first layer does).
2. Whole steps: the engine over random bf16 SDAR-4B weights at batch 1 and 128, once per
   way (`gpu_bench_block.run_engine`: an untimed run, then the timed one).

Prints JSON and writes it to `--out DIR/paged_attention.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dlm_engine import Engine, EngineConfig  # noqa: E402
from dlm_engine.loader import random_checkpoint  # noqa: E402
from dlm_engine.paged_kv import PagePool  # noqa: E402
from dlm_engine.presets import PRESETS  # noqa: E402
from dlm_engine.ragged import PackedAttention, RowQuery, plan_packed  # noqa: E402

TINY = "sdar-tiny"  # --tiny: a 2-layer SDAR for the CPU smoke run
TINY_PRESET = {
    **PRESETS["sdar-4b"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "mask_token_id": 500,
    "eos_token_id": 501,
    "torch_dtype": "float32",
}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def layer_rows(batch: int, keys: int, block: int, page: int) -> list[tuple]:
    """(first fed position, length, block, page table) per row: every row shares the first
    two pages (a prompt prefix), lengths vary by a few blocks (partial last pages), each row
    feeds its active block."""
    rows, next_page = [], 2
    for r in range(batch):
        length = keys - block * (r % 5)
        n = -(-length // page)
        table = [0, 1] + list(range(next_page, next_page + n - 2))
        next_page += n - 2
        rows.append((length - block, length, block, table))
    return rows


def time_call(fn, dev: torch.device, iters: int) -> tuple[float, bool]:
    """Milliseconds per call: a captured CUDA graph replayed (CUDA), else eager calls."""
    fn()
    sync(dev)
    graphed = False
    call = fn
    if dev.type == "cuda":
        try:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            call, graphed = graph.replay, True
        except RuntimeError as exc:  # report it and time eagerly
            print(f"graph capture failed, timing eagerly: {exc}", file=sys.stderr)
    call()
    sync(dev)
    t = time.perf_counter()
    for _ in range(iters):
        call()
    sync(dev)
    return (time.perf_counter() - t) / iters * 1e3, graphed


@torch.inference_mode()
def layer_section(args, dev: torch.device, dtype: torch.dtype) -> list[dict]:
    preset = TINY_PRESET if args.tiny else PRESETS["sdar-4b"]
    heads, kv = preset["num_attention_heads"], preset["num_key_value_heads"]
    dim, block, page = preset["head_dim"], preset["block_size"], 16
    out = []
    for batch in [int(b) for b in args.batches.split(",")]:
        rows = layer_rows(batch, args.keys, block, page)
        n_pages = max(p for *_, table in rows for p in table) + 1 + args.spare_pages
        g = torch.Generator(device=dev).manual_seed(batch)
        base = torch.randn((n_pages + 1, page, kv, dim), generator=g, device=dev, dtype=dtype)
        fed = sum(end - start for start, end, *_ in rows)
        res: dict = {"batch": batch, "keys": args.keys, "pool_pages": n_pages}
        outs, packed = {}, []
        for mode in ("gather", "flex"):
            pool = PagePool(1, n_pages, page, kv, dim, dtype, dev)
            pool.k[0].copy_(base)
            pool.v[0].copy_(base.flip(0))
            queries = [
                RowQuery(torch.zeros(end - start, dtype=torch.long, device=dev), start, end,
                         start, None, blk, table)
                for start, end, blk, table in rows
            ]  # fmt: skip
            plan = plan_packed(
                queries, width=block, shift=0, pad_id=0, device=dev, pool=None, bucket=True,
                query_multiple=32, pages=pool, paged_attention=mode,
            )  # fmt: skip
            n = plan.inputs["ids"].shape[1]  # the same packed length either way
            if not packed:  # one set of fresh queries, keys and values for both
                packed = [torch.randn((1, h, n, dim), generator=g, device=dev, dtype=dtype)
                          for h in (heads, kv, kv)]  # fmt: skip
            q, k, v = packed
            ctx = PackedAttention(plan.inputs, None, plan.layout, pool)
            try:
                t = time.perf_counter()
                outs[mode] = ctx.attend(0, q, k, v)[0, :, :fed].float()  # compiles; mask once
                sync(dev)
                res[f"{mode}_first_call_s"] = time.perf_counter() - t
                call = functools.partial(ctx.attend, 0, q, k, v)
                res[f"{mode}_ms"], res[f"{mode}_graphed"] = time_call(call, dev, 50)
            except Exception as exc:  # noqa: BLE001 - reported, the other figures still come
                traceback.print_exc()
                res[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"[:2000]
                break
        if "flex_ms" in res:
            res["max_abs_diff"] = float((outs["flex"] - outs["gather"]).abs().max())
            res["max_abs_gather"] = float(outs["gather"].abs().max())
            res["flex_over_gather"] = res["flex_ms"] / res["gather_ms"]
        print(json.dumps(res))
        out.append(res)
    return out


def step_section(args, dev: torch.device) -> list[dict]:
    from gpu_bench_block import run_engine

    name = TINY if args.tiny else "sdar-4b"
    if args.tiny:
        PRESETS[TINY] = TINY_PRESET
    lm = random_checkpoint(name, "float32" if args.tiny else "bfloat16", str(dev))
    block = int(lm.config["block_size"])
    batches = [int(b) for b in args.step_batches.split(",")]
    cfg = EngineConfig(
        model=f"random:{name}", device=str(dev), dtype="float32" if args.tiny else "bfloat16",
        max_rows=max(batches), max_canvas=args.canvas + block, max_prompt=args.prompt + 8,
        max_queue=2 * max(batches), kv_cache_tokens=args.kv_cache_tokens,
    )  # fmt: skip
    params = {
        "max_tokens": args.canvas,
        "block_length": block,
        "steps": block,
        "algorithm": "low_confidence_static",
    }
    vocab = min(int(lm.model.vocab_size), 30000)
    out = []
    for mode in ("gather", "flex"):
        engine = Engine(dataclasses.replace(cfg, paged_attention=mode), lm)
        for b in batches:
            gen = torch.Generator().manual_seed(b)
            prompts = [
                torch.randint(100, vocab - 20, (args.prompt,), generator=gen).tolist()
                for _ in range(b)
            ]
            row = {"paged_attention": mode, "batch": b, "prompt": args.prompt,
                   "canvas": args.canvas}  # fmt: skip
            try:
                t = time.perf_counter()
                row.update(run_engine(engine, prompts, params))
                row["wall_s"] = time.perf_counter() - t  # both runs: compiles and captures
                row["graphs"] = engine.runner.graph_captures
            except Exception as exc:  # noqa: BLE001 - reported, the other figures still come
                traceback.print_exc()
                row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            print(json.dumps(row))
            out.append(row)
        del engine
        gc.collect()  # the pool and graphs go before the next engine sizes its pool
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and model (CPU smoke)")
    ap.add_argument("--batches", default="", help="layer section batches (default 1,32,128)")
    ap.add_argument("--keys", type=int, default=0, help="keys a row (default 1100)")
    ap.add_argument("--spare-pages", type=int, default=4096, help="pool pages no row holds")
    ap.add_argument("--step-batches", default="", help="step section batches (default 1,128)")
    ap.add_argument("--prompt", type=int, default=0, help="step section prompt tokens")
    ap.add_argument("--canvas", type=int, default=0, help="step section generated tokens")
    ap.add_argument("--kv-cache-tokens", type=int, default=0, help="page pool (0: the default)")
    ap.add_argument("--skip-steps", action="store_true", help="the layer section only")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    small = {"batches": "1,3", "keys": 100, "spare_pages": 16, "step_batches": "1,2",
             "prompt": 12, "canvas": 8, "kv_cache_tokens": 1024}  # fmt: skip
    full = {"batches": "1,32,128", "keys": 1100, "step_batches": "1,128", "prompt": 512,
            "canvas": 128}  # fmt: skip
    for key, value in (small if args.tiny else full).items():
        if not getattr(args, key):
            setattr(args, key, value)
    dev = torch.device(args.device)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    meta = {"device": name, "torch": torch.__version__, "dtype": str(dtype), "tiny": args.tiny}
    print(json.dumps(meta))
    report = {"meta": meta, "layer": layer_section(args, dev, dtype)}
    if not args.skip_steps:
        report["steps"] = step_section(args, dev)
    worst = max(r.get("max_abs_diff", float("inf")) for r in report["layer"])
    failed = any("error" in r for r in report.get("steps", []))
    report["ok"] = worst <= (1e-4 if dtype == torch.float32 else 0.05) and not failed
    print(json.dumps({"ok": report["ok"], "max_abs_diff": worst}))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "paged_attention.json").write_text(json.dumps(report, indent=1))
    if not report["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
