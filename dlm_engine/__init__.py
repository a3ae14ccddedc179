"""dlm_engine: a step-level continuous-batching engine for diffusion language models.

No Triton, FastAPI or HTTP imports live here: servers wrap `Engine` in `EngineLoop`.
"""

from .config import EngineConfig
from .engine import Engine
from .engine_loop import EngineLoop
from .errors import EngineOverloadedError, InvalidRequestError
from .outputs import RequestOutput
from .sampling_params import ResolvedParams, SamplingParams

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineLoop",
    "EngineOverloadedError",
    "InvalidRequestError",
    "RequestOutput",
    "ResolvedParams",
    "SamplingParams",
]
