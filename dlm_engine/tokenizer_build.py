"""Small character-level tokenizers in the published special-token layout of each family.

Used for the tiny test checkpoints and the embedded default model: one token per character
keeps arithmetic, reversal and counting learnable by a tiny model, and the special tokens
and chat templates follow LLaDA's (Llama-3 style) and Dream's (Qwen2 style) mechanics so the
same code path serves them as the published checkpoints. Saved as `tokenizer.json` +
`tokenizer_config.json`, loadable by `transformers.AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

CHARS: list[str] = [chr(i) for i in range(32, 127)] + ["\n"]

LLADA_SPECIALS = [
    "<|endoftext|>",
    "<|startoftext|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|mdm_mask|>",
]
DREAM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]

LLADA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
DREAM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_char_tokenizer(out_dir: str | Path, family: str) -> dict[str, int]:
    """Write the tokenizer files for `family` ("llada" | "dream"); return special token ids."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = LLADA_SPECIALS if family == "llada" else DREAM_SPECIALS
    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")  # newlines too
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in specials}
    if family == "llada":
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|startoftext|>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "mask_token": "<|mdm_mask|>",
            "unk_token": "<unk>",
            "chat_template": LLADA_CHAT_TEMPLATE,
            "model_max_length": 4096,
        }
    else:
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "mask_token": "<|mask|>",
            "unk_token": "<unk>",
            "chat_template": DREAM_CHAT_TEMPLATE,
            "model_max_length": 4096,
        }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({k: v for k, v in cfg.items() if k.endswith("_token") and v}, indent=2)
    )
    return ids


def vocab_size_for(ids: dict[str, int]) -> int:
    """Model vocabulary rows needed for a tokenizer built here."""
    return max(ids.values()) + 1
