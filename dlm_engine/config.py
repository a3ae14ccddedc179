"""Engine settings: which checkpoint, where it runs, and the limits that protect the server."""

from __future__ import annotations

from dataclasses import dataclass

from dlm_protocol import limits


@dataclass
class EngineConfig:
    """Settings of one engine (one model on one device)."""

    model: str  # a checkpoint directory, a Hub id (org/name), or random:<preset>
    revision: str | None = None  # Hub branch, tag or commit for a Hub id (None: main)
    dtype: str = "auto"
    device: str = "cpu"
    quantization: str | None = None
    max_rows: int = limits.MAX_ROWS  # rows (requests) per denoising step
    max_canvas: int = limits.MAX_CANVAS  # max_tokens ceiling
    max_prompt: int = limits.MAX_PROMPT  # prompt tokens ceiling
    max_queue: int = limits.MAX_QUEUE  # waiting requests beyond the running rows
    max_step_tokens: int = 65536  # prompt + canvas tokens of all rows in one forward
    default_max_tokens: int = limits.DEFAULT_MAX_TOKENS
    # steps a waiting cached row may be held so it joins when the running cached rows refresh
    # (one forward per step instead of a refresh plus a span forward); 0 admits at once
    phase_wait_steps: int = 8
    cuda_graphs: bool = True  # replay captured graphs for the forwards on CUDA devices
    max_cuda_graphs: int = 96  # shapes kept captured (one shared activation pool)
    fused_kernels: bool = True  # torch.compile the elementwise pieces on CUDA devices
    # issue 16: keys/values of block-diffusion prompt blocks kept for reuse (tokens; 0 = off)
    prefix_cache_tokens: int = 16384

    def __post_init__(self) -> None:
        for name in (
            "max_rows",
            "max_canvas",
            "max_prompt",
            "max_queue",
            "max_step_tokens",
            "default_max_tokens",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1")
