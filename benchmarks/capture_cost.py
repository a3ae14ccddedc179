"""What a step that feeds whole sequences costs on each path: replayed from a CUDA graph,
captured first (with 2, 1 or 0 warm-up runs), or run eagerly with and without the compiled
elementwise pieces. Two step kinds: a refresh of `rows` cached rows at a block start, and a
mixed step (one new row's first forward packed with `rows` rows inside a block).

    python benchmarks/capture_cost.py --out OUT_DIR        # LLaDA-8B architecture on CUDA

Random bf16 weights (fixed schedules: the timing is honest); prompt 64, canvas 256, block 32.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch

from dlm_engine import Engine, EngineConfig, cuda_graphs
from dlm_engine.models.common import FusedKernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_vs_eager import CANVAS, refresh_steps, setup, timed_step  # noqa: E402


@contextlib.contextmanager
def plain_eager(runner, on: bool):
    """Eager steps without the compiled pieces (plain PyTorch ops) while `on`."""
    if not on:
        yield
        return
    original = runner._run

    def run(key, fn, inputs, layout):
        graphed = runner.graphs is not None and cuda_graphs.worth_a_graph(
            inputs["ids"].shape[1], True, runner.graph_max_tokens
        )
        if graphed:
            return original(key, fn, inputs, layout)
        FusedKernels.enabled = False
        try:
            with torch.inference_mode():
                return fn(inputs)
        finally:
            FusedKernels.enabled = True

    runner._run = run
    try:
        yield
    finally:
        runner._run = original


def mixed_step(engine: Engine, prompt, rows: int, params: dict) -> tuple[float, int]:
    """(ms, captures) of the step where a new request's first forward joins `rows` rows that
    are inside a block; the rest of the run is then finished."""
    for _ in range(rows):
        engine.add_request(None, prompt, params)
    engine.step()  # their first forward
    engine.step()  # inside the block now
    engine.add_request(None, prompt, params)
    result = timed_step(engine)
    while engine.has_unfinished():
        engine.step()
    return result


def main() -> None:
    args, out, rows, lm, prompt, params = setup(__doc__, "1,2,4", "capture_cost_out")
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def engine(limit: int) -> Engine:
        cfg = EngineConfig(model=f"random:{args.model}", device="cuda", max_rows=16,
                           max_canvas=CANVAS, cuda_graph_max_tokens=limit,
                           phase_wait_steps=0)  # fmt: skip
        return Engine(cfg, loaded=lm)

    warm = engine(0)  # compile the pieces once for the process
    refresh_steps(warm, prompt, 2, params)
    del warm
    for warmups in (2, 1, 0):
        for n in rows:
            e = engine(0)
            e.runner.graphs.warmups = warmups
            first = refresh_steps(e, prompt, n, params)
            caps = [w for w, c in first if c]
            again = [w for w, _ in refresh_steps(e, prompt, n, params)]
            mixed_first = mixed_step(e, prompt, n, params)
            mixed_again = mixed_step(e, prompt, n, params)
            rec = {
                "refresh_capture_ms": round(caps[0], 1) if caps else None,
                "refresh_graph_ms": round(statistics.median(again[1:]), 2),
                "mixed_capture_ms": round(mixed_first[0], 1),
                "mixed_captures": mixed_first[1],
                "mixed_graph_ms": round(mixed_again[0], 2),
            }
            result[f"warmups{warmups}_rows{n}"] = rec
            print(f"warm-ups {warmups} rows {n}: {rec}", flush=True)
            del e
    for plain in (False, True):
        for n in rows:
            e = engine(1)  # every whole-sequence step eagerly
            with plain_eager(e.runner, plain):
                refresh_steps(e, prompt, n, params)
                walls = [w for w, _ in refresh_steps(e, prompt, n, params)]
                mixed_step(e, prompt, n, params)
                mixed = [mixed_step(e, prompt, n, params)[0] for _ in range(3)]
            rec = {
                "refresh_eager_ms": round(statistics.median(walls[1:]), 2),
                "mixed_eager_ms": round(statistics.median(mixed), 2),
            }
            result[f"eager_{'plain' if plain else 'compiled'}_rows{n}"] = rec
            print(f"eager {'plain' if plain else 'compiled'} rows {n}: {rec}", flush=True)
            del e
    import cProfile
    import io
    import pstats

    for plain in (False, True):  # where an eager refresh step's host time goes
        e = engine(1)
        with plain_eager(e.runner, plain):
            refresh_steps(e, prompt, 2, params)
            prof = cProfile.Profile()
            prof.enable()
            refresh_steps(e, prompt, 2, params)
            prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        result[f"cprofile_{'plain' if plain else 'compiled'}"] = buf.getvalue()
        print(buf.getvalue()[:6000], flush=True)
        del e
    (out / "capture_cost.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
