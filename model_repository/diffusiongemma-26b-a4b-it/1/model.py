"""Triton Python backend entry point; the adapter lives in dlm_triton.triton_model."""

from dlm_triton.triton_model import TritonPythonModel  # noqa: F401
