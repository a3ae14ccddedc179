"""Quality of the embedded tiny-dlm through the engine: exact match vs. decoding speed.

Asks held-out questions (never seen in training, see `dlm_lab/training/tasks.py`) at
temperature 0 through `dlm_engine.Engine`, at 1, 2 and 4 tokens per step (steps =
max_tokens / k, LLaDA low-confidence remasking) and with confidence thresholds 0.9 / 0.7 /
0.5, and reports exact-match accuracy against forwards per request (NFE) and tokens per
forward. All requests of a setting go through the engine together, so it batches them.

    python benchmarks/quality.py                 # 600 prompts, table + docs/quality_tradeoff.png
    python benchmarks/quality.py --n 120 --no-plot
    python benchmarks/quality.py --rephrased --n 120 --only k=1 --no-plot   # unseen wordings
    python benchmarks/quality.py --only k=1 --quantization none,fp8,int4 --no-plot

`--quantization` runs the selected settings once per weight precision (`none` = the model's
own weights), each on the same questions; on the CPU `fp8` and `int4` compute by dequantizing
(bitsandbytes `int8` / `nf4` need CUDA).

It records, it does not assert (tests/unit/test_tiny_dlm_quality.py does).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dlm_engine import Engine, EngineConfig, SamplingParams
from dlm_lab.training import tasks
from dlm_protocol.settings import QUANTIZATIONS

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "dlm_engine" / "assets" / "tiny-dlm"


@dataclass
class Setting:
    """One decoding configuration of the sweep."""

    name: str
    params: dict[str, Any]


@dataclass
class Result:
    """Accuracy and cost of one setting over the whole prompt set."""

    name: str
    params: dict[str, Any]
    accuracy: float
    per_task: dict[str, float]
    mean_nfe: float
    # canvas positions decided per forward (max_tokens / NFE); NaN for block diffusion, which
    # stops after the block holding the end of turn, so its canvas is not max_tokens
    tokens_per_forward: float
    answer_tokens_per_forward: float  # completion tokens (no padding) per forward
    seconds: float
    wrong: list[dict[str, str]] = field(default_factory=list)
    quantization: str | None = None  # weight precision, where the run compared several


def settings(max_tokens: int) -> list[Setting]:
    """The sweep: k tokens a step, then confidence thresholds (steps capped at max_tokens)."""
    out = [
        Setting(f"k={k}", {"max_tokens": max_tokens, "steps": max_tokens // k}) for k in (1, 2, 4)
    ]
    out += [
        Setting(f"threshold={t}", {"max_tokens": max_tokens, "threshold": t})
        for t in (0.9, 0.7, 0.5)
    ]
    return out


def cache_settings(max_tokens: int, block: int = 8) -> list[Setting]:
    """Cached mode's quality cost: blocks of `block`, exact vs prefix vs dual KV caches."""
    return [
        Setting(
            f"{cache} k={k}",
            {
                "max_tokens": max_tokens,
                "steps": max_tokens // k,
                "block_length": block,
                "cache": cache,
            },
        )
        for k in (1, 2)
        for cache in ("none", "prefix", "dual")
    ]


def accel_settings(max_tokens: int, block: int = 8) -> list[Setting]:
    """Each accelerated algorithm over its main threshold, beside k and threshold."""
    mt = {"max_tokens": max_tokens}
    out = [Setting(f"k={k}", dict(mt, steps=max_tokens // k)) for k in (1, 4)]
    out += [Setting(f"threshold={t}", dict(mt, threshold=t)) for t in (0.9, 0.5)]
    out += [Setting(f"factor={f}", dict(mt, algorithm="factor", factor=f)) for f in (0.5, 1, 2, 4)]
    out += [
        Setting(f"entropy_threshold={t}", dict(mt, algorithm="entropy_threshold", threshold=t))
        for t in (0.1, 0.3, 0.6, 1.0)
    ]
    out += [
        Setting(
            f"local_leap={a}", dict(mt, steps=max_tokens, use_local_leap=True, anchor_threshold=a)
        )  # fmt: skip
        for a in (0.9, 0.7, 0.5)
    ]
    out += [
        Setting(f"multi_block={t}", dict(mt, multi_block=True, block_length=block, threshold=t))
        for t in (0.01, 0.1, 0.3, 0.6, 1.0)
    ]
    out += [  # d3LLM's delayed KV cache (cache_delay_iter 2, its LLaDA chat setting; and 1)
        Setting(
            f"multi_block+prefix={t}" + ("" if delay == 2 else f",delay={delay}"),
            dict(
                mt,
                multi_block=True,
                block_length=block,
                threshold=t,
                cache="prefix",
                cache_delay_iter=delay,
            ),  # fmt: skip
        )
        for t in (0.01, 0.1, 0.3, 0.6, 1.0)
        for delay in ((2, 1) if t == 0.01 else (2,))
    ]
    return out


def block_settings(max_tokens: int, block: int = 4) -> list[Setting]:
    """The embedded block-diffusion tiny-sdar (blocks of 4): SDAR's four commit
    rules; `steps` counts per block, so k = block / steps tokens a forward for the static
    rules and at least that many for the dynamic and entropy-bounded ones; then Diffulex's
    multi_bd (several blocks a forward) at buffer sizes 1, 2 and 4."""
    mt = {"max_tokens": max_tokens}
    out = [
        Setting(f"k={k}", dict(mt, algorithm="low_confidence_static", steps=block // k))
        for k in (1, 2, 4)
    ]
    out += [
        Setting(f"threshold={t}", dict(mt, algorithm="low_confidence_dynamic", threshold=t))
        for t in (0.95, 0.9, 0.8, 0.7, 0.5)
    ]
    out += [
        Setting(f"entropy_bounded={e}", dict(mt, algorithm="entropy_bounded", threshold=e))
        for e in (0.1, 0.5, 1.0, 2.0)
    ]
    out += [
        Setting(f"sequential k={k}", dict(mt, algorithm="sequential", steps=block // k))
        for k in (1, 2)
    ]
    out += [  # Diffulex multi-block diffusion at its published thresholds, by buffer size
        Setting(f"multi_bd buffer={b}", dict(mt, algorithm="multi_bd", buffer_size=b))
        for b in (1, 2, 4)
    ]
    return out


def run_setting(
    engine: Engine,
    examples: list[tasks.Example],
    prompts: list[list[int]],
    setting: Setting,
    whole_canvas: bool = True,
) -> Result:
    """All prompts through the engine at once; returns exact match and forwards used.
    `whole_canvas`: every request decodes all of max_tokens (LLaDA, Dream)."""
    params = SamplingParams(temperature=0.0, **setting.params)
    finals: dict[str, Any] = {}
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"q{i}", ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    seconds = time.perf_counter() - t0
    hits: dict[str, list[int]] = {}
    wrong: list[dict[str, str]] = []
    nfe = completion = 0
    for i, ex in enumerate(examples):
        out = finals[f"q{i}"]
        ok = out.text.strip() == ex.answer
        hits.setdefault(ex.task, []).append(int(ok))
        nfe += out.steps
        completion += out.completion_tokens
        if not ok:
            wrong.append({"question": ex.question, "expected": ex.answer, "got": out.text})
    n = len(examples)
    return Result(
        name=setting.name,
        params=setting.params,
        accuracy=sum(sum(v) for v in hits.values()) / n,
        per_task={t: sum(v) / len(v) for t, v in hits.items()},
        mean_nfe=nfe / n,
        tokens_per_forward=setting.params["max_tokens"] * n / nfe if whole_canvas else math.nan,
        answer_tokens_per_forward=completion / nfe,
        seconds=seconds,
        wrong=wrong,
    )


def _cell(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}"


def markdown_table(results: list[Result]) -> str:
    """The table as it goes into docs/benchmarks.md (a precision column where runs carry one)."""
    task_names = list(results[0].per_task)
    precision = any(r.quantization is not None for r in results)
    head = (
        "| setting | "
        + ("precision | " if precision else "")
        + "exact match | NFE / request | tokens / forward | answer tokens / forward | "
        + " | ".join(task_names)
        + " | wall s |"
    )
    sep = "|" + "---|" * (6 + precision + len(task_names))
    rows = [head, sep]
    for r in results:
        tasks_cells = " | ".join(f"{100 * r.per_task[t]:.1f}" for t in task_names)
        precision_cell = f"{r.quantization} | " if precision else ""
        rows.append(
            f"| {r.name} | {precision_cell}**{100 * r.accuracy:.1f}%** | {r.mean_nfe:.2f} | "
            f"{_cell(r.tokens_per_forward)} | {r.answer_tokens_per_forward:.2f} | {tasks_cells} | "
            f"{r.seconds:.0f} |"
        )
    return "\n".join(rows)


def plot(results: list[Result], path: Path, n: int, model: str = "tiny-dlm") -> None:
    """Accuracy against tokens per forward and against NFE (log2 axes); one point a setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    lo = min(100 * r.accuracy for r in results)
    for ax, key, label in (
        (axes[0], "answer_tokens_per_forward", "answer tokens per forward"),
        (axes[1], "mean_nfe", "forwards per request (NFE)"),
    ):
        groups = sorted({r.name.split("=")[0] + "=" for r in results if "=" in r.name})
        legends = {"k=": "k tokens per step", "threshold=": "threshold"}
        for group, marker in zip(groups, "os^vDpx*", strict=False):
            legend = legends.get(group, group.rstrip("="))
            pts = sorted(
                (r for r in results if r.name.startswith(group)), key=lambda r: getattr(r, key)
            )
            xs = [getattr(r, key) for r in pts]
            ys = [100 * r.accuracy for r in pts]
            ax.plot(xs, ys, marker=marker, label=legend)
            # k points are spread out; threshold points cluster, so stack their labels by y
            by_y = sorted(range(len(pts)), key=lambda i: -ys[i])
            for j, i in enumerate(by_y):
                dy = (6 if i % 2 == 0 else -12) if group == "k=" else 10 - 11 * j
                ax.annotate(
                    pts[i].name,
                    (xs[i], ys[i]),
                    textcoords="offset points",
                    xytext=(8, dy),
                    fontsize=8,
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("exact match (%)")
        ax.set_ylim(max(0.0, lo - 5), 100.5)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(loc="lower left")
    fig.suptitle(f"{model}: {n} held-out prompts, T=0, canvas 32, through dlm_engine")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def precisions(value: str) -> list[str]:
    """`--quantization`'s comma list, checked against the engine's schemes (`none` = none)."""
    names = [v.strip() for v in value.split(",")]
    bad = [v for v in names if v not in ("none", *QUANTIZATIONS)]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad} not among none, {', '.join(QUANTIZATIONS)}")
    return names


def main(argv: list[str] | None = None) -> list[Result]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--n", type=int, default=600, help="held-out prompts (tasks interleaved)")
    p.add_argument(
        "--rephrased",
        action="store_true",
        help="ask the held-out problems in wordings training never uses (tasks.REPHRASED_FORMS)",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-rows", type=int, default=100, help="engine rows per step")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument("--only", nargs="*", help="setting names to run (default: all)")
    p.add_argument(
        "--sweep",
        choices=("parallel", "cache", "accel", "block"),
        default="parallel",
        help="parallel: k tokens/step and thresholds; cache: exact vs prefix vs dual KV caches; "
        "accel: LocalLeap, d3LLM entropy threshold / multi-block, Fast-dLLM factor; "
        "block: SDAR's commit rules (with --model dlm_engine/assets/tiny-sdar)",
    )
    p.add_argument(
        "--quantization",
        type=precisions,
        default=None,
        help="comma list of weight precisions, each running the selected settings: none (the "
        "model's own), fp8, int4 (dequantized on CPU); int8, nf4 need CUDA (default: none)",
    )
    p.add_argument("--plot", default=str(ROOT / "docs" / "quality_tradeoff.png"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--from-json", default=None, help="re-render table and plot from a --json file")
    args = p.parse_args(argv)
    if args.from_json:
        results = [Result(**r) for r in json.loads(Path(args.from_json).read_text())]
        print(markdown_table(results))
        if not args.no_plot:
            plot(results, Path(args.plot), args.n)
        return results
    if args.threads:
        torch.set_num_threads(args.threads)

    examples = (tasks.rephrased_examples if args.rephrased else tasks.heldout_examples)(args.n)
    sweeps = {
        "parallel": settings,
        "cache": cache_settings,
        "accel": accel_settings,
        "block": block_settings,
    }
    chosen = [
        s for s in sweeps[args.sweep](args.max_tokens) if not args.only or s.name in args.only
    ]
    results: list[Result] = []
    for precision in args.quantization or [None]:
        engine = Engine(
            EngineConfig(
                model=args.model,
                dtype=args.dtype,
                device=args.device,
                quantization=None if precision in (None, "none") else precision,
                max_rows=args.max_rows,
                max_queue=max(1024, args.n),
            )
        )
        prompts = [engine.encode_prompt(messages=tasks.messages_for(e)) for e in examples]
        print(
            f"{args.n} held-out prompts{' (rephrased)' if args.rephrased else ''}, model "
            f"{args.model} ({engine.loaded.dtype}"
            f"{'' if precision is None else f', weights {precision}'}, {args.device}, "
            f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()})",
            flush=True,
        )
        for s in chosen:
            r = run_setting(engine, examples, prompts, s, whole_canvas=args.sweep != "block")
            r.quantization = precision
            results.append(r)
            print(
                f"{r.name:>14}: exact match {100 * r.accuracy:5.1f}%  NFE {r.mean_nfe:6.2f}  "
                f"answer tokens/forward {r.answer_tokens_per_forward:4.2f}  ({r.seconds:.0f} s)",
                flush=True,
            )
    print()
    print(markdown_table(results))
    plotted = args.quantization is None  # one point a setting: a single precision
    if plotted and not args.no_plot and results and args.sweep in ("parallel", "block"):
        plot(results, Path(args.plot), args.n, Path(args.model).name)
        print(f"\nplot: {args.plot}")
    if args.json:
        rows = [{k: v for k, v in asdict(r).items() if k != "quantization" or v} for r in results]
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
