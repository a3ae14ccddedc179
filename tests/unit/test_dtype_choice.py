"""`dtype: auto` on CPU is float32 (measured faster than bf16, and flat in memory); an
explicit dtype always wins; on accelerators `auto` keeps the checkpoint's own dtype."""

from __future__ import annotations

import pytest

from dlm_engine.loader import choose_dtype


@pytest.mark.parametrize("stored", ["bfloat16", "float16", "float32"])
def test_auto_on_cpu_is_float32(stored: str) -> None:
    dtype, why = choose_dtype("auto", {"torch_dtype": stored}, "cpu")
    assert dtype == "float32"
    assert ("auto on CPU" in why) == (stored != "float32")


def test_auto_on_an_accelerator_keeps_the_checkpoint_dtype() -> None:
    assert choose_dtype("auto", {"torch_dtype": "bfloat16"}, "cuda")[0] == "bfloat16"
    assert choose_dtype("auto", {}, "cuda:0")[0] == "float32"


def test_an_explicit_dtype_always_wins() -> None:
    assert choose_dtype("bfloat16", {"torch_dtype": "float32"}, "cpu") == ("bfloat16", "asked for")
    with pytest.raises(ValueError, match="unsupported dtype"):
        choose_dtype("float8", {}, "cpu")


def test_the_embedded_model_loads_in_float32_on_cpu() -> None:
    import torch

    from dlm_engine.loader import load_checkpoint
    from dlm_protocol.settings import ASSETS_DIR

    lm = load_checkpoint(ASSETS_DIR / "tiny-dlm", "auto", "cpu")
    assert lm.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in lm.model.parameters())
