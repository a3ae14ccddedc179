"""DiffusionGemma's attention shapes on the GPU: each way of computing them, timed and checked
against float32 attention.

    python benchmarks/gpu_check_gemma_attention.py [--out FILE]

Shapes (the published 26B-A4B: 16 query heads; sliding layers 8 key heads of 256, window
1024; full layers 2 key heads of 512):
- `decode_full`: a decoder step's full layer at 32 rows, 256 canvas queries over 4,096 cached
  + 256 canvas keys, no mask;
- `decode_sliding`: the same step's sliding layer (1,023 cached + 256 keys);
- `encode_full`: one row's 4,096-token prompt through a full layer, causal;
- `encode_sliding`: the same through a sliding layer, causal within the window;
- `encode_full_chunk`: a 1,024-token chunk after 3,072 cached positions (causal, shifted).

Ways: `grouped` (`diffusion_gemma._grouped_attention`: bf16 products, float32 scores and
softmax, in chunks of queries; what the model runs where SDPA's fused kernels do not), `sdpa`
(PyTorch's dispatch, as the model runs the unmasked sliding layers), `efficient` (SDPA's
memory-efficient kernel, key heads repeated, boolean mask), and `flex` (FlexAttention
compiled, grouped heads in the kernel, the mask as a `mask_mod` whose block mask skips blocks
no query sees; `flex_dynamic`: compiled once for every length).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dlm_engine.models.diffusion_gemma import _grouped_attention

WINDOW = 1024
CASES = {
    # name: rows, query heads, key heads, head dim, queries, cached keys, sliding
    "decode_full": (32, 16, 2, 512, 256, 4096, False),
    "decode_sliding": (32, 16, 8, 256, 256, 1023, True),
    "encode_full": (1, 16, 2, 512, 4096, 0, False),
    "encode_sliding": (1, 16, 8, 256, 4096, 0, True),
    "encode_full_chunk": (1, 16, 2, 512, 1024, 3072, False),
}


def bool_mask(t: int, cached: int, sliding: bool, decode: bool, device) -> torch.Tensor | None:
    """[t, cached + t] True where a query sees a key (None: every key)."""
    if decode:
        return None
    pos = torch.arange(cached, cached + t, device=device)[:, None]
    kpos = torch.arange(cached + t, device=device)[None, :]
    mask = kpos <= pos
    if sliding:
        mask &= kpos > pos - WINDOW
    return mask


def reference(q, k, v, mask) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = q.float() @ k.transpose(-1, -2)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v).to(q.dtype)


def flex_mask(t: int, cached: int, sliding: bool, decode: bool, device):
    if decode:
        return None
    offset = cached

    def visible(b, h, q_idx, kv_idx):
        seen = kv_idx <= q_idx + offset
        if sliding:
            seen = seen & (kv_idx > q_idx + offset - WINDOW)
        return seen

    return create_block_mask(visible, None, None, t, cached + t, device=device)


def ways(dynamic_flex):
    flex_static = torch.compile(flex_attention, dynamic=False)

    def grouped(q, k, v, mask, bm):
        return _grouped_attention(q, k, v, mask)

    def sdpa(q, k, v, mask, bm):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=True)

    def efficient(q, k, v, mask, bm):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)

    def flex(q, k, v, mask, bm):
        return flex_static(q, k, v, block_mask=bm, scale=1.0, enable_gqa=True)

    def flex_dyn(q, k, v, mask, bm):
        return dynamic_flex(q, k, v, block_mask=bm, scale=1.0, enable_gqa=True)

    def flex_small(q, k, v, mask, bm):  # tiles that fit 512-wide heads in shared memory
        opts = {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2} if q.shape[-1] > 256 else None
        return flex_static(q, k, v, block_mask=bm, scale=1.0, enable_gqa=True, kernel_options=opts)

    return {
        "grouped": grouped,
        "sdpa": sdpa,
        "efficient": efficient,
        "flex": flex,
        "flex_dynamic": flex_dyn,
        "flex_small_tiles": flex_small,
    }


def timed(fn, *args, reps: int = 10) -> float:
    for _ in range(2):
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--cases", default=",".join(CASES), help="comma list of the shapes above")
    ap.add_argument("--ways", default="", help="comma list of ways (default: all)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    dynamic_flex = torch.compile(flex_attention, dynamic=True)
    table = ways(dynamic_flex)
    if args.ways:
        table = {w: table[w] for w in args.ways.split(",")}
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in args.cases.split(","):
        n, heads, kv, d, t, cached, sliding = CASES[name]
        decode = name.startswith("decode")
        # keys normed as the model's (unit RMS) and queries too: scale 1 gives sharp scores
        q = F.rms_norm(torch.randn(n, heads, t, d, device=dev), (d,)).bfloat16()
        k = F.rms_norm(torch.randn(n, kv, cached + t, d, device=dev), (d,)).bfloat16()
        v = F.rms_norm(torch.randn(n, kv, cached + t, d, device=dev), (d,)).bfloat16()
        mask = bool_mask(t, cached, sliding, decode, dev)
        ref = reference(q, k, v, mask) if n * heads * t * (cached + t) <= 1 << 31 else None
        bm = flex_mask(t, cached, sliding, decode, dev)
        row: dict = {}
        for way, fn in table.items():
            try:
                out = fn(q, k, v, mask, bm)
                err = None if ref is None else float((out.float() - ref.float()).abs().max())
                ms = timed(fn, q, k, v, mask, bm)
                row[way] = {"ms": round(ms, 3), "max_abs_err": err}
            except Exception as exc:  # unsupported here: recorded, the others still run
                row[way] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            torch.cuda.empty_cache()
            print(name, way, json.dumps(row[way]), flush=True)
        report[name] = row
    if "flex_dynamic" in table:
        try:
            report["flex_dynamic_three_new_lengths_s"] = new_lengths_cost(dynamic_flex, dev)
        except Exception as exc:  # unsupported here: recorded
            report["flex_dynamic_three_new_lengths_s"] = f"{type(exc).__name__}: {exc}"[:300]
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


def new_lengths_cost(dynamic_flex, dev) -> float:
    """Seconds that flex compiled once for every length takes over three new lengths."""
    s0 = time.perf_counter()
    n, heads, kv, d = 1, 16, 8, 256
    for t in (640, 1536, 2304):
        q = torch.randn(n, heads, t, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(n, kv, t, d, device=dev, dtype=torch.bfloat16)
        dynamic_flex(q, k, k, block_mask=flex_mask(t, 0, False, False, dev), enable_gqa=True)
    torch.cuda.synchronize()
    return time.perf_counter() - s0


if __name__ == "__main__":
    main()
