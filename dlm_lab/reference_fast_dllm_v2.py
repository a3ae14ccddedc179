"""A plain restatement of Fast-dLLM v2's published `generate()` (NVlabs/Fast-dLLM
`v2/modeling.py`, `Fast_dLLM_QwenForCausalLM.generate`, `use_block_cache=False`), used only to
prove the engine equal token for token at temperature 0. Slow on purpose.

The published loop, per block of `block_size` tokens aligned to absolute position 0:
- a prompt longer than one block is prefilled in whole blocks; if it ends on a block boundary,
  the argmax of its last position is appended (the next block's first token);
- the block holding the sequence's end is padded with masks; its sub-blocks of
  `small_block_size` are decoded in order: while the sub-block holds a mask, forward the block
  (every earlier position from the cache), shift its logits right by one inside the block
  (position j reads the output at j - 1, position 0 its own), take the sub-block's softmax
  argmax and probability, commit every mask whose probability exceeds `threshold` and the most
  probable mask;
- a block with no mask left is forwarded once more to store its keys, and the argmax of its
  last position is appended;
- decoding stops once `stop_token` is present with no mask before it; `max_new_tokens //
  block_size` blocks are decoded at most; the answer is cut after its first `stop_token`.

Here the cache is replaced by one block-causal forward over everything before the block's end
(`reference_block.block_logits`): what the cached forwards compute. One published step is not
restated: a prompt of exactly `block_size` tokens is not prefilled (the test is `>`), and no
cache exists for its first generated block, whose forwards then never see the prompt; this loop
(and the engine) reads the prompt there as for every longer prompt."""

from __future__ import annotations

import torch

from .reference_block import BlockRun, block_logits


def _stopped(x: list[int], start: int, stop_token: int, mask_id: int) -> bool:
    """Upstream's check: the stop token after `start` with no mask before it."""
    tail = x[start:]
    if stop_token not in tail:
        return False
    return mask_id not in tail[: tail.index(stop_token)]


@torch.no_grad()
def fast_dllm_v2_generate(
    model: torch.nn.Module,
    prompt: list[int],
    *,
    mask_id: int,
    stop_token: int,
    max_new_tokens: int,
    block_size: int = 32,
    small_block_size: int = 8,
    threshold: float = 1.0,
) -> BlockRun:
    """Greedy (temperature 0) `generate()` of one prompt. `tokens`: the answer after the prompt,
    up to and including the first stop token; `forwards` counts every forward whose logits
    the loop reads (prefill, sub-block steps, the block-end forwards)."""
    if block_size % small_block_size:
        raise ValueError("small_block_size must divide block_size")
    x = list(prompt)
    p_len = len(x)
    dev = next(model.parameters()).device
    forwards = 0
    commits: list[list[int]] = []

    def logits(start: int, end: int) -> torch.Tensor:
        nonlocal forwards
        forwards += 1
        return block_logits(model, torch.tensor(x, device=dev), start, end, block_size)

    if p_len >= block_size and p_len % block_size == 0:
        x.append(int(logits(p_len - block_size, p_len)[-1].argmax()))
    for _ in range(max_new_tokens // block_size):
        if stop_token in x[p_len:]:
            break
        begin = len(x)
        x += [mask_id] * (block_size - begin % block_size)
        start, end = len(x) - block_size, len(x)
        counts: list[int] = []
        while True:
            if _stopped(x, begin, stop_token, mask_id):
                break
            if mask_id not in x[start:end]:  # store the block, append the next block's first
                x.append(int(logits(start, end)[-1].argmax()))
                break
            for lo in range(start, end, small_block_size):
                hi = lo + small_block_size
                while mask_id in x[lo:hi] and not _stopped(x, begin, stop_token, mask_id):
                    lg = logits(start, end)
                    lg = torch.cat([lg[:1], lg[:-1]])[lo - start : hi - start]
                    p = torch.softmax(lg, dim=-1)
                    x1 = p.argmax(dim=-1)
                    conf = p.gather(-1, x1[:, None])[:, 0]
                    masked = torch.tensor([t == mask_id for t in x[lo:hi]], device=dev)
                    conf = torch.where(masked, conf, -torch.inf)
                    take = conf > threshold
                    take[conf.argmax()] = True
                    take &= masked
                    for j in take.nonzero()[:, 0].tolist():
                        x[lo + j] = int(x1[j])
                    counts.append(int(take.sum()))
        commits.append(counts)
    answer = x[p_len:]
    if stop_token in answer:
        answer = answer[: answer.index(stop_token) + 1]
    return BlockRun(torch.tensor(answer), forwards, torch.tensor(x), commits)
