"""Locust load for a running dlm-triton stack: chat through the OpenAI proxy, or Triton gRPC direct.

Run headless (``benchmarks/run_load.py`` wraps this for a sweep of user counts)::

    locust -f benchmarks/locustfile.py --headless -u 8 -r 8 -t 60s --host http://localhost:9000

Two user classes (pick one by naming it after the options, or both by weight):

* ``ProxyChatUser``: ``POST /v1/chat/completions`` over plain HTTP, streaming (SSE parsed here)
  or not. Plain ``requests`` rather than Locust's HttpUser client, whose timing stops at the
  response headers of a stream; every number below is an event we fire ourselves.
* ``TritonGrpcUser``: ``tritonclient.grpc`` bidirectional stream to the decoupled model, the
  way the proxy talks to Triton, so the two rows separate proxy cost from engine cost.

Events (Locust ``request`` events; the ``Type`` column of the stats):

* ``E2E``: request start to final response. ``response_length`` is the number of completion
  tokens, so Locust's "Average Content Size" x "Requests/s" is generated tokens/s.
* ``TTFT``: request start to the first non-empty text (streaming requests only). Fired when the
  request completes, so TTFT and E2E cover the same requests (a run that quits mid-request
  records neither for it).

Everything is configured by environment variables (defaults in brackets):

* ``DLM_LOAD_MODEL`` [tiny-dlm]: model name (OpenAI ``model`` and Triton model).
* ``DLM_LOAD_TRITON_GRPC`` [localhost:8001]: Triton gRPC address for ``TritonGrpcUser``.
* ``DLM_LOAD_PROXY_WEIGHT`` [3], ``DLM_LOAD_GRPC_WEIGHT`` [1]: class weights; 0 disables one.
* ``DLM_LOAD_STREAM_FRACTION`` [0.5]: share of requests that stream.
* ``DLM_LOAD_PROMPT_MIX`` [short=3,medium=2,long=1]: weights of the built-in prompt sets.
* ``DLM_LOAD_PROMPTS_FILE``: JSON Lines file of ``{"prompt": str, "weight": float}`` (or plain
  text, one prompt a line) replacing the built-in sets.
* ``DLM_LOAD_MAX_TOKENS`` [32], ``DLM_LOAD_STEPS``, ``DLM_LOAD_BLOCK_LENGTH``,
  ``DLM_LOAD_ALGORITHM``, ``DLM_LOAD_THRESHOLD``, ``DLM_LOAD_TEMPERATURE``, ``DLM_LOAD_CACHE``:
  diffusion settings (unset = the server's default); ``DLM_LOAD_PARAMS``: a JSON object of any
  further sampling keys (docs/api.md), merged last.
* ``DLM_LOAD_WAIT_S`` [0]: think time between a user's requests, uniform in [0, value].
* ``DLM_LOAD_TIMEOUT_S`` [300]: a request slower than this counts as a failure.
* ``DLM_LOAD_API_KEY``: bearer key for the proxy.
* ``DLM_LOAD_STOP_AFTER`` [0]: stop the run once every request kind that can occur (proxy and
  gRPC, streamed and not, as the weights and stream fraction allow) has completed this many
  requests; ``--run-time`` is then only a cap. 0 runs for ``--run-time``.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import gevent
import grpc.experimental.gevent as grpc_gevent
import requests
import tritonclient.grpc as grpcclient
from dlm_client import build_inputs
from locust import User, between, events, task
from locust import stats as locust_stats
from locust.env import Environment

from dlm_protocol import tensors

# Locust runs users as greenlets: gRPC's C core must yield to gevent or one blocked stream
# read would freeze every user in the process. Must run before any channel exists.
grpc_gevent.init_gevent()

BUILTIN_PROMPTS: dict[str, list[str]] = {
    "short": [
        "What is 17 times 23?",
        "Name three primary colours.",
        "Translate 'good morning' into French.",
        "What is the capital of Australia?",
    ],
    "medium": [
        "Explain in a few sentences why the sky is blue.",
        "Write a short poem about a lighthouse keeper who befriends a seagull.",
        "Give three tips for writing clear documentation for a command-line tool.",
        "Describe how a diffusion language model differs from an autoregressive one.",
    ],
    "long": [
        "Summarise the following text in two sentences. "
        + "The city council met on Tuesday to discuss the new public transport plan, which "
        "adds three bus lines, extends tram service into the evening, and introduces a "
        "single ticket valid across all modes. Residents raised concerns about noise from "
        "night trams and the cost of the new ticket, while local businesses welcomed longer "
        "opening hours near stations. The council will vote on the plan next month. " * 3,
        "You are reviewing a pull request. The change replaces a polling loop with an event "
        "queue, moves configuration into environment variables, and adds a health endpoint. "
        "List the risks a reviewer should check, then suggest tests for each. Be specific "
        "about failure modes such as lost events, misconfigured defaults and slow starts.",
    ],
}


def _env_float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name, "").strip()
    return default if raw == "" else float(raw)


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name, "").strip()
    return default if raw == "" else int(raw)


@dataclass
class LoadSettings:
    """The load's knobs, read once from the environment (see the module docstring)."""

    model: str = "tiny-dlm"
    triton_grpc: str = "localhost:8001"
    stream_fraction: float = 0.5
    prompts: list[str] = field(default_factory=list)
    prompt_weights: list[float] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    wait_s: float = 0.0
    timeout_s: float = 300.0
    api_key: str = ""

    @classmethod
    def from_env(cls) -> LoadSettings:
        s = cls(
            model=os.environ.get("DLM_LOAD_MODEL", "tiny-dlm"),
            triton_grpc=os.environ.get("DLM_LOAD_TRITON_GRPC", "localhost:8001"),
            stream_fraction=_env_float("DLM_LOAD_STREAM_FRACTION", 0.5) or 0.0,
            wait_s=_env_float("DLM_LOAD_WAIT_S", 0.0) or 0.0,
            timeout_s=_env_float("DLM_LOAD_TIMEOUT_S", 300.0) or 300.0,
            api_key=os.environ.get("DLM_LOAD_API_KEY", ""),
        )
        s.prompts, s.prompt_weights = _load_prompts()
        params: dict[str, Any] = {"max_tokens": _env_int("DLM_LOAD_MAX_TOKENS", 32)}
        for key, conv in (
            ("steps", _env_int),
            ("block_length", _env_int),
            ("threshold", _env_float),
            ("temperature", _env_float),
        ):
            value = conv(f"DLM_LOAD_{key.upper()}", None)
            if value is not None:
                params[key] = value
        for key in ("algorithm", "cache"):
            value = os.environ.get(f"DLM_LOAD_{key.upper()}", "").strip()
            if value:
                params[key] = value
        params.update(json.loads(os.environ.get("DLM_LOAD_PARAMS", "") or "{}"))
        s.params = params
        return s

    def pick_prompt(self) -> str:
        return random.choices(self.prompts, weights=self.prompt_weights, k=1)[0]


def _load_prompts() -> tuple[list[str], list[float]]:
    """Prompts and weights from DLM_LOAD_PROMPTS_FILE, else the built-in mix."""
    path = os.environ.get("DLM_LOAD_PROMPTS_FILE", "").strip()
    prompts: list[str] = []
    weights: list[float] = []
    if path:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                if line.startswith("{"):
                    item = json.loads(line)
                    prompts.append(str(item["prompt"]))
                    weights.append(float(item.get("weight", 1.0)))
                else:
                    prompts.append(line)
                    weights.append(1.0)
        if not prompts:
            raise ValueError(f"DLM_LOAD_PROMPTS_FILE={path} holds no prompts")
        return prompts, weights
    mix = os.environ.get("DLM_LOAD_PROMPT_MIX", "short=3,medium=2,long=1")
    for part in mix.split(","):
        if not part.strip():
            continue
        name, _, weight = part.partition("=")
        name = name.strip()
        if name not in BUILTIN_PROMPTS:
            raise ValueError(
                f"DLM_LOAD_PROMPT_MIX: unknown set {name!r} ({sorted(BUILTIN_PROMPTS)})"
            )
        share = float(weight or 1.0)
        if share <= 0:
            continue
        group = BUILTIN_PROMPTS[name]
        prompts += group
        weights += [share / len(group)] * len(group)
    if not prompts:
        raise ValueError("DLM_LOAD_PROMPT_MIX selects no prompts")
    return prompts, weights


SETTINGS = LoadSettings.from_env()
# Pause after a failed request so a dead server yields a readable count, not a hot loop.
FAILURE_BACKOFF_S = 0.2
_request_ids = itertools.count()


class _GreenletSafeClient(grpcclient.InferenceServerClient):
    """tritonclient closes its channel in ``__del__``: run by the garbage collector inside
    gevent's hub, that close can block forever and freeze every user of the process (seen:
    a sweep run stuck in ``Channel._close`` from ``__del__``). Users close explicitly in
    ``on_stop`` instead."""

    def __del__(self) -> None:
        pass


class LoadError(Exception):
    """A response that arrived but breaks the API contract (counted as a Locust failure)."""


def _fire(
    env: Environment,
    kind: str,
    name: str,
    started: float,
    *,
    tokens: int = 0,
    exc: BaseException | None = None,
    ended: float | None = None,
) -> None:
    """One Locust event from ``started`` to ``ended`` (default: now)."""
    stop = time.perf_counter() if ended is None else ended
    env.events.request.fire(
        request_type=kind,
        name=name,
        response_time=(stop - started) * 1000.0,
        response_length=tokens,
        exception=exc,
        context={},
    )


class ProxyChatUser(User):
    """A chat client of the OpenAI proxy (``--host``, default http://localhost:9000)."""

    weight = _env_int("DLM_LOAD_PROXY_WEIGHT", 3) or 0
    abstract = weight <= 0
    wait_time = between(0.0, SETTINGS.wait_s)
    host = "http://localhost:9000"

    def on_start(self) -> None:
        self.session = requests.Session()
        if SETTINGS.api_key:
            self.session.headers["Authorization"] = f"Bearer {SETTINGS.api_key}"

    def on_stop(self) -> None:
        self.session.close()

    def _body(self, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": SETTINGS.model,
            "messages": [{"role": "user", "content": SETTINGS.pick_prompt()}],
            "stream": stream,
            **SETTINGS.params,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    @task
    def chat(self) -> None:
        stream = random.random() < SETTINGS.stream_fraction
        name = "proxy chat stream" if stream else "proxy chat"
        started = time.perf_counter()
        first_text_at: float | None = None
        try:
            if stream:
                tokens, first_text_at = self._stream(started)
            else:
                tokens = self._once()
        except Exception as exc:  # every failure is a Locust failure, never a crash
            _fire(self.environment, "E2E", name, started, exc=exc)
            time.sleep(FAILURE_BACKOFF_S)
            return
        if first_text_at is not None:
            _fire(self.environment, "TTFT", name, started, ended=first_text_at)
        _fire(self.environment, "E2E", name, started, tokens=tokens)

    def _post(self, body: dict[str, Any], stream: bool) -> requests.Response:
        resp = self.session.post(
            self.host.rstrip("/") + "/v1/chat/completions",
            json=body,
            stream=stream,
            timeout=(10.0, SETTINGS.timeout_s),
        )
        if resp.status_code != 200:
            text = resp.text[:300]
            resp.close()
            raise LoadError(f"HTTP {resp.status_code}: {text}")
        return resp

    def _once(self) -> int:
        data = self._post(self._body(stream=False), stream=False).json()
        choice = data["choices"][0]
        if choice.get("finish_reason") not in ("stop", "length"):
            raise LoadError(f"finish_reason {choice.get('finish_reason')!r}")
        if not isinstance(choice["message"].get("content"), str):
            raise LoadError("no message content")
        return int(data["usage"]["completion_tokens"])

    def _stream(self, started: float) -> tuple[int, float | None]:
        """Read the SSE stream: completion tokens, and when the first non-empty content came."""
        finish_reason = None
        tokens: int | None = None
        saw_done = False
        first_text_at: float | None = None
        deadline = started + SETTINGS.timeout_s
        with self._post(self._body(stream=True), stream=True) as resp:
            resp.encoding = resp.encoding or "utf-8"  # SSE is UTF-8; else lines come as bytes
            for raw in resp.iter_lines(decode_unicode=True):
                if time.perf_counter() > deadline:
                    raise LoadError(f"stream longer than {SETTINGS.timeout_s}s")
                if not raw or not raw.startswith("data:"):
                    continue  # blank separators, comments, keep-alives
                payload = raw[5:].strip()
                if payload == "[DONE]":
                    saw_done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise LoadError(f"error event: {chunk['error']}")
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
                for choice in chunk.get("choices", []):
                    if first_text_at is None and choice.get("delta", {}).get("content"):
                        first_text_at = time.perf_counter()
                    finish_reason = choice.get("finish_reason") or finish_reason
        if not saw_done:
            raise LoadError("stream ended without data: [DONE]")
        if finish_reason not in ("stop", "length"):
            raise LoadError(f"finish_reason {finish_reason!r}")
        if tokens is None:
            raise LoadError("no usage chunk although stream_options.include_usage was set")
        return tokens, first_text_at


class TritonGrpcUser(User):
    """A direct Triton client: one gRPC stream per user, decoupled responses read to FINAL."""

    weight = _env_int("DLM_LOAD_GRPC_WEIGHT", 1) or 0
    abstract = weight <= 0
    wait_time = between(0.0, SETTINGS.wait_s)

    def on_start(self) -> None:
        self.client = _GreenletSafeClient(SETTINGS.triton_grpc)
        self._open_stream()

    def on_stop(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()

    def _open_stream(self) -> None:
        """A fresh stream and queue: after an error the old stream is dead or holds strays."""
        self.responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
        responses = self.responses
        self.client.start_stream(callback=lambda result, error: responses.put((result, error)))

    def _inputs(self, stream: bool) -> list[grpcclient.InferInput]:
        """The contract's input tensors (names, datatypes: dlm_protocol.tensors)."""
        messages = [{"role": "user", "content": SETTINGS.pick_prompt()}]
        arrays = build_inputs(messages=messages, stream=stream, sampling=SETTINGS.params)
        inputs = []
        for name, array in arrays.items():
            item = grpcclient.InferInput(name, list(array.shape), tensors.BY_NAME[name].datatype)
            item.set_data_from_numpy(array)
            inputs.append(item)
        return inputs

    @task
    def generate(self) -> None:
        stream = random.random() < SETTINGS.stream_fraction
        name = "grpc stream" if stream else "grpc"
        request_id = f"locust-{os.getpid()}-{next(_request_ids)}-{uuid.uuid4().hex[:6]}"
        started = time.perf_counter()
        try:
            self.client.async_stream_infer(
                SETTINGS.model, self._inputs(stream), request_id=request_id
            )
            tokens, first_text_at = self._read(request_id, started, stream)
        except Exception as exc:
            _fire(self.environment, "E2E", name, started, exc=exc)
            try:
                self.client.stop_stream(cancel_requests=True)
                self._open_stream()
            except Exception:
                pass  # the next request fails and reports it
            time.sleep(FAILURE_BACKOFF_S)
            return
        if first_text_at is not None:
            _fire(self.environment, "TTFT", name, started, ended=first_text_at)
        _fire(self.environment, "E2E", name, started, tokens=tokens)

    def _read(self, request_id: str, started: float, stream: bool) -> tuple[int, float | None]:
        """Responses of this request until one carries a finish_reason (the final one): its
        completion tokens, and when the first non-empty text came (streams only)."""
        first_text_at: float | None = None
        deadline = started + SETTINGS.timeout_s
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise LoadError(f"no final response within {SETTINGS.timeout_s}s")
            try:
                result, error = self.responses.get(timeout=left)
            except queue.Empty:
                continue
            if error is not None:
                raise LoadError(f"Triton error: {error}")
            if result.get_response().id != request_id:
                continue  # a late answer to an earlier, timed-out request
            text = result.as_numpy(tensors.TEXT_OUTPUT.name).reshape(-1)[0]
            if stream and first_text_at is None and text:
                first_text_at = time.perf_counter()
            reason = result.as_numpy(tensors.FINISH_REASON.name).reshape(-1)[0].decode()
            if reason:
                if reason not in ("stop", "length"):
                    raise LoadError(f"finish_reason {reason!r}")
                tokens = int(result.as_numpy(tensors.COMPLETION_TOKENS.name).reshape(-1)[0])
                return tokens, first_text_at


STOP_AFTER = int(os.environ.get("DLM_LOAD_STOP_AFTER", "0") or 0)


def expected_kinds(env: Environment) -> list[str]:
    """The E2E names the running users can produce (what a count-bounded run waits for)."""
    running = getattr(env.runner, "user_classes_count", {}) or {}
    kinds = []
    for cls, base in ((ProxyChatUser, "proxy chat"), (TritonGrpcUser, "grpc")):
        if running.get(cls.__name__, 0) > 0:
            if SETTINGS.stream_fraction < 1:
                kinds.append(base)
            if SETTINGS.stream_fraction > 0:
                kinds.append(f"{base} stream")
    return kinds


_completed: dict[str, int] = {}


@events.request.add_listener
def _stop_after_counts(request_type: str, name: str, exception: Any, context: Any = None, **kw):
    """Count-bounded runs: quit once every kind has STOP_AFTER successful requests, so a slow
    machine runs longer instead of failing (``--run-time`` only catches a real hang)."""
    if not STOP_AFTER or request_type != "E2E" or exception is not None:
        return
    _completed[name] = _completed.get(name, 0) + 1
    env = _ENV.get("env")
    if env is not None and env.runner is not None and not _ENV.get("quitting"):
        kinds = expected_kinds(env)
        if kinds and all(_completed.get(k, 0) >= STOP_AFTER for k in kinds):
            _ENV["quitting"] = True
            print(f"[dlm] every kind completed {STOP_AFTER} requests: stopping", flush=True)
            gevent.spawn(_quit_after_csv_tick, env)


def _quit_after_csv_tick(env: Environment) -> None:
    """Stop the users, let Locust's CSV writer record the final counts, then quit. Locust
    rewrites its ``--csv`` files every ``CSV_STATS_INTERVAL_SEC`` and not at shutdown, so a
    run that reached its counts within the first second left a stats file with no rows (seen
    on a fast idle machine: the sweep's 1-user run had none)."""
    env.runner.stop()
    gevent.sleep(locust_stats.CSV_STATS_INTERVAL_SEC + 0.5)
    env.runner.quit()


_ENV: dict[str, Any] = {}


@events.init.add_listener
def _remember_env(environment: Environment, **_: Any) -> None:
    _ENV["env"] = environment


@events.test_stop.add_listener
def _report_tokens_per_second(environment: Environment, **_: Any) -> None:
    """Print generated tokens/s per request kind when a run ends (also derivable from the CSV)."""
    stats = environment.stats
    if stats is None or not stats.total.num_requests:
        return
    elapsed = max(stats.last_request_timestamp - stats.start_time, 1e-9)
    total = 0
    for entry in stats.entries.values():
        if entry.method == "E2E":
            total += entry.total_content_length
            print(
                f"[dlm] {entry.name}: {entry.total_content_length / elapsed:.1f} generated tokens/s"
            )
    print(f"[dlm] all: {total / elapsed:.1f} generated tokens/s over {elapsed:.1f}s")
