"""Building blocks shared by the model families: RMSNorm, rotary embeddings, attention.

Both LLaDA and Dream are pre-norm transformers with RoPE and bidirectional attention; they
differ in tensor names, biases and where RoPE is computed in float32. The families compose
these pieces under their own published module names so checkpoints load without renaming.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class FusedKernels:
    """Elementwise pieces (norm, rotary, gated activation) optionally compiled into fused
    kernels with `torch.compile`: in eager PyTorch each is a handful of tiny kernels, and at
    small token counts those, not the matrix products, dominate a step on the GPU.

    Off by default (CPU, tests); the model runner turns it on for CUDA devices. A function
    that fails to compile falls back to eager for good."""

    enabled = False

    fallbacks: list[str] = []  # names of the functions that fell back to eager, for reports

    def __init__(self, fn) -> None:
        # A code object of its own: the compiler keeps its compiled variants (and counts them
        # against its recompile limit) per code object, so two kernels built from one function
        # (the hidden-state and the per-head norm: rank 3 and rank 4 inputs) would otherwise
        # evict each other until the limit disables both.
        self.fn = types.FunctionType(
            fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        self.compiled = None
        self.failed = False

    def __call__(self, *args):
        if FusedKernels.enabled and not self.failed:
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
                return self.compiled(*args)
            except Exception as exc:  # compiler missing or unsupported: stay correct
                logging.getLogger(__name__).warning("fused %s disabled: %s", self.fn.__name__, exc)
                self.failed = True
                FusedKernels.fallbacks.append(self.fn.__name__)
        return self.fn(*args)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _add_rms_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # the sum rounded to x's dtype first, as eager `x + y` rounds it, written as explicit
    # casts so a compiled kernel keeps that rounding instead of feeding the norm float32
    s = (x.float() + y.float()).to(x.dtype)
    return s, _rms_norm(s, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, in_fp32: bool) -> torch.Tensor:
    if in_fp32:
        xf = x.float()
        return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def _rope_qk(q, k, cos, sin, in_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope(q, cos, sin, in_fp32), _rope(k, cos, sin, in_fp32)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


rms_norm = FusedKernels(_rms_norm)
rms_norm_heads = FusedKernels(_rms_norm)
add_rms_norm = FusedKernels(_add_rms_norm)  # a residual add and the next norm: one kernel
apply_rope_fn = FusedKernels(_rope)
apply_rope_qk_fn = FusedKernels(_rope_qk)  # q and k in one call: one launch a layer, not two
silu_mul = FusedKernels(_silu_mul)


class RMSNorm(nn.Module):
    """RMS norm computed in float32 and cast back, as both published implementations do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, this norm of it): a block's residual add and its next norm, compiled as
        one kernel on CUDA (one launch a layer fewer). The sum is eager `x + y` bit for bit;
        the norm may differ in its last bf16 bit from the norm compiled apart, as that one
        does from eager (benchmarks/gpu_check_fused.py). Eager (CPU): the same ops apart."""
        return add_rms_norm(x, y, self.weight, self.eps)


class HeadRMSNorm(RMSNorm):
    """RMS norm over head_dim of q or k [B, heads, T, D] (Qwen3 / LLaDA2 QK norm). Its own
    compiled kernel: one function fed rank-3 and rank-4 inputs recompiles past torch's limit
    and falls back to eager for every norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_heads(x, self.weight, self.eps)


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, 1, T, head_dim] in float32 for per-row position ids [B, T]."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos(), emb.sin()


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, in_fp32: bool
) -> torch.Tensor:
    """Rotate q or k. LLaDA rotates in float32; Qwen2/Dream casts the tables to the model dtype."""
    return apply_rope_fn(x, cos, sin, in_fp32)


def apply_rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, in_fp32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope` on q and on k, compiled as one function (the same arithmetic)."""
    return apply_rope_qk_fn(q, k, cos, sin, in_fp32)


def additive_mask(key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as the additive one SDPA makes of it (0 / -inf in the
    query's dtype): made once per forward, SDPA need not convert it in every layer."""
    return torch.zeros_like(key_mask, dtype=dtype).masked_fill_(key_mask.logical_not(), -torch.inf)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Attention. q [B,H,T,D], k/v [B,KV,S,D]; key_mask True = attend (or additive, from
    `additive_mask`): [B,S] for the same keys at every query (bidirectional), or [B,T,S] per
    query (block-causal block diffusion).

    Padding keys are masked, never attended to, so a row's result does not depend on how
    much padding its batch carries.
    """
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    if key_mask is None:
        mask = None
    elif key_mask.dim() == 3:
        mask = key_mask[:, None]
    else:
        mask = key_mask[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)


class ForwardBatch:
    """What one batched forward needs: tokens, per-row positions, key mask, logit positions,
    and optionally a KV context (cached mode) that decides what attention reads and stores."""

    __slots__ = ("input_ids", "positions", "key_mask", "logits_index", "kv")

    def __init__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        logits_index: torch.Tensor | None,
        kv=None,
    ) -> None:
        self.input_ids = input_ids
        self.positions = positions
        self.key_mask = key_mask
        self.logits_index = logits_index
        self.kv = kv

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.kv is None:
            return attention(q, k, v, self.key_mask)
        return self.kv.attend(layer, q, k, v, self.key_mask)


Logits = Callable[[torch.Tensor], torch.Tensor]


def full_logits(model: nn.Module) -> Logits:
    """Adapt one of our models to the published `model(x).logits` call (no mask, all
    positions): what scoring runs, and what the reference loops call."""

    def call(x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device).expand_as(x)
        return model(ForwardBatch(x, pos, None, None))

    return call


def gather_positions(hidden: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Hidden states [B,T,D] at index [B,K] -> [B,K,D]; all positions when index is None."""
    if index is None:
        return hidden
    return torch.gather(hidden, 1, index[..., None].expand(-1, -1, hidden.shape[-1]))


def fuse_linears(layers: list[nn.Linear]) -> nn.Linear:
    """One linear layer computing several that share an input (q/k/v, gate/up).

    Fewer, wider matrix products keep the GPU busier at small token counts; the outputs are
    the same numbers, split apart by the caller."""
    first = layers[0]
    if hasattr(first, "concat"):  # FP8 layers of a published FP8 checkpoint (fp8.Fp8Linear)
        return type(first).concat(layers)
    out = sum(layer.out_features for layer in layers)
    bias = first.bias is not None
    fused = nn.Linear(
        first.in_features, out, bias=bias, device=first.weight.device, dtype=first.weight.dtype
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([layer.weight for layer in layers]))
        if bias:
            fused.bias.copy_(torch.cat([layer.bias for layer in layers]))
    fused.requires_grad_(False)
    return fused


class QKVHeads:
    """For attention modules holding `q_proj`, `k_proj`, `v_proj` (published names) and, once
    fused, `qkv`: projects and splits into heads [B, heads, T, head_dim]."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    qkv: nn.Linear | None

    def qkv_heads(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = h.shape
        if self.qkv is not None:
            kv_dim = self.n_kv_heads * self.head_dim
            q, k, v = self.qkv(h).split([self.n_heads * self.head_dim, kv_dim, kv_dim], dim=-1)
        else:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        q = q.reshape(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def fuse_qkv(self) -> None:
        self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj


def gated_mlp(owner: nn.Module, gate: str, up: str, x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate(x)) * up(x) for the layers named `gate` and `up` of `owner`, or from
    `owner.gate_up` once `fuse_gate_up` has fused them."""
    if owner.gate_up is not None:
        g, u = owner.gate_up(x).chunk(2, dim=-1)
    else:
        g, u = getattr(owner, gate)(x), getattr(owner, up)(x)
    return silu_mul(g, u)


def fuse_gate_up(owner: nn.Module, gate: str, up: str) -> None:
    owner.gate_up = fuse_linears([getattr(owner, gate), getattr(owner, up)])
    delattr(owner, gate)
    delattr(owner, up)


class BidirectionalLM(nn.Module):
    """What both families share: embed, run the blocks with per-row RoPE positions, and
    compute logits only at the positions a step asks for. Families supply the published
    module tree through `embed`, `blocks`, `head` and their architecture numbers."""

    logits_shift = 0  # Dream predicts token i from position i - 1
    head_dim: int
    rope_theta: float

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def head(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed(batch.input_ids)
        rope = rope_tables(batch.positions, self.head_dim, self.rope_theta)
        for i, block in enumerate(self.blocks()):
            x = block(x, rope, batch, i)
        return x

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, K, vocab] of hidden positions `batch.logits_index` (all when None)."""
        return self.head(gather_positions(self.hidden_states(batch), batch.logits_index))
