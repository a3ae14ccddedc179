"""Typed client for dlm-triton models (installed as ``dlm_client``)."""

from dlm_client.client import Chunk, Completion, DLMClient, DLMError, build_inputs

__all__ = ["Chunk", "Completion", "DLMClient", "DLMError", "build_inputs"]
