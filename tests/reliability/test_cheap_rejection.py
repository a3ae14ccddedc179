"""Oversized inputs are rejected before expensive work.

Structural checks: the byte cap derived from the token limit rejects before the tokenizer is
called and never rejects a prompt that fits; large requests are accepted on a worker thread,
small ones inline, so a small request never waits behind a large one. The flood test sends 8
concurrent 1 MB prompts to Triton beside a normal request and prints the latency ratio that
docs/reliability.md records (timings are not asserted: CI machines differ 5x in speed).
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from dlm_client import DLMClient

from dlm_engine import Engine, EngineConfig
from dlm_engine.errors import InvalidRequestError
from dlm_engine.prompt_limits import longest_token_bytes
from dlm_lab.testing import make_tiny_checkpoint
from dlm_triton.backend.intake import INLINE_BYTES, Intake, input_bytes
from dlm_triton.launch.launcher import TritonServerProcess


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("cap") / "llada", "llada", seed=1)
    return Engine(EngineConfig(model=str(ckpt), max_prompt=256))


def test_byte_cap_rejects_before_tokenizing(engine: Engine, monkeypatch) -> None:
    def never(*_a, **_k):
        raise AssertionError("the tokenizer ran on an oversized prompt")

    monkeypatch.setattr(engine.tokenizer, "encode", never)
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", never)
    big = "x" * (engine.prompt_byte_cap + 1)
    with pytest.raises(InvalidRequestError, match="invalid request: text_input: prompt is"):
        engine.encode_prompt(text=big)
    with pytest.raises(InvalidRequestError, match="invalid request: messages: prompt is"):
        engine.encode_prompt(messages=[{"role": "user", "content": big}])
    multibyte = "é" * (engine.prompt_byte_cap // 2 + 1)  # counted in UTF-8 bytes
    with pytest.raises(InvalidRequestError, match="bytes"):
        engine.encode_prompt(text=multibyte)


def test_byte_cap_never_rejects_a_prompt_that_fits(engine: Engine) -> None:
    """The longest vocabulary entry, repeated to the token limit: under the cap."""
    vocab = engine.tokenizer.get_vocab()
    longest = max(
        (t for t in vocab if t != engine.mask_token), key=lambda t: len(t.encode("utf-8"))
    )
    assert len(longest.encode()) <= longest_token_bytes(engine.tokenizer)
    text = longest * engine.config.max_prompt
    assert len(text.encode()) <= engine.prompt_byte_cap
    ids = engine.encode_prompt(text=text)  # may be cut by the token check, never by bytes
    assert len(ids) <= engine.config.max_prompt


def test_large_requests_are_accepted_off_the_request_thread() -> None:
    intake = Intake()
    where: dict[str, int] = {}
    done = threading.Event()
    small = {"text_input": np.array([[b"hi"]], dtype=np.object_)}
    large = {"text_input": np.array([[b"x" * (INLINE_BYTES + 1)]], dtype=np.object_)}
    assert input_bytes(small) == 2 and input_bytes(large) == INLINE_BYTES + 1

    def record(name: str) -> None:
        where[name] = threading.get_ident()
        if name == "large":
            done.set()

    intake.accept(large, lambda: record("large"))
    intake.accept(small, lambda: record("small"))
    assert done.wait(5)
    intake.shutdown()
    assert where["small"] == threading.get_ident() != where["large"]
    assert intake.offloaded == 1


@pytest.mark.integration
def test_flood_of_megabyte_prompts_beside_a_normal_request(stack: TritonServerProcess) -> None:
    client = DLMClient(stack.urls["grpc"], stack.model_name, http_url=stack.urls["http"])
    normal = {"max_tokens": 16, "steps": 8}

    def timed() -> tuple[float, str]:
        t0 = time.monotonic()
        text = client.generate("What is 2+2?", **normal).text
        return time.monotonic() - t0, text

    expected = timed()[1]
    idle = statistics.median(timed()[0] for _ in range(3))
    megabyte = "word " * (1 << 18)  # 1.25 MB

    def big(mb: int = 1) -> str:
        try:
            client.generate(megabyte * mb, max_tokens=8)
        except Exception as exc:
            return str(exc)
        return "accepted"

    with ThreadPoolExecutor(9) as pool:
        flood = [pool.submit(big) for _ in range(8)]
        time.sleep(0.05)  # the big ones go out first
        busy, text = pool.submit(timed).result(timeout=120)
        errors = [f.result(timeout=120) for f in flood]
    assert text == expected
    for error in errors:
        assert "invalid request: text_input: prompt is" in error and "bytes" in error, error
    t0 = time.monotonic()
    assert "bytes" in big(8)  # one 10 MB prompt straight to Triton
    ten_mb_s = time.monotonic() - t0
    print(f"\nnormal request: idle {idle:.3f}s, beside 8 x 1.25 MB prompts {busy:.3f}s "
          f"(ratio {busy / idle:.2f}); one 10 MB prompt rejected in {ten_mb_s:.3f}s")  # fmt: skip
