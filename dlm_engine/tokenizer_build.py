"""Small character-level tokenizers in the published special-token layout of each family.

Used for the tiny test checkpoints and the embedded default model: one token per character
keeps arithmetic, reversal and counting learnable by a tiny model, and the special tokens
and chat templates follow LLaDA's (Llama-3 style), Dream's (Qwen2 style), SDAR's (Qwen3
ChatML) and LLaDA2's (Ling 2.0 role tags) mechanics so the same code path serves them as the
published checkpoints. Saved as `tokenizer.json` +
`tokenizer_config.json`, loadable by `transformers.AutoTokenizer`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
SDAR_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
LLADA2_SPECIALS = [
    "<|endoftext|>",
    "<|startoftext|>",
    "<role>",
    "</role>",
    "<|role_end|>",
    "<|mask|>",
]

LLADA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Dream's template is Qwen2.5's: with `tools` the system turn lists them and teaches the
# <tool_call> format; assistant calls and tool results (<tool_response>) are rendered too.
# Without tools and tool messages the text is the plain ChatML of before.
DREAM_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system{{ '\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "' }}"
    "{% elif messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|im_start|>assistant"
    "{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "<|im_start|>user{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# SDAR's template is Qwen3's (JetAstra/SDAR training/model/SDAR-4B-Chat/tokenizer_config.json)
# without its tools and <think> handling: a system turn only when given, then plain ChatML.
SDAR_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# LLaDA2's is Ling 2.0's (thinking off) without tools: the system turn always opens and ends
# with "detailed thinking off", turns are <role>ROLE</role>...<|role_end|>, tool results are
# an OBSERVATION turn.
LLADA2_CHAT_TEMPLATE = (
    "<role>SYSTEM</role>{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\n' }}{% endif %}detailed thinking off<|role_end|>"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<role>HUMAN</role>{{ message['content'] }}<|role_end|>"
    "{% elif message['role'] == 'system' and not loop.first %}"
    "<role>SYSTEM</role>{{ message['content'] }}<|role_end|>"
    "{% elif message['role'] == 'assistant' %}"
    "<role>ASSISTANT</role>{{ message['content'] }}<|role_end|>"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "<role>OBSERVATION</role>{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|role_end|>{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}"
)


@dataclass(frozen=True)
class CharTokenizer:
    """A family's character tokenizer: its special tokens (in id order), mask and bos tokens,
    and chat template. Each family names its own (`models/<family>.py`)."""

    specials: tuple[str, ...]
    mask_token: str
    chat_template: str
    bos_token: str | None = None

    def config(self) -> dict:
        """tokenizer_config.json (key order kept: the files stay byte-identical)."""
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "mask_token": self.mask_token,
            "unk_token": "<unk>",
            "chat_template": self.chat_template,
            "model_max_length": 4096,
        }


LLADA_TOKENIZER = CharTokenizer(
    tuple(LLADA_SPECIALS), "<|mdm_mask|>", LLADA_CHAT_TEMPLATE, "<|startoftext|>"
)
DREAM_TOKENIZER = CharTokenizer(tuple(DREAM_SPECIALS), "<|mask|>", DREAM_CHAT_TEMPLATE)
SDAR_TOKENIZER = CharTokenizer(tuple(SDAR_SPECIALS), "<|MASK|>", SDAR_CHAT_TEMPLATE)
LLADA2_TOKENIZER = CharTokenizer(
    tuple(LLADA2_SPECIALS), "<|mask|>", LLADA2_CHAT_TEMPLATE, "<|startoftext|>"
)


def build_char_tokenizer(out_dir: str | Path, family: Any) -> dict[str, int]:
    """Write the character tokenizer of `family` (a `models.Family` or its name); return
    special token ids. A family with no tokenizer of its own gets Dream's."""
    from .models import family_of  # the families name their tokenizers

    spec = family_of(family).char_tokenizer or DREAM_TOKENIZER
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = list(spec.specials)
    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")  # newlines too
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in specials}
    cfg = spec.config()
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({k: v for k, v in cfg.items() if k.endswith("_token") and v}, indent=2)
    )
    return ids


def vocab_size_for(ids: dict[str, int]) -> int:
    """Model vocabulary rows needed for a tokenizer built here."""
    return max(ids.values()) + 1
