"""A byte cap on prompts, derived from the token limit, checked before tokenizing.

Tokenizing a megabyte takes seconds; knowing it cannot fit takes a `len()`. Each token of a
byte-level or byte-fallback BPE (LLaDA, Dream) or a character vocabulary (tiny-dlm) covers at
most as many input bytes as its longest vocabulary entry, so a prompt of more than
`max_prompt * longest_token_bytes` bytes has more than `max_prompt` tokens. A normalizer may
shrink text before splitting (NFC composes a Hangul syllable from three jamo: 9 bytes to 3), so
the cap is tripled when the tokenizer has one. The cap never rejects a prompt that fits.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import InvalidRequestError

MIN_TOKEN_BYTES = 4  # one UTF-8 character: the floor for any vocabulary
NORMALIZER_SHRINK = 3


def longest_token_bytes(tokenizer: Any) -> int:
    """Bytes of the longest vocabulary entry (added tokens included), as stored."""
    longest = MIN_TOKEN_BYTES
    for token in tokenizer.get_vocab():
        longest = max(longest, len(token.encode("utf-8", "surrogatepass")))
    return longest


def has_normalizer(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return True  # unknown: assume the worst
    try:
        return json.loads(backend.to_str()).get("normalizer") is not None
    except (ValueError, AttributeError):
        return True


def prompt_byte_cap(tokenizer: Any, max_prompt: int) -> int:
    """Prompt bytes above which no text can fit in `max_prompt` tokens."""
    factor = NORMALIZER_SHRINK if has_normalizer(tokenizer) else 1
    return max_prompt * longest_token_bytes(tokenizer) * factor


def prompt_bytes(text: str | None, messages: Any) -> int:
    """UTF-8 bytes of the prompt text (message contents summed), without copying it."""
    if text is not None:
        return _utf8_len(text) if isinstance(text, str) else 0
    if isinstance(messages, list):
        return sum(
            _utf8_len(m["content"])
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
    return 0


def check_prompt_bytes(size: int, cap: int, max_prompt: int, field: str) -> None:
    if size > cap:
        raise InvalidRequestError(
            field,
            f"prompt is {size} bytes; more than {cap} bytes cannot fit in the limit of "
            f"{max_prompt} tokens",
        )


def _utf8_len(s: str) -> int:
    """UTF-8 length: ASCII strings are counted without encoding them."""
    return len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))
