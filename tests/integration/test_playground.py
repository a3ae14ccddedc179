"""The playground in a real browser against the real stack: Debian's Chromium driven by
Playwright, the proxy as a subprocess, tritonserver serving the embedded tiny-dlm.

Chromium comes from apt (installed here when missing: Playwright's own browser download does
not work on these machines). Screenshots go to $DLM_SCREENSHOTS_DIR when set
(`DLM_SCREENSHOTS_DIR=docs pytest tests/integration/test_playground.py` refreshes the README's).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import tritonclient.grpc as grpcclient
from chromium_setup import LAUNCH_ARGS, ensure_chromium
from embedded_server import embedded_server as serve_embedded
from proxy_fixtures import ProxyProcess

from dlm_triton.launch.launcher import TritonServerProcess

pytestmark = pytest.mark.integration
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-dlm"
PROMPT = "Reverse the word diffusion."
# Four blocks of 8 positions, one commit per step: a canvas that visibly settles block by block.
SETTINGS = {"max_tokens": 32, "steps": 32, "block_length": 8, "temperature": 0}
WAIT_MS = 60_000  # caps that only catch hangs
XSS = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script>'

# Records every frame the page paints in panel A while it runs: (frame, grid text, masked).
RECORD_FRAMES = """() => {
  window.__frames = [];
  const panel = document.querySelector('#panel-a');
  new MutationObserver(() => {
    if (panel.dataset.state !== 'running' || panel.dataset.frame === '0') return;
    const grid = panel.querySelector('.grid');
    window.__frames.push([panel.dataset.frame, grid.textContent,
                          grid.querySelectorAll('.cell.masked').length]);
  }).observe(panel, {attributes: true, attributeFilter: ['data-frame']});
}"""


@pytest.fixture(scope="module")
def tiny_dlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServerProcess]:
    with serve_embedded(tmp_path_factory.mktemp("playground-triton"), ready_timeout_s=180) as s:
        yield s


@pytest.fixture(scope="module")
def proxy(tiny_dlm: TritonServerProcess, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("playground-proxy") / "proxy.log"
    p = ProxyProcess([tiny_dlm.urls["grpc"]], log_path=log).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable, why = ensure_chromium()
    if executable is None:
        pytest.skip(why)
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(executable), args=LAUNCH_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture()
def page(browser: Any, proxy: ProxyProcess) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(WAIT_MS)
    pg.errors = []
    pg.on("pageerror", lambda exc: pg.errors.append(str(exc)))
    pg.on("console", lambda msg: msg.type == "error" and pg.errors.append(msg.text))
    pg.goto(proxy.base_url + "/")
    pg.wait_for_selector("body[data-ready=true]")
    try:
        yield pg
    finally:
        context.close()


def fill_settings(page: Any, panel: str, settings: dict[str, Any]) -> None:
    for name, value in settings.items():
        field = page.locator(f"#settings-{panel} [data-param={name}]")
        if field.evaluate("el => el.tagName") == "SELECT":
            field.select_option(str(value))
        else:
            field.fill(str(value))


def send(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def wait_done(page: Any, panel: str = "a", state: str = "done") -> None:
    page.wait_for_selector(f"#panel-{panel}[data-state={state}]")


def stat(page: Any, panel: str, name: str) -> str:
    return page.locator(f"#panel-{panel} dd[data-stat='{name}']").inner_text()


def api_stream(proxy: ProxyProcess, messages: list[dict[str, str]], settings: dict[str, Any]):
    """(text, last canvas, forwards) of the same request through the official client."""
    params = dict(settings)
    temperature = params.pop("temperature", None)
    text, canvas, forwards = "", None, 0
    for chunk in proxy.client().chat.completions.create(
        model=MODEL,
        messages=messages,
        stream=True,
        temperature=temperature,
        max_tokens=params.pop("max_tokens"),
        extra_body={**params, "stream_mode": "denoise"},
    ):
        if not chunk.choices:
            continue
        text += chunk.choices[0].delta.content or ""
        extra = chunk.choices[0].model_extra or {}
        if extra.get("canvas") is not None:
            canvas, forwards = extra["canvas"], extra["steps"]
    return text, canvas, forwards


def screenshot(page: Any, name: str, tmp_path: Path) -> None:
    page.screenshot(path=str(tmp_path / name), full_page=True)
    target = os.environ.get("DLM_SCREENSHOTS_DIR")
    if target:
        page.screenshot(path=str(ROOT / target / name), full_page=True)


def test_canvas_settles_and_matches_the_api(
    page: Any, proxy: ProxyProcess, tiny_dlm: TritonServerProcess, tmp_path: Path
):
    models = [m.id for m in proxy.client().models.list().data]
    assert page.locator("#settings-a [data-param=model] option").all_inner_texts() == models
    # The controls carry the server's limits: max_tokens up to the model's max_canvas.
    with urllib.request.urlopen(proxy.base_url + "/v1/limits", timeout=10) as resp:
        limits = json.load(resp)["data"][0]
    config = grpcclient.InferenceServerClient(tiny_dlm.urls["grpc"]).get_model_config(
        MODEL, as_json=True
    )["config"]
    assert limits["max_tokens"] == int(config["parameters"]["max_canvas"]["string_value"])
    for name in ("max_tokens", "steps", "block_length"):
        field = page.locator(f"#settings-a [data-param={name}]")
        assert field.get_attribute("max") == str(limits["max_tokens"])
    fill_settings(page, "a", SETTINGS)
    page.evaluate(RECORD_FRAMES)
    send(page, PROMPT)
    wait_done(page)

    frames = page.evaluate("window.__frames")
    distinct = {grid for _, grid, _ in frames}
    assert len(distinct) >= 3, frames
    masked = [m for _, _, m in frames]
    assert masked == sorted(masked, reverse=True) and masked[0] > masked[-1]

    answer = page.locator("#panel-a .answer").inner_text()
    reference = proxy.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=SETTINGS["max_tokens"],
        temperature=0,
        extra_body={k: SETTINGS[k] for k in ("steps", "block_length")},
    )
    assert answer == reference.choices[0].message.content
    assert page.locator("#history .msg.assistant .content").inner_text() == answer

    # The page's last canvas and NFE are the API's for the same request.
    text, canvas, forwards = api_stream(proxy, [{"role": "user", "content": PROMPT}], SETTINGS)
    assert text == answer
    cells = page.locator("#panel-a .grid .cell")
    assert cells.count() == len(canvas) == SETTINGS["max_tokens"]
    assert int(stat(page, "a", "NFE")) == forwards <= SETTINGS["steps"]
    tokens = reference.usage.completion_tokens
    assert float(stat(page, "a", "tokens / forward")) == pytest.approx(tokens / forwards, abs=0.006)
    assert stat(page, "a", "first stable text").endswith(" ms")
    assert stat(page, "a", "finish") == reference.choices[0].finish_reason
    # Special tokens in the canvas (<|eot_id|>, ...) show as text, not as markup.
    assert any(t and t.startswith("<|") for t in canvas)
    assert page.locator("#panel-a .grid .cell", has_text="<|").count() >= 1

    # Replay: the slider walks back to a half-masked canvas, then forward to the end.
    slider = page.locator("#panel-a .slider")
    assert slider.is_enabled()
    last = int(slider.get_attribute("max"))
    slider.fill(str(max(1, last // 3)))
    mid_masked = page.locator("#panel-a .grid .cell.masked").count()
    assert mid_masked > 0
    assert page.locator("#panel-a .grid .cell.in-block").count() > 0
    screenshot(page, "playground_denoising.png", tmp_path)
    slider.fill(str(last))
    assert page.locator("#panel-a .grid .cell.masked").count() < mid_masked
    screenshot(page, "playground_finished.png", tmp_path)
    assert page.errors == []


def test_compare_mode_runs_two_settings_side_by_side(page: Any, proxy: ProxyProcess):
    fast = {**SETTINGS, "steps": 4, "block_length": 32}
    page.check("#compare")
    fill_settings(page, "a", SETTINGS)
    fill_settings(page, "b", fast)
    send(page, PROMPT)
    wait_done(page, "a")
    wait_done(page, "b")
    messages = [{"role": "user", "content": PROMPT}]
    for panel, settings in (("a", SETTINGS), ("b", fast)):
        text, _, forwards = api_stream(proxy, messages, settings)
        assert page.locator(f"#panel-{panel} .answer").inner_text() == text
        assert int(stat(page, panel, "NFE")) == forwards
    assert int(stat(page, "b", "NFE")) <= 4
    # Only answer A goes on into the conversation; B is shown for comparison.
    assert page.locator("#history .msg.assistant").count() == 2
    assert (
        page.locator("#history .msg.assistant .role")
        .all_text_contents()[1]
        .endswith("(B, not kept)")
    )
    assert page.errors == []


@pytest.mark.parametrize(
    "bad",
    [{"temperature": 3}, {"max_tokens": 32, "block_length": 5}],
    ids=["schema-range", "model-side-check"],
)
def test_validation_errors_show_as_the_api_gives_them(
    page: Any, proxy: ProxyProcess, bad: dict[str, Any]
):
    fill_settings(page, "a", bad)
    send(page, PROMPT)
    wait_done(page, "a", "error")
    shown = page.locator("#panel-a .error").inner_text()
    with pytest.raises(openai.BadRequestError) as info:
        params = dict(bad)
        proxy.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            temperature=params.pop("temperature", None),
            max_tokens=params.pop("max_tokens", None),
            stream=True,
            extra_body={**params, "stream_mode": "denoise"},
        )
    error = info.value.body
    assert shown.startswith("400 · invalid_request_error")
    assert shown.endswith(": " + error["message"])
    assert f"param {error['param']}" in shown
    # The failed turn is not kept; its text is back in the box for a retry.
    assert page.locator("#history .msg.assistant").count() == 0
    assert page.input_value("#prompt") == PROMPT


def cancelled_streams(proxy: ProxyProcess) -> float:
    with urllib.request.urlopen(proxy.base_url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("dlm_proxy_triton_streams_cancelled_total "):
                return float(line.split()[1])
    raise AssertionError("no dlm_proxy_triton_streams_cancelled_total in /metrics")


def test_stop_cancels_a_running_answer(page: Any, proxy: ProxyProcess):
    before = cancelled_streams(proxy)
    fill_settings(page, "a", {"max_tokens": 1024, "steps": 1024, "block_length": 1024})
    send(page, PROMPT)
    page.wait_for_selector("#panel-a[data-state=running]:not([data-frame='0'])")
    page.click("#stop")
    wait_done(page, "a", "error")
    assert page.locator("#panel-a .error").inner_text() == "stopped"
    assert page.locator("#panel-a .grid .cell.masked").count() > 0
    assert page.input_value("#prompt") == PROMPT and page.locator("#send").is_enabled()
    # The proxy saw the browser go away and cancelled the Triton stream.
    deadline = time.monotonic() + 30
    while cancelled_streams(proxy) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cancelled_streams(proxy) == before + 1


def test_html_in_messages_model_names_and_errors_renders_as_text(page: Any):
    fill_settings(page, "a", {"max_tokens": 16, "steps": 8})
    send(page, XSS)
    wait_done(page)
    assert page.locator("#history .msg.user .content").inner_text() == XSS
    # A hostile model name comes back inside the API's 404 message.
    page.evaluate(
        """(name) => {
            const select = document.querySelector('#settings-a [data-param=model]');
            const option = document.createElement('option');
            option.value = name; option.textContent = 'hostile';
            select.appendChild(option); select.value = name;
        }""",
        XSS,
    )
    send(page, "hi")
    wait_done(page, "a", "error")
    assert XSS in page.locator("#panel-a .error").inner_text()
    assert page.locator("main img, main script").count() == 0
    assert page.evaluate("window.__xss") is None


# Model output with markup: a script tag and an image whose error handler would run script.
SCRIPT_TAG = "<script>window.__xss=1</script>"
IMG_TAG = '<img src=x onerror="window.__xss=1">'
HOSTILE_CANVAS = [SCRIPT_TAG, IMG_TAG, "<b>bold?</b>", "<|eot_id|>"]


def hostile_denoise_stream() -> str:
    """A denoise SSE stream in the proxy's own shapes (role chunk, one chunk per step with
    `delta.content` = the new stable text and `canvas` / `steps`, finish, usage, [DONE]) whose
    text and canvas frames are markup."""
    base = {"id": "chatcmpl-xss", "object": "chat.completion.chunk", "created": 0,
            "model": MODEL, "system_fingerprint": None, "usage": None}  # fmt: skip
    first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]}  # fmt: skip
    chunks = [first]
    order = [0, 2, 1, 3]  # commit order: position 2 before 1, so step 2 has no stable text
    canvas: list[str | None] = [None] * len(HOSTILE_CANVAS)
    sent = 0
    for step, position in enumerate(order, start=1):
        canvas[position] = HOSTILE_CANVAS[position]
        stable = 0
        while stable < len(canvas) and canvas[stable] is not None:
            stable += 1
        text = "".join(t for t in canvas[:stable] if t != "<|eot_id|>")
        delta, sent = text[sent:], len(text)
        chunks.append({**base, "choices": [{
            "index": 0, "delta": {"content": delta}, "logprobs": None, "finish_reason": None,
            "canvas": list(canvas), "steps": step}]})  # fmt: skip
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "stop"}]})  # fmt: skip
    usage = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "forwards": 4,
             "tokens_per_forward": 1.0}  # fmt: skip
    chunks.append({**base, "choices": [], "usage": usage})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_markup_in_model_output_is_shown_as_text_and_nothing_leaves_the_origin(
    browser: Any, proxy: ProxyProcess
):
    """The model's answer and canvas tokens are markup: the page shows them literally, creates
    no element from them and runs none of them (the page's CSP would also block inline script;
    the DOM checks catch an escaping bug that the CSP would hide). Every request the page makes
    goes to the proxy's own origin."""
    answer = "".join(t for t in HOSTILE_CANVAS if t != "<|eot_id|>")
    origin = urlsplit(proxy.base_url)[:2]
    requested: list[str] = []
    asked: list[dict[str, Any]] = []

    def answer_with_markup(route: Any) -> None:
        asked.append(json.loads(route.request.post_data))
        route.fulfill(
            status=200,
            headers={"content-type": "text/event-stream", "cache-control": "no-cache"},
            body=hostile_denoise_stream(),
        )

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        pg = context.new_page()
        pg.set_default_timeout(WAIT_MS)
        errors: list[str] = []
        pg.on("pageerror", lambda exc: errors.append(str(exc)))
        pg.on("request", lambda request: requested.append(request.url))
        pg.route("**/v1/chat/completions", answer_with_markup)
        pg.goto(proxy.base_url + "/")
        pg.wait_for_selector("body[data-ready=true]")
        elements = "() => [document.querySelectorAll('img').length, document.scripts.length]"
        before = pg.evaluate(elements)
        fill_settings(pg, "a", {"max_tokens": len(HOSTILE_CANVAS), "steps": len(HOSTILE_CANVAS)})
        send(pg, "Say something with HTML in it.")
        wait_done(pg)

        assert asked and asked[0]["stream_mode"] == "denoise" and asked[0]["stream"] is True
        assert pg.locator("#panel-a .answer").inner_text() == answer
        assert pg.locator("#history .msg.assistant .content").inner_text() == answer
        cells = pg.locator("#panel-a .grid .cell")
        assert cells.all_inner_texts() == HOSTILE_CANVAS
        # Every frame redrawn from the slider shows the tokens as text too.
        slider = pg.locator("#panel-a .slider")
        for frame in range(1, int(slider.get_attribute("max")) + 1):
            slider.fill(str(frame))
            shown = [t for t in cells.all_inner_texts() if t != "?"]
            assert set(shown) <= set(HOSTILE_CANVAS) and len(shown) == frame, (frame, shown)
        pg.wait_for_timeout(500)  # time for an injected image's onerror to have fired
        assert pg.evaluate(elements) == before  # no element made from the model's text
        assert pg.evaluate("typeof window.__xss") == "undefined"
        assert errors == []
    finally:
        context.close()
    assert any(urlsplit(url).path.endswith("/v1/chat/completions") for url in requested)
    assert any(urlsplit(url).path == "/v1/models" for url in requested)
    foreign = [url for url in requested if urlsplit(url)[:2] != origin]
    assert foreign == [], f"the page reached beyond {proxy.base_url}: {foreign}"


def test_usable_at_phone_width(browser: Any, proxy: ProxyProcess, tmp_path: Path):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    try:
        pg = context.new_page()
        pg.set_default_timeout(WAIT_MS)
        pg.goto(proxy.base_url + "/playground/")
        pg.wait_for_selector("body[data-ready=true]")
        pg.check("#compare")
        for panel in "ab":
            fill_settings(pg, panel, {"max_tokens": 16, "steps": 8})
        send(pg, PROMPT)
        wait_done(pg, "a")
        wait_done(pg, "b")
        width = pg.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"the page scrolls sideways at phone width ({width}px)"
        for selector in ("#send", "#prompt", "#panel-a .grid", "#panel-b .grid"):
            box = pg.locator(selector).bounding_box()
            assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390
        screenshot(pg, "playground_phone.png", tmp_path)
    finally:
        context.close()


def test_keyed_proxy_page_asks_for_the_key_and_sends_it(
    browser: Any, tiny_dlm: TritonServerProcess, tmp_path: Path
):
    """With API keys the page is off unless enabled (tests/unit/test_proxy_playground.py);
    enabled, it is public but the API behind it is not: the page asks for the key."""
    enabled = ProxyProcess(
        [tiny_dlm.urls["grpc"]],
        ["--api-key", "k1", "--playground", "on"],
        log_path=tmp_path / "p.log",
    ).start()
    context = browser.new_context()
    try:
        pg = context.new_page()
        pg.set_default_timeout(WAIT_MS)
        pg.goto(enabled.base_url + "/playground/")
        error = pg.locator("#load-error")
        error.wait_for(state="visible")
        assert error.inner_text().startswith("401 missing API key")
        pg.click("#auth summary")
        pg.fill("#api-key", "k1")
        pg.press("#api-key", "Tab")  # the key is taken on change
        pg.wait_for_selector("body[data-ready=true]")
        assert error.is_hidden()
        fill_settings(pg, "a", {"max_tokens": 16, "steps": 8})
        send(pg, PROMPT)
        wait_done(pg, "a")
        assert pg.locator("#panel-a .answer").inner_text() != ""
    finally:
        context.close()
        enabled.stop()
