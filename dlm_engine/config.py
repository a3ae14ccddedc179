"""Engine settings: which checkpoint, where it runs, and the limits that protect the server."""

from __future__ import annotations

from dataclasses import dataclass

from dlm_protocol import limits


@dataclass
class EngineConfig:
    """Settings of one engine (one model on one device, or split over `tensor_parallel_size`
    ranks)."""

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
    default_max_tokens: int = limits.DEFAULT_MAX_TOKENS  # 0: the checkpoint's published length
    # steps a waiting cached row may be held so it joins when the running cached rows refresh
    # (one forward per step instead of a refresh plus a span forward); 0 admits at once
    phase_wait_steps: int = 8
    # an idle engine (no row running) that receives a cached row keeps gathering
    # arrivals until none came for admission_gap_ms, at most admission_window_ms, so the
    # requests of one burst start their first block together instead of the late ones waiting
    # for the next block start (served clients reach the engine milliseconds apart: streams
    # sent "at once" land over tens of ms, as the stub parses them one by one); exact rows
    # never wait; 0 = off.
    # Once a second request has come the gap grows to admission_burst_gap_ms: a burst's
    # arrivals through the proxy can stall mid-way for tens of ms, while a lone request pays
    # only the short gap (docs/architecture.md, "Gathering a burst"; figures in
    # docs/benchmarks.md)
    admission_window_ms: float = 250.0
    admission_gap_ms: float = 8.0
    admission_burst_gap_ms: float = 40.0
    # scoring requests (`score`; the proxy's completions echo + max_tokens 0) feed at most this
    # many tokens a forward (one text at least), and beside generation rows earn per step half
    # the rows' own tokens, at most this many, so a neighbour's steps cost at most about 1.5x
    # its forwards (dlm_engine/scoring.py); 0 = max_step_tokens / 64 (1024 by default)
    score_step_tokens: int = 0
    cuda_graphs: bool = True  # replay captured graphs for the forwards on CUDA devices
    max_cuda_graphs: int = 96  # shapes kept captured (one shared activation pool)
    # a step that feeds whole sequences (exact rows, cached rows at a block start) over more
    # packed tokens than this runs eagerly instead of capturing a graph: a capture costs far
    # more than one eager forward and such shapes (rows x lengths) rarely repeat, while past
    # this size the GPU's arithmetic outlasts an eager forward's host launches; in-block steps
    # always replay graphs; 0 = capture every shape
    # (docs/benchmarks.md, "CUDA graph captures under staggered arrivals")
    cuda_graph_max_tokens: int = 1536
    fused_kernels: bool = True  # torch.compile the elementwise pieces on CUDA devices
    # queue the next in-block forward before a step's copy (dlm_engine/lookahead.py; CUDA only)
    lookahead: bool = True
    # block-diffusion rows keep their keys/values in pages of one pool
    # (dlm_engine/paged_kv.py). Tokens it holds; 0 = automatic: on CUDA the share
    # kv_cache_memory_fraction of the memory free after the weights load, on CPU 32768 tokens
    # (at least one row of max_prompt + max_canvas, at most max_rows of them)
    kv_cache_tokens: int = 0
    kv_cache_memory_fraction: float = 0.5
    # prompt pages shared across requests (dlm_engine/prefix_cache.py): tokens of cached pages
    # that no running request uses kept for reuse, least recently used first out (they also
    # give way whenever the pool needs pages); 0 = prefix caching off
    prefix_cache_tokens: int = 16384
    # ranks the weights are split over (vLLM's tensor_parallel_size): this process is rank 0
    # and runs the engine; ranks 1..N-1 are worker processes it starts and stops
    # (dlm_engine/parallel/); 1 = one device
    tensor_parallel_size: int = 1
    # with tensor_parallel_size N, a mixture-of-experts model's routed experts are spread
    # whole over the ranks (num_experts / N each) instead of each expert being split N ways
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_rows",
            "max_canvas",
            "max_prompt",
            "max_queue",
            "max_step_tokens",
            "tensor_parallel_size",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1")
        for name in (
            "default_max_tokens",
            "kv_cache_tokens",
            "prefix_cache_tokens",
            "phase_wait_steps",
            "cuda_graph_max_tokens",
            "score_step_tokens",
        ):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0")
        for name in ("admission_window_ms", "admission_gap_ms", "admission_burst_gap_ms"):
            if not 0.0 <= float(getattr(self, name)) <= 60_000.0:
                raise ValueError(f"EngineConfig.{name} must be in [0, 60000]")
        if not 0.0 < float(self.kv_cache_memory_fraction) <= 1.0:
            raise ValueError("EngineConfig.kv_cache_memory_fraction must be in (0, 1]")

    @property
    def score_tokens(self) -> int:
        """Scoring's tokens a forward and its earnings cap a step (`score_step_tokens`)."""
        return int(self.score_step_tokens) or max(1, int(self.max_step_tokens) // 64)
