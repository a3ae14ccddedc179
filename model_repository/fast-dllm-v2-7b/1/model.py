"""Triton Python backend entry point; the adapter lives in dlm_triton.backend.triton_model."""

from dlm_triton.backend.triton_model import TritonPythonModel  # noqa: F401
