"""A request's output state (stable text, tool-call text, logprob stream) is one object from
admission to its final output, dropped on every way a request ends: finished, aborted, its row
dropped after a failed step. A leak would grow the engine with every request."""

from __future__ import annotations

from dlm_engine import Engine
from dlm_engine.output_state import OutputState

TOOL = {"type": "function", "function": {"name": "noop", "description": "does nothing"}}
MSG = [{"role": "user", "content": "hi"}]


def _add(eng: Engine, rid: str, params: dict) -> str:
    resolved = eng.resolve_params(params)
    prompt = eng.encode_prompt(messages=MSG, tools=resolved.tools)
    return eng.add_request(rid, prompt, resolved)


def test_one_state_per_request_with_what_it_asked_for(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    _add(eng, "plain", {"max_tokens": 16, "steps": 16})
    _add(eng, "both", {"max_tokens": 16, "steps": 16, "tools": [TOOL], "logprobs": 2})
    states = eng._outputs
    assert set(states) == {"plain", "both"}
    assert isinstance(states["plain"], OutputState)
    assert states["plain"].tools is None and states["plain"].logprobs is None
    assert states["both"].tools is not None and states["both"].logprobs is not None
    finals = {o.request_id: o for o in eng.outputs() if o.finished}
    assert set(finals) == {"plain", "both"} and eng._outputs == {}
    assert finals["both"].logprobs is not None  # the stream still made the entries


def test_every_way_a_request_ends_drops_its_state(engines: dict[str, Engine]) -> None:
    eng = engines["dream"]
    for rid in ("keep", "abort", "drop"):
        _add(eng, rid, {"max_tokens": 32, "steps": 32, "logprobs": 1})
    eng.step()
    eng.abort("abort")
    ended = {o.request_id: o for o in eng.step() if o.finished}
    assert ended["abort"].finish_reason == "abort" and "abort" not in eng._outputs
    dropped = dict(eng.drop_running())  # what the loop does after a failed step
    assert set(dropped) == {"keep", "drop"} and eng._outputs == {}
    assert not eng.has_unfinished()
    again = eng.generate([eng.encode_prompt(messages=MSG)], {"max_tokens": 8, "steps": 8})[0]
    assert again.finished and eng._outputs == {}
