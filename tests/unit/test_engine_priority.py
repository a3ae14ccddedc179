"""Request `priority`: waiting requests are admitted lowest value first, in arrival
order among equals; a running row is never preempted; priority never changes a request's tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dlm_engine import Engine, EngineConfig, InvalidRequestError
from dlm_lab.testing import SAMPLE_PROMPTS


def _prompt(engine: Engine, i: int) -> list[int]:
    text = SAMPLE_PROMPTS[i % len(SAMPLE_PROMPTS)]
    return engine.encode_prompt(messages=[{"role": "user", "content": text}])


def _params(i: int, priority: int | None = None) -> dict[str, Any]:
    params: dict[str, Any] = dict(
        max_tokens=8, steps=4, temperature=0.8, seed=100 + i, suppress_eos=True
    )
    if priority is not None:
        params["priority"] = priority
    return params


def _run(engine: Engine, late: dict[int, tuple[str, int]] | None = None):
    """Step until idle: (request ids in the order they started running, final token ids,
    the running set after each step). `late` adds (id, priority) requests at a step."""
    order: list[str] = []
    finals: dict[str, list[int]] = {}
    running: list[set[str]] = []
    step = 0
    while engine.has_unfinished():
        outs = engine.step()
        for out in outs:
            if out.finished:
                finals[out.request_id] = out.token_ids
        now = [s.request_id for s in engine.scheduler.running]
        # a row that finished within its first step is only in that step's outputs
        order += [
            rid for rid in dict.fromkeys([o.request_id for o in outs] + now) if rid not in order
        ]
        running.append(set(now))
        step += 1
        if late and step in late:
            rid, priority = late[step]
            i = int(rid[1:])
            engine.add_request(rid, _prompt(engine, i), _params(i, priority))
    return order, finals, running


# arrival order r0..r5 and their priorities: admitted by (priority, arrival)
PRIORITIES = [0, 5, -3, 0, -3, 10]
WANT = ["r2", "r4", "r0", "r3", "r1", "r5"]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_one_row_admits_by_priority_then_arrival(ckpt_dir: dict[str, Path], family: str) -> None:
    engine = Engine(EngineConfig(model=str(ckpt_dir[family]), max_rows=1))
    for i, priority in enumerate(PRIORITIES):
        engine.add_request(f"r{i}", _prompt(engine, i), _params(i, priority))
    order, finals, running = _run(engine)
    assert order == WANT
    assert all(len(r) <= 1 for r in running)  # max_rows still holds
    # the same requests run alone, without a priority: the same tokens
    alone = Engine(EngineConfig(model=str(ckpt_dir[family]), max_rows=1))
    for i in range(len(PRIORITIES)):
        want = alone.generate([_prompt(alone, i)], _params(i))[0].token_ids
        assert finals[f"r{i}"] == want, i


def test_equal_priorities_are_fifo(ckpt_dir: dict[str, Path]) -> None:
    engine = Engine(EngineConfig(model=str(ckpt_dir["llada"]), max_rows=1))
    for i in range(4):
        engine.add_request(f"r{i}", _prompt(engine, i), _params(i, 7 if i % 2 else None))
    # r0, r2 default to 0; r1, r3 have 7
    assert _run(engine)[0] == ["r0", "r2", "r1", "r3"]
    engine = Engine(EngineConfig(model=str(ckpt_dir["llada"]), max_rows=1))
    for i in range(4):
        engine.add_request(f"r{i}", _prompt(engine, i), _params(i))
    assert _run(engine)[0] == ["r0", "r1", "r2", "r3"]


def test_a_late_urgent_request_waits_for_the_running_row(ckpt_dir: dict[str, Path]) -> None:
    """Strict priority over the waiting queue, never preemption of a running row."""
    engine = Engine(EngineConfig(model=str(ckpt_dir["llada"]), max_rows=1))
    for i in range(3):
        engine.add_request(f"r{i}", _prompt(engine, i), _params(i))
    order, finals, running = _run(engine, late={1: ("r3", -100)})  # r0 running, r1, r2 wait
    assert order == ["r0", "r3", "r1", "r2"]
    r0_steps = [i for i, r in enumerate(running) if "r0" in r]
    assert r0_steps == list(range(len(r0_steps))) and len(r0_steps) > 1  # never preempted
    alone = Engine(EngineConfig(model=str(ckpt_dir["llada"]), max_rows=1))
    for i in (0, 3):
        assert finals[f"r{i}"] == alone.generate([_prompt(alone, i)], _params(i))[0].token_ids


@pytest.mark.parametrize("value", [101, -101, 1.5, "1", True])
def test_a_bad_priority_names_the_field(engines: dict[str, Engine], value: Any) -> None:
    engine = engines["llada"]
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(None, _prompt(engine, 0), _params(0, value))
    assert err.value.field == "priority"
    assert str(err.value).startswith("invalid request: priority: ")
    assert engine.resolve_params({"priority": -100}).priority == -100
    assert engine.resolve_params({}).priority == 0


def test_priority_reaches_the_engine_from_every_surface() -> None:
    """The proxy body field, a Triton `generate` request parameter, the sampling tensor and the
    CLI flag all carry the contract's key unchanged (n > 1: every choice keeps it)."""
    import numpy as np

    from dlm_triton.backend.request_parse import parse_request
    from dlm_triton.launch import cli
    from openai_proxy.config import ProxyConfig
    from openai_proxy.converters import sampling_parameters
    from openai_proxy.schemas import ChatCompletionRequest

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "priority": -5, "n": 2}
    req = ChatCompletionRequest.model_validate(chat)
    for choice in (0, 1):
        assert sampling_parameters(req, choice, ProxyConfig())["priority"] == -5
    inputs = {"text_input": np.array([[b"hi"]], dtype=object)}
    assert parse_request(inputs, '{"priority": 3}').sampling == {"priority": 3}
    args = cli.build_parser().parse_args(["generate", "hi", "--priority", "-7"])
    assert cli._sampling(args) == {"priority": -7}
