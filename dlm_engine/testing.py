"""Tiny random checkpoints in the exact published layouts, for tests and benchmarks.

They carry the published file names (`config.json`, `generation_config.json`, sharded
`model-0000N-of-0000M.safetensors` + `model.safetensors.index.json`, tokenizer files), config
keys and tensor names, so the loader meets them exactly as it meets LLaDA-8B or Dream-7B.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .models import DREAM, LLADA, build_model
from .tokenizer_build import build_char_tokenizer, vocab_size_for

SAMPLE_PROMPTS = [
    "Hello there, what is 2+2?",
    "Sort: 5 3 9 1",
    "abc",
    "Reverse the word diffusion, please, and then tell me how many letters it has.",
]


def llada_config(vocab: int, ids: dict[str, int], **arch: Any) -> dict[str, Any]:
    """A LLaDA `config.json` with the published keys (values scaled down via `arch`)."""
    d_model = arch.get("d_model", 64)
    n_heads = arch.get("n_heads", 4)
    return {
        "activation_type": "silu",
        "alibi": False,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "block_type": "llama",
        "d_model": d_model,
        "embedding_dropout": 0.0,
        "embedding_size": vocab,
        "eos_token_id": ids["<|endoftext|>"],
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "init_device": "meta",
        "layer_norm_type": "rms",
        "mask_token_id": ids["<|mdm_mask|>"],
        "max_sequence_length": 4096,
        "mlp_hidden_size": arch.get("mlp_hidden_size", 4 * d_model),
        "mlp_ratio": 4,
        "model_type": "llada",
        "n_heads": n_heads,
        "n_kv_heads": arch.get("n_kv_heads", n_heads),
        "n_layers": arch.get("n_layers", 2),
        "pad_token_id": ids["<|endoftext|>"],
        "rms_norm_eps": 1e-05,
        "rope": True,
        "rope_theta": arch.get("rope_theta", 500000.0),
        "scale_logits": False,
        "torch_dtype": arch.get("torch_dtype", "float32"),
        "vocab_size": vocab,
        "weight_tying": False,
    }


def dream_config(vocab: int, ids: dict[str, int], **arch: Any) -> dict[str, Any]:
    """A Dream `config.json` with the published (Qwen2) keys."""
    hidden = arch.get("hidden_size", 64)
    return {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|endoftext|>"],
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": arch.get("intermediate_size", 4 * hidden),
        "mask_token_id": ids["<|mask|>"],
        "max_position_embeddings": 4096,
        "model_type": "Dream",
        "num_attention_heads": arch.get("num_attention_heads", 4),
        "num_hidden_layers": arch.get("num_hidden_layers", 2),
        "num_key_value_heads": arch.get("num_key_value_heads", 2),
        "pad_token_id": ids["<|endoftext|>"],
        "rms_norm_eps": 1e-06,
        "rope_theta": arch.get("rope_theta", 1000000.0),
        "tie_word_embeddings": False,
        "torch_dtype": arch.get("torch_dtype", "float32"),
        "use_cache": False,
        "vocab_size": vocab,
    }


def write_checkpoint(
    out: Path, config: dict[str, Any], state: dict[str, torch.Tensor], shards: int = 2
) -> None:
    """Write `config.json` and the weights as published: sharded safetensors plus index."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(state)
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {n: state[n].contiguous() for n in part}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = fname
            total += state[n].numel() * state[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _point_row_at_masks(
    model: torch.nn.Module, head: torch.Tensor, row: int, mask_id: int, scale: float
) -> None:
    """Aim `head[row]` at the mean final hidden state of masked positions, so the token wins
    at some canvas positions (how many grows with `scale`)."""
    ids = torch.full((1, 48), mask_id)
    ids[0, :16] = torch.arange(16)
    from .models.common import ForwardBatch

    h = model.hidden_states(ForwardBatch(ids, torch.arange(48)[None], None, None))
    norm = model.model.transformer.ln_f if hasattr(model.model, "transformer") else model.model.norm
    u = norm(h)[0, 16:].mean(0)
    head[row] = u / u.norm() * head.norm(dim=1).max() * scale


def make_tiny_checkpoint(
    out_dir: str | Path,
    family: str = "llada",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    eos_boost: float = 0.0,
    **arch: Any,
) -> Path:
    """A random checkpoint of `family`; `eos_boost` > 0 makes end-of-text likely (early stop tests)."""
    out = Path(out_dir)
    fam = LLADA if family == "llada" else DREAM
    ids = build_char_tokenizer(out, fam.name)
    vocab = vocab_size_for(ids)
    arch.setdefault("torch_dtype", str(dtype).removeprefix("torch."))
    cfg = (llada_config if fam is LLADA else dream_config)(vocab, ids, **arch)
    eos = ids["<|endoftext|>"]
    gen = {"bos_token_id": cfg.get("bos_token_id", eos), "eos_token_id": eos, "pad_token_id": eos}
    if fam is DREAM:
        gen["mask_token_id"] = cfg["mask_token_id"]
    torch.manual_seed(seed)
    model = build_model(fam, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.02)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)  # sharp, position-dependent attention: varied outputs per position
        head = model.model.transformer.ff_out.weight if fam is LLADA else model.lm_head.weight
        emb = (
            model.model.transformer.wte.weight if fam is LLADA else model.model.embed_tokens.weight
        )
        head.mul_(4.0)
        if eos_boost:
            _point_row_at_masks(model, head, eos, cfg["mask_token_id"], eos_boost)
        head[cfg["mask_token_id"]] = 0.0
        emb.mul_(4.0)
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    write_checkpoint(out, cfg, state)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def seed_hub_cache(
    checkpoint: str | Path,
    cache_dir: str | Path,
    repo_id: str,
    commit: str = "0123456789abcdef0123456789abcdef01234567",
    refs: tuple[str, ...] = ("main",),
) -> Path:
    """Put a checkpoint folder into a Hugging Face Hub cache as a download would leave it
    (huggingface_hub's documented layout), so tests and air-gapped hosts can load it by id.

    ``models--<org>--<name>/blobs/<hash>`` holds each file once (safetensors under their sha256,
    as Git LFS files are; others under their git blob sha1), ``snapshots/<commit>/<file>``
    links to the blob, and ``refs/<branch>`` holds the commit. Returns the snapshot folder.
    """
    import hashlib
    import os

    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for src in sorted(Path(checkpoint).iterdir()):
        if not src.is_file():
            continue
        data = src.read_bytes()
        if src.suffix == ".safetensors":
            digest = hashlib.sha256(data).hexdigest()
        else:
            digest = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (blobs / digest).write_bytes(data)
        link = snapshot / src.name
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blobs / digest, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
