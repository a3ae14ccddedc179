"""Tensor parallelism on GPUs (NCCL): TP=N against TP=1 on the same checkpoint, same process.

    python benchmarks/gpu_bench_tp.py --configs tp1,tp2 [--model llada-8b] [--out DIR]
    python benchmarks/gpu_bench_tp.py --configs tp2,tp2ep --model llada2-mini  # expert parallel
    python benchmarks/gpu_bench_tp.py --model diffusiongemma-26b-a4b --configs tp1,tp2,tp2ep \
        --runs uniform:1,uniform:32  # DiffusionGemma: 16 seeded denoising steps a canvas
    python benchmarks/gpu_bench_tp.py --configs tp1,tp2 --runs exact:1 --profile exact:1 \
        --profile-dir OUT  # where a batch-1 step's time goes on rank 0, all-reduces included

Writes a random bf16 checkpoint of a published architecture (`dlm_engine/presets.py`) in the
published layout to local disk (/dev/shm where it exists: tensor parallelism reads each rank's
slices of the safetensors), then for each configuration (`tpN`: N ranks; `tpNep`: N ranks with
the routed experts spread whole over them): one forward's logits over a prompt and masked
canvas, greedy tokens of a few requests (exact mode), and the throughput of the benchmark
schedule (prompt 64, canvas 256, block 32, 64 steps; DiffusionGemma's `uniform`: one 256-token
canvas in 16 seeded denoising steps, no logits compared) for each `--runs` mode:batch, each
against the first configuration, with the mean time of one forward. For block-diffusion
models each configuration also reports the distinct routed experts an in-block forward of one
request selects per MoE layer and rank 0's weight-read floor of that forward (its shard's
weights, the selected share of the experts, at the measured copy bandwidth; all-reduce time
not included). CUDA graphs are captured on every rank (`--no-graphs`: eager).
Random weights make logits nearly flat, so rounding differences between one matmul and a
sharded one followed by an all-reduce can flip greedy tokens; the logits' relative error is
the figure that says whether the shards compute the same model.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

from dlm_engine import Engine, EngineConfig
from dlm_engine.models import build_model, detect_family
from dlm_engine.models.common import full_logits
from dlm_engine.presets import PRESETS
from dlm_engine.tokenizer_build import build_char_tokenizer

PROMPT, CANVAS, BLOCK, STEPS = 64, 256, 32, 64
UNIFORM_STEPS = 16  # DiffusionGemma's denoising steps a canvas (the gpu_bench_gemma schedule)
# DiffusionGemma's generation defaults for random weights: stability and confidence such that
# the adaptive stop never fires, so every canvas runs its steps
UNIFORM_GENERATION = {
    "max_denoising_steps": UNIFORM_STEPS, "stability_threshold": 1, "confidence_threshold": 0.005,
}  # fmt: skip


def write_random_checkpoint(
    config: dict, out: Path, device: str, shard_bytes: int = 8 << 30
) -> Path:
    """Random bf16 weights of the architecture `config` under the published tensor names, in
    safetensors shards of about `shard_bytes`. The model is laid out on the meta device; each
    shard's tensors are drawn on `device`, moved to host memory, written and freed before the
    next shards, so a model larger than one GPU (LLaDA2.0-flash's 206 GB) needs room for its
    files and a few shards, not for the model twice."""
    config = dict(config)
    family = detect_family(config)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(family, config)
    params = {name for name, _ in model.named_parameters()}
    metas = model.state_dict()
    del model

    def nbytes(meta: torch.Tensor) -> int:
        return meta.numel() * (2 if meta.is_floating_point() else meta.element_size())

    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(metas):
        if shards[-1] and size + nbytes(metas[name]) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes(metas[name])
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    # files are written on threads while the next shard is drawn (safetensors writes release
    # the GIL); at most `writers` shards wait in host memory
    writers = 4
    pool = ThreadPoolExecutor(writers)
    pending: list = []
    with torch.no_grad():
        for i, names in enumerate(shards):
            state = {}
            for name in names:
                meta = metas[name]
                dtype = torch.bfloat16 if meta.is_floating_point() else meta.dtype
                t = torch.empty(meta.shape, dtype=dtype, device=device)
                if name not in params:  # buffers (routers' biases, scalars): zeros
                    t.zero_()
                elif name.endswith(("norm.weight", "ln_f.weight")):
                    t.fill_(1.0)
                else:
                    t.normal_(0, 0.02)
                state[name] = t.cpu()
                total += t.numel() * t.element_size()
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            pending.append(pool.submit(save_file, state, str(out / fname), {"format": "pt"}))
            weight_map.update(dict.fromkeys(names, fname))
            del state
            while len(pending) >= writers:
                pending.pop(0).result()
    for job in pending:
        job.result()
    pool.shutdown()
    sync_empty(device)
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if family.uniform_diffusion:  # DiffusionGemma: Gemma's special ids, its generation config
        from dlm_lab.testing_diffusion_gemma import build_gemma_char_tokenizer

        build_gemma_char_tokenizer(out)
        (out / "generation_config.json").write_text(json.dumps(UNIFORM_GENERATION))
    else:
        build_char_tokenizer(out, family.name)
    return out


def sync_empty(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def schedule(mode: str, max_tokens: int, block: int = BLOCK) -> dict:
    """The fixed schedule: `max_tokens` in blocks of 32, 4 tokens a step; `block` for the
    block-diffusion families, whose blocks are `block` tokens (LLaDA2's 32: 8 steps a block,
    published low_confidence_static; SDAR's 4: a step a token)."""
    if mode == "block":
        return {"max_tokens": max_tokens, "steps": min(BLOCK * STEPS // CANVAS, block),
                "algorithm": "low_confidence_static", "temperature": 0.0}  # fmt: skip
    if mode == "uniform":  # DiffusionGemma: a fixed number of denoising steps a canvas, seeded
        return {"max_tokens": max_tokens, "steps": UNIFORM_STEPS, "seed": 0}
    params = {"max_tokens": max_tokens, "block_length": BLOCK, "temperature": 0.0}
    params["steps"] = max_tokens * STEPS // CANVAS
    if mode != "exact":
        params["cache"] = mode
    return params


def run(engine: Engine, batch: int, mode: str, prompts: list[list[int]]) -> tuple[float, float]:
    """Generated tok/s of the schedule at `batch`, and the mean ms of one forward (a step)."""
    params = schedule(mode, CANVAS, engine.model_block or BLOCK)
    eager = mode == "exact" and batch * (PROMPT + CANVAS) > engine.config.cuda_graph_max_tokens
    # warm-up: allocations and graph captures (eager forwards capture nothing: one block)
    engine.generate(
        prompts[:batch], schedule(mode, BLOCK, engine.model_block or BLOCK) if eager else params
    )
    sync_empty(engine.config.device)
    f0 = engine.runner.forward_passes
    t = time.perf_counter()
    outs = engine.generate(prompts[:batch], params)
    sync_empty(engine.config.device)
    seconds = time.perf_counter() - t
    forwards = max(1, engine.runner.forward_passes - f0)
    return sum(len(o.token_ids) for o in outs) / seconds, seconds / forwards * 1e3


def distinct_experts(engine: Engine, prompt: list[int]) -> float | None:
    """Mean distinct routed experts one MoE layer selects in an in-block forward of one
    request (the model's router on these weights), or None for a model without routed
    experts. The weight-read floor of a batch-1 step counts these, not all experts."""
    import sys

    from dlm_engine.models import moe

    seen: list[tuple[int, int]] = []  # (tokens routed, distinct experts) per MoE layer call
    original = moe.run_experts

    def counting(flat, chosen, *args, **kw):
        seen.append((int(chosen.shape[0]), int(chosen.unique().numel())))
        return original(flat, chosen, *args, **kw)

    # every family module that imported the grouped experts by name (LLaDA2, SDAR-MoE)
    users = [
        m for name, m in list(sys.modules.items())
        if name.startswith("dlm_engine.models.") and getattr(m, "run_experts", None) is original
    ]  # fmt: skip
    for m in users:
        m.run_experts = counting
    graphs, engine.runner.graphs = engine.runner.graphs, None  # eager: a replay runs no Python
    try:
        engine.generate([prompt], schedule("block", BLOCK, engine.model_block))
    finally:
        for m in users:
            m.run_experts = original
        engine.runner.graphs = graphs
    if not seen:
        return None
    fewest = min(tokens for tokens, _ in seen)  # in-block forwards: the block's tokens only
    counts = [n for tokens, n in seen if tokens == fewest]
    return sum(counts) / len(counts)


def floor_ms(engine: Engine, experts: float | None, bandwidth: float) -> float:
    """Batch-1 weight-read floor of a forward on rank 0: its shard's weights with the routed
    experts counted by the share a forward selects (`experts` of the model's experts: a
    tensor-parallel rank holds a slice of every expert, an expert-parallel one whole experts
    of its own), at `bandwidth`. All-reduce time is not included."""
    from gpu_bench_block import weight_bytes

    lm = engine.runner.model
    model = getattr(lm, "local", lm)  # rank 0's shard under tensor parallel
    total_experts = int(getattr(getattr(model, "arch", None), "num_experts", 0) or 0)
    share = experts / total_experts if experts is not None and total_experts else None
    return weight_bytes(model, share) / bandwidth * 1e3


def profile_run(engine: Engine, args, prompts: list[list[int]], name: str) -> str:
    """Rank 0's view of one more run of `--profile` (mode:batch) under the PyTorch profiler:
    its kernels by device time, the collectives' kernels included (an all-reduce's kernel
    time holds its wait for the other ranks), and host time; a Chrome trace in
    `--profile-dir`."""
    from torch.profiler import ProfilerActivity, profile

    mode, batch = args.profile.split(":")
    activities = [ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run(engine, int(batch), mode, prompts)
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.profile_dir) / f"{name}_{mode}_b{batch}.json"))
    sort = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30)
    print(f"---- {name} {mode} batch {batch} under the profiler\n{table}", flush=True)
    return table


def parse_config(name: str) -> tuple[int, bool]:
    """`tp2` -> (2, False), `tp2ep` -> (2, True)."""
    ep = name.endswith("ep")
    return int(name.removeprefix("tp").removesuffix("ep")), ep


def measure(ckpt: Path, name: str, args, prompts, runs) -> dict:
    tp, ep = parse_config(name)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    batches = [b for _, b in runs]
    t0 = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model=str(ckpt), device=args.device, dtype=dtype, tensor_parallel_size=tp,
            expert_parallel=ep, cuda_graphs=not args.no_graphs, max_rows=max(batches),
            expert_gemm=args.expert_gemm,
            max_canvas=CANVAS, max_prompt=PROMPT + 8, max_step_tokens=1 << 30,
        )
    )  # fmt: skip
    res: dict = {"start_s": time.perf_counter() - t0}
    uniform = engine.family.uniform_diffusion
    if not uniform:  # one forward over the prompt and a masked canvas (no masks in DiffusionGemma)
        x = torch.tensor([prompts[0] + [engine.mask_id] * 64], device=args.device)
        with torch.no_grad():
            res["logits"] = full_logits(engine.runner.model)(x).float().cpu()
    first = "uniform" if uniform else "block" if engine.model_block else "exact"
    greedy = schedule(first, 64, engine.model_block or BLOCK)
    res["tokens"] = [o.token_ids for o in engine.generate(prompts[:4], greedy)]
    for mode, b in runs:
        key = f"{mode}_b{b}_tok_s"
        res[key], res[f"{mode}_b{b}_ms_per_forward"] = run(engine, b, mode, prompts)
        print(f"{name} {mode:5s} batch {b:3d}: {res[key]:8.1f} tok/s", flush=True)
    if args.profile:
        res["profile"] = profile_run(engine, args, prompts, name)
    if engine.model_block:  # block diffusion: a batch-1 in-block forward's weight-read floor
        res["distinct_experts"] = distinct_experts(engine, prompts[0])
        res["floor_ms_b1"] = floor_ms(engine, res["distinct_experts"], args.bandwidth)
        print(f"{name} batch-1 floor {res['floor_ms_b1']:.2f} ms a forward, distinct experts "
              f"a layer {res['distinct_experts']}", flush=True)  # fmt: skip
    res["graph_captures"] = engine.runner.graph_captures
    close = getattr(engine.runner.model, "close", None)
    if close is not None:
        close()
    del engine
    sync_empty(args.device)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llada-8b")
    ap.add_argument("--configs", default="tp1,tp2", help="tpN or tpNep, the first the baseline")
    ap.add_argument("--runs", default="exact:1,exact:32,dual:32", help="mode:batch, ...")
    ap.add_argument("--no-graphs", action="store_true", help="eager forwards on every rank")
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="shrunken preset: a CPU smoke run")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than published (0: all)")
    ap.add_argument("--profile", default="", help="mode:batch: one more run of it, profiled")
    ap.add_argument("--profile-dir", default="", help="write the profiles' Chrome traces here")
    ap.add_argument("--expert-gemm", default="aten", help="aten or triton (`expert_gemm`)")
    ap.add_argument(
        "--hang-dump", type=float, default=0, help="seconds: print every thread's stack and exit"
    )
    args = ap.parse_args()
    if args.hang_dump:  # a run that stalls says where rank 0 waits instead of saying nothing
        faulthandler.dump_traceback_later(args.hang_dump, exit=True)
    if args.layers:
        for key in ("n_layers", "num_hidden_layers"):
            if key in PRESETS[args.model]:
                PRESETS[args.model][key] = args.layers
    if args.tiny:
        shrink = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4,
                  "mlp_hidden_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                  "intermediate_size": 128, "moe_intermediate_size": 32}  # fmt: skip
        PRESETS[args.model].update({k: v for k, v in shrink.items() if k in PRESETS[args.model]})
        if "text_config" in PRESETS[args.model]:  # DiffusionGemma: the test suite's tiny shape
            from dlm_lab.testing_diffusion_gemma import tiny_config

            text = tiny_config(32000, num_global_key_value_heads=2).text_config.to_dict()
            PRESETS[args.model]["text_config"] = text
            PRESETS[args.model]["canvas_length"] = 16
    if args.device.startswith("cuda"):
        print(
            f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()} torch={torch.__version__}"
        )
    if args.device.startswith("cuda"):
        from gpu_bench_block import copy_bandwidth

        args.bandwidth = copy_bandwidth(torch.device(args.device))
        print(f"copy bandwidth {args.bandwidth / 1e12:.2f} TB/s", flush=True)
    else:  # a CPU smoke run: any positive figure
        args.bandwidth = 1e10
    shm = Path("/dev/shm")
    tmp = Path(tempfile.mkdtemp(prefix="tp-ckpt-", dir=shm if shm.is_dir() else None))
    print(f"checkpoint in {tmp}: {shutil.disk_usage(tmp).free / 1e9:.0f} GB free", flush=True)
    try:
        t0 = time.perf_counter()
        # written by a child process: the host memory its shards passed through goes back to
        # the system when it exits, before the ranks load (a 206 GB model needs all of it)
        writer = mp.get_context("spawn").Process(
            target=write_random_checkpoint, args=(dict(PRESETS[args.model]), tmp, args.device)
        )
        writer.start()
        writer.join()
        if writer.exitcode:
            raise SystemExit(f"writing the checkpoint failed (exit code {writer.exitcode})")
        ckpt = tmp
        print(f"checkpoint written in {time.perf_counter() - t0:.1f} s", flush=True)
        gen = torch.Generator().manual_seed(0)
        runs = [(m, int(b)) for m, b in (r.split(":") for r in args.runs.split(","))]
        n_prompts = max(32, *(b for _, b in runs))  # every row of the widest run its own prompt
        prompts = torch.randint(100, 30000, (n_prompts, PROMPT), generator=gen).tolist()
        names = args.configs.split(",")
        results = {name: measure(ckpt, name, args, prompts, runs) for name in names}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base_name = names[0]
    base = results[base_name]
    summary: dict = {
        "model": args.model,
        "layers": args.layers or "published",
        "configs": names,
        "graphs": not args.no_graphs,
    }
    for name in names[1:]:
        other = results[name]
        same = sum(a == b for a, b in zip(base["tokens"], other["tokens"], strict=True))
        summary[f"{name}_vs_{base_name}"] = {"identical_greedy": same}
        if "logits" in base:
            rel = float((other["logits"] - base["logits"]).norm() / base["logits"].norm())
            agree = (other["logits"].argmax(-1) == base["logits"].argmax(-1)).float().mean()
            summary[f"{name}_vs_{base_name}"].update(
                logits_rel_error=rel, argmax_agreement=float(agree)
            )
    for key in ("distinct_experts", "floor_ms_b1"):
        if key in base:
            summary[key] = {name: results[name].get(key) for name in names}
    for key in base:
        if key.endswith("ms_per_forward"):
            summary[key] = {name: results[name][key] for name in names}
        if key.endswith("tok_s"):
            summary[key] = {name: results[name][key] for name in names}
            for name in names[1:]:
                summary[key][f"speedup_{name}"] = results[name][key] / base[key]
    summary["start_s"] = {name: results[name]["start_s"] for name in names}
    summary["graph_captures"] = {name: results[name]["graph_captures"] for name in names}
    if args.profile:
        summary["profile"] = {name: results[name]["profile"] for name in names}
    print(json.dumps({k: v for k, v in summary.items() if k != "profile"}, indent=1))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_bench_tp.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
