"""DiffusionGemma with a Gemma 4 layout checkpoint (its tool-call markup as special tokens, a chat
template that renders tools) served by the real tritonserver behind the OpenAI proxy, through
the `openai` client: required and named tool calls in Gemma 4's syntax come back as OpenAI
`tool_calls` whose arguments validate, streamed or not, with no markup in the content; a
`denoise` stream shows the canvas being denoised at every step; `logit_bias` bans and forces
tokens as the engine does."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from proxy_fixtures import ProxyProcess

from dlm_engine.config import EngineConfig
from dlm_engine.engine import Engine
from dlm_lab.testing_diffusion_gemma import WEATHER_SCHEMA, make_tiny_diffusion_gemma

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def g4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_diffusion_gemma(
        tmp_path_factory.mktemp("g4") / "tiny-g4", canvas_length=16, chat="gemma4"
    )


def test_gemma4_tool_calls_denoise_and_logit_bias_through_the_proxy(
    server_factory, g4_checkpoint, tmp_path
):
    server = server_factory(g4_checkpoint, name="tiny-diffusiongemma")
    proxy = ProxyProcess([server.urls["grpc"]], log_path=tmp_path / "proxy.log").start()
    try:
        client = proxy.client()
        model = server.model_name
        named = {"type": "function", "function": {"name": "get_weather"}}
        for seed, choice in ((0, "required"), (1, named), (2, "required")):
            got = client.chat.completions.create(
                model=model,
                messages=MESSAGES,
                max_tokens=96,
                seed=seed,
                tools=TOOLS,
                tool_choice=choice,
            )
            c = got.choices[0]
            assert c.finish_reason == "tool_calls" and not c.message.content
            for tc in c.message.tool_calls:
                assert tc.function.name == "get_weather"
                jsonschema.validate(json.loads(tc.function.arguments), WEATHER_SCHEMA)
            # the conversation goes on: the call and its result back through the template
            follow = client.chat.completions.create(
                model=model,
                messages=[
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [tc.model_dump() for tc in c.message.tool_calls],
                    },
                    {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": "20C"},
                ],
                max_tokens=16,
                seed=seed,
                tools=TOOLS,
            )
            assert "<|" not in (follow.choices[0].message.content or "")
        stream = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=96,
            seed=3,
            tools=TOOLS,
            tool_choice="required",
            stream=True,
        )
        content, calls = "", []
        for chunk in stream:
            if chunk.choices:
                content += chunk.choices[0].delta.content or ""
                calls += chunk.choices[0].delta.tool_calls or []
        assert content == "" and calls
        for tc in calls:  # each call comes whole in its chunk
            assert tc.function.name == "get_weather"
            jsonschema.validate(json.loads(tc.function.arguments), WEATHER_SCHEMA)

        # denoise: a frame every step, the canvas in progress shown (no nulls inside it)
        frames, text = [], ""
        for chunk in client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=32,
            seed=4,
            stream=True,
            extra_body={"stream_mode": "denoise"},
        ):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                extra = chunk.choices[0].model_extra or {}
                if extra.get("canvas") is not None:
                    frames.append((extra["steps"], extra["canvas"]))
        plain = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=32, seed=4
        )
        assert text == (plain.choices[0].message.content or "")
        steps = [s for s, _ in frames]
        assert steps == sorted(set(steps)) and len(frames) >= 4
        first = frames[0][1]
        assert len(first) == 32 and all(t is not None for t in first[:16])
        assert all(t is None for t in first[16:])  # the second canvas has not begun
        assert len({tuple(c) for _, c in frames}) > len(frames) // 2  # it moves

        # logit_bias, as the engine applies it
        engine = Engine(EngineConfig(model=str(g4_checkpoint), device="cpu"))
        (q,) = engine.tokenizer.encode("q", add_special_tokens=False)
        forced = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=8,
            seed=5,
            logit_bias={str(q): 100},
        )
        assert forced.choices[0].message.content == "q" * 8
        prompt = engine.encode_prompt(messages=MESSAGES)
        want = engine.generate([prompt], {"seed": 6, "max_tokens": 24, "logit_bias": {"40": -100}})
        banned = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=24,
            seed=6,
            logit_bias={"40": -100},
        )
        assert banned.choices[0].message.content == want[0].text
    finally:
        proxy.stop()
