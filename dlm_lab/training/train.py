"""Train the embedded tiny models: tiny-dlm (LLaDA layout) and tiny-sdar (SDAR layout).

Objective (`--family llada`, `dlm_engine/assets/tiny-dlm`): LLaDA's supervised fine-tuning
loss for masked diffusion. Per example a ratio t ~ U(eps, 1) is drawn, every response token
(the answer, its `<|eot_id|>` and the `<|endoftext|>` padding up to the canvas length) is
replaced by the mask token with probability t, the prompt is never masked, attention is
bidirectional, and cross-entropy is taken on masked positions only, weighted by 1/t and
divided by the response length. `--family sdar` (`dlm_engine/assets/tiny-sdar`) trains the
same tasks block-causally with per-block noise (`block_objective.py`).

    python -m dlm_lab.training.train --out DIR --device cuda --minutes 9
    python -m dlm_lab.training.train --family sdar --out DIR --device cuda --minutes 9

Without `--steps` the cosine schedule runs on elapsed time, so the run fills `--minutes`
whatever the device's speed. Data are generated on the fly by
seeded worker processes (`tasks.py`); the held-out problems never enter a batch.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from dlm_engine.models import LLADA, SDAR, build_model
from dlm_engine.models.common import ForwardBatch
from dlm_engine.tokenizer_build import build_char_tokenizer, vocab_size_for

from ..testing import llada_config, sdar_config, write_checkpoint
from . import tasks
from .block_objective import block_diffusion_loss, block_greedy_decode

MASK_EPS = 1e-3  # lowest masking ratio, as in LLaDA's forward process
CANVAS_EVAL = 32  # canvas used by the quality benchmark and the CI test
CANVAS_MAX = 64  # longest canvas seen in training (the engine's default max_tokens)


@dataclass
class Special:
    """Token ids the objective and the decoder need."""

    mask: int
    eos: int
    eot: int
    bos: int | None
    end_header: int | None  # LLaDA's template only (see split_blank_lines)
    unk: int
    newline: int

    @classmethod
    def from_tokenizer(cls, tok: PreTrainedTokenizerBase, family: str = "llada") -> Special:
        v = tok.get_vocab()
        if family == "sdar":  # Qwen's names: <|MASK|>, end of turn <|im_end|>, no BOS
            return cls(
                v["<|MASK|>"], v["<|endoftext|>"], v["<|im_end|>"], None, None, v["<unk>"], v["\n"]
            )
        return cls(
            v["<|mdm_mask|>"],
            v["<|endoftext|>"],
            v["<|eot_id|>"],
            v["<|startoftext|>"],
            v["<|end_header_id|>"],
            v["<unk>"],
            v["\n"],
        )


def encode_prompt(tok: PreTrainedTokenizerBase, question: str) -> list[int]:
    """Prompt ids exactly as a server builds them: the chat template, then plain encoding."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return list(tok.encode(text, add_special_tokens=False))


def canvas_length(rng: random.Random, need: int) -> int:
    """Mostly the evaluation canvas, often the default 64, sometimes anything that fits.

    Varying the canvas teaches the model that the answer does not depend on how much EOS
    padding follows it, so any `max_tokens` a user picks works.
    """
    r = rng.random()
    if r < 0.5:
        return CANVAS_EVAL
    if r < 0.75:
        return CANVAS_MAX
    return rng.randint(need, CANVAS_MAX)


def split_blank_lines(prompt: list[int], sp: Special) -> list[int]:
    """The chat template's "\\n\\n" as two newline ids instead of one `<unk>`.

    The char tokenizer's split regex does not match newlines, so a run of them encodes as
    `<unk>`; a tokenizer with that fixed gives two `\\n` ids. Training on both makes the
    model indifferent to which tokenizer file serves it.
    """
    if sp.end_header is None:
        return list(prompt)
    out: list[int] = []
    for i, t in enumerate(prompt):
        if t == sp.unk and i > 0 and prompt[i - 1] == sp.end_header:
            out += [sp.newline, sp.newline]
        else:
            out.append(t)
    return out


def make_batch(
    rng: random.Random,
    tok: PreTrainedTokenizerBase,
    sp: Special,
    batch_size: int,
    block_len: int | None = None,
    forms: tasks.Forms | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B,T] right-padded with EOS, prompt lengths [B], total lengths [B]).

    With `block_len` (block diffusion) the EOS padding ends at a block boundary (the engine
    stops after the block holding the end of turn) and T is a multiple of the block.
    Questions are asked in `forms` (default: tasks.CANONICAL_FORMS)."""
    align = math.lcm(8, block_len or 8)
    exs = [tasks.sample(rng, "train", forms=forms) for _ in range(batch_size)]
    texts = [
        tok.apply_chat_template(tasks.messages_for(e), add_generation_prompt=True, tokenize=False)
        for e in exs
    ]
    # one batched (Rust) call each; same ids as `tok.encode(text, add_special_tokens=False)`
    prompts = tok(texts, add_special_tokens=False)["input_ids"]
    answers = tok([e.answer for e in exs], add_special_tokens=False)["input_ids"]
    rows: list[list[int]] = []
    plen: list[int] = []
    for prompt, ans in zip(prompts, answers, strict=True):
        prompt = split_blank_lines(prompt, sp) if rng.random() < 0.5 else list(prompt)
        answer = list(ans) + [sp.eot]
        if block_len:  # block diffusion: up to the end of the eot's block, or one block more
            end = -(-(len(prompt) + len(answer)) // block_len) * block_len
            canvas = end - len(prompt) + (block_len if rng.random() < 0.5 else 0)
        else:
            canvas = canvas_length(rng, len(answer))
        rows.append(prompt + answer + [sp.eos] * (canvas - len(answer)))
        plen.append(len(prompt))
    width = -(-max(len(r) for r in rows) // align) * align
    ids = torch.tensor([r + [sp.eos] * (width - len(r)) for r in rows], dtype=torch.long)
    return ids, torch.tensor(plen), torch.tensor([len(r) for r in rows])


class BatchStream(IterableDataset):
    """Endless training batches; each worker draws from its own seeded generator."""

    def __init__(
        self,
        tok_dir: str,
        sp: Special,
        batch_size: int,
        seed: int,
        block_len: int | None,
        forms: tasks.Forms | None = None,
    ) -> None:
        self.tok_dir, self.sp, self.batch_size, self.seed = tok_dir, sp, batch_size, seed
        self.block_len, self.forms = block_len, forms

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        rng = random.Random(self.seed * 1_000_003 + worker)
        tok = AutoTokenizer.from_pretrained(self.tok_dir, trust_remote_code=False)
        while True:
            yield make_batch(rng, tok, self.sp, self.batch_size, self.block_len, self.forms)


def init_weights(model: nn.Module, n_layers: int) -> None:
    """GPT-2 style init: N(0, 0.02), residual output projections scaled by depth."""
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        std = 0.02
        if name.endswith(("attn_out.weight", "o_proj.weight", "down_proj.weight")) or (
            "blocks" in name and name.endswith("ff_out.weight")
        ):
            std = 0.02 / math.sqrt(2 * n_layers)
        nn.init.normal_(p, 0.0, std)


def diffusion_loss(
    model: nn.Module,
    ids: torch.Tensor,
    plen: torch.Tensor,
    tlen: torch.Tensor,
    mask_id: int,
    amp: bool,
) -> torch.Tensor:
    """LLaDA SFT loss for one batch (no host sync: masks are weights, not indices)."""
    b, t_len = ids.shape
    pos = torch.arange(t_len, device=ids.device).expand(b, t_len)
    key_mask = pos < tlen[:, None]
    response = (pos >= plen[:, None]) & key_mask
    t = torch.rand(b, device=ids.device) * (1 - MASK_EPS) + MASK_EPS
    masked = (torch.rand(b, t_len, device=ids.device) < t[:, None]) & response
    noisy = torch.where(masked, torch.full_like(ids, mask_id), ids)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(ForwardBatch(noisy, pos, key_mask, None))
    ce = F.cross_entropy(logits.float().transpose(1, 2), ids, reduction="none")
    weight = masked.float() / (t * (tlen - plen).float())[:, None]
    return (ce * weight).sum() / b


@torch.no_grad()
def greedy_decode(
    model: nn.Module,
    prompts: list[list[int]],
    sp: Special,
    canvas: int,
    k: int,
    block: int,
    amp: bool,
) -> list[list[int]]:
    """LLaDA's low-confidence remasking at T=0, k tokens a step, semi-AR blocks, batched.

    A compact re-statement of the published loop used only to watch training; the shipped
    numbers come from the engine (`benchmarks/quality.py`).
    """
    dev = next(model.parameters()).device
    b = len(prompts)
    plen = torch.tensor([len(p) for p in prompts], device=dev)
    width = int(plen.max()) + canvas
    ids = torch.full((b, width), sp.eos, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, device=dev)
    offs = torch.arange(canvas, device=dev)
    cidx = plen[:, None] + offs
    ids.scatter_(1, cidx, sp.mask)
    pos = torch.arange(width, device=dev).expand(b, width)
    key_mask = pos < (plen + canvas)[:, None]
    for blk in range(canvas // block):
        in_block = (offs >= blk * block) & (offs < (blk + 1) * block)
        for _ in range(block // k):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(ForwardBatch(ids, pos, key_mask, cidx))
            conf, pred = torch.softmax(logits.float(), dim=-1).max(-1)
            cur = ids.gather(1, cidx)
            open_ = (cur == sp.mask) & in_block
            conf = torch.where(open_, conf, torch.full_like(conf, -1.0))
            top = conf.topk(k, dim=1).indices
            sel = torch.zeros_like(open_).scatter(1, top, True) & open_
            ids.scatter_(1, cidx, torch.where(sel, pred, cur))
    return ids.gather(1, cidx).tolist()


def answer_text(tok: PreTrainedTokenizerBase, ids: list[int], sp: Special) -> str:
    """Committed completion up to the first end-of-turn / end-of-text, as text."""
    out: list[int] = []
    for i in ids:
        if i in (sp.eot, sp.eos):
            break
        out.append(i)
    return tok.decode(out, skip_special_tokens=True).strip()


def evaluate(
    model: nn.Module,
    tok: PreTrainedTokenizerBase,
    sp: Special,
    examples: list[tasks.Example],
    canvas: int = CANVAS_EVAL,
    k: int = 1,
    amp: bool = False,
    chunk: int = 256,
    block: int | None = None,
) -> dict[str, float]:
    """Exact-match accuracy overall and per task: `greedy_decode`, or `block_greedy_decode`
    with blocks of `block` for a block-diffusion model."""
    was_training = model.training
    model.eval()
    hits: dict[str, list[int]] = {}
    for s in range(0, len(examples), chunk):
        part = examples[s : s + chunk]
        prompts = [encode_prompt(tok, e.question) for e in part]
        if block:
            outs = block_greedy_decode(model, prompts, sp.mask, sp.eos, canvas, k, block, amp)
        else:
            outs = greedy_decode(model, prompts, sp, canvas, k, min(canvas, 32), amp)
        for e, o in zip(part, outs, strict=True):
            hits.setdefault(e.task, []).append(int(answer_text(tok, o, sp) == e.answer))
    model.train(was_training)
    res = {name: sum(v) / len(v) for name, v in hits.items()}
    res["all"] = sum(sum(v) for v in hits.values()) / len(examples)
    return res


def lr_at(step: int, progress: float, warmup: int, peak: float, floor_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `floor_ratio * peak`.

    `progress` in [0, 1] is the fraction of the run done: steps over `--steps`, or elapsed
    time over `--minutes`, so a timed run always ends its schedule whatever its speed.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = min(1.0, progress)
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def save(
    model: nn.Module,
    cfg: dict[str, Any],
    sp: Special,
    out: Path,
    summary: dict[str, Any],
    family: str = "llada",
) -> None:
    """Write the checkpoint in the family's published layout (bf16 weights, one shard)."""
    out.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer(out, family)
    state = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()}
    write_checkpoint(out, cfg, state, shards=1)
    if family == "sdar":  # as SDAR publishes it: end of turn, then end of text; no BOS
        gen: dict[str, Any] = {"bos_token_id": sp.eos, "eos_token_id": [sp.eot, sp.eos]}
        gen["pad_token_id"] = sp.eos
    else:
        gen = {"bos_token_id": sp.bos, "eos_token_id": sp.eos, "pad_token_id": sp.eos}
    gen["max_new_tokens"] = 64  # answers of the training tasks fit; the default max_tokens
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors as published (unfused, float32), to continue training from."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update({k: v.float() for k, v in load_file(str(f)).items()})
    return state


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--family", choices=["llada", "sdar"], default="llada", help="checkpoint layout")
    p.add_argument("--block-size", type=int, default=4, help="SDAR block length")
    p.add_argument("--kv-heads", type=int, default=0, help="SDAR key/value heads (0 = all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=9.0, help="training time budget")
    p.add_argument(
        "--steps", type=int, default=None, help="fixed step count instead of a time budget"
    )
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=300, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--mlp", type=int, default=512, help="mlp_hidden_size")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--workers", type=int, default=6, help="data worker processes")
    p.add_argument("--eval-n", type=int, default=600, help="held-out prompts for evaluation")
    p.add_argument("--evals", type=int, default=4, help="evaluations during the run")
    p.add_argument("--init", default=None, help="start from this checkpoint's weights")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument(
        "--forms",
        choices=["canonical", "varied"],
        default="canonical",
        help="question wordings: canonical (tasks.CANONICAL_FORMS, as tiny-dlm was trained) "
        "or varied (tasks.TRAIN_FORMS: canonical plus EXTRA_TRAIN_FORMS); never the held-out "
        "tasks.REPHRASED_FORMS",
    )
    return p.parse_args(argv)


def model_config(args: argparse.Namespace, ids: dict[str, int]) -> dict[str, Any]:
    """config.json of the model to train, in its family's published keys."""
    if args.family == "sdar":
        return sdar_config(
            vocab_size_for(ids),
            ids,
            hidden_size=args.d_model,
            num_hidden_layers=args.n_layers,
            num_attention_heads=args.n_heads,
            num_key_value_heads=args.kv_heads or args.n_heads,
            head_dim=args.d_model // args.n_heads,
            intermediate_size=args.mlp,
            block_size=args.block_size,
            rope_theta=args.rope_theta,
            torch_dtype="bfloat16",
        )
    cfg = llada_config(
        vocab_size_for(ids),
        ids,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        mlp_hidden_size=args.mlp,
        rope_theta=args.rope_theta,
        torch_dtype="bfloat16",
    )
    cfg["max_sequence_length"] = 1024
    return cfg


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = Path(tempfile.mkdtemp(prefix=f"tiny-{args.family}-tok-"))
    ids = build_char_tokenizer(tok_dir, args.family)
    tok = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=False)
    sp = Special.from_tokenizer(tok, args.family)
    block = args.block_size if args.family == "sdar" else None
    cfg = model_config(args, ids)

    dev = torch.device(args.device)
    amp = dev.type == "cuda"
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = build_model(SDAR if block else LLADA, cfg)
    init_weights(model, args.n_layers)
    if args.init:
        model.load_state_dict(read_weights(Path(args.init)), strict=True)
    model.to(dev).train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.98),
        fused=amp,
    )
    heldout = tasks.heldout_examples(args.eval_n)
    rephrased = tasks.rephrased_examples(min(args.eval_n, 120))
    forms = tasks.TRAIN_FORMS if args.forms == "varied" else tasks.CANONICAL_FORMS
    stream = BatchStream(str(tok_dir), sp, args.batch_size, args.seed, block, forms)
    loader = DataLoader(
        stream,
        batch_size=None,
        num_workers=args.workers,
        pin_memory=amp,
        prefetch_factor=4 if args.workers else None,
        persistent_workers=args.workers > 0,
    )
    print(
        f"params {n_params:,} | device {dev} ({torch.cuda.get_device_name(dev) if amp else 'cpu'}) "
        f"| batch {args.batch_size} | budget {args.minutes} min",
        flush=True,
    )

    budget = args.minutes * 60.0
    total = args.steps or 10**9
    calib_at = 60
    warmup = args.warmup
    estimate = args.steps or 0
    interactive = sys.stderr.isatty()
    bar = tqdm(total=args.steps, desc="train", mininterval=1 if interactive else 20, smoothing=0.05)
    history: list[dict[str, float]] = []
    evals: list[dict[str, Any]] = []
    next_eval = 1
    ema = None
    tokens = 0
    t0 = time.time()
    t_calib = t0
    step = 0
    for ids_b, plen_b, tlen_b in loader:
        if step >= total or (args.steps is None and time.time() - t0 > budget):
            break
        tokens += int(tlen_b.sum())
        ids_b = ids_b.to(dev, non_blocking=True)
        plen_b = plen_b.to(dev, non_blocking=True)
        tlen_b = tlen_b.to(dev, non_blocking=True)
        elapsed = time.time() - t0
        progress = step / args.steps if args.steps else elapsed / budget
        lr = lr_at(step, progress, warmup, args.lr, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        if block:
            loss = block_diffusion_loss(model, ids_b, plen_b, tlen_b, sp.mask, block, amp)
        else:
            loss = diffusion_loss(model, ids_b, plen_b, tlen_b, sp.mask, amp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        if step == 10:
            t_calib = time.time()
        if args.steps is None and step == calib_at:
            rate = (calib_at - 10) / (time.time() - t_calib)
            left = budget - (time.time() - t0)
            estimate = step + int(rate * left)
            bar.total = estimate
            bar.refresh()
            print(f"\nspeed {rate:.1f} steps/s -> about {estimate} steps", flush=True)
        if step % 50 == 0:
            val = float(loss)
            ema = val if ema is None else 0.9 * ema + 0.1 * val
            history.append({"step": step, "loss": val, "lr": lr, "gnorm": float(gnorm)})
            bar.set_postfix(loss=f"{ema:.4f}", lr=f"{lr:.2e}")
        frac = step / args.steps if args.steps else (time.time() - t0) / budget
        if args.evals > 1 and frac >= next_eval / args.evals and next_eval < args.evals:
            next_eval += 1
            acc = evaluate(model, tok, sp, heldout[:240], amp=amp, block=block)
            reph = evaluate(model, tok, sp, rephrased, amp=amp, block=block)
            evals.append(
                {"step": step, "minutes": (time.time() - t0) / 60, "acc": acc, "rephrased": reph}
            )
            print(
                f"\nstep {step} loss {float(loss):.4f} held-out acc {json.dumps(acc)} "
                f"rephrased {reph['all']:.3f}",
                flush=True,
            )
    bar.close()
    train_s = time.time() - t0
    final: dict[str, Any] = {}
    for k in (1, 2, 4):
        final[f"canvas32_k{k}"] = evaluate(
            model, tok, sp, heldout, CANVAS_EVAL, k, amp, block=block
        )
    final["canvas64_k1"] = evaluate(model, tok, sp, heldout, CANVAS_MAX, 1, amp, block=block)
    final["rephrased_canvas32_k1"] = evaluate(model, tok, sp, rephrased, amp=amp, block=block)
    summary = {
        "params": n_params,
        "device": torch.cuda.get_device_name(dev) if amp else "cpu",
        "train_seconds": round(train_s, 1),
        "steps": step,
        "batch_size": args.batch_size,
        "examples_seen": step * args.batch_size,
        "tokens_seen": tokens,
        "final_loss_ema": ema,
        "args": vars(args),
        "heldout_eval_greedy_decode": final,
        "evals_during_training": evals,
        "loss_history": history[-40:],
    }
    save(model, cfg, sp, out, summary, args.family)
    print(
        json.dumps({k: v for k, v in summary.items() if k != "loss_history"}, indent=1), flush=True
    )
    return summary


if __name__ == "__main__":
    main()
