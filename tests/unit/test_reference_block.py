"""The no-cache block-diffusion reference loops (SDAR, LLaDA2.0, LLaDA2.1 JointThreshold):
block causality, commit schedules, the prompt-tail block, stopping, seeded sampling.

Any bidirectional model serves: the block-causal mask is passed in, so the tiny LLaDA
checkpoint stands in for both families."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlm_engine.loader import load_checkpoint
from dlm_engine.models.common import ForwardBatch
from dlm_lab.reference_block import (
    SDAR_STRATEGIES,
    block_logits,
    joint_threshold_generate,
    llada2_generate,
    sample_tokens,
    sdar_generate,
    transfer_schedule,
)
from dlm_lab.testing import make_tiny_checkpoint

BL = 8  # block length used throughout


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory):
    path: Path = make_tiny_checkpoint(tmp_path_factory.mktemp("refblock") / "llada", "llada")
    return load_checkpoint(path)


class Recorder(torch.nn.Module):
    """Wraps a model and keeps each forward's input ids and logit positions."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.calls.append((batch.input_ids[0].clone(), batch.logits_index[0].clone()))
        return self.model(batch)


def _prompt(lm, n: int) -> torch.Tensor:
    ids = [(5 + 7 * i) % lm.mask_id for i in range(n)]
    return torch.tensor([i if i not in (lm.mask_id, lm.eos_id) else 3 for i in ids])


def _published_mask(num_blocks: int) -> torch.Tensor:
    """SDAR / LLaDA2's own construction: tril over blocks, expanded to tokens."""
    blocks = torch.tril(torch.ones(num_blocks, num_blocks))
    return blocks.repeat_interleave(BL, 0).repeat_interleave(BL, 1).bool()


def _full_canvas_logits(model, x: torch.Tensor) -> torch.Tensor:
    """Every position's logits from forwarding the whole canvas with the published mask."""
    n = x.numel()
    batch = ForwardBatch(x[None], torch.arange(n)[None], _published_mask(n // BL)[None], None)
    return model(batch)[0]


# ---- (i) block causality ------------------------------------------------------------------


def test_prefix_forward_equals_full_canvas_forward(lm) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, lm.mask_id, (4 * BL,), generator=gen)
    x[2 * BL :] = lm.mask_id
    full = _full_canvas_logits(lm.model, x)
    for b in range(4):
        mine = block_logits(lm.model, x, b * BL, (b + 1) * BL, BL)
        torch.testing.assert_close(mine, full[b * BL : (b + 1) * BL], rtol=1e-5, atol=1e-5)
    # later blocks never reach an earlier one
    y = x.clone()
    y[2 * BL :] = torch.randint(0, lm.mask_id, (2 * BL,), generator=gen)
    torch.testing.assert_close(
        _full_canvas_logits(lm.model, y)[: 2 * BL], full[: 2 * BL], rtol=1e-5, atol=1e-5
    )


def test_one_block_equals_plain_full_canvas_loop(lm) -> None:
    """The loop against a plainer one: whole canvas forwarded with the published mask each
    step, greedy, k most confident masks of the block committed."""
    prompt = _prompt(lm, BL)
    steps = 3
    run = sdar_generate(
        lm.model,
        prompt,
        mask_id=lm.mask_id,
        gen_length=BL,
        block_length=BL,
        denoising_steps=steps,
        temperature=0.0,
        remasking_strategy="low_confidence_static",
    )
    x = torch.cat([prompt, torch.full((BL,), lm.mask_id)])
    for k in transfer_schedule(BL, steps):
        logits = _full_canvas_logits(lm.model, x)[BL:]
        probs = torch.softmax(logits, dim=-1)
        conf, tok = probs.max(dim=-1)
        conf = torch.where(x[BL:] == lm.mask_id, conf, -torch.inf)
        idx = torch.topk(conf, k).indices
        x[BL + idx] = tok[idx]
    assert run.tokens.tolist() == x[BL:].tolist()
    assert run.forwards == steps


# ---- (ii) schedules ------------------------------------------------------------------------


def test_transfer_schedule() -> None:
    assert transfer_schedule(8, 3) == [3, 3, 2]
    assert transfer_schedule(4, 6) == [1, 1, 1, 1, 0, 0]
    assert transfer_schedule(8, 0) == []


def _sdar(lm, prompt, **kw):
    kw.setdefault("gen_length", 2 * BL)
    kw.setdefault("block_length", BL)
    kw.setdefault("temperature", 0.0)
    return sdar_generate(lm.model, prompt, mask_id=lm.mask_id, **kw)


@pytest.mark.parametrize("strategy", ["sequential", "low_confidence_static"])
def test_sdar_fixed_schedules(lm, strategy: str) -> None:
    run = _sdar(lm, _prompt(lm, BL), denoising_steps=3, remasking_strategy=strategy)
    assert run.commits == [[3, 3, 2], [3, 3, 2]]
    assert run.forwards == 6
    assert not (run.tokens == lm.mask_id).any()


def test_sdar_sequential_fills_left_to_right(lm) -> None:
    rec = Recorder(lm.model)
    sdar_generate(
        rec,
        _prompt(lm, BL),
        mask_id=lm.mask_id,
        gen_length=BL,
        block_length=BL,
        denoising_steps=4,
        temperature=0.0,
        remasking_strategy="sequential",
    )
    for n, (ids, _) in enumerate(rec.calls):
        masked = (ids[BL:] == lm.mask_id).nonzero().flatten().tolist()
        assert masked == list(range(2 * n, BL))


def test_sdar_dynamic_threshold_branches(lm) -> None:
    prompt = _prompt(lm, BL)
    none_pass = _sdar(lm, prompt, denoising_steps=3, confidence_threshold=1.0)
    assert none_pass.commits == [[3, 3, 2], [3, 3, 2]]
    all_pass = _sdar(lm, prompt, denoising_steps=3, confidence_threshold=0.0)
    assert all_pass.commits == [[BL], [BL]]
    # a threshold between: never fewer than the schedule's k (capped at the masks left)
    mid = _sdar(lm, prompt, denoising_steps=4, confidence_threshold=0.05)
    for counts in mid.commits:
        left = [BL - sum(counts[:s]) for s in range(len(counts))]
        assert sum(counts) == BL
        assert all(c >= min(2, n) for c, n in zip(counts, left, strict=True))


def test_sdar_entropy_bounded(lm) -> None:
    prompt = _prompt(lm, BL)
    # k >= 1 a forward; upstream's budget is denoising_steps + 1 forwards a block
    one = _sdar(
        lm, prompt, denoising_steps=BL - 1, remasking_strategy="entropy_bounded", eb_threshold=0
    )
    assert one.commits == [[1] * BL, [1] * BL]
    assert one.forwards == 2 * BL
    with pytest.raises(ValueError, match="masks"):  # upstream would leave the block masked
        _sdar(lm, prompt, denoising_steps=2, remasking_strategy="entropy_bounded", eb_threshold=0)
    every = _sdar(
        lm, prompt, denoising_steps=2, remasking_strategy="entropy_bounded", eb_threshold=1e9
    )
    assert every.commits == [[BL], [BL]]
    mid = _sdar(lm, prompt, remasking_strategy="entropy_bounded", eb_threshold=12.0)
    for counts in mid.commits:
        assert sum(counts) == BL and min(counts) >= 1
    assert 2 < mid.forwards < 2 * BL


def test_sdar_entropy_bounded_needs_threshold(lm) -> None:
    with pytest.raises(ValueError):
        _sdar(lm, _prompt(lm, BL), remasking_strategy="entropy_bounded")


def test_llada2_schedule_threshold_and_minimal_topk(lm) -> None:
    prompt = _prompt(lm, BL)
    kw = dict(mask_id=lm.mask_id, eos_id=None, gen_length=2 * BL, block_length=BL)
    strict = llada2_generate(lm.model, prompt, steps=3, threshold=1.0, **kw)
    assert strict.commits == [[3, 3, 2], [3, 3, 2]]
    loose = llada2_generate(lm.model, prompt, steps=3, threshold=0.0, **kw)
    assert loose.commits == [[BL], [BL]] and loose.forwards == 2
    # steps = min(32, 16 // 4) = 4: two tokens a step
    capped = llada2_generate(lm.model, prompt, steps=32, minimal_topk=4, threshold=1.0, **kw)
    assert capped.commits == [[2, 2, 2, 2], [2, 2, 2, 2]]
    assert capped.tokens.numel() == 2 * BL and not (capped.tokens == lm.mask_id).any()


def test_joint_threshold_schedules(lm) -> None:
    prompt = _prompt(lm, BL)
    kw = dict(mask_id=lm.mask_id, eos_id=None, gen_length=2 * BL, block_length=BL)
    # nothing passes either threshold: one mask a step, then one forward that changes nothing
    slow = joint_threshold_generate(lm.model, prompt, threshold=1.0, edit_threshold=1.0, **kw)
    assert slow.commits == [[1] * BL + [0]] * 2
    assert slow.edits == [[0] * (BL + 1)] * 2
    assert slow.forwards == 2 * (BL + 1)
    fast = joint_threshold_generate(lm.model, prompt, threshold=0.0, edit_threshold=1.0, **kw)
    assert fast.commits == [[BL, 0], [BL, 0]] and fast.forwards == 4
    # edits whenever the argmax moves: bounded by the post-edit budget
    edit = joint_threshold_generate(
        lm.model, prompt, threshold=1.0, edit_threshold=0.0, max_post_edit_steps=2, **kw
    )
    for counts, changed in zip(edit.commits, edit.edits, strict=True):
        assert sum(counts) == BL and len(counts) == len(changed) <= BL + 2
        assert changed[0] == 0  # nothing decoded yet to edit
    assert sum(map(sum, edit.edits)) > 0  # the tiny model does change its mind
    assert edit.forwards == sum(len(c) for c in edit.commits)


# ---- (iii) the prompt-tail block ----------------------------------------------------------


def _tail_runs(model, lm, prompt: torch.Tensor) -> dict[str, object]:
    """Every loop on a prompt ending mid-block, committing as much as each rule allows."""
    kw = dict(mask_id=lm.mask_id, gen_length=2 * BL, block_length=BL)
    runs: dict[str, object] = {}
    for s in SDAR_STRATEGIES:
        runs[s] = sdar_generate(
            model,
            prompt,
            denoising_steps=1,
            temperature=0.0,
            remasking_strategy=s,
            confidence_threshold=1.0,
            eb_threshold=1e9,
            **kw,
        )
    runs["llada2"] = llada2_generate(model, prompt, eos_id=None, steps=1, threshold=1.0, **kw)
    runs["joint"] = joint_threshold_generate(
        model, prompt, eos_id=None, threshold=1.0, edit_threshold=0.0, **kw
    )
    return runs


def test_prompt_tail_never_overwritten(lm) -> None:
    p_len = BL + 3  # block 1 holds 3 prompt tokens and 5 masks
    prompt = _prompt(lm, p_len)
    rec = Recorder(lm.model)
    for name, run in _tail_runs(rec, lm, prompt).items():
        assert run.canvas[:p_len].tolist() == prompt.tolist(), name
        assert not (run.canvas[p_len:] == lm.mask_id).any(), name
        if name != "joint":
            # one step with k = 8 > 5 masks: exactly the 5 masks, then full blocks
            assert run.commits[0] == [BL - 3], name
    # decoding starts at block P // BL: the first forward reads block 1's logits
    assert all(int(index[0]) >= BL for _, index in rec.calls)
    assert int(rec.calls[0][1][0]) == BL


# ---- (iv) stopping --------------------------------------------------------------------------


def _first_block_holding(tokens: torch.Tensor, p_len: int, pick: int) -> tuple[int, int]:
    """The id at generated index `pick`, and the decoded-block number where it first shows."""
    t = int(tokens[pick])
    first = int((tokens == t).nonzero()[0])
    return t, (p_len + first) // BL - p_len // BL


def test_sdar_stops_after_block_with_stop_id(lm) -> None:
    p_len = BL + 3
    prompt = _prompt(lm, p_len)
    free = _sdar(lm, prompt, gen_length=4 * BL, denoising_steps=4)
    stop, blk = _first_block_holding(free.tokens, p_len, pick=BL + 6)
    run = _sdar(lm, prompt, gen_length=4 * BL, denoising_steps=4, stop_ids=[stop])
    end = (p_len // BL + blk + 1) * BL
    assert run.tokens.tolist() == free.tokens[: end - p_len].tolist()
    assert run.commits == free.commits[: blk + 1]
    assert run.forwards == sum(len(c) for c in free.commits[: blk + 1])
    assert (run.canvas[end:] == lm.mask_id).all()


def test_llada2_eos_stop_and_truncation(lm) -> None:
    prompt = _prompt(lm, BL + 3)
    kw = dict(mask_id=lm.mask_id, gen_length=4 * BL, block_length=BL, steps=4, threshold=0.2)
    free = llada2_generate(lm.model, prompt, eos_id=None, **kw)
    assert free.tokens.numel() == 4 * BL
    eos, blk = _first_block_holding(free.tokens, BL + 3, pick=BL + 6)
    first = int((free.tokens == eos).nonzero()[0])
    run = llada2_generate(lm.model, prompt, eos_id=eos, **kw)
    assert run.tokens.tolist() == free.tokens[: first + 1].tolist()
    assert run.forwards == sum(len(c) for c in free.commits[: blk + 1])
    early = llada2_generate(lm.model, prompt, eos_id=eos, eos_early_stop=True, **kw)
    assert early.tokens.tolist() == run.tokens.tolist()
    assert early.forwards <= run.forwards


def test_joint_threshold_eos_stop(lm) -> None:
    prompt = _prompt(lm, BL + 3)
    kw = dict(mask_id=lm.mask_id, gen_length=4 * BL, block_length=BL, threshold=0.2)
    free = joint_threshold_generate(lm.model, prompt, eos_id=None, **kw)
    eos, blk = _first_block_holding(free.tokens, BL + 3, pick=BL + 6)
    first = int((free.tokens == eos).nonzero()[0])
    run = joint_threshold_generate(lm.model, prompt, eos_id=eos, **kw)
    assert run.tokens.tolist() == free.tokens[: first + 1].tolist()
    assert run.forwards == sum(len(c) for c in free.commits[: blk + 1])
    late = joint_threshold_generate(lm.model, prompt, eos_id=eos, eos_early_stop=False, **kw)
    assert late.tokens.tolist() == run.tokens.tolist() and late.forwards == free.forwards


# ---- (v) sampling --------------------------------------------------------------------------


def test_greedy_sample_is_argmax_with_plain_probability() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, -1.0, 0.5]])
    x0, p = sample_tokens(logits, 0.0, top_k=1, top_p=0.5)
    assert x0.tolist() == [1, 0]
    torch.testing.assert_close(p, torch.softmax(logits, -1).max(-1).values)
    # top-k 1 at T = 1: the argmax, whose filtered probability is 1
    x0, p = sample_tokens(logits, 1.0, top_k=1, top_p=None, generator=torch.Generator())
    assert x0.tolist() == [1, 0] and p.tolist() == [1.0, 1.0]


def _sampled(lm, seed: int) -> list[list[int]]:
    prompt = _prompt(lm, BL + 3)
    kw = dict(mask_id=lm.mask_id, gen_length=2 * BL, block_length=BL, temperature=0.8)
    g = torch.Generator().manual_seed(seed)
    out = [
        sdar_generate(lm.model, prompt, top_k=20, top_p=0.9, generator=g, **kw).tokens,
        llada2_generate(lm.model, prompt, eos_id=None, top_p=0.9, generator=g, **kw).tokens,
        joint_threshold_generate(lm.model, prompt, eos_id=None, generator=g, **kw).tokens,
    ]
    return [t.tolist() for t in out]


def test_seeded_sampling_is_reproducible(lm) -> None:
    assert _sampled(lm, 7) == _sampled(lm, 7)
    assert _sampled(lm, 7) != _sampled(lm, 8)
