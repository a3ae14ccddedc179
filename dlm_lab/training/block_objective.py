"""Block-diffusion training for the SDAR layout (the embedded tiny-sdar).

SDAR decodes block by block: a token attends to every token of its own block and of the
blocks before it (blocks aligned at absolute position 0, so a prompt's tail shares its block
with the first answer tokens), and the keys of finished blocks are those of their committed,
clean tokens. Training sees both views at once, as SDAR's and BD3-LM's trainers do: the
input is the noisy sequence followed by the clean one (same positions), and

* a noisy token in block b attends to the noisy tokens of block b and the clean tokens of
  blocks before b (what the engine's step sees: the active block over the cached clean KV);
* a clean token in block b attends to the clean tokens of blocks up to b (how the cache's
  keys and values are computed).

Noise is drawn per block (each block is denoised on its own at inference): every answer
token of block b is masked with probability t_b ~ U(eps, 1), prompt tokens never are, and
cross-entropy on the masked positions is weighted by 1 / t_b and divided by the answer length,
LLaDA's estimator applied block-wise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dlm_engine.models.common import ForwardBatch

from ..reference_block import block_causal_mask

MASK_EPS = 1e-3  # lowest masking ratio


def training_mask(t_len: int, block: int, device: torch.device) -> torch.Tensor:
    """[2T, 2T] attention mask (True = attend) of the [noisy; clean] training input."""
    blk = torch.arange(t_len, device=device) // block
    same = blk[:, None] == blk[None, :]
    before = blk[None, :] < blk[:, None]
    upto = block_causal_mask(t_len, block, device)
    none = torch.zeros(t_len, t_len, dtype=torch.bool, device=device)
    top = torch.cat([same, before], dim=1)  # noisy queries: own block noisy, earlier clean
    bottom = torch.cat([none, upto], dim=1)  # clean queries: clean up to own block
    return torch.cat([top, bottom], dim=0)


def block_diffusion_loss(
    model: nn.Module,
    ids: torch.Tensor,
    plen: torch.Tensor,
    tlen: torch.Tensor,
    mask_id: int,
    block: int,
    amp: bool,
) -> torch.Tensor:
    """The block-wise masked-diffusion loss of one batch (no host sync).

    `ids` [B, T] (T a multiple of `block`), prompt lengths `plen`, answer-region ends `tlen`:
    positions [plen, tlen) are the answer (with its end-of-turn and padding) and carry loss;
    anything after `tlen` is padding that, being later, no counted position can see."""
    b, t_len = ids.shape
    dev = ids.device
    pos = torch.arange(t_len, device=dev).expand(b, t_len)
    answer = (pos >= plen[:, None]) & (pos < tlen[:, None])
    t_block = torch.rand(b, t_len // block, device=dev) * (1 - MASK_EPS) + MASK_EPS
    t_pos = t_block.repeat_interleave(block, dim=1)
    masked = (torch.rand(b, t_len, device=dev) < t_pos) & answer
    noisy = torch.where(masked, torch.full_like(ids, mask_id), ids)
    inputs = torch.cat([noisy, ids], dim=1)
    positions = torch.cat([pos, pos], dim=1)
    mask = training_mask(t_len, block, dev)[None].expand(b, -1, -1)
    noisy_half = torch.arange(t_len, device=dev).expand(b, t_len)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(ForwardBatch(inputs, positions, mask, noisy_half))
    ce = F.cross_entropy(logits.float().transpose(1, 2), ids, reduction="none")
    weight = masked.float() / (t_pos * (tlen - plen).float()[:, None])
    return (ce * weight).sum() / b


@torch.no_grad()
def block_greedy_decode(
    model: nn.Module,
    prompts: list[list[int]],
    mask_id: int,
    pad_id: int,
    canvas: int,
    k: int,
    block: int,
    amp: bool,
) -> list[list[int]]:
    """Greedy block-by-block decoding, k most confident masks a step, batched, no cache.

    A compact statement of SDAR's low_confidence_static rule used only to watch training
    (the shipped numbers come from the engine, `benchmarks/quality.py`): every row is masks
    from its prompt's end to a common width, blocks are aligned at position 0, and each step
    forwards the whole width under the block-causal mask (later blocks are invisible)."""
    dev = next(model.parameters()).device
    b = len(prompts)
    plen = torch.tensor([len(p) for p in prompts], device=dev)
    width = -(-(int(plen.max()) + canvas) // block) * block
    ids = torch.full((b, width), mask_id, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, device=dev)
    pos = torch.arange(width, device=dev).expand(b, width)
    mask = block_causal_mask(width, block, dev)[None].expand(b, -1, -1)
    for blk in range(int(plen.min()) // block, width // block):
        cols = slice(blk * block, (blk + 1) * block)
        for _ in range(-(-block // k)):
            cur = ids[:, cols]
            open_ = cur == mask_id
            if not bool(open_.any()):
                break
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(ForwardBatch(ids, pos, mask, pos[:, cols]))
            conf, pred = torch.softmax(logits.float(), dim=-1).max(-1)
            conf = torch.where(open_, conf, torch.full_like(conf, -1.0))
            top = conf.topk(min(k, block), dim=1).indices
            sel = torch.zeros_like(open_).scatter(1, top, True) & open_
            ids[:, cols] = torch.where(sel, pred, cur)
    out = []
    for i, p in enumerate(prompts):
        row = ids[i, len(p) :].tolist()
        out.append([pad_id if t == mask_id else t for t in row])
    return out
