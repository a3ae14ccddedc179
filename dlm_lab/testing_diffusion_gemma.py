"""A tiny random DiffusionGemma checkpoint in the published layout, for tests.

Written by transformers' own `DiffusionGemmaForBlockDiffusion.save_pretrained` (safetensors,
published tensor names, the tiny vision tower included, as the published checkpoint carries
one), with a `generation_config.json` holding the published decoding keys and a small
character-level tokenizer in Gemma's special-token layout (pad 0, eos 1, bos 2) with a
turn-based chat template. No network: the real Gemma tokenizer comes with the real checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]
# a tool's parameters that a tiny canvas can hold (bounded string, enum, integer range),
# shared by the Gemma 4 tool-call tests of the engine and of the served stack
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Gemma 4's layout (chat="gemma4"): its turn markers and tool-call markup as special tokens, and
# a template that renders `tools`, calls and results in Gemma 4's syntax (dlm_engine/tool_gemma4.py)
GEMMA4_SPECIALS = [
    *GEMMA_SPECIALS[:5],
    "<|turn>",
    "<turn|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
]
GEMMA4_CHAT_TEMPLATE = (
    "{%- macro arg(v) -%}"
    '{%- if v is string -%}<|"|>{{ v }}<|"|>'
    "{%- elif v is boolean -%}{{ 'true' if v else 'false' }}"
    "{%- elif v is mapping -%}{{ '{' }}{%- for k, x in v | dictsort -%}"
    "{{ k }}:{{ arg(x) }}{{ ',' if not loop.last }}{%- endfor -%}{{ '}' }}"
    "{%- elif v is sequence -%}[{%- for x in v -%}{{ arg(x) }}{{ ',' if not loop.last }}"
    "{%- endfor -%}]"
    "{%- elif v is none -%}null{%- else -%}{{ v }}{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- if tools or messages[0]['role'] == 'system' -%}<|turn>system{{ '\\n' }}"
    "{%- if messages[0]['role'] == 'system' -%}{{ messages[0]['content'] | trim }}{%- endif -%}"
    "{%- for t in tools or [] -%}<|tool>declaration:{{ t['function']['name'] }}"
    "{description:<|\"|>{{ t['function']['description'] or '' }}<|\"|>,parameters:"
    "{{ arg(t['function']['parameters'] or {}) }}}<tool|>{%- endfor -%}<turn|>{{ '\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages if m['role'] != 'system' -%}"
    "{%- if m['role'] == 'tool' -%}{%- set ns = namespace(name='tool') -%}"
    "{%- for a in messages -%}{%- for c in a.get('tool_calls') or [] -%}"
    "{%- if c.get('id') == m.get('tool_call_id') -%}{%- set ns.name = c['function']['name'] -%}"
    "{%- endif -%}{%- endfor -%}{%- endfor -%}"
    "<|tool_response>response:{{ ns.name }}{value:<|\"|>{{ m['content'] }}<|\"|>}"
    "<tool_response|>"
    "{%- else -%}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}{{ '\\n' }}"
    "{{ (m['content'] or '') | trim }}"
    "{%- for c in m.get('tool_calls') or [] -%}<|tool_call>call:{{ c['function']['name'] }}"
    "{{ arg(c['function']['arguments']) }}<tool_call|>{%- endfor -%}"
    "{%- if not m.get('tool_calls') -%}<turn|>{{ '\\n' }}{%- endif -%}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt and messages[-1]['role'] != 'tool' -%}<|turn>model{{ '\\n' }}"
    "{%- endif -%}"
)
# The published decoding defaults' keys (DiffusionGemmaGenerationConfig); values for a tiny
# canvas that stops early now and then.
GENERATION_DEFAULTS: dict[str, Any] = {
    "max_denoising_steps": 12,
    "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
}


def build_gemma_char_tokenizer(out_dir: Path, chat: str = "gemma") -> dict[str, int]:
    """Gemma's special ids first (pad 0, eos 1, bos 2), then one token per character.
    `chat="gemma4"`: Gemma 4's turn and tool-call markup and its tool-rendering template."""
    specials = GEMMA4_SPECIALS if chat == "gemma4" else GEMMA_SPECIALS
    vocab = {s: i for i, s in enumerate(specials)}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "chat_template": GEMMA4_CHAT_TEMPLATE if chat == "gemma4" else CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return {s: vocab[s] for s in specials} | {"vocab_size": len(vocab)}


def tiny_config(vocab_size: int, canvas_length: int = 16, sliding_window: int = 6, **text: Any):
    """A `DiffusionGemmaConfig` a few kilobytes big: 3 layers (sliding, sliding, full), 4
    experts, GQA, a full-attention head twice the sliding one, k = v on full layers."""
    from transformers import DiffusionGemmaConfig

    text_config = {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "global_head_dim": 16,
        "num_global_key_value_heads": 1,
        "sliding_window": sliding_window,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 16,
        "max_position_embeddings": 4096,
        "use_bidirectional_attention": "vision",
        **text,
    }
    vision_config = {
        "model_type": "gemma4_vision",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "patch_size": 4,
        "position_embedding_size": 64,
    }
    return DiffusionGemmaConfig(
        text_config=text_config,
        vision_config=vision_config,
        canvas_length=canvas_length,
        architectures=["DiffusionGemmaForBlockDiffusion"],
    )


def make_tiny_diffusion_gemma(
    out_dir: str | Path,
    *,
    seed: int = 0,
    canvas_length: int = 16,
    sliding_window: int = 6,
    generation: dict[str, Any] | None = None,
    chat: str = "gemma",
    text: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint folder and return it. Weights are random but seeded, scaled up so
    the tiny model's distributions are far from uniform (entropy-bound acceptance, early
    stops and end-of-text all happen within a few canvases). `chat="gemma4"`: the tokenizer and
    chat template in Gemma 4's layout (turn and tool-call markup as special tokens, tools
    rendered by the template), as the published checkpoint's. `text`: text-config keys to
    override (head counts, say)."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    out = Path(out_dir)
    ids = build_gemma_char_tokenizer(out, chat)
    config = tiny_config(ids["vocab_size"], canvas_length, sliding_window, **(text or {}))
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, 2
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        embed = model.model.decoder.embed_tokens.weight
        embed.normal_(0.0, 1.0)
        for name, p in model.named_parameters():
            if "layers" in name and ("proj" in name or "experts" in name):
                p.mul_(6.0)
    model.save_pretrained(str(out), safe_serialization=True)
    gen = {
        **GENERATION_DEFAULTS,
        **(generation or {}),
        "bos_token_id": 2,
        "pad_token_id": 0,
        "eos_token_id": [ids["<eos>"], ids["<turn|>" if chat == "gemma4" else "<end_of_turn>"]],
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def served_alone(engine: Any, prompt: list[int], params: dict[str, Any]) -> list[int]:
    """A request alone through the sampler, no batching, budget or prefix cache (proven
    equal to transformers' generate in tests/unit/test_diffusion_gemma.py), cut as the
    served text is: at its first stop token."""
    from dataclasses import replace

    from dlm_engine.decoding.uniform_diffusion import generate

    resolved = engine.resolve_params(params)
    canvas = engine.loaded.model.canvas_length
    settings = replace(resolved.uniform, canvases=-(-resolved.max_tokens // canvas))
    tokens = generate(
        engine.loaded.model, [prompt], [settings], [params["seed"]], sorted(engine.stop_ids)
    )[0][: resolved.max_tokens]
    return next((tokens[:i] for i, t in enumerate(tokens) if t in engine.stop_ids), tokens)


# three seeded requests of unlike lengths (one canvas, two, three): the batch that parallel and
# graphed runs are held to one device's tokens with
SEEDED_ROWS = (
    {"seed": 1, "max_tokens": 40},
    {"seed": 3, "max_tokens": 20},
    {"seed": 6, "max_tokens": 48},
)
SEEDED_TEXTS = ("hi there", "What is 12 + 7?", "sort 4 2 9")


def chat_prompts(tokenizer: Any, texts: tuple[str, ...] = SEEDED_TEXTS) -> list[list[int]]:
    """Each text as the ids of a one-turn chat prompt (the checkpoint's template)."""
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for text in texts
    ]


def batch_tokens(engine: Any, prompts: list[list[int]], params: Any) -> list[list[int]]:
    """The token ids `engine.generate` returns for the prompts, in order."""
    return [o.token_ids for o in engine.generate(prompts, params)]


def spy_encoder(engine: Any, monkeypatch: Any) -> list[list[int]]:
    """Records each encoder forward of the engine's DiffusionGemma model as its span lengths."""
    model = engine.runner.model
    calls: list[list[int]] = []
    real = model.encode

    def spy(spans: list) -> Any:
        calls.append([int(ids.numel()) for ids, _ in spans])
        return real(spans)

    monkeypatch.setattr(model, "encode", spy)
    return calls


def generation_settings(
    checkpoint: str | Path, max_tokens: int, canvas_length: int, **over: Any
) -> Any:
    """The sampler settings a checkpoint's `generation_config.json` gives transformers'
    `generate` (overrides by the same key names, `entropy_bound` for the sampler config's),
    for answers of `max_tokens`: what the tests hand the sampler directly."""
    from dlm_engine.decoding.uniform_diffusion import UniformSettings

    gen = json.loads((Path(checkpoint) / "generation_config.json").read_text())
    return UniformSettings(
        steps=over.get("max_denoising_steps", gen["max_denoising_steps"]),
        t_min=over.get("t_min", gen["t_min"]),
        t_max=over.get("t_max", gen["t_max"]),
        entropy_bound=over.get("entropy_bound", gen["sampler_config"]["entropy_bound"]),
        stability_threshold=over.get("stability_threshold", gen["stability_threshold"]),
        stop_entropy=over.get("confidence_threshold", gen["confidence_threshold"]),
        canvases=-(-max_tokens // canvas_length),
    )
