"""A checkpoint's own decoding defaults: d3LLM's multi-block settings.

d3LLM publishes its checkpoints (d3LLM/d3LLM_LLaDA, d3LLM/d3LLM_Dream on the Hugging Face Hub)
in the LLaDA and Dream layouts, and their `generation_config.json` carries no decoding
settings (LLaDA's holds only bos/eos ids; Dream's is Dream's own, `alg: origin`). The
settings they were evaluated and served with are published in the d3LLM repository (chat
scripts, eval scripts, README's SGLang table): multi-block decoding with the entropy
threshold 0.5 (LLaDA) / 0.4 (Dream), block_add_threshold 0.1, decoded_token_threshold 0.95,
blocks of 32, with `early_stop=True` (end-of-text fills the rest of the canvas and the blocks
past it close; not with the delayed cache, see `sampling_params.apply_model_defaults`). So:

1. decoding keys a generation config does carry under d3LLM's names (`threshold`,
   `block_add_threshold`, `decoded_token_threshold`, `block_size`, `alg: entropy_threshold`,
   `multi_block`, `early_stop`) are used as the model's defaults;
2. a d3LLM checkpoint (its model card tags `d3llm`, or its config or directory names d3LLM)
   gets the
   published settings above for whatever (1) left unset.
A request's own keys always win (see `sampling_params.apply_model_defaults`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..models import Family, family_of

_SHARED = {"block_add_threshold": 0.1, "decoded_token_threshold": 0.95, "early_stop": True}
_GEN_KEYS = {
    "threshold": "threshold",
    "block_add_threshold": "block_add_threshold",
    "decoded_token_threshold": "decoded_token_threshold",
    "multi_block": "multi_block",
    "early_stop": "early_stop",
}


def is_d3llm(path: Path, config: dict[str, Any]) -> bool:
    """The model card's tags (README.md front matter), the config or the directory name d3LLM."""
    name = str(config.get("_name_or_path", ""))
    if "d3llm" in name.lower() or any("d3llm" in part.lower() for part in path.parts[-4:]):
        return True  # e.g. /ckpt/d3LLM_LLaDA, or the Hub cache's models--d3LLM--d3LLM_Dream
    card = path / "README.md"
    if not card.exists():
        return False
    text = card.read_text(errors="replace")
    front = re.match(r"^---\n(.*?)\n---", text, re.S)
    return bool(front and re.search(r"^\s*-\s*d3llm\s*$", front.group(1), re.M | re.I))


def decoding_defaults(
    path: Path, family: Family | str, config: dict[str, Any], gen: dict[str, Any]
) -> dict[str, Any]:
    """Request-key defaults this checkpoint asks for ({} for plain LLaDA / Dream)."""
    family = family_of(family)
    if family.checkpoint_defaults is not None:  # a family reading its own sampler's keys
        return family.checkpoint_defaults(gen)
    out: dict[str, Any] = {}
    for key, name in _GEN_KEYS.items():
        if gen.get(key) is not None:
            out[name] = gen[key]
    if gen.get("alg") == "entropy_threshold":
        out["algorithm"] = "entropy_threshold"
    if family.d3llm_defaults is not None and is_d3llm(path, config):
        for key, value in {**family.d3llm_defaults, **_SHARED}.items():
            out.setdefault(key, value)
    return out


def write_d3llm_card(out: Path, family: Family | str) -> None:
    """The model card front matter as d3LLM publishes it (for test checkpoints)."""
    family = family_of(family)
    (out / "README.md").write_text(
        "---\nlicense: apache-2.0\npipeline_tag: text-generation\ntags:\n- diffusion\n"
        f"- fast-inference\n- d3llm\n- {family.name}\n---\n# d3LLM-{family.label}\n",
    )


# ---- max_tokens when a request names none: the generation length each family publishes ----
# LLaDA chat.py: gen_length 128; Dream's README: max_new_tokens 512 (its generation_config.json
# holds steps 512, no length); SDAR generate.py: gen_length 128; LLaDA2.0's model card:
# gen_length 512 (each family's `Family.generation_length`). A checkpoint's own
# generation_config.json (`max_new_tokens`, or LLaDA's `gen_length` name) wins; the embedded
# tiny models carry 64 there.
_LENGTH_KEYS = ("max_new_tokens", "gen_length")


def generation_length(path: Path, family: Family | str) -> int:
    """The checkpoint's published answer length: its generation config's, else its family's."""
    gen_file = Path(path) / "generation_config.json"
    try:
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    except (OSError, ValueError):
        gen = {}
    for key in _LENGTH_KEYS:
        value = gen.get(key) if isinstance(gen, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return family_of(family).generation_length
