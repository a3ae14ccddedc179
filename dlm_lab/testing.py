"""Tiny random checkpoints in the exact published layouts, for tests and benchmarks.

They carry the published file names (`config.json`, `generation_config.json`, sharded
`model-0000N-of-0000M.safetensors` + `model.safetensors.index.json`, tokenizer files), config
keys and tensor names, so the loader meets them exactly as it meets LLaDA-8B, Dream-7B,
SDAR-4B-Chat or LLaDA2.0-mini.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dlm_engine.models import (
    DREAM,
    FAST_DLLM_V2,
    LLADA,
    LLADA2,
    SDAR,
    SDAR_MOE,
    Family,
    build_model,
)
from dlm_engine.tokenizer_build import build_char_tokenizer, vocab_size_for

# max_tokens of tiny checkpoints' requests that name none (their generation_config.json)
TINY_GENERATION_LENGTH = 64
SAMPLE_PROMPTS = [
    "Hello there, what is 2+2?",
    "Sort: 5 3 9 1",
    "abc",
    "Reverse the word diffusion, please, and then tell me how many letters it has.",
]


# The published checkpoints name their remote code (`auto_map`); the loader never runs it
# (every `from_pretrained` passes trust_remote_code=False), and loading must never ask to.
AUTO_MAPS: dict[str, dict[str, Any]] = {
    "llada": {  # GSAI-ML/LLaDA-8B-Instruct
        "AutoConfig": "configuration_llada.LLaDAConfig",
        "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        "AutoModel": "modeling_llada.LLaDAModelLM",
    },
    "dream": {  # Dream-org/Dream-v0-Instruct-7B
        "AutoConfig": "configuration_dream.DreamConfig",
        "AutoModel": "modeling_dream.DreamModel",
    },
    "sdar": {  # JetLM/SDAR-4B-Chat
        "AutoConfig": "configuration_sdar.SDARConfig",
        "AutoModel": "modeling_sdar.SDARModel",
        "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
    },
    "sdar_moe": {  # JetLM/SDAR-30B-A3B-Chat
        "AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
        "AutoModel": "modeling_sdar_moe.SDARMoeModel",
        "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM",
    },
    "fast_dllm_v2": {  # Efficient-Large-Model/Fast_dLLM_v2_7B
        "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
        "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
    },
    "llada2": {  # inclusionAI/LLaDA2.0-mini
        "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
        "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
        "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
    },
}
# Dream also ships its tokenizer as remote code (tokenizer_config.json)
TOKENIZER_AUTO_MAPS = {"dream": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]}}


def llada_config(vocab: int, ids: dict[str, int], **arch: Any) -> dict[str, Any]:
    """A LLaDA `config.json` with the published keys (values scaled down via `arch`)."""
    d_model = arch.get("d_model", 64)
    n_heads = arch.get("n_heads", 4)
    return {
        "activation_type": "silu",
        "alibi": False,
        "architectures": ["LLaDAModelLM"],
        "auto_map": AUTO_MAPS["llada"],
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
        "auto_map": AUTO_MAPS["dream"],
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


def fast_dllm_v2_config(vocab: int, ids: dict[str, int], **arch: Any) -> dict[str, Any]:
    """A Fast-dLLM v2 `config.json`: Qwen2.5's keys plus `bd_size` (Fast_dLLM_v2_7B's)."""
    # published configs name no mask token: generate() hard-codes 151665
    cfg = dream_config(vocab, {**ids, "<|mask|>": ids["|<MASK>|"]}, **arch)
    del cfg["mask_token_id"]
    cfg.update(
        architectures=["Fast_dLLM_QwenForCausalLM"],
        auto_map=AUTO_MAPS["fast_dllm_v2"],
        model_type="Fast_dLLM_Qwen",
        bd_size=arch.get("bd_size", 32),
        eos_token_id=ids["<|im_end|>"],
        max_window_layers=cfg["num_hidden_layers"],
        rope_scaling=None,
        sliding_window=4096,
        use_sliding_window=False,
        use_cache=True,
    )
    return cfg


def sdar_config(vocab: int, ids: dict[str, int], **arch: Any) -> dict[str, Any]:
    """An SDAR `config.json` with the published keys (JetAstra/SDAR SDAR-4B-Chat/config.json)."""
    hidden = arch.get("hidden_size", 64)
    layers = arch.get("num_hidden_layers", 2)
    return {
        "architectures": ["SDARForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": AUTO_MAPS["sdar"],
        "fuse_cross_entropy": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|endoftext|>"],
        "block_size": arch.get("block_size", 4),
        "mask_token_id": ids["<|MASK|>"],
        "head_dim": arch.get("head_dim", 16),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": arch.get("intermediate_size", 4 * hidden),
        "max_position_embeddings": 4096,
        "max_window_layers": layers,
        "model_type": "sdar",
        "num_attention_heads": arch.get("num_attention_heads", 4),
        "num_hidden_layers": layers,
        "num_key_value_heads": arch.get("num_key_value_heads", 2),
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": arch.get("rope_theta", 1000000.0),
        "sliding_window": None,
        "tie_word_embeddings": arch.get("tie_word_embeddings", False),
        "torch_dtype": arch.get("torch_dtype", "float32"),
        "use_cache": False,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }


def sdar_moe_config(vocab: int, ids: dict[str, int], **arch: Any) -> dict[str, Any]:
    """An SDAR-MoE `config.json`: SDAR's keys plus Qwen3-MoE's (SDAR-30B-A3B-Chat: 128
    experts, 8 a token, renormalised), scaled down to 8 experts, 2 a token; `mlp_only_layers`
    can make a layer dense."""
    cfg = sdar_config(vocab, ids, **arch)
    cfg.update(
        architectures=["SDARMoeForCausalLM"],
        auto_map=AUTO_MAPS["sdar_moe"],
        model_type="sdar_moe",
        decoder_sparse_step=arch.get("decoder_sparse_step", 1),
        mlp_only_layers=list(arch.get("mlp_only_layers", [])),
        moe_intermediate_size=arch.get("moe_intermediate_size", 32),
        norm_topk_prob=arch.get("norm_topk_prob", True),
        num_experts=arch.get("num_experts", 8),
        num_experts_per_tok=arch.get("num_experts_per_tok", 2),
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    )
    return cfg


def llada2_config(vocab: int, ids: dict[str, int], **arch: Any) -> dict[str, Any]:
    """A LLaDA2 `config.json` with the published (`LLaDA2MoeConfig`) keys, scaled down: 8
    experts in 4 groups, 2 per token from the 2 best groups, one dense layer first."""
    hidden = arch.get("hidden_size", 64)
    return {
        "architectures": ["LLaDA2MoeModelLM"],
        "attention_dropout": 0.0,
        "auto_map": AUTO_MAPS["llada2"],
        "embedding_dropout": 0.0,
        "eos_token_id": ids["<|endoftext|>"],
        "first_k_dense_replace": arch.get("first_k_dense_replace", 1),
        "head_dim": arch.get("head_dim", 16),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": arch.get("intermediate_size", 2 * hidden),
        "max_position_embeddings": 4096,
        "model_type": "llada2_moe",
        "moe_intermediate_size": arch.get("moe_intermediate_size", 32),
        "n_group": arch.get("n_group", 4),
        "norm_head": False,
        "norm_topk_prob": True,
        "num_attention_heads": arch.get("num_attention_heads", 4),
        "num_experts": arch.get("num_experts", 8),
        "num_experts_per_tok": arch.get("num_experts_per_tok", 2),
        "num_hidden_layers": arch.get("num_hidden_layers", 3),
        "num_key_value_heads": arch.get("num_key_value_heads", 2),
        "num_shared_experts": arch.get("num_shared_experts", 1),
        "output_dropout": 0.0,
        "output_router_logits": False,
        "pad_token_id": ids["<|endoftext|>"],
        "partial_rotary_factor": arch.get("partial_rotary_factor", 0.5),
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": arch.get("rope_theta", 600000.0),
        "routed_scaling_factor": arch.get("routed_scaling_factor", 2.5),
        "score_function": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": arch.get("topk_group", 2),
        "torch_dtype": arch.get("torch_dtype", "float32"),
        "use_bias": False,
        "use_cache": False,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "vocab_size": vocab,
    }


FAMILIES: dict[str, Family] = {
    "llada": LLADA,
    "dream": DREAM,
    "sdar": SDAR,
    "sdar_moe": SDAR_MOE,
    "llada2": LLADA2,
    "fast_dllm_v2": FAST_DLLM_V2,
}
_CONFIGS = {
    "llada": llada_config,
    "dream": dream_config,
    "sdar": sdar_config,
    "sdar_moe": sdar_moe_config,
    "llada2": llada2_config,
    "fast_dllm_v2": fast_dllm_v2_config,
}
_QK_NORMS = ("q_norm.weight", "k_norm.weight", "query_layernorm.weight", "key_layernorm.weight")


def _head_and_embedding(model: torch.nn.Module, fam: Family) -> tuple[torch.Tensor, torch.Tensor]:
    """The output head's and the input embedding's weights (the same tensor when tied)."""
    if fam is LLADA:
        tr = model.model.transformer
        return tr.ff_out.weight, tr.wte.weight
    emb = model.model.word_embeddings if fam is LLADA2 else model.model.embed_tokens
    head = getattr(model, "lm_head", None)
    return (emb.weight if head is None else head.weight), emb.weight


def _generation_config(fam: Family, cfg: dict[str, Any], ids: dict[str, int]) -> dict[str, Any]:
    eos = ids["<|endoftext|>"]
    gen: dict[str, Any] = {
        "bos_token_id": cfg.get("bos_token_id", eos),
        "eos_token_id": eos,
        "pad_token_id": eos,
    }
    if fam is DREAM:
        gen["mask_token_id"] = cfg["mask_token_id"]
    if fam in (SDAR, SDAR_MOE, FAST_DLLM_V2):  # as published: end of turn first, then end of text
        gen["eos_token_id"] = [ids["<|im_end|>"], eos]
    # what the tests' requests without max_tokens were written for (the families publish
    # longer answers: decoding/checkpoint_defaults.py)
    gen["max_new_tokens"] = TINY_GENERATION_LENGTH
    return gen


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
    from dlm_engine.models.common import ForwardBatch

    h = model.hidden_states(ForwardBatch(ids, torch.arange(48)[None], None, None))
    norm = model.model.transformer.ln_f if hasattr(model.model, "transformer") else model.model.norm
    u = norm(h)[0, 16:].mean(0)
    head[row] = u / u.norm() * head.norm(dim=1).max() * scale


def chat_prompt(engine, text: str) -> list[int]:
    """`text` as one user message through the engine's chat template (prompt ids)."""
    return engine.encode_prompt(messages=[{"role": "user", "content": text}])


def until_stop(engine, ids: list[int]) -> list[int]:
    """A reference loop's canvas cut where the engine's output ends: before the first stop id."""
    for i, t in enumerate(ids):
        if t in engine.stop_ids:
            return ids[:i]
    return ids


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
    fam = FAMILIES.get(family, DREAM)
    ids = build_char_tokenizer(out, fam.name)
    vocab = vocab_size_for(ids)
    arch.setdefault("torch_dtype", str(dtype).removeprefix("torch."))
    cfg = _CONFIGS[fam.name](vocab, ids, **arch)
    eos = ids["<|endoftext|>"]
    gen = _generation_config(fam, cfg, ids)
    torch.manual_seed(seed)
    model = build_model(fam, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(_QK_NORMS):
                p.fill_(3.0)  # q/k normed per head: attention sharpness comes from these
            elif name.endswith("norm.weight") or name.endswith("ln_f.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.02)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)  # sharp, position-dependent attention: varied outputs per position
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):  # load balancing bias: small, so it matters
                b.copy_(torch.randn(b.shape) * 0.05)
        head, emb = _head_and_embedding(model, fam)
        head.mul_(4.0)
        mask_id = ids[fam.mask_token]  # LLaDA2's config names none: its tokenizer does
        if eos_boost:
            _point_row_at_masks(model, head, eos, mask_id, eos_boost)
        head[mask_id] = 0.0
        if emb is not head:
            emb.mul_(4.0)
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    write_checkpoint(out, cfg, state)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if fam.name in TOKENIZER_AUTO_MAPS:
        tok_config = out / "tokenizer_config.json"
        tok = json.loads(tok_config.read_text())
        tok["auto_map"] = TOKENIZER_AUTO_MAPS[fam.name]
        tok_config.write_text(json.dumps(tok, indent=2))
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


def block_reference_run(engine: Any, prompt: list[int], params: dict[str, Any]) -> Any:
    """The plain no-cache loop (dlm_lab/reference_block.py) of a block-diffusion request
    as `engine` resolves it, on the engine's own model: Diffulex's multi_bd, LLaDA2.1's
    token editing, LLaDA2's threshold loop or SDAR's four rules. Returns its `BlockRun`."""
    from . import reference_block as ref

    r = engine.resolve_params(params)
    model, mask_id = engine.loaded.model, engine.mask_id
    x = torch.tensor(prompt, device=next(model.parameters()).device)
    common = {"mask_id": mask_id, "gen_length": r.max_tokens, "block_length": r.block_length}
    if r.algorithm == "multi_bd":
        return ref.multi_bd_generate(
            model,
            x,
            **common,
            buffer_size=r.buffer_size,
            threshold=r.threshold,
            add_block_threshold=r.add_block_threshold,
            semi_complete_threshold=r.semi_complete_threshold,
            temperature=0.0,
            stop_ids=sorted(engine.stop_ids),
        )
    if r.algorithm == "joint_threshold":
        return ref.joint_threshold_generate(
            model,
            x,
            **common,
            eos_id=engine.loaded.eos_id,
            threshold=r.threshold,
            edit_threshold=r.edit_threshold,
            max_post_edit_steps=r.max_post_edit_steps,
            temperature=0.0,
        )
    if engine.loaded.family is FAST_DLLM_V2:
        from .reference_fast_dllm_v2 import fast_dllm_v2_generate

        # upstream decodes max_new_tokens // block_size blocks, each one token further (the
        # next block's first): enough blocks to cover max_tokens
        return fast_dllm_v2_generate(
            model,
            prompt,
            mask_id=mask_id,
            stop_token=engine.loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"),
            max_new_tokens=(r.max_tokens + 2 * r.block_length) // r.block_length * r.block_length,
            block_size=r.block_length,
            small_block_size=engine.loaded.family.sub_block_length,
            threshold=r.threshold,
        )
    if engine.loaded.family is LLADA2:
        return ref.llada2_generate(
            model,
            x,
            **common,
            eos_id=engine.loaded.eos_id,
            steps=r.steps,
            threshold=r.threshold,
            temperature=0.0,
        )
    return ref.sdar_generate(
        model,
        x,
        **common,
        denoising_steps=r.steps,
        temperature=0.0,
        remasking_strategy=r.algorithm,
        confidence_threshold=r.threshold or 0.0,
        eb_threshold=r.threshold,
        stop_ids=sorted(engine.stop_ids),
    )


def block_reference(engine: Any, prompt: list[int], params: dict[str, Any]) -> list[int]:
    """`block_reference_run`'s answer as the engine reports it: the tokens before the first
    stop id, at most max_tokens (the loops return whole decoded blocks)."""
    max_tokens = engine.resolve_params(params).max_tokens
    out = block_reference_run(engine, prompt, params).tokens.tolist()[:max_tokens]
    stop = next((i for i, t in enumerate(out) if t in engine.stop_ids), None)
    return out if stop is None else out[:stop]


class EagerGraphs:
    """Stands in for `cuda_graphs.GraphCache` on CPU: with it the runner pads every input to
    its CUDA-graph bucket (rows, query width, packed length, pages), as on a GPU; this runs
    the forward eagerly and keeps the input shapes it was given, so tests can prove that the
    padding changes no token."""

    def __init__(self) -> None:
        self.shapes: list[dict[str, tuple[int, ...]]] = []
        self.keys: list[Any] = []  # each forward's graph key (its layout among it)

    def run(self, key: Any, fn: Any, inputs: dict[str, Any]) -> Any:
        self.shapes.append({n: tuple(t.shape) for n, t in inputs.items()})
        self.keys.append(key)
        return fn(inputs)

    def clear(self) -> None:
        pass
