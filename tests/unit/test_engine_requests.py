"""Abort, limits, and every invalid input: one clear typed error naming the field."""

from __future__ import annotations

import os
import threading

import pytest

from dlm_engine import (
    Engine,
    EngineConfig,
    EngineLoop,
    EngineOverloadedError,
    InvalidRequestError,
    RequestOutput,
)


def _prompt(eng: Engine) -> list[int]:
    return eng.encode_prompt(messages=[{"role": "user", "content": "hi"}])


def test_abort_leaves_before_next_step(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    p = _prompt(eng)
    eng.add_request("keep", p, dict(max_tokens=16, steps=16))
    eng.add_request("drop", p, dict(max_tokens=16, steps=16))
    eng.step()
    eng.abort("drop")
    outs = eng.step()
    aborted = [o for o in outs if o.request_id == "drop"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert eng.last_step_rows == 1
    while eng.has_unfinished():
        outs = eng.step()
    alone = eng.generate([p], dict(max_tokens=16, steps=16))[0]
    assert alone.finish_reason in ("stop", "length")


BAD = [
    ({"steps": 0}, "steps"),
    ({"max_tokens": 8, "steps": 9}, "steps"),
    ({"max_tokens": 30, "block_length": 8}, "block_length"),
    ({"max_tokens": 32, "block_length": 8, "steps": 6}, "steps"),
    ({"algorithm": "greedy"}, "algorithm"),
    ({"threshold": 0.0}, "threshold"),
    ({"threshold": 1.5}, "threshold"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stream_mode": "tokens"}, "stream_mode"),
    ({"cache": "paged"}, "cache"),
    ({"bogus": 1}, "bogus"),
    ({"seed": -1}, "seed"),
    ({"steps": True}, "steps"),
]


@pytest.mark.parametrize(("params", "field"), BAD, ids=[f for _, f in BAD])
def test_invalid_params_name_the_field(
    engines: dict[str, Engine], params: dict, field: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engines["llada"].resolve_params(params)
    assert err.value.field == field
    assert str(err.value).startswith(f"invalid request: {field}: ")


def test_family_specific_params(engines: dict[str, Engine]) -> None:
    with pytest.raises(InvalidRequestError, match="algorithm"):
        engines["llada"].resolve_params({"algorithm": "origin"})
    with pytest.raises(InvalidRequestError, match="cfg_scale"):
        engines["dream"].resolve_params({"cfg_scale": 1.0})


def test_invalid_prompts(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    cases = [
        (dict(text=""), "text_input"),
        (dict(text="fill <|mdm_mask|> here"), "text_input"),
        (dict(messages=[{"role": "user", "content": "a <|mdm_mask|>"}]), "messages"),
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), "messages"),
        (dict(messages=[{"role": "user"}]), "messages"),
        (dict(input_ids=[1, 2, eng.mask_id]), "input_ids"),
        (dict(input_ids=[1, -5]), "input_ids"),
        (dict(input_ids=["a"]), "input_ids"),
        (dict(text="x" * 5000), "text_input"),
        (dict(text="a", input_ids=[1]), "prompt"),
        (dict(), "prompt"),
    ]
    for kwargs, field in cases:
        with pytest.raises(InvalidRequestError) as err:
            eng.encode_prompt(**kwargs)
        assert err.value.field == field, kwargs


def test_bad_request_does_not_harm_running_rows(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    p = _prompt(eng)
    expected = eng.generate([p], dict(max_tokens=16, steps=16))[0].token_ids
    eng.add_request("good", p, dict(max_tokens=16, steps=16))
    eng.step()
    with pytest.raises(InvalidRequestError):
        eng.add_request("bad", p, dict(max_tokens=16, steps=17))
    with pytest.raises(InvalidRequestError):
        eng.add_request("good", p, dict(max_tokens=16, steps=16))
    final = None
    while eng.has_unfinished():
        for o in eng.step():
            final = o if o.finished else final
    assert final is not None and final.token_ids == expected


def test_queue_limit_overload(ckpt_dir) -> None:
    eng = Engine(EngineConfig(model=str(ckpt_dir["dream"]), max_rows=1, max_queue=2))
    p = _prompt(eng)
    eng.add_request("1", p, dict(max_tokens=4, steps=4))
    eng.add_request("2", p, dict(max_tokens=4, steps=4))
    with pytest.raises(EngineOverloadedError, match="^overloaded: "):
        eng.add_request("3", p, dict(max_tokens=4, steps=4))


def test_engine_loop_submit_cancel_shutdown(engines: dict[str, Engine]) -> None:
    eng = engines["dream"]
    loop = EngineLoop(eng)
    p = _prompt(eng)
    done: dict[str, RequestOutput] = {}
    finished = threading.Event()

    def collect(out: RequestOutput) -> None:
        if out.finished:
            done[out.request_id] = out
            if len(done) == 3:
                finished.set()

    try:
        loop.submit("ok", p, eng.resolve_params(dict(max_tokens=16, steps=16)), collect)
        loop.submit("long", p, eng.resolve_params(dict(max_tokens=512, steps=512)), collect)
        loop.submit("dup", p, eng.resolve_params(dict(max_tokens=16, steps=16)), collect)
        loop.cancel("long")
        assert finished.wait(60)
    finally:
        loop.shutdown()
    assert done["ok"].finish_reason in ("stop", "length")
    assert done["long"].finish_reason == "abort"
    assert done["long"].steps < 512
    assert done["dup"].finish_reason in ("stop", "length")


def test_engine_loop_thread_takes_the_torch_threads(engines: dict[str, Engine]) -> None:
    """The Triton model keeps its main thread single-threaded and hands the process's thread
    count to the engine thread (dlm_engine/threads.py: worker threads ran 1.5x slower once the
    main thread had run a two-thread op); the loop sets it on its own thread."""
    import torch

    from dlm_engine.threads import hand_threads_to_engine_thread

    before = torch.get_num_threads()
    try:
        handed = hand_threads_to_engine_thread()
        assert handed == before and torch.get_num_threads() == 1
        eng = engines["llada"]
        seen: list[int] = []
        finished = threading.Event()

        def collect(out: RequestOutput) -> None:
            seen.append(torch.get_num_threads())  # runs on the loop's thread
            if out.finished:
                finished.set()

        loop = EngineLoop(eng, torch_threads=handed + 1)
        try:
            loop.submit("t", _prompt(eng), eng.resolve_params(dict(max_tokens=4, steps=4)), collect)
            assert finished.wait(60)
        finally:
            loop.shutdown()
        assert seen and set(seen) == {handed + 1}
        assert torch.get_num_threads() == 1  # the caller's own count is untouched
    finally:
        torch.set_num_threads(before)


def test_a_gpu_engine_thread_takes_a_few_threads() -> None:
    """0 (the default): every thread on the CPU, at most GPU_ENGINE_THREADS on a GPU (replicas
    sharing a host must not each take every core); a configured count wins either way."""
    import torch

    from dlm_engine.threads import GPU_ENGINE_THREADS, engine_threads

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    assert engine_threads(0, 32, cpu) == 32
    assert engine_threads(0, 32, gpu) == GPU_ENGINE_THREADS < 32
    assert engine_threads(0, 2, gpu) == 2
    assert engine_threads(12, 32, gpu) == 12 and engine_threads(3, 32, cpu) == 3
    # tensor-parallel worker ranks on a GPU take the same few threads; on the CPU the caller's
    from types import SimpleNamespace

    from dlm_engine.parallel.start import worker_threads

    cores = os.cpu_count() or 1
    on_gpu = SimpleNamespace(device="cuda:1", engine_threads=0)
    assert worker_threads(on_gpu) == min(cores, GPU_ENGINE_THREADS)
    assert worker_threads(SimpleNamespace(device="cuda", engine_threads=6)) == 6
    assert (
        worker_threads(SimpleNamespace(device="cpu", engine_threads=0)) == torch.get_num_threads()
    )
