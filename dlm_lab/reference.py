"""Plain re-statements of the published decoding loops, used only to prove the engine equal.

`llada_generate` follows LLaDA's `generate.py` (semi-autoregressive blocks, per-block linear
transfer schedule, Gumbel noise in float64, low_confidence / random remasking, CFG);
`dream_generate` follows Dream's `diffusion_generate` (timestep schedule, origin /
maskgit_plus / topk_margin / entropy, shifted logits). Both call the model on the whole
sequence every step, exactly as published: slow on purpose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dlm_engine.decoding.filters import top_k_logits, top_p_logits
from dlm_engine.models.common import ForwardBatch, Logits, attention


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


# ---- the accelerated loops, restated plainly (T = 0, batch 1, no cache) ----------


def _entropy(logits: torch.Tensor, dtype: torch.dtype | None, eps: float) -> torch.Tensor:
    p = F.softmax(logits.to(dtype) if dtype is not None else logits, dim=-1)
    return -torch.sum(p * torch.log(p + eps), dim=-1)


@torch.no_grad()
def fast_dllm_factor_generate(
    logits_fn: Logits,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    gen_length: int,
    block_length: int,
    factor: float = 1.0,
) -> torch.Tensor:
    """NVlabs/Fast-dLLM `llada/generate.py`: `generate(..., factor=f)` (no cache), which calls
    `get_transfer_index_dynamic`: with the masked confidences sorted c_0 >= c_1 >= ..., walk
    i = 0, 1, ... and stop at the first i with c_i < 1 - f / (i + 2) (i = 0 always passes);
    commit that many; a stop at the last index, or no stop, commits every mask. Blocks end
    when they hold no mask (`steps` plays no part)."""
    x = F.pad(prompt, (0, gen_length), value=mask_id)
    p_len = prompt.shape[1]
    for nb in range(gen_length // block_length):
        end = p_len + (nb + 1) * block_length
        while (x[:, end - block_length : end] == mask_id).any():
            mask_index = x == mask_id
            logits = logits_fn(x)
            mask_index[:, end:] = False
            x0 = torch.argmax(logits, dim=-1)
            x0_p = torch.gather(F.softmax(logits.to(torch.float64), -1), -1, x0[..., None])[..., 0]
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -torch.inf)
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(x.shape[0]):
                m = int(mask_index[j].sum())
                threshs = [1 - factor / (n + 1) for n in range(1, m + 1)]
                threshs[0] = -1
                sorted_conf = torch.sort(confidence[j][mask_index[j]], descending=True)[0]
                top_i = 0
                for top_i in range(m):
                    if sorted_conf[top_i] < threshs[top_i]:
                        break
                if top_i == 0 or top_i == m - 1:
                    top_i += 1
                _, idx = torch.topk(confidence[j], k=top_i)
                transfer[j, idx] = True
            x[transfer] = x0[transfer]
    return x


@torch.no_grad()
def d3llm_entropy_generate(
    logits_fn: Logits,
    prompt: torch.Tensor,
    *,
    family: str,
    mask_id: int,
    gen_length: int,
    block_length: int,
    threshold: float,
) -> torch.Tensor:
    """hao-ai-lab/d3LLM single-block entropy threshold, blocks until each holds no mask.

    LLaDA (`d3llm/d3llm_LLaDA/d3llm_llada_generate_util.py`, `generate(threshold=...)` ->
    `get_transfer_index_entropy`): float64 entropy with eps 1e-12; the lowest-entropy mask is
    always committed, the others while entropy <= threshold.
    Dream (`d3llm/d3llm_DREAM/d3llm_dream_generate_util.py`, `_sample` with alg
    `entropy_threshold`, as SGLang's `EntropyThreshold`): logits shifted right by one, entropy
    in the logits' dtype with eps 1e-8; lowest always, the others while entropy < threshold."""
    x = F.pad(prompt, (0, gen_length), value=mask_id)
    p_len = prompt.shape[1]
    for nb in range(gen_length // block_length):
        start, end = p_len + nb * block_length, p_len + (nb + 1) * block_length
        while (x[:, start:end] == mask_id).any():
            mask_index = x == mask_id
            logits = logits_fn(x)
            if family == "dream":
                logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
                entropy = _entropy(logits, None, 1e-8)
            else:
                entropy = _entropy(logits, torch.float64, 1e-12)
            mask_index[:, end:] = False
            x0 = torch.where(mask_index, torch.argmax(logits, dim=-1), x)
            ent_sel = torch.where(mask_index, entropy, torch.inf)
            transfer = torch.zeros_like(x, dtype=torch.bool)
            for j in range(x.shape[0]):
                k = int(mask_index[j].sum())
                vals, idx = torch.topk(ent_sel[j], k=k, largest=False)
                transfer[j, idx[0]] = True
                for i in range(1, k):
                    keep = vals[i] < threshold if family == "dream" else vals[i] <= threshold
                    transfer[j, idx[i]] = bool(keep)
            x[transfer] = x0[transfer]
    return x


def _d3llm_progress(b: dict) -> float:
    return 1 - b["masks"] / b["total"]


def _d3llm_grow_blocks(
    blocks: dict[int, dict],
    next_id: int,
    x: torch.Tensor,
    *,
    p_len: int,
    num_blocks: int,
    block_size: int,
    mask_id: int,
    block_add_threshold: float,
    decoded_token_threshold: float,
    **fields,
) -> int:
    """The top of d3LLM's multi-block iteration: a block whose predecessor has decoded >=
    decoded_token_threshold becomes active; then, if the last block's progress is >=
    block_add_threshold (or it has no mask), the next block is added (active when its
    predecessor already passes that threshold; `fields` are extra per-block entries). Returns
    the next block id."""
    for bid in sorted(blocks):
        prev_done = bid > 0 and _d3llm_progress(blocks[bid - 1]) >= decoded_token_threshold
        if prev_done and not blocks[bid]["active"]:
            blocks[bid]["active"] = True
    if next_id <= num_blocks:
        last = blocks[max(blocks)]
        if _d3llm_progress(last) >= block_add_threshold or last["masks"] == 0:
            start = p_len + (next_id - 1) * block_size
            blocks[next_id] = dict(
                start=start,
                end=start + block_size,
                masks=int((x[:, start : start + block_size] == mask_id).sum()),
                total=block_size,
                active=_d3llm_progress(blocks[next_id - 1]) >= decoded_token_threshold,
                **fields,
            )
            next_id += 1
    return next_id


def _d3llm_early_stop(
    x: torch.Tensor,
    blocks: dict[int, dict],
    next_id: int,
    *,
    eos_id: int,
    p_len: int,
    num_blocks: int,
    block_size: int,
    mask_id: int,
    **_: float,
) -> int:
    """d3LLM's `handle_early_stop` (LLaDA and Dream alike), in place: with an end-of-text token
    in the generated part, every position after the first one becomes end-of-text; a block
    starting after it that still counts masks gets none and is activated; the block holding it
    counts the masks up to and including it, and is activated if that count changed to none;
    the blocks not yet added are added with no mask, activated. (Dream then recounts every
    block from the canvas: the same counts.) Returns the next block id."""
    hits = (x[0, p_len:] == eos_id).nonzero()
    if hits.numel() == 0:
        return next_id
    first = p_len + int(hits[0, 0])
    x[:, first + 1 :] = eos_id
    for bid in sorted(blocks):
        b = blocks[bid]
        if bid == 0:
            continue
        if b["start"] > first:
            if b["masks"] != 0:
                b["masks"], b["active"] = 0, True
        elif b["start"] <= first < b["end"]:
            before = int((x[:, b["start"] : first + 1] == mask_id).sum())
            if before != b["masks"]:
                b["masks"] = before
                b["active"] = b["active"] or before == 0
    while next_id <= num_blocks:
        start = p_len + (next_id - 1) * block_size
        blocks[next_id] = dict(start=start, end=start + block_size, masks=0, total=block_size,
                               active=True)  # fmt: skip
        next_id += 1
    return next_id


def _d3llm_active_end(blocks: dict[int, dict]) -> int | None:
    """End of the rightmost block that is active or still holds masks (None: none is)."""
    rightmost = 0
    for bid in sorted(blocks):
        if blocks[bid]["active"] or blocks[bid]["masks"] > 0:
            rightmost = bid
    return None if rightmost == 0 else blocks[rightmost]["end"]


def _d3llm_commit(
    x: torch.Tensor,
    logits: torch.Tensor,
    entropy: torch.Tensor,
    mask_index: torch.Tensor,
    active_end: int,
    blocks: dict[int, dict],
    *,
    family: str,
    threshold: float,
) -> None:
    """d3LLM's multi-block commit, in place on `x` and the blocks' mask counts: every mask
    before `active_end` is a candidate; LLaDA commits the lowest entropy and every entropy <=
    threshold, Dream every entropy < threshold; if the first active block still holding masks
    got none, its lowest-entropy mask is committed."""
    decode = mask_index.clone()
    decode[:, active_end:] = False
    x0 = torch.where(decode, torch.argmax(logits, dim=-1), x)
    if family == "dream":
        transfer = (entropy < threshold) & decode
    else:
        ent_sel = torch.where(decode, entropy, torch.inf)
        k = int(decode[0].sum())
        vals, idx = torch.topk(ent_sel[0], k=k, largest=False)
        transfer = torch.zeros_like(x, dtype=torch.bool)
        transfer[0, idx] = True
        for i in range(1, k):
            if vals[i] > threshold:
                transfer[0, idx[i]] = False
    first = next(
        (b for bid, b in sorted(blocks.items()) if bid > 0 and b["active"] and b["masks"] > 0),
        None,
    )
    if first is not None and not transfer[:, first["start"] : first["end"]].any():
        lo, hi = first["start"], first["end"]
        ent_block = torch.where(decode[:, lo:hi], entropy[:, lo:hi], torch.inf)
        best = lo + int(ent_block[0].argmin())
        transfer[0, best] = True
        x0[0, best] = torch.argmax(logits[0, best])
    x[transfer] = x0[transfer]
    for bid in sorted(blocks):
        b = blocks[bid]
        if bid > 0 and b["masks"] > 0:
            b["masks"] -= int(transfer[:, b["start"] : b["end"]].sum())


@torch.no_grad()
def d3llm_multi_block_generate(
    logits_fn: Logits,
    prompt: torch.Tensor,
    *,
    family: str,
    mask_id: int,
    gen_length: int,
    block_size: int,
    threshold: float,
    block_add_threshold: float,
    decoded_token_threshold: float,
    eos_id: int | None = None,
) -> torch.Tensor:
    """hao-ai-lab/d3LLM `generate_multi_block` (LLaDA) / `_sample_multi_block` (Dream, as
    SGLang PR #20615's `FullAttnMultiBlock`), without cache, batch 1; with `eos_id`, its
    `early_stop=True` (the published runs' setting; see `_d3llm_early_stop`).

    Blocks of `block_size` after the prompt (block 0, complete). Each iteration: a block
    whose predecessor has decoded >= decoded_token_threshold of its tokens becomes fully
    activated; if the last block's progress is >= block_add_threshold (or it has no mask)
    the next block is added, activated when its predecessor already passes that threshold;
    the decode region is every mask up to the end of the rightmost block that is activated
    or still holds masks. Full forward; float64 entropy (eps 1e-12). LLaDA commits the
    lowest-entropy mask and every mask with entropy <= threshold; Dream (shifted logits)
    every mask with entropy < threshold. If the first activated block still holding masks
    got none, its lowest-entropy mask is committed. Mask counts drop by the commits.

    Early stop runs right after the loop's end check, before activation: the step's mask
    set is the one taken before it, as upstream, so the positions its fill takes from the mask
    remain candidates of that step (their commits are overwritten by the next fill)."""
    x = F.pad(prompt, (0, gen_length), value=mask_id)
    p_len = prompt.shape[1]
    num_blocks = gen_length // block_size
    blocks = {0: dict(start=0, end=p_len, masks=0, total=p_len, active=True)}
    blocks[1] = dict(
        start=p_len,
        end=p_len + block_size,
        masks=block_size,
        total=block_size,
        active=decoded_token_threshold <= 1.0,
    )
    next_id = 2
    grow = dict(p_len=p_len, num_blocks=num_blocks, block_size=block_size, mask_id=mask_id,
                block_add_threshold=block_add_threshold,
                decoded_token_threshold=decoded_token_threshold)  # fmt: skip
    while True:
        mask_index = x == mask_id
        if not mask_index[:, p_len:].any() and next_id > num_blocks:
            break
        if eos_id is not None:
            next_id = _d3llm_early_stop(x, blocks, next_id, eos_id=eos_id, **grow)
            if not (x[:, p_len:] == mask_id).any():
                break
        next_id = _d3llm_grow_blocks(blocks, next_id, x, **grow)
        active_end = _d3llm_active_end(blocks)
        if active_end is None:
            break
        logits = logits_fn(x)
        if family == "dream":
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        entropy = _entropy(logits, torch.float64, 1e-12)
        _d3llm_commit(x, logits, entropy, mask_index, active_end, blocks, family=family,
                      threshold=threshold)  # fmt: skip
    return x


class _ExplicitKV:
    """Attention context of `cached_forward`: each layer attends bidirectionally over its past
    keys/values followed by the fresh ones, and keeps the fresh ones for the caller."""

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        self.past = past
        self.fresh: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attend(self, layer: int, q, k, v, key_mask=None) -> torch.Tensor:
        self.fresh.append((k, v))
        if self.past is not None:
            pk, pv = self.past[layer]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        return attention(q, k, v, None)


KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, kv heads, S, D]


def cached_forward(
    model: torch.nn.Module, tokens: torch.Tensor, pos0: int = 0, past: KV | None = None
) -> tuple[torch.Tensor, KV]:
    """One of our LLaDA/Dream-layout models on `tokens` [1, T] at absolute positions
    pos0..pos0+T-1, attending over `past` (keys/values of positions [0, pos0), as an HF
    `past_key_values`) and the fresh tokens. Returns the logits [1, T, V] (unshifted) and each
    layer's fresh keys/values. Independent of the engine's pool and packed forward."""
    assert past is not None or pos0 == 0, "positions before pos0 need their keys"
    pos = torch.arange(pos0, pos0 + tokens.shape[1], device=tokens.device)[None]
    ctx = _ExplicitKV(past)
    logits = model(ForwardBatch(tokens, pos, None, None, ctx))
    return logits, ctx.fresh


@torch.no_grad()
def d3llm_multi_block_cached_generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    family: str,
    mask_id: int,
    gen_length: int,
    block_size: int,
    threshold: float,
    block_add_threshold: float,
    decoded_token_threshold: float,
    cache_delay_iter: int,
    refresh_interval: int | None = None,
    trace: list[str] | None = None,
) -> torch.Tensor:
    """hao-ai-lab/d3LLM `generate_multi_block_kv_cache` (LLaDA) / `_sample_multi_block_kv_cache`
    (Dream, which `generate_multi_block` runs when cache_delay_iter < 10000): the multi-block
    loop of `d3llm_multi_block_generate` with a delayed prefix KV cache. T = 0, batch 1, no
    early stop; `refresh_interval` None means never (upstream's 10000).

    Blocks, activation, adding and the commit rule are the no-cache loop's. The prompt is
    block 0, complete "at nfe 0", not cached. Each iteration (nfe counted first), after
    activation and adding, the blocks ending past the cache are walked in order up to the first
    one holding masks: a decoded block gets its completion nfe (once); one whose delay (nfe -
    completion) reaches `cache_delay_iter` is marked cached; LLaDA also stops the walk at a
    block still within its delay (Dream walks on). The cache grows to the end of the last block
    marked. Stabilizing blocks: decoded, stamped, not cached. The forward:

    * cache grows: x[cache_length:] at its absolute positions over the cache (no cache yet: the
      whole x), bidirectional over [cache; fresh]; the first `update` fresh keys are appended;
    * a cache, no stabilizing block, nfe not a multiple of `refresh_interval`: x[cache_length:]
      over the cache, which is left unchanged;
    * a cache otherwise (a refresh): the whole x without cache; its logits are used and the
      cache becomes its keys of [0, cache_length);
    * no cache: the whole x.

    Positions outside the forwarded piece get entropy inf (they hold no mask). Dream shifts
    logits right by one within the forwarded piece (its first position keeps its own logits),
    as upstream. `trace` receives each forward's kind: full, cache, span, refresh (a block is
    stabilizing), periodic (`refresh_interval`).

    Upstream defect not copied: a refresh truncates the fresh keys to the start of the latest
    stabilizing block, not to cache_length. For LLaDA these are equal (its walk stops at the
    first stabilizing block, so only one can exist and it starts at the cache's end). Dream's
    walk does not stop, so when two blocks stabilize together the refreshed cache already
    holds the first one's keys, and the next caching step appends them again: attention sees
    those positions twice. Here the cache always holds exactly positions [0, cache_length)."""
    x = F.pad(prompt, (0, gen_length), value=mask_id)
    p_len = prompt.shape[1]
    num_blocks = gen_length // block_size
    blocks = {0: dict(start=0, end=p_len, masks=0, total=p_len, active=True, done_at=0)}
    blocks[1] = dict(
        start=p_len,
        end=p_len + block_size,
        masks=block_size,
        total=block_size,
        active=decoded_token_threshold <= 1.0,
        done_at=None,
    )
    for b in blocks.values():
        b["cached"] = False
    next_id = 2
    grow = dict(p_len=p_len, num_blocks=num_blocks, block_size=block_size, mask_id=mask_id,
                block_add_threshold=block_add_threshold,
                decoded_token_threshold=decoded_token_threshold)  # fmt: skip
    cache: KV | None = None  # keys/values of positions [0, cache_len)
    cache_len = 0
    nfe = 0
    while True:
        mask_index = x == mask_id
        if not mask_index[:, p_len:].any() and next_id > num_blocks:
            break
        nfe += 1
        next_id = _d3llm_grow_blocks(blocks, next_id, x, done_at=None, cached=False, **grow)
        active_end = _d3llm_active_end(blocks)
        if active_end is None:
            break
        # the delayed cache: which decoded blocks have waited long enough
        cache_to = None
        for bid in sorted(blocks):
            b = blocks[bid]
            if b["end"] <= cache_len:
                continue
            if b["masks"] > 0:
                break
            if b["done_at"] is None:
                b["done_at"] = nfe
            delay = nfe - b["done_at"]
            if delay >= cache_delay_iter and not b["cached"]:
                b["cached"] = True
                cache_to = b["end"]
            elif delay < cache_delay_iter and family != "dream":
                break
        update = 0 if cache_to is None else cache_to - cache_len
        stabilizing = any(
            b["masks"] == 0 and b["done_at"] is not None and not b["cached"]
            for b in blocks.values()
        )
        periodic = refresh_interval is not None and nfe % refresh_interval == 0
        # (upstream also stops when nothing from the cache's end on needs forwarding: a block
        # holding masks always starts at or after the cache's end, so that never happens)
        if update > 0 or (cache is not None and not stabilizing and not periodic):
            kind = "cache" if update > 0 else "span"
            start = cache_len
            logits, fresh = cached_forward(model, x[:, start:], start, cache)
            if update > 0:
                new = [(k[:, :, :update], v[:, :, :update]) for k, v in fresh]
                if cache is not None:
                    new = [
                        (torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
                        for (pk, pv), (k, v) in zip(cache, new, strict=True)
                    ]
                cache, cache_len = new, cache_len + update
        else:
            kind = "full" if cache is None else "refresh" if stabilizing else "periodic"
            start = 0
            logits, fresh = cached_forward(model, x)
            if cache is not None:
                cache = [(k[:, :, :cache_len], v[:, :, :cache_len]) for k, v in fresh]
        if trace is not None:
            trace.append(kind)
        if family == "dream":
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        full = logits.new_zeros((1, x.shape[1], logits.shape[-1]))
        full[:, start:] = logits
        entropy = _entropy(full, torch.float64, 1e-12)
        entropy[:, :start] = torch.inf
        _d3llm_commit(x, full, entropy, mask_index, active_end, blocks, family=family,
                      threshold=threshold)  # fmt: skip
    return x


@torch.no_grad()
def local_leap_generate(
    logits_fn: Logits,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    steps: int,
    gen_length: int,
    block_length: int,
    anchor_threshold: float = 0.9,
    neighbor_threshold: float = 0.75,
    radius: int = 4,
) -> torch.Tensor:
    """dlmserve 0.1.1 `denoise_loop.denoise` with `use_local_leap` (`sampler.commit_with_local_
    leap`; LocalLeap, arXiv 2510.07081): LLaDA's blocks and linear per-block schedule k; the
    confidence is softmax(logits) in the logits' dtype at the argmax, -inf outside the masked
    active block. The k most confident are anchors; each anchor with confidence >= anchor
    threshold also commits the masked positions within `radius` whose confidence >= neighbor
    threshold. A block ends when it holds no mask, or after its steps.

    One deliberate difference: dlmserve takes `topk(k)` even when fewer than k masks are left
    in the block (its extra commits end blocks early), so the surplus picks fall on -inf
    positions in an order torch leaves unspecified, which can commit tokens of later blocks.
    Here k is capped at the masks left, which is what the algorithm means."""
    x = F.pad(prompt, (0, gen_length), value=mask_id)
    p_len = prompt.shape[1]
    steps_per_block = steps // (gen_length // block_length)
    offsets = torch.arange(-radius, radius + 1, device=prompt.device)
    for nb in range(gen_length // block_length):
        start, end = p_len + nb * block_length, p_len + (nb + 1) * block_length
        schedule = num_transfer_tokens(x[:, start:end] == mask_id, steps_per_block)
        for step in range(steps_per_block):
            mask_index = x == mask_id
            logits = logits_fn(x)
            x0 = logits.argmax(dim=-1)
            x0_p = logits.softmax(dim=-1).gather(-1, x0[..., None])[..., 0]
            x0_p[:, end:] = -torch.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -torch.inf)
            new_x = x.clone()
            for j in range(x.shape[0]):
                k = min(int(schedule[j, step]), int(mask_index[j, start:end].sum()))
                if k <= 0:
                    continue
                vals, idx = torch.topk(confidence[j], k=k)
                new_x[j, idx] = x0[j, idx]
                strong = idx[vals >= anchor_threshold]
                if strong.numel() == 0:
                    continue
                near = (strong[:, None] + offsets[None, :]).clamp(0, x.shape[1] - 1).flatten()
                near = torch.unique(near)
                keep = near[confidence[j, near] >= neighbor_threshold]
                new_x[j, keep] = x0[j, keep]
            x = new_x
            if not (x[:, start:end] == mask_id).any():
                break
    return x
