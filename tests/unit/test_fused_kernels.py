"""Compiled elementwise kernels: two built from one function never share the compiler's cache
(shared, a rank-3 and a rank-4 caller evict each other until the recompile limit turns both
off), and a kernel that does fall back to eager is reported."""

from __future__ import annotations

import pytest
import torch

from dlm_engine.models.common import FusedKernels, rms_norm, rms_norm_heads


def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_kernels_from_one_function_hold_their_own_code() -> None:
    assert rms_norm.fn.__code__ is not rms_norm_heads.fn.__code__
    assert rms_norm.fn.__name__ == rms_norm_heads.fn.__name__ == "_rms_norm"


def test_rank_3_and_rank_4_callers_stay_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    # each caller needs two variants (a batch of one is always specialised): shared, the four
    # would pass this limit
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 3)
    monkeypatch.setattr(FusedKernels, "enabled", True)
    monkeypatch.setattr(FusedKernels, "fallbacks", [])
    hidden, heads = FusedKernels(_twice), FusedKernels(_twice)
    for _ in range(3):
        for batch in (1, 8, 3):
            x3, x4 = torch.randn(batch, 5, 4), torch.randn(batch, 2, 5, 4)
            torch.testing.assert_close(hidden(x3), x3 * 2 + 1)
            torch.testing.assert_close(heads(x4), x4 * 2 + 1)
    assert not hidden.failed and not heads.failed
    assert FusedKernels.fallbacks == []


def test_a_fallback_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FusedKernels, "enabled", True)
    monkeypatch.setattr(FusedKernels, "fallbacks", [])

    def broken(*_args):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", lambda fn, **_kw: broken)
    kernel = FusedKernels(_twice)
    x = torch.randn(2, 3)
    torch.testing.assert_close(kernel(x), x * 2 + 1)  # still correct, in eager
    assert kernel.failed and FusedKernels.fallbacks == ["_twice"]
