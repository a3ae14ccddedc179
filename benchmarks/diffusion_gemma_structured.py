"""Structured output's cost on DiffusionGemma's canvas, in process (CPU, tiny checkpoint).

    python benchmarks/diffusion_gemma_structured.py [--rows 8] [--max-tokens 128] [--runs 3]

Writes the tiny random DiffusionGemma (dlm_lab/testing_diffusion_gemma.py, 16-token
canvases) and runs `--rows` requests together to the end, unconstrained and then with a JSON
schema, a regex and a required tool call. For each: CPU seconds per engine step (the median
of `--runs`; one torch thread, this process's CPU time, so other work on a shared machine does
not enter the figures), the share spent walking finished canvases under the grammar
(decoding/uniform_constraints.py), the walk's cost per canvas, and whether every answer was
valid. Constrained and free rows take different numbers of steps (their later canvases see
different text, and a finished structure ends the row), and a step's cost falls as rows finish
and the prompt's encoding is spread over fewer steps, so the walk's own time is the cost of
the constraint; the whole step's time is shown for scale.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import torch

from dlm_engine import Engine, EngineConfig
from dlm_engine.decoding import uniform_constraints
from dlm_lab.testing_diffusion_gemma import make_tiny_diffusion_gemma

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
MODES = {
    "free": {},
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    },
    "regex": {"regex": r"[A-Z]{2}[0-9]{3}"},
    "tool_required": {"tools": TOOLS, "tool_choice": "required"},
}


class _WalkClock:
    """CPU seconds spent in `CanvasConstraint.walk`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._walk = uniform_constraints.CanvasConstraint.walk
        clock = self

        def timed(self, logits, start):
            t0 = time.process_time()
            clock.calls += 1
            try:
                return clock._walk(self, logits, start)
            finally:
                clock.seconds += time.process_time() - t0

        uniform_constraints.CanvasConstraint.walk = timed


def _valid(mode: str, out) -> bool:
    if out.error is not None:
        return False
    if mode == "json_schema":
        import jsonschema

        try:
            jsonschema.validate(json.loads(out.text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if mode == "regex":
        return re.fullmatch(MODES["regex"]["regex"], out.text) is not None
    if mode == "tool_required":
        return bool(out.tool_calls) and all(
            json.loads(c["function"]["arguments"]).get("city") is not None for c in out.tool_calls
        )
    return True


def _run(eng: Engine, clock: _WalkClock, mode: str, rows: int, max_tokens: int, prompt):
    keys = MODES[mode]
    ids = [
        eng.add_request(None, prompt, keys | {"seed": s, "max_tokens": max_tokens})
        for s in range(rows)
    ]
    clock.seconds, clock.calls, steps, finals = 0.0, 0, 0, {}
    t0 = time.process_time()
    while len(finals) < rows:
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
    total = time.process_time() - t0
    valid = sum(_valid(mode, finals[i]) for i in ids)
    per_canvas = clock.seconds / clock.calls if clock.calls else 0.0
    return total / steps, clock.seconds / steps, per_canvas, steps, valid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_diffusion_gemma(Path(tmp) / "tiny-dg", canvas_length=16)
        eng = Engine(EngineConfig(model=str(ckpt), device="cpu", max_rows=args.rows))
        prompt = eng.encode_prompt(messages=[{"role": "user", "content": "Weather in Paris?"}])
        clock = _WalkClock()
        print(f"batch {args.rows}, max_tokens {args.max_tokens}, canvas 16, CPU, 1 thread")
        print(
            f"{'mode':<14}{'ms/step':>9}{'walk ms/step':>14}{'walk ms/canvas':>16}"
            f"{'steps':>7}{'valid':>8}"
        )
        for mode in MODES:
            _run(eng, clock, mode, args.rows, args.max_tokens, prompt)  # warm: compile, caches
            runs = [
                _run(eng, clock, mode, args.rows, args.max_tokens, prompt) for _ in range(args.runs)
            ]
            per_step, walk, per_canvas, steps, valid = sorted(runs)[len(runs) // 2]
            print(
                f"{mode:<14}{per_step * 1e3:>9.2f}{walk * 1e3:>14.2f}{per_canvas * 1e3:>16.2f}"
                f"{steps:>7}{valid:>5}/{args.rows}"
            )


if __name__ == "__main__":
    main()
