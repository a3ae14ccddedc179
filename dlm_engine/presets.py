"""Published architectures, for benchmarks with random weights (`random:<name>` checkpoints).

The values are the published `config.json` values of each checkpoint. With random weights a
model has the real architecture and cost, so fixed decoding schedules time honestly; it has no
meaningful end of text, so such models never stop early.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "llada-8b": {
        "model_type": "llada",
        "architectures": ["LLaDAModelLM"],
        "block_type": "llama",
        "d_model": 4096,
        "n_layers": 32,
        "n_heads": 32,
        "n_kv_heads": 32,
        "mlp_hidden_size": 12288,
        "vocab_size": 126464,
        "embedding_size": 126464,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "include_bias": False,
        "include_qkv_bias": False,
        "weight_tying": False,
        "mask_token_id": 126336,
        "eos_token_id": 126081,
        "torch_dtype": "bfloat16",
    },
    "dream-7b": {
        "model_type": "Dream",
        "architectures": ["DreamModel"],
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "mask_token_id": 151666,
        "eos_token_id": 151643,
        "torch_dtype": "bfloat16",
    },
}
