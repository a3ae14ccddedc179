"""dlm_protocol: the request contract shared by every room (engine, adapter, proxy, client).

Torch-free and dependency-free so anything may import it: request keys (`params`), Triton
tensors (`tensors`), response extras (`response`), shared server defaults (`limits`) and the
error every bad value raises (`errors`).
"""

from . import limits, response, tensors
from .errors import (
    ERROR_PREFIXES,
    PREFIX_INTERNAL,
    PREFIX_INVALID,
    PREFIX_OVERLOADED,
    InvalidRequestError,
)
from .params import ALIASES, BY_NAME, PARAM_NAMES, PARAMS, Param, canonical, parse_params

__all__ = [
    "ALIASES",
    "BY_NAME",
    "ERROR_PREFIXES",
    "PARAMS",
    "PARAM_NAMES",
    "PREFIX_INTERNAL",
    "PREFIX_INVALID",
    "PREFIX_OVERLOADED",
    "InvalidRequestError",
    "Param",
    "canonical",
    "limits",
    "parse_params",
    "response",
    "tensors",
]
