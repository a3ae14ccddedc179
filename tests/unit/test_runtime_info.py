"""Reading a model's ``dlm_model_info`` sample back from Prometheus text."""

from __future__ import annotations

from dlm_triton.launch.runtime_info import model_info

TEXT = """# HELP dlm_model_info Always 1
# TYPE dlm_model_info gauge
dlm_model_info{model="other",instance="o_0",dtype="bfloat16",device="cuda",torch_threads="8"} 1
dlm_model_info{model="tiny",instance="tiny_0",dtype="float32",dtype_reason="auto on CPU: float32 (a \\"quoted\\", b)",device="cpu",torch_threads="2"} 1
dlm_requests_in_flight{model="tiny",instance="tiny_0"} 0
"""


def test_the_named_models_labels_are_read_with_escapes() -> None:
    info = model_info(TEXT, "tiny")
    assert info == {
        "dtype": "float32",
        "dtype_reason": 'auto on CPU: float32 (a "quoted", b)',
        "device": "cpu",
        "torch_threads": "2",
    }
    assert model_info(TEXT, "other")["dtype"] == "bfloat16"


def test_absent_metric_or_model_gives_nothing() -> None:
    assert model_info("", "tiny") == {}
    assert model_info(TEXT, "missing") == {}


def test_fused_kernel_fallbacks_are_summed_over_the_models_instances() -> None:
    from dlm_triton.launch.runtime_info import fused_fallbacks

    text = TEXT + (
        'dlm_fused_kernel_fallbacks{model="tiny",instance="tiny_0"} 1\n'
        'dlm_fused_kernel_fallbacks{model="tiny",instance="tiny_1"} 2\n'
        'dlm_fused_kernel_fallbacks{model="other",instance="o_0"} 0\n'
    )
    assert fused_fallbacks(text, "tiny") == 3
    assert fused_fallbacks(text, "other") == 0
    assert fused_fallbacks(TEXT, "tiny") is None  # metric absent
