"""Where a denoising step makes the host wait for the GPU.

    python benchmarks/gpu_check_syncs.py     # one line per case; exits 1 on an unexpected wait

A step queues its forward (one CUDA graph replay) and then the commit rule's kernels; the host
should wait once, for the small copy of the committed windows at the end of
`ModelRunner.step`. Any other synchronising call made after the forward is queued stalls the
host until the forward has finished, and every kernel launched after it then runs serially
behind it (a Python scalar put by tensor index is such a call).

Runs tiny random LLaDA and Dream checkpoints on CUDA (graphs captured as served) with
`torch.cuda.set_sync_debug_mode("warn")`, every decoding algorithm alone and all in one batch,
and lists each synchronising call with its source line and whether it came before or after
the forward. Waits that an algorithm's published control flow needs are allowed by name
(Dream `origin` draws one random number per masked position; `alg_temp` samples a count).
"""

from __future__ import annotations

import argparse
import linecache
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch

from dlm_engine import Engine, EngineConfig
from dlm_lab.testing import SAMPLE_PROMPTS, make_tiny_checkpoint

LLADA_CASES = {
    "low_confidence": dict(steps=16),
    "threshold": dict(threshold=0.9),
    "factor": dict(algorithm="factor", factor=1.0),
    "local_leap": dict(steps=16, use_local_leap=True),
    "entropy_threshold": dict(algorithm="entropy_threshold", threshold=0.5),
    "multi_block": dict(multi_block=True, threshold=0.5),
    "suppress_eos": dict(steps=16, suppress_eos=True),
    "temperature": dict(steps=16, temperature=0.7, seed=1),
    "prefix cache": dict(steps=16, cache="prefix"),
    "dual cache": dict(steps=16, cache="dual"),
}
DREAM_CASES = {
    "entropy": dict(steps=16, algorithm="entropy"),
    "maskgit_plus": dict(steps=16, algorithm="maskgit_plus"),
    "threshold": dict(threshold=0.9),
    "entropy_threshold": dict(algorithm="entropy_threshold", threshold=0.5),
    "multi_block": dict(multi_block=True, threshold=0.5),
    "dual cache": dict(steps=16, cache="dual"),
}
# waits the published loops need (a count or a draw that decides the next kernel's shape)
ALLOWED_AFTER = ("origin", "alg_temp")


def _case_params(params: dict) -> dict:
    return dict(params, max_tokens=32, block_length=8)


def record(engine: Engine, batch: list[dict]) -> list[tuple[str, str]]:
    """Run `batch` (one request each) to the end; (phase, 'file:line  source') per sync."""
    runner = engine.runner
    phase = ["host"]
    seen: list[tuple[str, str]] = []
    orig_run, orig_take = runner._run, runner._take_lookahead

    def run(*args, **kwargs):
        out = orig_run(*args, **kwargs)
        phase[0] = "after forward"
        return out

    def take(*args, **kwargs):  # a forward queued by the last step counts as this step's
        ahead = orig_take(*args, **kwargs)
        if ahead is not None:
            phase[0] = "after forward"
        return ahead

    runner._run, runner._take_lookahead = run, take
    try:
        for i, params in enumerate(batch):
            engine.add_request(None, engine.encode_prompt(text=SAMPLE_PROMPTS[i % 4]), params)
        steps = 0

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            if "synchroniz" in str(message):
                src = linecache.getline(filename, lineno).strip()
                where = f"{Path(filename).name}:{lineno}  {src}"
                if "the one copy" in src:  # the GPU is idle from here on: waits cost nothing
                    phase[0] = "the step's copy"
                seen.append((phase[0] if steps >= 2 else "warm-up", where))
                if "the one copy" in src:
                    phase[0] = "after the copy"

        while engine.has_unfinished():
            phase[0] = "before forward"
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show  # the phase at the moment of the wait
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    engine.step()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            steps += 1
    finally:
        runner._run, runner._take_lookahead = orig_run, orig_take
    return seen


def unexpected(seen: list[tuple[str, str]]) -> list[str]:
    """Syncs after the forward other than the step's one host copy and the allowed ones."""
    bad = []
    for phase, where in seen:
        if phase != "after forward":
            continue
        if any(a in where for a in ALLOWED_AFTER):
            continue
        bad.append(where)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA: set_sync_debug_mode only sees CUDA synchronisations")
        return 2
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for family, cases in (("llada", LLADA_CASES), ("dream", DREAM_CASES)):
            ckpt = make_tiny_checkpoint(Path(tmp) / family, family)
            engine = Engine(EngineConfig(model=str(ckpt), device=args.device, max_rows=16))
            runs = {name: [_case_params(p)] for name, p in cases.items()}
            runs["all in one batch"] = [_case_params(p) for p in cases.values()]
            for name, batch in runs.items():
                seen = record(engine, batch)
                bad = unexpected(seen)
                failures += bool(bad)
                counts = Counter(p for p, _ in seen)
                status = "ok" if not bad else "UNEXPECTED WAIT"
                print(f"{family:<6}{name:<20}{status:<16}{dict(counts)}", flush=True)
                for where, n in Counter(bad).items():
                    print(f"      {n:>4}x after forward: {where}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
