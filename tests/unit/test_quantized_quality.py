"""The embedded models keep their answers when their weights are quantized on the CPU.

`EngineConfig(quantization="fp8" | "int4")` swaps the blocks' linear layers for e4m3 or 4-bit
layers that the CPU computes by dequantizing (`dlm_engine/fp8.py`, `dlm_engine/int4.py`). A
wrong scale, zero point or packing leaves the model running but answering wrongly, which only
accuracy shows: each model answers the same 60 held-out questions at T=0 with its own weights
and quantized, and the quantized model may get at most `MAX_LOST` fewer right. Measured on 600
questions the loss is within a point (docs/benchmarks.md, "Low precision on CPU"); on these 60
the quantized models answer as many as the unquantized ones or more, so the bound leaves room
for a CPU's rounding to flip a borderline answer, while a broken scale loses dozens.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from dlm_engine import Engine, EngineConfig, SamplingParams
from dlm_engine.fp8 import Fp8Linear
from dlm_engine.int4 import Int4Linear
from dlm_lab.training import tasks

ASSETS = Path(__file__).resolve().parents[2] / "dlm_engine" / "assets"
N_QUESTIONS = 60  # ten per task, held out from training by the hash split
MAX_LOST = 3  # of 60: quantized may answer at most this many fewer than unquantized
# fewer forwards than the published k=1 keep the test short; every request still decodes
# several steps, so a quantization error has forwards in which to compound
PARAMS = {
    "tiny-dlm": {"max_tokens": 32, "steps": 8},  # 4 tokens a step
    "tiny-sdar": {"max_tokens": 32},  # the family's default rule (low_confidence_dynamic)
}
LAYERS = {"fp8": Fp8Linear, "int4": Int4Linear}


@cache
def correct(model: str, quantization: str | None) -> int:
    """How many of the held-out questions `model` answers exactly at T=0."""
    engine = Engine(
        EngineConfig(
            model=str(ASSETS / model),
            device="cpu",
            quantization=quantization,
            max_rows=N_QUESTIONS,
        )
    )
    if quantization is not None:  # the layers really were swapped, not silently kept dense
        swapped = [m for m in engine.loaded.model.modules() if isinstance(m, LAYERS[quantization])]
        assert len(swapped) >= 6, f"{model}: {len(swapped)} {quantization} layers"
    examples = tasks.heldout_examples(N_QUESTIONS)
    prompts = [engine.encode_prompt(messages=tasks.messages_for(ex)) for ex in examples]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, **PARAMS[model]))
    return sum(out.text.strip() == ex.answer for ex, out in zip(examples, outs, strict=True))


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
@pytest.mark.parametrize("model", ["tiny-dlm", "tiny-sdar"])
def test_quantized_model_keeps_heldout_accuracy(model: str, quantization: str) -> None:
    """At most `MAX_LOST` of 60 held-out answers lost to fp8 / int4 weights."""
    baseline = correct(model, None)
    quantized = correct(model, quantization)
    assert quantized >= baseline - MAX_LOST, (
        f"{model} {quantization}: {quantized}/{N_QUESTIONS} right, unquantized {baseline}"
    )
