"""Tensor parallelism: one engine (rank 0: scheduler, decoding, outputs) driving N ranks,
each holding a shard of the weights; every forward runs on all ranks in lockstep over
torch.distributed (gloo on CPU, NCCL on CUDA) and rank 0 alone ends with full logits.

`sharding.py` (per-family tables of which published tensors are split how), `fp8_shards.py`
(a published FP8 checkpoint's scales, sliced with their weights), `layers.py` (row-parallel
linear, in FP8 too, vocabulary-parallel head), `group.py` (process group), `channel.py`
(rank 0's commands), `workers.py` (worker processes), `model.py` (rank 0's `ParallelLM`,
the workers' command loop), `graphs.py` (CUDA graphs captured and replayed on every rank),
`gemma.py` (DiffusionGemma under expert parallel), `start.py` (bringing it all up),
`node.py` (another host's ranks when the group spans hosts).
"""

from .model import ParallelLM, TensorParallelError
from .start import start_tensor_parallel

__all__ = ["ParallelLM", "TensorParallelError", "start_tensor_parallel"]
