"""DiffusionGemma (tiny random checkpoint in the published layout) served by the real
tritonserver behind the OpenAI proxy: the `openai` client's text equals the engine's own for
the same seed and settings, streaming delivers the same text, usage reports the decoder
forwards, keys that do not apply get a 400 naming the field and images a 400."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from proxy_fixtures import ProxyProcess

from dlm_engine.config import EngineConfig
from dlm_engine.engine import Engine
from dlm_lab.testing_diffusion_gemma import make_tiny_diffusion_gemma

MESSAGES = [{"role": "user", "content": "Sort 4 2 9."}]


@pytest.fixture(scope="module")
def dg_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "tiny-dg", canvas_length=16)


def test_diffusion_gemma_through_triton_and_the_proxy(server_factory, dg_checkpoint, tmp_path):
    server = server_factory(dg_checkpoint, name="tiny-diffusiongemma")
    proxy = ProxyProcess([server.urls["grpc"]], log_path=tmp_path / "proxy.log").start()
    try:
        client = proxy.client()
        engine = Engine(EngineConfig(model=str(dg_checkpoint), device="cpu"))
        prompt = engine.encode_prompt(messages=MESSAGES)
        keys = {"seed": 7, "max_tokens": 40, "stop_entropy": 0.3, "stability_threshold": 0}
        want = engine.generate([prompt], keys)[0]
        assert want.text and want.completion_tokens > 0  # a real answer to compare
        extra = {k: v for k, v in keys.items() if k != "max_tokens"}
        got = client.chat.completions.create(
            model=server.model_name, messages=MESSAGES, max_tokens=40, extra_body=extra
        )
        assert got.choices[0].message.content == want.text
        assert got.choices[0].finish_reason == want.finish_reason
        assert got.usage.completion_tokens == want.completion_tokens
        assert got.usage.model_extra["forwards"] == want.steps  # decoder forwards
        stream = client.chat.completions.create(
            model=server.model_name,
            messages=MESSAGES,
            max_tokens=40,
            extra_body=extra,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == want.text
        for bad, field in (({"temperature": 0.7}, "temperature"), ({"t_max": 0.1}, "t_max")):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(
                    model=server.model_name, messages=MESSAGES, max_tokens=8, extra_body=bad
                )
            assert field in str(err.value)
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        with pytest.raises(openai.BadRequestError):  # text only: images are refused
            client.chat.completions.create(
                model=server.model_name,
                messages=[{"role": "user", "content": [image]}],
                max_tokens=8,
            )
    finally:
        proxy.stop()
