"""Plain restatements of the published block-diffusion decoding loops, used only to prove the
engine equal (token for token at temperature 0).

- `sdar_generate`: JetAstra/SDAR `generate.py`, `block_diffusion_generate`.
- `llada2_generate`: inclusionAI LLaDA2.0 `modeling_llada2_moe.py`, `LLaDA2MoeModelLM.generate`
  (text read in inclusionAI/dFactory `models/llada2_moe/modeling_llada2_moe.py`).
- `joint_threshold_generate`: LLaDA2.1 token editing as SGLang's `JointThreshold` decoding
  algorithm (sgl-project/sglang `python/sglang/srt/dllm/algorithm/joint_threshold.py`).
- `multi_bd_generate`: Diffulex's Multi-Block Diffusion (`decoding_strategy: multi_bd`,
  SJTU-DENG-Lab/Diffulex): several consecutive blocks refined in one forward.

Shared layout (all three): prompt length P; num_blocks = ceil((P + gen_length) / block_length);
the canvas is the prompt followed by mask ids up to num_blocks * block_length. Blocks before
P // block_length hold only prompt; decoding starts at block P // block_length, which may hold
the prompt's tail (only its masks are decoded, its prompt tokens are never written).

No KV cache: every step forwards the canvas up to the end of the current block, with a
block-causal per-query key mask (token i may attend key j iff j // block_length <=
i // block_length), and reads the logits at the block's own positions (no shift). This is
what the published cached loops compute: a finished block never sees a later one. The
published "prefill" and "store the block's KV" forwards do not exist here, so `forwards`
counts denoising forwards only (the ones whose logits a decoding rule reads).

As published, the mask token is not excluded from the proposals (real checkpoints give it no
probability); a committed mask id leaves its position masked. Slow on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dlm_engine.models.common import ForwardBatch

SDAR_STRATEGIES = (
    "sequential",
    "low_confidence_static",
    "low_confidence_dynamic",
    "entropy_bounded",
)


@dataclass
class BlockRun:
    """What one loop did, so tests can check schedules and the engine its step count.

    `tokens`: generated ids after the prompt (each loop's docstring says where they end).
    `forwards`: denoising forwards. `canvas`: the whole sequence when the loop stopped (prompt
    included; undecoded blocks still masked). `commits[b][s]`: masks committed at step s of
    the b-th decoded block (one entry per forward). `edits[b][s]`: tokens edited likewise
    (`joint_threshold_generate` only; empty elsewhere). `running[s]`: the absolute indices
    of the blocks whose masks forward s sampled (`multi_bd_generate` only)."""

    tokens: torch.Tensor
    forwards: int
    canvas: torch.Tensor
    commits: list[list[int]] = field(default_factory=list)
    edits: list[list[int]] = field(default_factory=list)
    running: list[list[int]] = field(default_factory=list)  # multi_bd: blocks per forward


def block_causal_mask(length: int, block_length: int, device=None) -> torch.Tensor:
    """[length, length] bool, True = attend: query i sees key j iff j's block <= i's block."""
    blk = torch.arange(length, device=device) // block_length
    return blk[None, :] <= blk[:, None]


def block_logits(
    model: torch.nn.Module, x: torch.Tensor, start: int, end: int, block_length: int
) -> torch.Tensor:
    """Logits [end - start, V] of positions [start, end), from forwarding x[:end] block-causally.

    Keys past `end` would be masked for these queries anyway, so they are simply not sent."""
    dev = x.device
    batch = ForwardBatch(
        x[None, :end],
        torch.arange(end, device=dev)[None],
        block_causal_mask(end, block_length, dev)[None],
        torch.arange(start, end, device=dev)[None],
    )
    return model(batch)[0]


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Tokens to commit at each step of a block (SDAR `get_num_transfer_tokens`, LLaDA2
    `_get_num_transfer_tokens`): block_length // steps each, the first `remainder` steps one
    more. LLaDA2 gives an empty schedule for 0 steps."""
    if steps <= 0:
        return []
    base, rem = divmod(block_length, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """SDAR / LLaDA2 `top_k_logits`: -inf below the k-th largest logit (k capped at the vocab
    size, where upstream's `torch.topk` would raise)."""
    kth = torch.topk(logits, min(k, logits.shape[-1])).values[..., -1:]
    return logits.masked_fill(logits < kth, -torch.inf)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """SDAR / LLaDA2 `top_p_logits`: drop tokens once the sorted cumulative probability has
    passed p, always keeping the most likely one."""
    sorted_logits, order = torch.sort(logits, descending=True)
    drop = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    mask = torch.zeros_like(drop).scatter(-1, order, drop)
    return logits.masked_fill(mask, -torch.inf)


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_with_temperature_topk_topp` (SDAR and LLaDA2 share it): proposals [K] and
    their probabilities x0_p [K] for logits [K, V], in the logits' dtype.

    T > 0: logits / T (skipped at T == 1), top-k (k > 0), then top-p (p < 1), softmax, one
    `torch.multinomial` draw per position from `generator`, x0_p = the drawn token's
    probability under that filtered softmax. T == 0 is greedy: argmax of the raw logits and
    x0_p = its plain softmax probability, top-k / top-p ignored. Upstream differs there: SDAR
    divides by zero; LLaDA2's published greedy branch is the same as ours but only without
    top-k / top-p, otherwise (and in dFactory's older text, always) T == 0 samples at T = 1."""
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    if temperature == 0:
        x0 = logits.argmax(dim=-1)
        return x0, F.softmax(logits, dim=-1).gather(-1, x0[:, None])[:, 0]
    if temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and top_k > 0:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    probs = F.softmax(logits, dim=-1)
    x0 = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return x0, probs.gather(-1, x0[:, None])[:, 0]


def _canvas(
    prompt: torch.Tensor, mask_id: int, gen_length: int, block_length: int
) -> tuple[torch.Tensor, int, int]:
    """Prompt then masks to a whole number of blocks; returns (canvas, P, num_blocks)."""
    if prompt.dim() != 1:
        raise ValueError("prompt must be a 1-D tensor of token ids (the loops are batch 1)")
    p_len = prompt.numel()
    num_blocks = (p_len + gen_length + block_length - 1) // block_length
    x = torch.full((num_blocks * block_length,), mask_id, dtype=torch.long, device=prompt.device)
    x[:p_len] = prompt
    return x, p_len, num_blocks


def _top_k_index(conf: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [K]: the k largest entries of conf."""
    out = torch.zeros(conf.shape, dtype=torch.bool, device=conf.device)
    out[torch.topk(conf, k).indices] = True
    return out


def _answer(x: torch.Tensor, p_len: int, gen_length: int, eos_id: int | None) -> torch.Tensor:
    """LLaDA2's return: x[P : P + gen_length], cut after the first eos (kept)."""
    answer = x[p_len : p_len + gen_length]
    if eos_id is not None:
        hits = (answer == eos_id).nonzero()
        if len(hits):
            answer = answer[: int(hits[0]) + 1]
    return answer.clone()


def entropy_bounded_select(
    logits: torch.Tensor, mask: torch.Tensor, eb_threshold: float
) -> torch.Tensor:
    """The entropy-bounded rule SDAR means: entropy of each position's full predictive
    distribution (softmax of the raw logits over the vocabulary, float32, p clamped to 1e-12
    as upstream), masked positions sorted by ascending entropy (ties by position), k = the
    number whose running sum stays below eb_threshold (`searchsorted`, left), clamped to
    [1, masked count]; the k lowest are committed."""
    p = F.softmax(logits.float(), dim=-1).clamp_min(1e-12)
    ent = torch.where(mask, -(p * p.log()).sum(dim=-1), torch.inf)
    ent_sorted, order = torch.sort(ent, stable=True)
    cum = torch.cumsum(ent_sorted, dim=0)
    bound = torch.tensor([eb_threshold], dtype=cum.dtype, device=cum.device)
    k = int(torch.searchsorted(cum, bound, right=False))
    k = max(1, min(k, int(mask.sum())))
    out = torch.zeros_like(mask)
    out[order[:k]] = True
    return out


@torch.no_grad()
def sdar_generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    gen_length: int = 128,
    block_length: int = 8,
    denoising_steps: int = 8,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    remasking_strategy: str = "low_confidence_dynamic",
    confidence_threshold: float = 0.85,
    eb_threshold: float | None = None,
    stop_ids: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> BlockRun:
    """SDAR's `block_diffusion_generate`, without cache (defaults as published).

    Per decoded block, step s = 0, 1, ... (counted within the block) while the block holds a
    mask: forward, `sample_tokens` on the block's logits (in the logits' dtype, as SDAR's head
    returns them), k = transfer_schedule(block_length, denoising_steps)[s], then commit:
    `sequential` the positions [first mask, first mask + k); `low_confidence_static` the k
    most confident masks; `low_confidence_dynamic` every mask with x0_p >
    confidence_threshold if there are >= k of them, else the k most confident;
    `entropy_bounded` see `entropy_bounded_select`. Upstream's loop runs `denoising_steps + 1`
    iterations: the scheduled rules fill a block within `denoising_steps` (the last one only
    stores the block's KV, which has no counterpart here); `entropy_bounded` ignores the
    schedule, commits >= 1 a step and gets all `denoising_steps + 1` forwards, after which
    upstream leaves the block with its masks (never caching its keys): that is not restated,
    a block still holding masks then raises ValueError (the engine refuses entropy_bounded
    with steps < block_length - 1, where it can happen). After a block: stop if any of
    `stop_ids` is in x[P : block end] (upstream's `stopping_criteria_idx` test, on the decoded
    part only).

    Deviations, each an upstream defect: (a) upstream's top-k takes k = schedule[s] even when
    fewer masks are left, so it also picks -inf (already decoded, e.g. prompt) positions, in
    an order torch leaves unspecified, and overwrites them with their current proposals. Two
    cases reach it: the prompt-tail block (fewer masks than the schedule's sum), and any
    block under `low_confidence_dynamic` once a step has committed more than its schedule
    (every confidence above the threshold) while a later step's count of confident masks
    falls short of its k. k is capped here at the masks left, and the engine does the same
    (the dynamic rule still compares its count with the uncapped k, as upstream). (b) upstream
    `entropy_bounded` takes the "entropy" of the scalar x0_p summed over the block dimension
    and never creates `transfer_index`, so it cannot run; the intended per-position rule is
    restated. (c) temperature 0 is greedy (see `sample_tokens`); upstream divides by zero.

    Returns `tokens` = x[P : end of the last decoded block]: mask ids never remain there, but
    the stop id and what follows it in its block do, and the last block may reach past
    P + gen_length: the caller truncates. `forwards` counts denoising forwards only."""
    if remasking_strategy not in SDAR_STRATEGIES:
        raise ValueError(f"unknown remasking strategy {remasking_strategy!r}")
    if remasking_strategy == "entropy_bounded" and eb_threshold is None:
        raise ValueError("entropy_bounded needs eb_threshold")
    if denoising_steps < 1:
        raise ValueError("denoising_steps must be >= 1")
    x, p_len, num_blocks = _canvas(prompt, mask_id, gen_length, block_length)
    schedule = transfer_schedule(block_length, denoising_steps)
    adaptive = remasking_strategy == "entropy_bounded"
    forwards, commits, end = 0, [], p_len
    for b in range(p_len // block_length, num_blocks):
        start, end = b * block_length, (b + 1) * block_length
        counts: list[int] = []
        step = 0
        while step < denoising_steps + adaptive:
            block = x[start:end]
            mask = block == mask_id
            if not mask.any():
                break
            logits = block_logits(model, x, start, end, block_length)
            forwards += 1
            x0, x0_p = sample_tokens(logits, temperature, top_k, top_p, generator)
            conf = torch.where(mask, x0_p, -torch.inf)
            left = int(mask.sum())
            if adaptive:
                transfer = entropy_bounded_select(logits, mask, eb_threshold)
            elif remasking_strategy == "sequential":
                k = schedule[step]
                first = int(mask.nonzero()[0])
                transfer = torch.zeros_like(mask)
                transfer[first : first + k] = True
            elif remasking_strategy == "low_confidence_static":
                transfer = _top_k_index(conf, min(schedule[step], left))
            else:
                k = schedule[step]
                high = conf > confidence_threshold
                transfer = high if int(high.sum()) >= k else _top_k_index(conf, min(k, left))
            block[transfer] = x0[transfer]
            counts.append(int(transfer.sum()))
            step += 1
        commits.append(counts)
        if adaptive and bool((x[start:end] == mask_id).any()):
            raise ValueError(
                f"entropy_bounded left block {b} with masks after {denoising_steps + 1} forwards"
            )
        if stop_ids and any(bool((x[p_len:end] == s).any()) for s in stop_ids):
            break
    return BlockRun(x[p_len:end].clone(), forwards, x.clone(), commits)


@torch.no_grad()
def llada2_generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    eos_id: int | None,
    gen_length: int = 2048,
    block_length: int = 32,
    steps: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_early_stop: bool = False,
    minimal_topk: int = 1,
    threshold: float = 0.95,
    generator: torch.Generator | None = None,
) -> BlockRun:
    """LLaDA2.0's `generate` (defaults as published; it has no cache itself, so this is the
    published computation, not just its equivalent).

    steps = min(steps, gen_length // minimal_topk); logits cast to float32 (the published
    forward returns `logits.float()`). Per decoded block, step s < steps while the block holds
    a mask: forward, `sample_tokens`, k = transfer_schedule(block_length, steps)[s]; the masks
    with x0_p > threshold are committed if there are >= k of them, else the
    min(k, masks left) most confident. `eos_early_stop`: after a step that committed an eos,
    if every position in [P, first eos in x[P:]) is decoded, stop at once and return
    x[P : that eos + 1]. After each block (whatever `eos_early_stop`): stop if eos_id is in
    x[P : block end].

    Returns `tokens` = x[P : P + gen_length] cut after its first eos (kept), as published
    (the eos-early-stop return excepted, as above); `forwards` = forwards made.

    One deviation: upstream looks for the first eos in the whole canvas, prompt included, so
    a prompt holding eos_id ends generation at the first eos committed, returning part of
    the prompt; here the search starts at P. Temperature 0 is greedy: see `sample_tokens`."""
    steps = min(steps, gen_length // minimal_topk)
    x, p_len, num_blocks = _canvas(prompt, mask_id, gen_length, block_length)
    schedule = transfer_schedule(block_length, steps)
    forwards, commits = 0, []
    for b in range(p_len // block_length, num_blocks):
        start, end = b * block_length, (b + 1) * block_length
        counts: list[int] = []
        commits.append(counts)
        for step in range(steps):
            block = x[start:end]
            mask = block == mask_id
            if not mask.any():
                break
            logits = block_logits(model, x, start, end, block_length).float()
            forwards += 1
            x0, x0_p = sample_tokens(logits, temperature, top_k, top_p, generator)
            k = schedule[step]
            conf = torch.where(mask, x0_p, -torch.inf)
            high = conf > threshold
            left = int(mask.sum())
            transfer = high if int(high.sum()) >= k else _top_k_index(conf, min(k, left))
            block[transfer] = x0[transfer]
            counts.append(int(transfer.sum()))
            if eos_early_stop and eos_id is not None and bool((x0[transfer] == eos_id).any()):
                gen = x[p_len:end]
                hits = (gen == eos_id).nonzero()
                if len(hits):
                    pos = int(hits[0])
                    if not bool((gen[:pos] == mask_id).any()):
                        return BlockRun(gen[: pos + 1].clone(), forwards, x.clone(), commits)
        if eos_id is not None and bool((x[p_len:end] == eos_id).any()):
            break
    return BlockRun(_answer(x, p_len, gen_length, eos_id), forwards, x.clone(), commits)


@torch.no_grad()
def joint_threshold_generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    eos_id: int | None,
    gen_length: int,
    block_length: int = 32,
    threshold: float = 0.5,
    edit_threshold: float = 0.0,
    max_post_edit_steps: int = 16,
    penalty_lambda: float = 0.0,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_early_stop: bool = True,
    generator: torch.Generator | None = None,
) -> BlockRun:
    """LLaDA2.1 token editing: SGLang's `JointThreshold` (defaults as SGLang's) on LLaDA2's
    block layout, one block at a time.

    At a block's start its non-mask positions (the prompt's tail) are frozen. Each iteration:
    if the block holds no mask, count a post-edit step and end the block once there have
    been more than `max_post_edit_steps` (before forwarding: no logits are read); forward
    (float32 logits); with `penalty_lambda` > 0 subtract it from position i's logit of the
    block token at i - 1 (i >= 1); proposals x0 and probabilities p (`sample_tokens`; SGLang
    is greedy). Mask to token: the masks with p > threshold, or if none the most probable
    one. Token to token: every unfrozen non-mask position with p > edit_threshold whose
    proposal differs from its token. Commit both; if neither chose anything, the block ends
    (that forward counts). SGLang's iteration cap, block_length + max_post_edit_steps + 1, is
    kept (it binds only if the mask token itself is proposed). After a block, with
    `eos_early_stop`, stop if x[P : block end] holds eos_id and no mask (LLaDA2.1's
    `generate`). Edits never reach a finished block: blocks are decoded in order.

    The mask-to-token fallback is LLaDA2.1 `generate`'s with num_to_transfer = 1 (its
    default), and its token-to-token rule and post-step budget decide as this one does; its
    published text was only seen through third-party copies, so SGLang's is what is
    restated. SGLang spends a forward on the iteration that exceeds the budget and another
    storing the block's KV; neither exists here.

    Returns `tokens` = x[P : P + gen_length] cut after its first eos (kept), as LLaDA2.1."""
    x, p_len, num_blocks = _canvas(prompt, mask_id, gen_length, block_length)
    forwards, commits, edits = 0, [], []
    rows = torch.arange(1, block_length, device=x.device)
    for b in range(p_len // block_length, num_blocks):
        start, end = b * block_length, (b + 1) * block_length
        frozen = x[start:end] != mask_id
        counts: list[int] = []
        changed: list[int] = []
        post = 0
        for _ in range(block_length + max_post_edit_steps + 1):
            block = x[start:end]
            mask = block == mask_id
            if not mask.any():
                post += 1
                if post > max_post_edit_steps:
                    break
            logits = block_logits(model, x, start, end, block_length).float()
            forwards += 1
            if penalty_lambda > 0:
                logits[rows, block[:-1]] -= penalty_lambda
            x0, p = sample_tokens(logits, temperature, top_k, top_p, generator)
            m2t = torch.zeros_like(mask)
            if mask.any():
                conf = torch.where(mask, p, -torch.inf)
                m2t = conf > threshold
                if not m2t.any():
                    m2t = _top_k_index(conf, 1)
            t2t = (p > edit_threshold) & (block != x0) & ~mask & ~frozen
            counts.append(int(m2t.sum()))
            changed.append(int(t2t.sum()))
            transfer = m2t | t2t
            if not transfer.any():
                break
            block[transfer] = x0[transfer]
        commits.append(counts)
        edits.append(changed)
        if eos_early_stop and eos_id is not None:
            gen = x[p_len:end]
            if not bool((gen == mask_id).any()) and bool((gen == eos_id).any()):
                break
    return BlockRun(_answer(x, p_len, gen_length, eos_id), forwards, x.clone(), commits, edits)


@torch.no_grad()
def multi_bd_generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    gen_length: int,
    block_length: int = 32,
    buffer_size: int = 4,
    threshold: float = 0.9,
    add_block_threshold: float = 0.1,
    semi_complete_threshold: float = 0.9,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> BlockRun:
    """Diffulex's Multi-Block Diffusion (`decoding_strategy: multi_bd`), batch 1, no cache.

    Read in SJTU-DENG-Lab/Diffulex at 184ba97 (2026-06-27): `diffulex/config.py` (Config:
    block_size 32, buffer_size 4; DecodingThresholds: add_block_threshold 0.1,
    semi_complete_threshold 0.9, accept_threshold 0.9), `diffulex/engine/request.py`
    (DllmReq.init_multi_block / step / postprocess / push_back_dummy_block),
    `diffulex/engine/dllm_block.py` (DllmBlock.progress, is_semi_complete,
    should_force_decode_topk, should_add_block; DllmBlockBuffer), `diffulex/engine/scheduler.py`
    (SchedulerBase.postprocess), `diffulex/strategy/multi_bd/` (config, request, scheduler,
    model runner, attention metadata), `diffulex/mixin/multi_block/model_runner.py`
    (_prepare_decode_req: the query is the whole block buffer over the cached prefix; only
    TO_CACHE blocks get KV slots), `diffulex/mixin/multi_block/attention_metadata.py` with
    `diffulex_kernel/python/chunked_prefill_triton.py` (is_block_causal and not
    is_prefix_full: a query sees every cached key and the buffer's fresh keys before its own
    block's end), `diffulex/sampler/{sdar,llada2}.py`, `diffulex/sampler/base/{core,
    no_shift}.py`, and docs/user_guide/features/{multi_block_decoding,decoding_strategies}.md.

    Blocks are laid out as the other loops' (absolute, prompt padded with masks to a block).
    The running set ("block buffer") holds at most `buffer_size` consecutive blocks; it
    starts with the first decoding block (the one holding the prompt's tail, if any). Each
    step:

    1. Entry (`DllmReq.step`): at most one block enters. If the running set is empty, the
       next block does; otherwise the next block enters when the last one's progress
       (decoded positions / block_length, prompt tokens counting as decoded) is >=
       `add_block_threshold` and fewer than `buffer_size` blocks occupy the buffer. A
       completed front block keeps its place for the one step in which its keys are stored
       (upstream's TO_CACHE status) and leaves after it. No block enters past the one
       holding position P + gen_length - 1, nor after a stop id was committed anywhere
       after the prompt.
    2. Forward of the canvas up to the last running block's end, block-causally: a later
       running block sees the earlier running blocks' current tokens, masks included (the
       buffer's fresh keys in upstream's kernel). A step whose running blocks hold no mask
       only stores keys upstream; it has no forward here and is not counted.
    3. Proposals (`sample_tokens`) with the mask id's logit at -inf (upstream forbids it, so
       the confidence is renormalised over the other tokens). For every running block with
       masks: the masks with confidence > `threshold` are committed; if none passes and the
       block is forced, its most confident mask is (the first on ties). A block is forced
       when it is the sequence's first block or its predecessor's progress is >=
       `semi_complete_threshold`, both read before this step's commits (upstream's sampler
       decides every block before any token is written). The front block's predecessor is
       complete, so every forward commits at least one token.
    4. Completed front blocks are marked for storage; those marked the step before leave.
       The loop ends once no block may enter (the last block entered, or a stop id was
       committed) and every running block is complete.

    `threshold` is upstream's `accept_threshold` (LLaDA2 sampler, default 0.9); Diffulex's
    SDAR sampler ignores it and compares with a fixed 0.95 (the engine's SDAR default).
    Temperature 0 is greedy (`sample_tokens`); upstream breaks exact ties toward the highest
    token id, here the lowest. Upstream passes no top-k / top-p to this sampler; here they
    apply as in `sample_tokens`.

    Upstream behaviour not restated: (a) the prefill forward of the prompt, which samples
    nothing when the prompt fills whole blocks (with add_block_threshold 0 upstream admits
    the first block during it, which is why the first step here may already admit the
    second); (b) `max_new_tokens_reached` is read from the allocated canvas, placeholder
    (DUMMY) blocks of the buffer included, and SchedulerBase.postprocess then ends the
    request at once (force_deactivate): a request whose max_tokens is at most
    buffer_size * block_size ends after its prefill with every position masked, and a longer
    one is cut with its last running blocks still masked; here the canvas ends with the
    block holding P + gen_length - 1 and every block up to it is decoded; (c) the
    auto_max_nfe truncation (max_nfe set after 8 forwards from the tokens per forward so
    far) and max_repetition_run; (d) logits past the tokenizer's vocabulary set to -inf
    (engine's vocabulary = the model's); (e) DMax's token_stability_threshold (0 by default,
    inert with these samplers).

    Returns `tokens` = x[P : end of the last block that entered] (every position decoded;
    the caller cuts at the first stop id and at gen_length), `forwards` = forwards made,
    `commits[b][s]` per block that entered (one entry per forward that sampled it) and
    `running[s]` = the blocks sampled by forward s."""
    if buffer_size < 1 or gen_length < 1:
        raise ValueError("buffer_size and gen_length must be >= 1")
    if not 0.0 <= semi_complete_threshold <= 1.0:
        raise ValueError("semi_complete_threshold must be in [0, 1]")
    x, p_len, num_blocks = _canvas(prompt, mask_id, gen_length, block_length)
    stops = set(stop_ids or ())
    first = p_len // block_length

    def span(b: int) -> slice:
        return slice(b * block_length, (b + 1) * block_length)

    def masks(b: int) -> int:
        return int((x[span(b)] == mask_id).sum())

    def progress(b: int) -> float:
        return (block_length - masks(b)) / block_length  # DllmBlock.progress

    front, last = first, first  # the running set: blocks [front, last]
    stored = 0  # front blocks complete and being stored this step (upstream TO_CACHE)
    ended = False  # no block may enter any more (upstream: a terminal context block)
    forwards, running = 0, []
    commits: dict[int, list[int]] = {first: []}
    while True:
        # 1. entry
        if last < num_blocks - 1 and not ended:
            occupied = last - front + 1
            if occupied == 0 or (occupied < buffer_size and progress(last) >= add_block_threshold):
                last += 1
                commits[last] = []
        sampled = [b for b in range(front + stored, last + 1) if masks(b) > 0]
        if sampled:
            # 2. one forward over the running set, block-causal, current tokens
            lo, hi = sampled[0] * block_length, (last + 1) * block_length
            logits = block_logits(model, x, lo, hi, block_length)
            forwards += 1
            running.append(sampled)
            logits[:, mask_id] = -torch.inf
            x0, conf = sample_tokens(logits, temperature, top_k, top_p, generator)
            # 3. every block decided on the state before the step, then written
            writes = []
            for b in sampled:
                at = span(b)
                rel = slice(at.start - lo, at.stop - lo)
                mask = x[at] == mask_id
                c = torch.where(mask, conf[rel], -torch.inf)
                transfer = mask & (c > threshold)
                forced = b == 0 or progress(b - 1) >= semi_complete_threshold
                if forced and not transfer.any():
                    transfer[int(torch.argmax(c))] = True
                writes.append((at, transfer, x0[rel]))
                commits[b].append(int(transfer.sum()))
            for at, transfer, tokens in writes:
                x[at][transfer] = tokens[transfer]
        # 4. the front blocks stored this step leave; completed front blocks are stored next
        front += stored
        stored = 0
        while front + stored <= last and masks(front + stored) == 0:
            stored += 1
        if stops and any(int(t) in stops for t in x[p_len:].tolist()):
            ended = True
        if (ended or last == num_blocks - 1) and all(masks(b) == 0 for b in range(front, last + 1)):
            break
    end = (last + 1) * block_length
    return BlockRun(
        x[p_len:end].clone(),
        forwards,
        x.clone(),
        [commits[b] for b in sorted(commits)],
        running=running,
    )
