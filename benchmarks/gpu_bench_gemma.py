"""DiffusionGemma on one GPU through the engine: per-step time, decode and end-to-end output
tok/s, TTFT, and the bf16 weight-read floor of a step.

    python benchmarks/gpu_bench_gemma.py [--batches 1,8,32] [--prompt 4096] [--output 512]
        [--steps 16] [--baseline out/gemma_base/diffusion_gemma.py] [--out FILE]
    python benchmarks/gpu_bench_gemma.py --tiny --batches 1,32 --prompt 512 --output 64
        # CPU, the tiny test checkpoint
    python benchmarks/gpu_bench_gemma.py --shared-prefix 3584 [--encoder-prefix-cache-bytes 0]
        # prompts sharing their first 3,584 tokens, the encoder prefix cache on (or off)
    python benchmarks/gpu_bench_gemma.py --quantization fp8
        # linear layers and experts in e4m3 (quantized at load), beside a bf16 run

The model is the published google/diffusiongemma-26B-A4B-it text architecture
(`presets.py`) with random bf16 weights, built on the meta device and materialised straight
on the GPU (no checkpoint is written). Requests run through `Engine` (the code that serves):
`batch` requests of `prompt` random tokens and `max_tokens=output`, `steps` denoising steps
per canvas, all added at once. Adaptive stopping stays on, as served, but never fires: random
weights give a mean entropy near ln(262144) = 12.5 nats, far above `stop_entropy`, so every
canvas takes all its steps (`engine_steps` shows it) and the text never ends early.

Figures per batch:
- `step_ms`: median wall time of an engine step that encodes nothing (one denoising step of
  every row), `forward_ms` its decoder forward (CUDA events), the rest is the per-row head,
  sampler and self-conditioning;
- `ttft_ms`: from adding the requests to each one's first streamed tokens (its first canvas),
  median over requests (`ttft_max_ms` the last request's);
- `first_step_encoder_forwards`, `first_step_encoded_rows`: the encoder forwards of the step
  that admits the batch and the rows they encode (prompts of rows admitted together are
  packed into one forward of at most `encode_step_tokens` tokens, `--encode-step-tokens`;
  longer prompts go on in chunks over the next steps); `encoder_forwards` over the run;
- `decode_tok_s`: output tokens / (end-to-end time - prompt encoding time); finished canvases
  re-encoded between canvases count as decode time (a forward encoding both prompt chunks and
  canvases is split between them by tokens);
- `output_tok_s`: output tokens / end-to-end time;
- `compute_floor_ms`: the step's matrix-product FLOPs (`step_tflop`, second canvas) at the
  H100's dense bf16 peak (989 TFLOP/s); `achieved_tflop_s` what the measured step did;
- `floor_ms`: bytes of the weights one step reads (every decoder weight, experts all touched
  by a 256-token canvas, plus the tied embedding read a second time by self-conditioning) /
  HBM bandwidth (3.35 TB/s, H100 SXM); `floor_decode_tok_s` the decode rate at that floor.

Each batch runs with the decoder step eager and replayed from CUDA graphs (`--graphs`), the
same requests and seeds, and says whether the tokens agree (`tokens_equal_other_mode`).

`--shared-prefix N`: every prompt (the warm-up request's too) starts with the same N random
tokens, as requests under one long system prompt; the warm-up leaves that prefix in the
encoder prefix cache (`--encoder-prefix-cache-bytes`, -1: the server's `auto`, 0: off), so
each measured row copies its whole 256-token chunks of it instead of encoding them.
`prefix_hit_tokens` and `prefix_lookup_tokens` are the cache's counters over the run; compare
`ttft_ms` and `prompt_encode_s` with the cache on and off.

`--baseline FILE` also times the decoder forward of an older `diffusion_gemma.py` (its
`decode`, a Python loop over experts) on the same weights, for before/after figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dlm_engine import Engine, EngineConfig
from dlm_engine.loader import LoadedModel, load_checkpoint
from dlm_engine.models import build_model, detect_family
from dlm_engine.presets import PRESETS

PRESET = "diffusiongemma-26b-a4b"
HBM_BYTES_PER_S = 3.35e12  # H100 SXM
PEAK_BF16_FLOP_S = 989e12  # H100 SXM dense bf16 tensor cores
VLLM_ANCHOR = {
    "source": "vLLM blog 2026-06-10: H100, batch 1, FP8, 4096 in / 512 out, 16 steps fixed",
    "output_tok_s": 895,
    "decode_tok_s": 1757,
    "ttft_ms": 426,
    "goal_32_concurrent_output_tok_s": 2700,
}


def random_model(device: torch.device) -> LoadedModel:
    """The published architecture with random bf16 weights, made on `device` directly."""
    from transformers import AutoTokenizer

    from dlm_engine.decoding.uniform_params import uniform_defaults
    from dlm_lab.testing_diffusion_gemma import build_gemma_char_tokenizer

    config = json.loads(json.dumps(PRESETS[PRESET]))
    family = detect_family(config)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = build_model(family, config)
        model = model.to_empty(device=device)
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("scale"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for name, b in model.named_buffers():
            b.fill_(1.0 if name.endswith("layer_scalar") else 0.0)
    model.eval().requires_grad_(False)
    tok_dir = Path(tempfile.mkdtemp(prefix="dlm-gemma-tok-"))
    build_gemma_char_tokenizer(tok_dir)
    gen_cfg = {"max_denoising_steps": 16, "stability_threshold": 1, "confidence_threshold": 0.005}
    (tok_dir / "generation_config.json").write_text(json.dumps(gen_cfg))
    vocab = int(config["text_config"]["vocab_size"])
    never = vocab  # a stop id no canvas can hold: the text never ends early
    return LoadedModel(
        model,
        family,
        config,
        AutoTokenizer.from_pretrained(str(tok_dir)),
        -1,
        never,
        frozenset({never}),
        torch.bfloat16,
        device,
        tok_dir,
        uniform_defaults(gen_cfg),
    )


def weight_floor(model: torch.nn.Module) -> dict[str, float]:
    """Bytes one decoder step reads at least, and that over the HBM bandwidth."""
    dec = model.model.decoder
    # FP8 layers keep their weights and scales as buffers
    total = sum(t.numel() * t.element_size() for t in (*dec.parameters(), *dec.buffers()))
    embed = dec.embed_tokens.weight
    step_bytes = total + embed.numel() * embed.element_size()  # head + soft embeddings
    return {
        "weight_bytes": total,
        "step_bytes": step_bytes,
        "floor_ms": 1e3 * step_bytes / HBM_BYTES_PER_S,
    }


def step_flops(model: torch.nn.Module, batch: int, cache: int) -> float:
    """Multiply-add FLOPs of one decoder step over `batch` canvases whose rows hold `cache`
    encoded positions: every matrix product (projections, dense MLP, the k chosen experts,
    router, attention over cache + canvas, head and self-conditioning's soft embeddings)."""
    a = model.arch
    h, length = a.hidden_size, a.canvas_length
    per_token = 2 * 3 * h * a.intermediate_size  # self-conditioning MLP
    per_token += 2 * 2 * a.vocab_size * h  # head, soft embeddings
    for shape in a.layers:
        qo = 2 * a.num_attention_heads * shape.head_dim * h
        kv = (1 if not shape.sliding else 2) * shape.kv_heads * shape.head_dim * h
        per_token += 2 * (qo + kv)
        per_token += 2 * 3 * h * a.intermediate_size + 2 * h * a.num_experts
        per_token += 2 * a.top_k_experts * 3 * h * a.moe_intermediate_size
        keys = (min(cache, a.sliding_window - 1) if shape.sliding else cache) + length
        per_token += 2 * 2 * a.num_attention_heads * shape.head_dim * keys
    return float(per_token * batch * length)


class Timers:
    """Wall time of the encoder forwards (split between prompt and finished-canvas tokens),
    installed on the model instance, and CUDA-event time of the decoder steps (`timed`,
    around the runner's)."""

    def __init__(self, model: Any, cuda: bool) -> None:
        self.model, self.cuda = model, cuda
        self.prompt_s = 0.0
        self.canvas_encode_s = 0.0
        self.forward_events: list[tuple[Any, Any]] = []
        self.encodes: list[int] = []  # rows (spans) of each encoder forward
        self.runner: Any = None  # the engine's UniformRunner: which spans are prompts
        encode = model.encode

        def timed_encode(spans):
            self._sync()
            t0 = time.perf_counter()
            encode(spans)
            self._sync()
            dt = time.perf_counter() - t0
            tokens = sum(ids.numel() for ids, _ in spans)
            prompts = {id(r.cache) for r in self.runner.rows.values() if r.canvases_done == 0}
            prompt = sum(ids.numel() for ids, c in spans if id(c) in prompts)
            self.prompt_s += dt * prompt / tokens
            self.canvas_encode_s += dt * (tokens - prompt) / tokens
            self.encodes.append(len(spans))

        model.encode = timed_encode

    def timed(self, decode):
        """The runner's decoder step (eager or graphed) between two CUDA events."""

        def timed_decode(*args):
            if not self.cuda:
                return decode(*args)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = decode(*args)
            b.record()
            self.forward_events.append((a, b))
            return out

        return timed_decode

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset(self) -> None:
        self.prompt_s = self.canvas_encode_s = 0.0
        self.forward_events = []
        self.encodes = []

    def forward_ms(self) -> list[float]:
        return [a.elapsed_time(b) for a, b in self.forward_events]


def run_batch(engine: Engine, timers: Timers, batch: int, args, vocab: int) -> dict[str, Any]:
    cuda = engine.loaded.device.type == "cuda"
    gen = torch.Generator().manual_seed(batch)
    shared = min(args.shared_prefix, args.prompt)
    prefix = torch.randint(3, vocab, (shared,), generator=torch.Generator().manual_seed(0))
    prompts = [
        prefix.tolist() + torch.randint(3, vocab, (args.prompt - shared,), generator=gen).tolist()
        for _ in range(batch)
    ]
    cache = engine.runner.prefix_cache
    looked, hits = (cache.lookup_tokens, cache.hit_tokens) if cache is not None else (0, 0)
    params = {"max_tokens": args.output, "steps": args.steps}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    timers.reset()
    t0 = time.perf_counter()
    ids = [engine.add_request(None, p, params | {"seed": i}) for i, p in enumerate(prompts)]
    first: dict[str, float] = {}
    done: dict[str, Any] = {}
    runner_step = engine.runner.step

    def step_seen(seqs, look_ahead=True):  # a row's first finished canvas: its first tokens
        windows = runner_step(seqs, look_ahead)
        if cuda:
            torch.cuda.synchronize()
        for seq, window in zip(seqs, windows, strict=True):
            if window and seq.request_id not in first:
                first[seq.request_id] = time.perf_counter() - t0
        return windows

    engine.runner.step = step_seen
    steps: list[dict[str, float]] = []
    while engine.has_unfinished():
        encoded = timers.prompt_s + timers.canvas_encode_s
        forwards = len(timers.encodes)
        s0, c0 = time.perf_counter(), time.process_time()
        outs = engine.step()
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        enc = timers.prompt_s + timers.canvas_encode_s - encoded
        steps.append(
            {
                "wall": now - s0,
                "cpu": time.process_time() - c0,
                "encode": enc,
                "encodes": timers.encodes[forwards:],
            }
        )
        for o in outs:
            if o.finished:
                done[o.request_id] = o
    e2e = time.perf_counter() - t0
    engine.runner.step = runner_step
    tokens = sum(len(done[i].token_ids) for i in ids)
    digest = hash(tuple(tuple(done[i].token_ids) for i in ids))
    plain = [s for s in steps if s["encode"] == 0.0]
    fwd = timers.forward_ms()
    decode_s = e2e - timers.prompt_s
    result = {
        "batch": batch,
        "output_tokens": tokens,
        "engine_steps": len(steps),
        "step_ms": 1e3 * statistics.median(s["wall"] for s in plain) if plain else None,
        "step_cpu_ms": 1e3 * statistics.median(s["cpu"] for s in plain) if plain else None,
        "forward_ms": statistics.median(fwd) if fwd else None,
        "ttft_ms": 1e3 * statistics.median(first.values()),
        "ttft_max_ms": 1e3 * max(first.values()),
        "encode_step_tokens": engine.runner.encode_step_tokens,
        "first_step_encoder_forwards": len(steps[0]["encodes"]),
        "first_step_encoded_rows": sum(steps[0]["encodes"]),
        "encoder_forwards": len(timers.encodes),
        "e2e_s": e2e,
        "prompt_encode_s": timers.prompt_s,
        "canvas_encode_s": timers.canvas_encode_s,
        "decode_tok_s": tokens / decode_s,
        "output_tok_s": tokens / e2e,
        "finish_reasons": sorted({str(done[i].finish_reason) for i in ids}),
        "shared_prefix": shared,
        "prefix_lookup_tokens": cache.lookup_tokens - looked if cache is not None else 0,
        "prefix_hit_tokens": cache.hit_tokens - hits if cache is not None else 0,
        "tokens_digest": digest,
    }
    if cuda:
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def attention_check() -> list[dict[str, Any]]:
    """The GPU attention paths of the model (grouped bf16 products with float32 scores)
    against PyTorch's float32 attention at the real shapes: relative error."""
    import torch.nn.functional as F

    from dlm_engine.models.diffusion_gemma import _grouped_attention

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for d, kv, t, s, masked in ((512, 2, 256, 4864, False), (256, 8, 1024, 1024, True)):
        q = torch.randn(1, 16, t, d, device="cuda", generator=gen).bfloat16() / d**0.25
        k = torch.randn(1, kv, s, d, device="cuda", generator=gen).bfloat16() / d**0.25
        v = torch.randn(1, kv, s, d, device="cuda", generator=gen).bfloat16()
        mask = None
        if masked:
            pos, kpos = torch.arange(s - t, s, device="cuda"), torch.arange(s, device="cuda")
            mask = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - 512)
        got = _grouped_attention(q, k, v, mask)
        rep_ = 16 // kv
        ref = F.scaled_dot_product_attention(
            q.float(),
            k.float().repeat_interleave(rep_, 1),
            v.float().repeat_interleave(rep_, 1),
            attn_mask=mask,
            scale=1.0,
        )
        err = None if got is None else float((got.float() - ref).norm() / ref.norm())
        rows.append({"head_dim": d, "masked": masked, "rel_error": err})
    # the sampler's GPU entropy (from the step's softmax) against Categorical's
    from dlm_engine.decoding.uniform_diffusion import token_entropy

    logits = 30 * torch.tanh(torch.randn(256, 262144, device="cuda", generator=gen) * 3 / 30)
    probs = logits.softmax(dim=-1)
    ref = torch.distributions.Categorical(logits=logits).entropy()
    err = float((token_entropy(logits, probs) - ref).abs().max())
    rows.append({"entropy_max_abs_error_nats": err})
    return rows


def baseline_forward(path: str, model: Any, batch: int, args, vocab: int) -> dict[str, Any]:
    """The older module's decoder forward on the same weights, over a prompt-long cache."""
    spec = importlib.util.spec_from_file_location("gemma_baseline", path)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old  # its dataclasses look their module up
    spec.loader.exec_module(old)
    with torch.device("meta"):
        base = old.DiffusionGemmaModel(model.arch)
    base.load_state_dict(model.state_dict(), assign=True)
    base.eval()
    dev = next(model.parameters()).device
    n_layers = len(model.model.decoder.layers)
    gen = torch.Generator(device=dev).manual_seed(0)
    caches = []
    t0 = time.perf_counter()
    for _ in range(batch):
        cache = old.RowCache(n_layers)
        base.encode(torch.randint(3, vocab, (args.prompt,), device=dev, generator=gen), 0, cache)
        caches.append(cache)
    torch.cuda.synchronize()
    encode_s = (time.perf_counter() - t0) / batch
    L = model.canvas_length
    canvas = torch.randint(0, vocab, (batch, L), device=dev, generator=gen)
    soft = [torch.randn(1, L, vocab, device=dev, dtype=torch.bfloat16) for _ in range(batch)]
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        s0 = time.perf_counter()
        logits = base.decode(canvas, soft, caches)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - s0)
        del logits
    return {
        "batch": batch,
        "forward_ms": 1e3 * statistics.median(times[1:]),
        "prompt_encode_s_per_row": encode_s,
    }


def profile_steps(
    engine: Engine, batch: int, args, vocab: int, trace_dir: str | None = None
) -> dict[str, str]:
    """`batch` requests under torch.profiler, in two parts: the step that admits them (its
    encoder forward over the first `encode_step_tokens` of their prompts) and two plain
    denoising steps once every prompt is encoded. Ops by device time and by host time for
    each (is a part bound by the GPU or by launching its kernels?); with `trace_dir`, each
    part's Chrome trace too, with each op's input shapes. Under `--graphs on` the decoder's
    kernels replay from a graph and name no op; `--graphs off` attributes them."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(7)
    params = {"max_tokens": engine.loaded.model.canvas_length, "steps": args.steps}
    for i in range(batch):
        prompt = torch.randint(3, vocab, (args.prompt,), generator=gen).tolist()
        engine.add_request(None, prompt, params | {"seed": i})
    budget = engine.runner.encode_step_tokens or batch * args.prompt
    encode_steps = -(-batch * args.prompt // budget)
    parts = {"encode": (0, 1), "denoise": (encode_steps + 1, 2)}
    tables: dict[str, str] = {}
    for name, (before, count) in parts.items():
        for _ in range(before):
            engine.step()
        torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities, record_shapes=True) as prof:
            for _ in range(count):
                engine.step()
            torch.cuda.synchronize()
        if trace_dir:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(trace_dir) / f"gemma_b{batch}_{name}.json"))
        events = prof.key_averages()
        for order in ("device", "host"):
            key = "self_cuda_time_total" if order == "device" else "self_cpu_time_total"
            table = events.table(sort_by=key, row_limit=30, max_name_column_width=70)
            tables[f"{name}_by_{order}_time"] = table
            print(f"---- profile batch {batch} {name} by {order} time\n{table}", flush=True)
    for _ in engine.outputs():
        pass
    return tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU, the tiny test checkpoint")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--output", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--baseline", help="an older diffusion_gemma.py to time beside (GPU)")
    ap.add_argument("--baseline-batches", default="1")
    ap.add_argument("--out", help="write the JSON here too")
    ap.add_argument(
        "--encode-step-tokens",
        type=int,
        default=0,
        help="the encoder's token budget a step (0: the server default)",
    )
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="prompts share their first N tokens (the warm-up's too: the cache holds them)",
    )
    ap.add_argument(
        "--encoder-prefix-cache-bytes",
        type=int,
        default=-1,
        help="the encoder prefix cache's budget (-1: the server's auto, 0: off)",
    )
    ap.add_argument(
        "--quantization",
        choices=("none", "fp8"),
        default="none",
        help="fp8: the linear layers and the experts quantized at load (e4m3, per channel)",
    )
    ap.add_argument(
        "--profile", type=int, default=0, help="profile an encode and 2 steps at this batch"
    )
    ap.add_argument("--profile-dir", help="write the profiled parts' Chrome traces here")
    ap.add_argument(
        "--expert-gemm", default="aten", help="aten or triton: the experts' kernel (`expert_gemm`)"
    )
    ap.add_argument(
        "--graphs", choices=("on", "off", "both"), default="both", help="decoder CUDA graphs"
    )
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    report: dict[str, Any] = {"preset": PRESET, "anchor": VLLM_ANCHOR}
    if args.tiny:
        from dlm_lab.testing_diffusion_gemma import make_tiny_diffusion_gemma

        ckpt = make_tiny_diffusion_gemma(Path(tempfile.mkdtemp(prefix="dlm-gemma-")))
        loaded = load_checkpoint(ckpt, dtype="float32")
        report["preset"] = "tiny test checkpoint (CPU float32)"
    else:
        loaded = random_model(torch.device("cuda"))
        report["device"] = torch.cuda.get_device_name()
        report["weights"] = "random bf16"
    report["torch"] = torch.__version__
    report["quantization"] = args.quantization
    if args.quantization != "none":
        from dlm_engine.quantization import quantize_linears

        report["quantized_layers"] = quantize_linears(
            loaded.model, args.quantization, loaded.device
        )
    model = loaded.model
    vocab = int(model.vocab_size)
    report["conditions"] = {
        "expert_gemm": args.expert_gemm,
        "prompt_tokens": args.prompt,
        "output_tokens": args.output,
        "steps_per_canvas": args.steps,
        "canvas": int(model.canvas_length),
        "adaptive_stop": "on (never fires with random weights)",
        "shared_prefix_tokens": args.shared_prefix,
    }
    floor = weight_floor(model)
    floor["floor_decode_tok_s"] = model.canvas_length / args.steps / (floor["floor_ms"] / 1e3)
    report["floor"] = floor
    print(json.dumps({"floor": floor}), flush=True)
    if not args.tiny:
        report["attention_check"] = attention_check()
        print(json.dumps({"attention_check": report["attention_check"]}), flush=True)
    if args.baseline and not args.tiny:
        report["baseline"] = []
        for b in (int(x) for x in args.baseline_batches.split(",")):
            try:
                row = baseline_forward(args.baseline, model, b, args, vocab)
            except Exception as exc:  # e.g. out of memory: recorded, the rest still runs
                row = {"batch": b, "error": f"{type(exc).__name__}: {exc}"[:300]}
            torch.cuda.empty_cache()
            report["baseline"].append(row)
            print(json.dumps({"baseline": row}), flush=True)
    cfg = EngineConfig(
        model=PRESET,
        device=str(loaded.device),
        dtype="float32" if args.tiny else "bfloat16",
        max_rows=max(batches),
        max_prompt=args.prompt + 16,
        max_canvas=max(args.output, 2 * model.canvas_length),  # the warm-up's two canvases
        max_step_tokens=1 << 24,
        max_queue=4 * max(batches),
        expert_gemm=args.expert_gemm,
        **({"encode_step_tokens": args.encode_step_tokens} if args.encode_step_tokens else {}),
        encoder_prefix_cache_bytes=(
            None if args.encoder_prefix_cache_bytes < 0 else args.encoder_prefix_cache_bytes
        ),
    )
    engine = Engine(cfg, loaded)
    cache = engine.runner.prefix_cache
    report["conditions"]["encoder_prefix_cache_bytes"] = cache.budget_bytes if cache else 0
    timers = Timers(model, loaded.device.type == "cuda")
    timers.runner = engine.runner
    graph = engine.runner.decode_graph
    engine.runner.decode_graph = timers.timed(graph or model.decode_hidden)
    # kernels of every shape a run meets, prompt and finished-canvas encodes included
    warm = argparse.Namespace(**{**vars(args), "output": 2 * model.canvas_length, "steps": 2})
    run_batch(engine, timers, 1, warm, vocab)
    report["runs"] = []
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.graphs]
    if graph is None:
        modes = [False]
    for b, graphs in ((b, g) for b in batches for g in modes):
        if graph is not None:
            graph.enabled, graph.replays = graphs, 0
        try:
            row = run_batch(engine, timers, b, args, vocab)
            row["cuda_graphs"] = graphs
            row["graph_replays"] = graph.replays if graph is not None else 0
            row["step_vs_floor"] = row["step_ms"] and floor["floor_ms"] / row["step_ms"]
            flops = step_flops(model, b, args.prompt + model.canvas_length)  # second canvas
            row["step_tflop"] = flops / 1e12
            row["compute_floor_ms"] = 1e3 * flops / PEAK_BF16_FLOP_S
            row["achieved_tflop_s"] = row["step_ms"] and flops / row["step_ms"] / 1e9
        except Exception as exc:
            row = {"batch": b, "error": f"{type(exc).__name__}: {exc}"[:300]}
            engine = Engine(cfg, loaded)  # rows of the failed run are dropped with it
            timers.runner = engine.runner
            graph = engine.runner.decode_graph
            engine.runner.decode_graph = timers.timed(graph or model.decode_hidden)
        if loaded.device.type == "cuda":
            torch.cuda.empty_cache()
        report["runs"].append(row)
        print(json.dumps(row), flush=True)
    for row in report["runs"]:  # the same requests with and without graphs: the same tokens
        twin = [r for r in report["runs"] if r["batch"] == row["batch"] and r is not row]
        if twin and "tokens_digest" in row and "tokens_digest" in twin[0]:
            row["tokens_equal_other_mode"] = row["tokens_digest"] == twin[0]["tokens_digest"]
    if args.profile:
        report["profile"] = profile_steps(engine, args.profile, args, vocab, args.profile_dir)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    if any("error" in r for r in report["runs"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
