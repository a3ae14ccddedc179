"""Server defaults that the engine, the Triton model settings, the model-repository writer, the
launcher and the proxy share: one source, so their configs cannot disagree."""

from __future__ import annotations

MAX_ROWS = 16  # rows (requests) per denoising step
MAX_CANVAS = 1024  # the largest max_tokens an engine accepts
MAX_PROMPT = 2048  # prompt tokens at most
MAX_QUEUE = 256  # requests waiting or running per model instance before `overloaded:`
# canvas length when a request gives none; 0 = the model's published generation length
# (dlm_engine/decoding/checkpoint_defaults.py: LLaDA 128, Dream 512, SDAR 128, LLaDA2 512)
DEFAULT_MAX_TOKENS = 0
# The proxy's own ceiling on max_tokens (a server may raise max_canvas up to it).
PROXY_MAX_TOKENS_LIMIT = 4096
