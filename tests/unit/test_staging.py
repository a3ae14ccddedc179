"""`dlm_engine.staging.to_device` builds the same tensors as `torch.tensor(..., device=)`
(values, dtype inference, explicit dtypes); on CUDA it only changes how the copy is queued
(pinned memory, no host wait), which benchmarks/gpu_check_syncs.py checks on the GPU."""

from __future__ import annotations

import math

import torch

from dlm_engine.staging import to_device

CPU = torch.device("cpu")


def test_lists_keep_torch_tensor_dtype_inference() -> None:
    for values in ([1, 2, 3], [True, False], [0.5, math.nan], []):
        got, want = to_device(values, CPU), torch.tensor(values)
        assert got.dtype == want.dtype
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_explicit_dtype_and_tensor_input() -> None:
    got = to_device([1, 2], CPU, torch.float64)
    assert got.dtype == torch.float64 and got.tolist() == [1.0, 2.0]
    t = torch.arange(4)
    assert torch.equal(to_device(t, CPU), t)
    assert to_device(t, CPU, torch.int32).dtype == torch.int32
