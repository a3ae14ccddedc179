"""Per-request overhead of serving through Triton vs calling the engine in-process.

``python benchmarks/overhead.py --model CKPT_DIR`` runs the same sequential requests both ways
on this machine and prints median latencies; the difference is what Triton, gRPC, the Python
backend's shared memory and our sender thread add per request.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from dlm_triton.launch.launcher import Ports, TritonServerProcess


def engine_latencies(model: Path, prompts: list[str], params: dict) -> list[float]:
    from dlm_engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=str(model), device="cpu"))
    sampling = SamplingParams.from_dict(params)
    times = []
    for i, prompt in enumerate(["warm-up", *prompts]):
        t = time.perf_counter()
        engine.add_request(f"r{i}", engine.encode_prompt(text=prompt), sampling)
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t)
    return times[1:]


def triton_latencies(model: Path, prompts: list[str], params: dict) -> list[float]:
    from dlm_client import DLMClient

    with TritonServerProcess(model, model_name="overhead", device="cpu", ports=Ports.free()) as s:
        client = DLMClient(s.urls["grpc"], s.model_name)
        times = []
        for prompt in ["warm-up", *prompts]:
            t = time.perf_counter()
            client.generate(prompt, **params)
            times.append(time.perf_counter() - t)
    return times[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    params = {"max_tokens": args.max_tokens, "steps": args.steps, "suppress_eos": True}
    prompts = [f"prompt number {i}" for i in range(args.requests)]
    eng = statistics.median(engine_latencies(args.model, prompts, params))
    tri = statistics.median(triton_latencies(args.model, prompts, params))
    print(f"requests={args.requests} max_tokens={args.max_tokens} steps={args.steps}")
    print(f"engine in-process  median {eng * 1e3:8.1f} ms")
    print(f"triton gRPC stream median {tri * 1e3:8.1f} ms")
    print(f"overhead per request      {(tri - eng) * 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
