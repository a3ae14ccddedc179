"""DiffusionGemma (`DiffusionGemmaForBlockDiffusion`): a Gemma 4 MoE backbone run twice.

A uniform-state diffusion LM that writes its answer one canvas (`canvas_length` tokens, 256
published) at a time. An *encoder* reads the prompt and every finished canvas causally and
leaves their keys and values in a cache; a *decoder* with the same weights reads a canvas of
token ids plus a self-conditioning signal (the previous step's softmax as soft embeddings),
attends bidirectionally over the cache and the canvas, and writes nothing to the cache.

Module names mirror the published checkpoint (`model.decoder.embed_tokens`,
`model.decoder.layers.N.{self_attn,mlp,router,experts,...}`, `model.decoder.self_conditioning`,
`model.decoder.norm`); the encoder's text weights are tied to the decoder's (not stored), only
its `layer_scalar`s are its own. The vision tower is not built (text only). Checked against
transformers' `models/diffusion_gemma/modeling_diffusion_gemma.py`:

- Gemma 4 layers: sliding-window layers (head_dim, own v_proj) and full layers (a wider head,
  fewer KV heads, values = the raw keys, "k = v"); q/k RMS-normed per head before RoPE, values
  RMS-normed without scale, attention scale 1; proportional RoPE on full layers (only the
  first `partial_rotary_factor` of the frequencies rotate).
- Each layer adds a dense GELU MLP and a top-k MoE (router on the un-normed residual), each
  with its own norms, then scales by `layer_scalar`.
- The encoder's sliding layers keep the last `sliding_window - 1` keys; the decoder sees those
  (sliding layers) or all (full layers) plus the canvas, unmasked.
- Logits in float32 with tanh soft-capping (`final_logit_softcapping`).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..cuda_graphs import GraphCache
from .family import Family
from .grouped_experts import gated_experts
from .shard_rules import COLUMN, EXPERT_COLUMN, EXPERT_ROW, ROW, ShardRules

log = logging.getLogger(__name__)

ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
MODEL_TYPE = "diffusion_gemma"


@dataclass(frozen=True)
class LayerShape:
    """What differs between sliding and full layers."""

    sliding: bool
    head_dim: int
    kv_heads: int
    rope_theta: float
    rope_type: str
    partial_rotary_factor: float
    rope_factor: float


@dataclass(frozen=True)
class DiffusionGemmaArch:
    """The text keys of a DiffusionGemma `config.json` (under `text_config`) plus the canvas."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    sliding_window: int
    rms_norm_eps: float
    final_logit_softcapping: float | None
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    canvas_length: int
    layers: tuple[LayerShape, ...] = field(default_factory=tuple)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> DiffusionGemmaArch:
        t = cfg.get("text_config") or {}
        if t.get("use_bidirectional_attention") == "all":
            raise ValueError(
                "DiffusionGemma with use_bidirectional_attention='all' (a bidirectional "
                "encoder) is not supported; published checkpoints encode causally"
            )
        if not cfg.get("tie_word_embeddings", True):
            raise ValueError("DiffusionGemma with untied encoder/decoder weights is not supported")
        act = t.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported DiffusionGemma hidden_activation {act!r}")
        n = int(t.get("num_hidden_layers", 30))
        types = list(t.get("layer_types") or [])
        if not types:
            types = [
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
            ]
        types[-1] = "full_attention"  # as the reference config forces
        rope = t.get("rope_parameters") or {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
            },
        }
        per_layer = {int(k): v for k, v in (t.get("per_layer_config") or {}).items()}
        head_dim = int(t.get("head_dim", 256))
        kv_heads = int(t.get("num_key_value_heads", 4))
        global_kv = t.get("num_global_key_value_heads")
        shapes = []
        for i, kind in enumerate(types):
            sliding = kind == "sliding_attention"
            over = per_layer.get(i)
            if over is None and not sliding:  # configs written before per_layer_config
                over = {"head_dim": int(t.get("global_head_dim", 512))}
                if global_kv is not None:
                    over["num_key_value_heads"] = int(global_kv)
            over = over or {}
            r = rope[kind]
            if r.get("rope_type", "default") not in ("default", "proportional"):
                raise ValueError(f"unsupported DiffusionGemma rope_type {r.get('rope_type')!r}")
            shapes.append(
                LayerShape(
                    sliding=sliding,
                    head_dim=int(over.get("head_dim", head_dim)),
                    kv_heads=int(over.get("num_key_value_heads", kv_heads)),
                    rope_theta=float(r["rope_theta"]),
                    rope_type=r.get("rope_type", "default"),
                    partial_rotary_factor=float(r.get("partial_rotary_factor", 1.0)),
                    rope_factor=float(r.get("factor", 1.0)),
                )
            )
        soft_cap = t.get("final_logit_softcapping", 30.0)
        return cls(
            vocab_size=int(t.get("vocab_size", 262_144)),
            hidden_size=int(t.get("hidden_size", 2304)),
            intermediate_size=int(t.get("intermediate_size", 9216)),
            num_attention_heads=int(t.get("num_attention_heads", 8)),
            sliding_window=int(t.get("sliding_window", 512)),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            final_logit_softcapping=None if soft_cap is None else float(soft_cap),
            num_experts=int(t["num_experts"]),
            top_k_experts=int(t["top_k_experts"]),
            moe_intermediate_size=int(t["moe_intermediate_size"]),
            canvas_length=int(cfg.get("canvas_length") or 256),
            layers=tuple(shapes),
        )


def inv_frequencies(shape: LayerShape) -> torch.Tensor:
    """RoPE inverse frequencies as transformers computes them (float32), `default` over the
    rotated part of the head or `proportional`: the first `partial_rotary_factor` of the
    head's frequencies rotate, the rest are zero (no rotation)."""
    base, d = shape.rope_theta, shape.head_dim
    if shape.rope_type == "default":
        dim = int(d * shape.partial_rotary_factor)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    angles = int(shape.partial_rotary_factor * d // 2)
    rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / d))
    inv = torch.cat((rotated, torch.zeros(d // 2 - angles)))
    return inv / shape.rope_factor


class GemmaRMSNorm(nn.Module):
    """Gemma 4's RMSNorm: x * (mean(x^2) + eps)^-0.5 in float32, times `weight` (not 1 +
    weight), or unscaled."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused kernel (float32 inside) instead of eight passes
            w = None if self.weight is None else self.weight.to(x.dtype)
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, d]; cos/sin: [B, T, d]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin


class GemmaAttention(nn.Module):
    def __init__(self, a: DiffusionGemmaArch, shape: LayerShape) -> None:
        super().__init__()
        self.shape = shape
        # per rank under tensor parallel (`parallel/sharding.py` splits both): the
        # projections' views take their head counts from the shards
        self.n_heads, self.head_dim, self.n_kv_heads = (
            a.num_attention_heads,
            shape.head_dim,
            shape.kv_heads,
        )
        self.q_proj = nn.Linear(a.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = (
            nn.Linear(a.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
            if shape.sliding
            else None
        )
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, a.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, a.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, a.rms_norm_eps)
        self.v_norm = GemmaRMSNorm(self.head_dim, a.rms_norm_eps, with_scale=False)

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries [B, H, T, d], keys and values [B, KV, T, d] (normed, keys and queries
        rotated)."""
        b, t, _ = h.shape
        q = self.q_norm(self.q_proj(h).view(b, t, -1, self.head_dim))
        q = _rope(q, cos, sin).transpose(1, 2)
        k = self.k_proj(h).view(b, t, -1, self.head_dim)
        v = self.v_proj(h).view(b, t, -1, self.head_dim) if self.v_proj is not None else k
        k = _rope(self.k_norm(k), cos, sin).transpose(1, 2)
        v = self.v_norm(v).transpose(1, 2)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None):
        """Attention (scale 1) of rows with keys of one length: q [n, H, T, d], k/v [n, KV,
        S, d], `mask` [T, S] True where a query sees a key. Query heads share key heads (GQA)
        inside the kernel on the GPU; on the CPU keys are repeated, as the reference does.
        The full layers' 512-wide heads, which PyTorch's fused kernels do not take, go through
        `_grouped_attention` on the GPU; everything else through SDPA's fused kernels, the
        sliding layers' masked encoder spans too (each way timed by
        `benchmarks/gpu_check_gemma_attention.py`)."""
        rep = self.n_heads // self.n_kv_heads
        if q.is_cuda and self.head_dim > 256:
            out = _grouped_attention(q, k, v, mask)
            if out is not None:
                return out
        if rep > 1 and q.is_cuda:
            return by_query_chunks(
                lambda qc, mc: F.scaled_dot_product_attention(
                    qc, k, v, attn_mask=mc, scale=1.0, enable_gqa=True
                ),
                q,
                mask,
                _SDPA_MASKED_QUERIES,
            )
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)


# masked queries one SDPA call takes at most: its kernels expand a boolean mask into a
# [queries, keys] bias, so a long prompt chunk goes in parts (the rows of a mask are each
# query's own: parts attend exactly as one call)
_SDPA_MASKED_QUERIES = 4096


def by_query_chunks(attend, q: torch.Tensor, mask: torch.Tensor | None, most: int):
    """`attend(q, mask)` over q [n, H, T, d] in parts of at most `most` queries, each with its
    rows of `mask` [T, S]; one call where the mask is None or T fits."""
    t = q.shape[2]
    if mask is None or t <= most:
        return attend(q, mask)
    parts = [attend(q[:, :, a : a + most], mask[a : a + most]) for a in range(0, t, most)]
    return torch.cat(parts, dim=2)


_GROUPED_ATTENTION_FAILED: list[str] = []
_SCORES_PER_CHUNK = 1 << 28  # float32 scores one chunk of queries holds at most (1 GiB)
_MASKED_QUERIES_PER_CHUNK = 1024


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None):
    """Attention (scale 1) where PyTorch's fused kernels do not run and it would fall back to
    float32 products: heads wider than 256 (the full layers' 512), masked (the encoder's
    causal spans) or not. Each key head's query heads go through one bf16 product with
    float32 scores, a float32 softmax and one bf16 product with the values, in chunks of
    queries. `mask` [T, S] is True where a query may look;
    None where `bmm(out_dtype=)` is missing. Rows (the batch) fold into the products' batch."""
    if _GROUPED_ATTENTION_FAILED:
        return None
    n, heads, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    rep = heads // kv
    qg = q.reshape(n * kv, rep, t, d)  # query heads h use key head h // rep
    kt, vg = k.reshape(n * kv, s, d).transpose(-1, -2), v.reshape(n * kv, s, d)
    kv *= n  # each row's key heads are a batch of their own
    out = q.new_empty(kv, rep, t, d)
    step = max(1, _SCORES_PER_CHUNK // (n * heads * s))
    if mask is not None:  # smaller chunks see fewer keys (causal, sliding window)
        step = min(step, _MASKED_QUERIES_PER_CHUNK)
    for a in range(0, t, step):
        b = min(t, a + step)
        part = qg[:, :, a:b].reshape(kv, rep * (b - a), d)
        lo, hi, chunk_mask = 0, s, None
        if mask is not None:  # only the keys some query of the chunk may see
            seen = mask[a:b].any(dim=0).int()
            lo, hi = int(seen.argmax()), s - int(seen.flip(0).argmax())
            chunk_mask = mask[a:b, lo:hi]
        try:
            if part.dtype == torch.float32:
                scores = torch.bmm(part, kt[:, :, lo:hi])
            else:
                scores = torch.bmm(part, kt[:, :, lo:hi], out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            log.warning("grouped attention falls back to SDPA: %s", exc)
            _GROUPED_ATTENTION_FAILED.append(str(exc))
            return None
        if chunk_mask is not None:
            scores = scores.view(kv, rep, b - a, hi - lo).masked_fill_(~chunk_mask, float("-inf"))
        probs = scores.view(kv, rep * (b - a), hi - lo).softmax(dim=-1).to(v.dtype)
        out[:, :, a:b] = torch.bmm(probs, vg[:, lo:hi]).view(kv, rep, b - a, d)
    return out.view(n, heads, t, d)


class GemmaMLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaRouter(nn.Module):
    """Top-k routing on the unscaled-normed residual; weights renormalised over the top k and
    scaled per expert."""

    def __init__(self, a: DiffusionGemmaArch) -> None:
        super().__init__()
        self.top_k = a.top_k_experts
        self.root = a.hidden_size**-0.5
        self.norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(a.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(a.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x) * self.scale * self.root
        probs = F.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


def _gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


class GemmaExperts(nn.Module):
    """Expert weights as 3D tensors (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]); each
    token sums its experts' outputs in expert order. Run as two grouped GEMMs
    (`grouped_experts.py`); `looped` is transformers' per-expert loop, kept as the reference
    the grouped path is tested and timed against."""

    looped = False

    def __init__(self, a: DiffusionGemmaArch) -> None:
        super().__init__()
        e, h, i = a.num_experts, a.hidden_size, a.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor):
        if self.looped:
            return self.loop(x, index, weights)
        return gated_experts(x, index, weights, self.gate_up_proj, self.down_proj, _gelu_mul)

    def loop(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor):
        """One expert at a time (a host wait per expert): the reference's order."""
        out = torch.zeros_like(x)
        for e in torch.unique(index).tolist():
            token, slot = torch.where(index == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[e])
            # a token picks an expert at most once: one addition per element, as index_add_
            out[token] += (y * weights[token, slot, None]).to(out.dtype)
        return out


class GemmaLayer(nn.Module):
    def __init__(self, a: DiffusionGemmaArch, shape: LayerShape) -> None:
        super().__init__()
        h, eps = a.hidden_size, a.rms_norm_eps
        self.self_attn = GemmaAttention(a, shape)
        self.mlp = GemmaMLP(h, a.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm_1 = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
        self.router = GemmaRouter(a)
        self.experts = GemmaExperts(a)
        self.layer_scalar = nn.Buffer(torch.ones(1))

    def feed_forward(self, x: torch.Tensor, attn: torch.Tensor, scalar: torch.Tensor):
        """Everything after attention: residual, dense MLP + MoE, layer scalar."""
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(attn))
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        flat = x.reshape(-1, x.shape[-1])
        weights, index = self.router(flat)
        moe = self.experts(self.pre_feedforward_layernorm_2(flat), index, weights)
        moe = self.post_feedforward_layernorm_2(moe.reshape(x.shape))
        x = x + self.post_feedforward_layernorm(dense + moe)
        return x * scalar


class SelfConditioning(nn.Module):
    """The previous step's soft embeddings through a gated MLP, added to the canvas embeddings."""

    def __init__(self, a: DiffusionGemmaArch) -> None:
        super().__init__()
        self.pre_norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, with_scale=False)
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        n = self.pre_norm(soft)
        signal = self.down_proj(F.gelu(self.gate_proj(n), approximate="tanh") * self.up_proj(n))
        return self.post_norm(embeds + signal)


class _Decoder(nn.Module):
    def __init__(self, a: DiffusionGemmaArch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(GemmaLayer(a, s) for s in a.layers)
        self.norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_conditioning = SelfConditioning(a)


class _ScalarOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer_scalar = nn.Buffer(torch.ones(1))


class _EncoderText(nn.Module):
    """The encoder's own tensors: its layer scalars (all other weights are the decoder's)."""

    def __init__(self, a: DiffusionGemmaArch) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ScalarOnly() for _ in a.layers)


class _Encoder(nn.Module):
    def __init__(self, a: DiffusionGemmaArch) -> None:
        super().__init__()
        self.language_model = _EncoderText(a)


class _Backbone(nn.Module):
    def __init__(self, a: DiffusionGemmaArch) -> None:
        super().__init__()
        self.encoder = _Encoder(a)
        self.decoder = _Decoder(a)


def _encoder_mask(
    start: int, t: int, keys: int, shape: LayerShape, a: DiffusionGemmaArch, device
) -> torch.Tensor:
    """Which of a row's `keys` cached-then-fresh keys (the last at position start + t - 1)
    each of its `t` queries from position `start` sees: causal, and within the sliding
    window on sliding layers. [t, keys] bool."""
    pos = torch.arange(start, start + t, device=device)
    kpos = torch.arange(start + t - keys, start + t, device=device)
    mask = kpos[None, :] <= pos[:, None]
    if shape.sliding:
        mask &= kpos[None, :] > pos[:, None] - a.sliding_window
    return mask


_CACHE_VERSIONS = itertools.count()


class RowCache:
    """One request's encoder keys and values, per layer [KV heads, S, d]; sliding layers keep
    only their last `sliding_window - 1` positions, as transformers' sliding cache layers.

    Each layer's keys and values sit at the front of a buffer with `room` free positions
    behind them: a decoder step writes its canvas's keys and values there and attends over
    the front of the buffer, instead of copying the whole cache every step."""

    def __init__(self, n_layers: int, room: int = 0) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self._buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        self.room = room
        self.length = 0  # positions encoded so far
        self.version = next(_CACHE_VERSIONS)  # new buffers, new version (never reused)
        # positions below this are also kept aside as they are encoded, every layer whole
        # (sliding layers drop them from the cache): the encoder prefix cache stores them
        self.record_upto = 0
        self.recorded: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n_layers)]

    def note(self, i: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer i's new keys and values [KV, T, d] from position `start`: a copy of those
        below `record_upto` is kept (`take_recorded`)."""
        n = min(k.shape[1], self.record_upto - start)
        if n > 0:
            self.recorded[i].append((k[:, :n].clone(), v[:, :n].clone()))

    def take_recorded(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The recorded keys and values per layer [KV, n, d] (None unless every layer holds
        `n` positions: an encode failed part-way), and recording stops."""
        parts, self.recorded = self.recorded, [[] for _ in self.recorded]
        self.record_upto = 0
        if any(sum(k.shape[1] for k, _ in layer) != n for layer in parts):
            return None
        keys = [torch.cat([k for k, _ in layer], 1) for layer in parts]
        return keys, [torch.cat([v for _, v in layer], 1) for layer in parts]

    def layer(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.keys[i], self.values[i]

    def store(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer i's cache becomes k, v [KV, S, d] (copied, with room behind)."""
        s = k.shape[1]
        kb = k.new_empty(k.shape[0], s + self.room, k.shape[2])
        vb = v.new_empty(v.shape[0], s + self.room, v.shape[2])
        kb[:, :s], vb[:, :s] = k, v
        self._buffers[i] = (kb, vb)
        self.keys[i], self.values[i] = kb[:, :s], vb[:, :s]
        self.version = next(_CACHE_VERSIONS)

    def with_canvas(self, i: int, k: torch.Tensor, v: torch.Tensor):
        """Keys and values [KV, S + L, d] of layer i's cache followed by a canvas's k, v
        [KV, L, d]; the cache itself is unchanged."""
        ck, cv = self.keys[i], self.values[i]
        if ck is None:
            return k, v
        s, length = ck.shape[1], k.shape[1]
        buffers = self._buffers[i]
        if buffers is None or buffers[0].shape[1] < s + length:
            return torch.cat([ck, k], 1), torch.cat([cv, v], 1)
        kb, vb = buffers
        kb[:, s : s + length], vb[:, s : s + length] = k, v
        return kb[:, : s + length], vb[:, : s + length]


def same_length_rows(caches: list[RowCache]) -> list[list[int]]:
    """The rows (indices into `caches`) grouped by encoded length, first-seen order: rows of
    one group have keys of one length at every layer, so a decoder layer attends over them in
    one batched call instead of one call a row (one row's call fills a fraction of the GPU)."""
    groups: dict[int, list[int]] = {}
    for r, cache in enumerate(caches):
        groups.setdefault(cache.length, []).append(r)
    return list(groups.values())


class DiffusionGemmaModel(nn.Module):
    """The text model: `encode` a span into a row's cache, `decode` canvases over caches."""

    logits_shift = 0

    def __init__(self, arch: DiffusionGemmaArch) -> None:
        super().__init__()
        self.arch = arch
        self.model = _Backbone(arch)
        self.embed_scale = float(torch.tensor(arch.hidden_size**0.5, device="cpu"))  # float32
        self._inv_freq: dict[tuple, torch.Tensor] = {}
        self._scale: dict[tuple, torch.Tensor] = {}

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def canvas_length(self) -> int:
        return self.arch.canvas_length

    def fuse_projections(self) -> None:
        """Nothing fused: the loader's hook for the other families."""

    @property
    def _decoder(self) -> _Decoder:
        return self.model.decoder

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self._decoder.embed_tokens.weight
        key = (w.dtype, w.device)
        if key not in self._scale:  # made once: a CUDA graph cannot copy from the host
            self._scale[key] = torch.tensor(self.embed_scale, dtype=w.dtype, device=w.device)
        return F.embedding(ids, w) * self._scale[key]

    def _rope(self, shape: LayerShape, positions: torch.Tensor, dtype: torch.dtype):
        key = (shape.rope_type, shape.head_dim, shape.rope_theta, shape.partial_rotary_factor)
        inv = self._inv_freq.get(key)
        if inv is None or inv.device != positions.device:
            inv = self._inv_freq[key] = inv_frequencies(shape).to(positions.device)
        freqs = positions[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.no_grad()
    def encode(self, spans: list[tuple[torch.Tensor, RowCache]]) -> None:
        """One encoder forward over several rows' spans: each `ids` [T] at positions
        `cache.length`.. appended to its row's `cache` (causal; sliding layers within their
        window). The spans are packed into one sequence, so every weight is read once for all
        rows and only attention works per row, over its own cache and span. A span may be any
        front part of what a row has left to encode: a prompt encoded in chunks over several
        calls leaves the keys and values one call over the whole prompt leaves (the sliding
        layers' `sliding_window - 1` kept keys are all an earlier position's query sees)."""
        a = self.arch
        ids = torch.cat([ids for ids, _ in spans]) if len(spans) > 1 else spans[0][0]
        device = ids.device
        rows, off = [], 0  # per span: its cache, first position, length, packed offset
        for span, cache in spans:
            t = int(span.shape[0])
            rows.append((cache, cache.length, t, off))
            off += t
        x = self._embed(ids[None])
        n = ids.shape[0]
        pos = torch.cat([torch.arange(s, s + t, device=device) for _, s, t, _ in rows])
        last = len(self._decoder.layers) - 1
        ropes: dict[LayerShape, tuple[torch.Tensor, torch.Tensor]] = {}
        masks: dict[tuple[int, bool, int], torch.Tensor] = {}  # the same for each layer kind
        for i, layer in enumerate(self._decoder.layers):
            shape = layer.self_attn.shape
            if shape not in ropes:
                ropes[shape] = self._rope(shape, pos[None], x.dtype)
            cos, sin = ropes[shape]
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            outs = []
            for r, (cache, start, t, off) in enumerate(rows):
                k_new, v_new = k[0, :, off : off + t], v[0, :, off : off + t]
                if start < cache.record_upto:  # a prompt chunk the prefix cache will store
                    cache.note(i, start, k_new, v_new)
                old_k, old_v = cache.layer(i)
                if old_k is not None:
                    k_all, v_all = torch.cat([old_k, k_new], 1), torch.cat([old_v, v_new], 1)
                else:
                    k_all, v_all = k_new, v_new
                # sliding layers keep their last window - 1 positions (all of them if fewer)
                drop = max(0, k_all.shape[1] - (a.sliding_window - 1)) if shape.sliding else 0
                cache.store(i, k_all[:, drop:], v_all[:, drop:])
                if i < last:  # the last layer's output feeds nothing: only its keys are kept
                    key = (r, shape.sliding, k_all.shape[1])
                    if key not in masks:
                        masks[key] = _encoder_mask(start, t, k_all.shape[1], shape, a, device)
                    outs.append(
                        layer.self_attn.attend(
                            q[:, :, off : off + t], k_all[None], v_all[None], masks[key]
                        )
                    )
            if i == last:
                break
            attn = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
            attn = attn.transpose(1, 2).reshape(1, n, -1)
            scalar = self.model.encoder.language_model.layers[i].layer_scalar
            x = layer.feed_forward(x, attn, scalar)
        for cache, start, t, _ in rows:
            cache.length = start + t

    def soft_embedding(self, probs: torch.Tensor) -> torch.Tensor:
        """A step's self-conditioning signal for the next step, from the float32 softmax of its
        processed logits [.., L, V]: soft embeddings [.., L, H]. Kept instead of the logits: a
        canvas's signal is L x H, not L x V. (The reference takes the softmax of the logits
        rounded to the weights' dtype; in float32 that is this softmax to the bit, in bf16
        it is within its rounding.)"""
        w = self._decoder.embed_tokens.weight
        probs = probs.to(w.dtype)
        scale = torch.tensor(self.embed_scale, dtype=w.dtype, device=w.device)
        return torch.matmul(probs, w) * scale

    @torch.no_grad()
    def decode_hidden(
        self,
        canvas: torch.Tensor,
        soft: list[torch.Tensor | None],
        caches: list[RowCache],
    ) -> torch.Tensor:
        """The decoder's normed hidden states [B, L, H] for canvases [B, L], each row over its
        own cache (positions follow it), with its self-conditioning soft embeddings [1, L, H]
        (`soft_embedding`; None: none yet). `head` turns them into logits."""
        w = self._decoder.embed_tokens.weight
        signal = torch.zeros(*canvas.shape, w.shape[1], dtype=w.dtype, device=w.device)
        for r, emb in enumerate(soft):
            if emb is not None:
                signal[r] = emb[0].to(w.dtype)
        offsets = torch.tensor([c.length for c in caches], device=canvas.device)
        return self.decode_core(canvas, signal, offsets, caches)

    def decode_core(
        self,
        canvas: torch.Tensor,
        signal: torch.Tensor,
        offsets: torch.Tensor,
        caches: list[RowCache],
    ) -> torch.Tensor:
        """`decode_hidden` from device tensors only (self-conditioning signals [B, L, H], each
        row's encoded length [B]): nothing here reads the host, so it can be captured in a
        CUDA graph (`DecodeGraph`)."""
        dec = self._decoder
        b, length = canvas.shape
        x = self._embed(canvas)
        x = dec.self_conditioning(x, signal)
        pos = offsets[:, None] + torch.arange(length, device=canvas.device)[None]
        groups = same_length_rows(caches)
        ropes: dict[LayerShape, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(dec.layers):
            shape = layer.self_attn.shape
            if shape not in ropes:  # the same for every layer of a shape
                ropes[shape] = self._rope(shape, pos, x.dtype)
            cos, sin = ropes[shape]
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            rows: list[torch.Tensor | None] = [None] * b
            for group in groups:
                keys, values = zip(
                    *(caches[r].with_canvas(i, k[r], v[r]) for r in group), strict=True
                )
                if len(group) == 1:  # its cache buffer as it is: no copy
                    r = group[0]
                    out = layer.self_attn.attend(q[r : r + 1], keys[0][None], values[0][None])
                else:
                    out = layer.self_attn.attend(
                        torch.cat([q[r : r + 1] for r in group]),
                        torch.stack(keys),
                        torch.stack(values),
                    )
                for j, r in enumerate(group):
                    rows[r] = out[j : j + 1]
            attn = torch.cat(rows).transpose(1, 2).reshape(b, length, -1)
            x = layer.feed_forward(x, attn, layer.layer_scalar)
        return dec.norm(x)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 soft-capped logits [.., L, V] of hidden states [.., L, H] (tied weights)."""
        return soft_cap(self.head_product(h), self.arch.final_logit_softcapping)

    def head_product(self, h: torch.Tensor) -> torch.Tensor:
        """The output head's product in the weights' dtype, before `soft_cap` (a fused
        sampler reads it once instead of a float32 copy)."""
        return F.linear(h, self._decoder.embed_tokens.weight)

    @property
    def logit_cap(self) -> float | None:
        return self.arch.final_logit_softcapping

    @torch.no_grad()
    def decode(
        self,
        canvas: torch.Tensor,
        soft: list[torch.Tensor | None],
        caches: list[RowCache],
    ) -> torch.Tensor:
        """Float32 soft-capped logits [B, L, V] (`decode_hidden` then `head`, all rows at once:
        the engine takes each row's logits alone, so B x L x V float32 never exists at once)."""
        return self.head(self.decode_hidden(canvas, soft, caches))


def soft_cap(product: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The head's float32 logits: its product soft-capped at `cap` (none: as it is)."""
    logits = product.float()
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


class DecodeGraph:
    """The decoder step replayed from a CUDA graph while the batch and its caches stay the
    same (a canvas's steps after its first: 16 steps a canvas replay 14 times).

    A step at small batch launches thousands of small kernels; on the GPU their launching,
    not the work, sets the step's time. A graph (`cuda_graphs.GraphCache`, one kept) is
    captured on the second step a key (the rows' caches, their versions and lengths) is seen,
    so a batch whose composition changes every step (rows starting canvases at different
    times) runs eagerly and never pays a capture. A capture that fails turns graphs off for
    good, with a log line."""

    def __init__(self, model: DiffusionGemmaModel, on_cpu: bool = False) -> None:
        self.model = model  # or parallel.gemma.ParallelGemma, which brings its own cache
        self.on_cpu = on_cpu  # tests: CPU "graphs" replay the step (`cuda_graphs.EagerGraph`)
        self.enabled = True
        self.replays = 0
        self._seen: tuple | None = None
        self._graphs: Any = None

    def __call__(
        self, canvas: torch.Tensor, soft: list[torch.Tensor | None], caches: list[RowCache]
    ) -> torch.Tensor:
        """As `DiffusionGemmaModel.decode_hidden`; the result is valid until the next call."""
        key = (tuple(canvas.shape), tuple((c.version, c.length) for c in caches))
        if not self.enabled or not (canvas.is_cuda or self.on_cpu) or key != self._seen:
            self._seen = key
            if self._graphs is not None:
                self._graphs.clear()  # its caches are gone or moved: free its memory
            return self.model.decode_hidden(canvas, soft, caches)
        if self._graphs is None:
            make = getattr(self.model, "decode_graph_cache", None)
            self._graphs = (
                make(canvas.device) if make else GraphCache(canvas.device, max_graphs=1, warmups=0)
            )
        w = self.model.model.decoder.embed_tokens.weight
        signal = torch.zeros(*canvas.shape, w.shape[1], dtype=w.dtype, device=w.device)
        for r, emb in enumerate(soft):
            if emb is not None:
                signal[r] = emb[0].to(w.dtype)
        inputs = {
            "ids": canvas,
            "signal": signal,
            "offsets": torch.tensor([c.length for c in caches], device=canvas.device),
        }

        def step(static: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.model.decode_core(
                static["ids"], static["signal"], static["offsets"], caches
            )

        step.caches = caches  # what a parallel model's cache names to its workers
        try:
            out = self._graphs.run(key, step, inputs)
        except Exception as exc:  # a kernel that cannot be captured: eager from now on
            log.warning("DiffusionGemma decoder graphs off: capture failed (%s)", exc)
            self.enabled = False
            self._graphs.clear()
            return self.model.decode_hidden(canvas, soft, caches)
        self.replays += 1
        return out

    @property
    def captures(self) -> int:
        """Decoder graphs captured so far."""
        return self._graphs.captures if self._graphs is not None else 0


VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
TIED_PREFIXES = ("model.encoder.language_model.", "lm_head.")


def drop_unused(state: dict[str, torch.Tensor], expected: set[str]) -> None:
    """Remove the tensors this text-only model does not use: the vision tower (said once, in
    the log) and tied copies of the decoder's weights some checkpoints store anyway."""
    vision = [n for n in state if n.startswith(VISION_PREFIXES)]
    if vision:
        log.warning(
            "DiffusionGemma: skipping the vision tower (%d tensors): this server runs the model "
            "on text only; requests with images are refused",
            len(vision),
        )
    for name in list(state):
        if name not in expected and (name.startswith(VISION_PREFIXES + TIED_PREFIXES)):
            del state[name]


def is_diffusion_gemma(config: dict[str, Any]) -> bool:
    archs = [str(a) for a in config.get("architectures") or []]
    return str(config.get("model_type", "")) == MODEL_TYPE or ARCHITECTURE in archs


__all__ = [
    "ARCHITECTURE",
    "DiffusionGemmaArch",
    "DecodeGraph",
    "DiffusionGemmaModel",
    "RowCache",
    "drop_unused",
    "inv_frequencies",
    "is_diffusion_gemma",
]


def _uniform_defaults(gen: dict[str, Any]) -> dict[str, Any]:
    from ..decoding.uniform_params import uniform_defaults  # its sampler's keys

    return uniform_defaults(gen)


# DiffusionGemma (`model.decoder.layers.N.{self_attn,mlp,experts}`). Tensor parallel: each rank
# holds 1/N of every layer's heads (sliding and full layers alike), of its dense MLP and of
# every routed expert's intermediate size. The dense MLP and the experts are normed apart
# before they add up, so each is summed on its own (the dense MLP by its row layer, the
# experts by their module's all-reduce): three all-reduces a layer. The router, norms,
# self-conditioning MLP and the tied embedding/head stay whole. Expert parallel: only the
# experts are spread (sliced by expert); everything else stays whole.
GEMMA_RULES = ShardRules(
    (
        (r"\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj)\.weight$", COLUMN),
        (r"\.layers\.\d+\.self_attn\.o_proj\.weight$", ROW),
        (r"\.layers\.\d+\.mlp\.(gate_proj|up_proj)\.weight$", COLUMN),
        (r"\.layers\.\d+\.mlp\.down_proj\.weight$", ROW),
        (r"\.layers\.\d+\.experts\.gate_up_proj$", EXPERT_COLUMN),
        (r"\.layers\.\d+\.experts\.down_proj$", EXPERT_ROW),
    ),
    summed=(r"\.layers\.\d+\.experts$",),
    expert_stack=r"\.layers\.\d+\.experts$",
    expert_stack_tensor=r"\.layers\.\d+\.experts\.(gate_up_proj|down_proj)$",
    split_with_experts=False,
    skip=("model.encoder.vision_tower.", "model.encoder.embed_vision."),
)


# DiffusionGemma: uniform-state diffusion over canvases (decoding/uniform_diffusion.py);
# Gemma's tokenizer, turns end with <end_of_turn>.
FAMILY = Family(
    name="diffusion_gemma",
    label="DiffusionGemma",
    table_label="DiffusionGemma (MoE, text)",
    detect=is_diffusion_gemma,
    build=lambda config: DiffusionGemmaModel(DiffusionGemmaArch.from_config(config)),
    default_algorithm="uniform",
    uses_blocks_by_default=False,
    mask_token="",
    # Gemma 4 ends a turn that made tool calls with <|tool_response> (where results go)
    end_of_turn_tokens=("<end_of_turn>", "<turn|>", "<|tool_response>"),
    uniform_diffusion=True,
    tool_format="gemma4",  # <|tool_call>call:name{...}<tool_call|> (dlm_engine/tool_gemma4.py)
    checkpoint_defaults=_uniform_defaults,
    shard_rules=GEMMA_RULES,
)
