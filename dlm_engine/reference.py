"""Plain re-statements of the published decoding loops, used only to prove the engine equal.

`llada_generate` follows LLaDA's `generate.py` (semi-autoregressive blocks, per-block linear
transfer schedule, Gumbel noise in float64, low_confidence / random remasking, CFG);
`dream_generate` follows Dream's `diffusion_generate` (timestep schedule, origin /
maskgit_plus / topk_margin / entropy, shifted logits). Both call the model on the whole
sequence every step, exactly as published: slow on purpose.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .models.common import ForwardBatch

Logits = Callable[[torch.Tensor], torch.Tensor]


def full_logits(model: torch.nn.Module) -> Logits:
    """Adapt one of our models to the published `model(x).logits` call (no mask, all positions)."""

    def call(x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device).expand_as(x)
        return model(ForwardBatch(x, pos, None, None))

    return call


def add_gumbel_noise(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """LLaDA's sampling trick: argmax of exp(logits) / (-log u)^T, in float64."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand_like(logits, dtype=torch.float64)
    return logits.exp() / (-torch.log(noise)) ** temperature


def num_transfer_tokens(mask_index: torch.Tensor, steps: int) -> torch.Tensor:
    """Tokens to commit at each step of a block: the masks spread evenly, remainder first."""
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base, rem = mask_num // steps, mask_num % steps
    out = torch.zeros(mask_num.size(0), steps, dtype=torch.int64, device=mask_index.device) + base
    for i in range(mask_num.size(0)):
        out[i, : int(rem[i])] += 1
    return out


@torch.no_grad()
def llada_generate(
    logits_fn: Logits,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    steps: int,
    gen_length: int,
    block_length: int,
    temperature: float = 0.0,
    cfg_scale: float = 0.0,
    remasking: str = "low_confidence",
    eos_id: int | None = None,
    logits_eos_inf: bool = False,
) -> torch.Tensor:
    """LLaDA's published loop; returns the whole sequence [B, prompt + gen_length]."""
    x = torch.full(
        (prompt.shape[0], prompt.shape[1] + gen_length),
        mask_id,
        dtype=torch.long,
        device=prompt.device,
    )
    x[:, : prompt.shape[1]] = prompt
    prompt_index = x != mask_id
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps = steps // num_blocks
    p_len = prompt.shape[1]
    for nb in range(num_blocks):
        block_mask = x[:, p_len + nb * block_length : p_len + (nb + 1) * block_length] == mask_id
        ntt = num_transfer_tokens(block_mask, steps)
        for i in range(steps):
            mask_index = x == mask_id
            if cfg_scale > 0.0:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                both = logits_fn(torch.cat([x, un_x], dim=0))
                logits, un_logits = torch.chunk(both, 2, dim=0)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = logits_fn(x)
            if logits_eos_inf and eos_id is not None:
                logits[:, :, eos_id] = -torch.inf
            x0 = torch.argmax(add_gumbel_noise(logits, temperature), dim=-1)
            if remasking == "low_confidence":
                p = F.softmax(logits.to(torch.float64), dim=-1)
                x0_p = torch.gather(p, -1, x0[..., None]).squeeze(-1)
            elif remasking == "random":
                x0_p = torch.rand(x0.shape, device=x0.device)
            else:
                raise NotImplementedError(remasking)
            x0_p[:, p_len + (nb + 1) * block_length :] = -torch.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -torch.inf)
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(confidence.shape[0]):
                _, idx = torch.topk(confidence[j], k=int(ntt[j, i]))
                transfer[j, idx] = True
            x[transfer] = x0[transfer]
    return x


def top_p_logits(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches `top_p` (Dream's filter)."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    cum = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cum > top_p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_idx, remove)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def top_k_logits(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` largest logits (Dream's filter)."""
    top_k = min(top_k, logits.size(-1))
    kth = torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def dream_sample_tokens(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    margin_confidence: bool = False,
    neg_entropy: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's `sample_tokens`: proposal and confidence per masked position."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        x0 = torch.multinomial(probs.float(), 1, generator=generator).squeeze(-1)
        confidence = torch.gather(probs, -1, x0[..., None]).squeeze(-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin_confidence:
        top2 = torch.topk(probs, 2, dim=-1).values
        confidence = top2[..., 0] - top2[..., 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


@torch.no_grad()
def dream_generate(
    logits_fn: Logits,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    steps: int,
    gen_length: int,
    alg: str = "entropy",
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    eps: float = 1e-3,
) -> torch.Tensor:
    """Dream's published `_sample` loop (alg_temp 0, no padding); returns the whole sequence."""
    x = F.pad(prompt, (0, gen_length), value=mask_id)
    timesteps = torch.linspace(1, eps, steps + 1, device=x.device)
    for i in range(steps):
        mask_index = x == mask_id
        logits = logits_fn(x)
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_logits = logits[mask_index]
        t, s = timesteps[i], timesteps[i + 1]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.zeros_like(x[mask_index]) + mask_id
            chosen = torch.rand(*x0.shape, device=x.device) < p_transfer
            _, x0[chosen] = dream_sample_tokens(mask_logits[chosen], temperature, top_p, top_k)
            x[mask_index] = x0.clone()
            continue
        confidence, x0 = dream_sample_tokens(
            mask_logits,
            temperature,
            top_p,
            top_k,
            margin_confidence=alg == "topk_margin",
            neg_entropy=alg == "entropy",
        )
        num_mask = mask_index.sum() / mask_index.shape[0]
        n_transfer = int(num_mask * (1 - s / t)) if i < steps - 1 else int(num_mask)
        full_conf = torch.full_like(x, -torch.inf, dtype=logits.dtype)
        full_conf[mask_index] = confidence
        if n_transfer > 0:
            _, transfer_index = torch.topk(full_conf, n_transfer)
            x_ = torch.zeros_like(x) + mask_id
            x_[mask_index] = x0.clone()
            rows = torch.arange(x.size(0), device=x.device)[:, None].expand_as(transfer_index)
            x[rows, transfer_index] = x_[rows, transfer_index]
    return x
