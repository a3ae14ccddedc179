"""The block-diffusion training objective sees what the engine's decoding sees.

`dlm_lab/training/block_objective.py` trains the noisy and the clean sequence in one
forward; these tests prove that its attention mask gives each noisy block exactly the logits
an inference forward over (clean earlier blocks, that noisy block) gives, and that the
watch-the-training decoder equals SDAR's published loop restated in reference_block.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from dlm_engine.models import SDAR, build_model
from dlm_engine.models.common import ForwardBatch
from dlm_engine.tokenizer_build import build_char_tokenizer, vocab_size_for
from dlm_lab.reference_block import block_causal_mask, sdar_generate
from dlm_lab.testing import sdar_config
from dlm_lab.training.block_objective import (
    block_diffusion_loss,
    block_greedy_decode,
    training_mask,
)

BLOCK = 4


@pytest.fixture(scope="module")
def model_and_ids(tmp_path_factory: pytest.TempPathFactory):
    ids = build_char_tokenizer(tmp_path_factory.mktemp("tok"), "sdar")
    cfg = sdar_config(vocab_size_for(ids), ids, block_size=BLOCK, hidden_size=64)
    torch.manual_seed(0)
    model = build_model(SDAR, cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    return model, ids


def test_training_mask_layout() -> None:
    """Noisy queries: own noisy block + earlier clean blocks; clean queries: clean blocks up
    to their own; a clean query never sees a noisy key."""
    m = training_mask(8, BLOCK, torch.device("cpu"))
    noisy_q, clean_q = m[:8], m[8:]
    assert noisy_q[5, :8].tolist() == [False] * 4 + [True] * 4  # own noisy block only
    assert noisy_q[5, 8:].tolist() == [True] * 4 + [False] * 4  # clean block 0, not its own
    assert noisy_q[1, 8:].tolist() == [False] * 8  # block 0 sees no clean key
    assert not clean_q[:, :8].any()
    assert torch.equal(clean_q[:, 8:], block_causal_mask(8, BLOCK))


def test_noisy_logits_equal_inference_forward(model_and_ids) -> None:
    """Every noisy block's training logits equal a block-causal forward of the clean
    blocks before it followed by that noisy block, as the engine's step computes them."""
    model, ids = model_and_ids
    mask_id = ids["<|MASK|>"]
    g = torch.Generator().manual_seed(1)
    t_len = 16
    clean = torch.randint(0, 90, (1, t_len), generator=g)
    noisy = torch.where(torch.rand(1, t_len, generator=g) < 0.5, mask_id, clean)
    pos = torch.arange(t_len)[None]
    with torch.no_grad():
        train = model(
            ForwardBatch(
                torch.cat([noisy, clean], 1),
                torch.cat([pos, pos], 1),
                training_mask(t_len, BLOCK, torch.device("cpu"))[None],
                pos,
            )
        )[0]
        for b in range(t_len // BLOCK):
            end = (b + 1) * BLOCK
            x = torch.cat([clean[:, : b * BLOCK], noisy[:, b * BLOCK : end]], 1)
            infer = model(ForwardBatch(x, pos[:, :end], block_causal_mask(end, BLOCK)[None], None))[
                0
            ]
            torch.testing.assert_close(train[b * BLOCK : end], infer[b * BLOCK :])


def test_loss_ignores_padding_after_the_answer(model_and_ids) -> None:
    """Finite and positive, and blind to tokens after `tlen` (later positions are invisible
    to every counted one under block-causal attention), so batch padding cannot bias it."""
    model, ids = model_and_ids
    mask_id = ids["<|MASK|>"]
    x = torch.randint(0, 90, (3, 16))
    plen, tlen = torch.tensor([3, 5, 6]), torch.tensor([12, 8, 11])
    torch.manual_seed(0)
    loss = block_diffusion_loss(model, x, plen, tlen, mask_id, BLOCK, amp=False)
    assert torch.isfinite(loss) and loss.item() > 0
    y = x.clone()
    y[0, 12:], y[1, 8:], y[2, 12:] = 7, 7, 7  # whole blocks after each row's answer
    torch.manual_seed(0)
    again = block_diffusion_loss(model, y, plen, tlen, mask_id, BLOCK, amp=False)
    torch.testing.assert_close(loss, again)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_decode_equals_sdar_reference(model_and_ids, k: int) -> None:
    """Batched, several prompt lengths: each row equals SDAR's `low_confidence_static` at
    T=0 with block / k steps per block, on the blocks the reference decodes."""
    model, ids = model_and_ids
    mask_id, eos = ids["<|MASK|>"], ids["<|endoftext|>"]
    rng = random.Random(k)
    prompts = [[rng.randrange(0, 90) for _ in range(n)] for n in (5, 8, 11)]
    canvas = 12
    got = block_greedy_decode(model, prompts, mask_id, eos, canvas, k, BLOCK, amp=False)
    for prompt, row in zip(prompts, got, strict=True):
        ref = sdar_generate(
            model,
            torch.tensor(prompt),
            mask_id=mask_id,
            gen_length=canvas,
            block_length=BLOCK,
            denoising_steps=BLOCK // k,
            temperature=0.0,
            remasking_strategy="low_confidence_static",
        ).tokens.tolist()
        assert row[: len(ref)] == ref
