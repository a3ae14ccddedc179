"""Proxy settings from environment variables and command-line flags.

Every setting has an environment variable (`DLM_PROXY_*`) so containers can be configured
without a command line; a flag given on the command line wins over the variable.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from dlm_protocol import limits

from .replicas import validate_targets

ENV_PREFIX = "DLM_PROXY_"
PLAYGROUND_MODES = ("auto", "on", "off")


def _split_list(value: str) -> list[str]:
    """Comma-separated list; empty items dropped so `""` means no entries."""
    return [item.strip() for item in value.split(",") if item.strip()]


def _parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {value!r}")


@dataclass
class ProxyConfig:
    """All knobs of the proxy. Defaults suit a local `dlm-triton serve`."""

    host: str = "127.0.0.1"  # beyond loopback needs API keys or allow_no_auth (security.py)
    port: int = 9000
    # gRPC endpoints of one or more tritonservers serving the same models; `dns:HOST:PORT` is
    # every address HOST resolves to (a headless Service), re-resolved every resolve_interval_s.
    # Each request goes to the replica with the fewest requests open (openai_proxy/replicas.py).
    triton_urls: list[str] = field(default_factory=lambda: ["localhost:8001"])
    resolve_interval_s: float = 10.0
    # Attempts on another replica after one broke before any token was sent (refusals are free).
    retries: int = 1
    # If set, only these Triton models are served (others answer 404); empty = all ready models.
    models: list[str] = field(default_factory=list)
    # Where Triton's Prometheus metrics live; /metrics points there.
    triton_metrics_url: str = "http://localhost:8002/metrics"
    # Bearer keys accepted on /v1/*; empty list (and no key file) = auth off.
    api_keys: list[str] = field(default_factory=list)
    # A file of keys, one per line (a compose secret), added to api_keys.
    api_keys_file: str = ""
    # Serve without keys on a non-loopback address (another layer authenticates).
    allow_no_auth: bool = False
    # Keys of operators: /metrics on the API port and /health's details need one of these
    # once any key is configured (API keys are tenants: they see neither). Not API keys.
    admin_keys: list[str] = field(default_factory=list)
    admin_keys_file: str = ""  # a file of admin keys, one per line, added to admin_keys
    # With API keys, the prefix cache is kept per key (openai_proxy/tenancy.py); true shares
    # it between keys (one tenant behind several keys; a hit then shows another key's prompt).
    share_prefix_cache: bool = False
    # A separate port for /metrics (0 = /metrics on the API port, behind the admin keys if any
    # key is configured).
    metrics_port: int = 0
    metrics_host: str = ""  # address of the metrics port; empty = host
    # Upper bound on max_tokens (canvas length) a client may ask for (each model's own
    # max_canvas applies too; the engine reports it).
    max_tokens_limit: int = limits.PROXY_MAX_TOKENS_LIMIT
    # Upper bound on n (choices per prompt) and on the total Triton requests one call fans out to.
    max_n: int = 16
    max_fanout: int = 64
    # Request bodies larger than this get 413 before they are parsed.
    max_request_bytes: int = 1 << 20
    # Allowed CORS origins; empty = CORS off, "*" = any.
    cors_origins: list[str] = field(default_factory=list)
    # Whole-request timeout (seconds) for one Triton stream.
    request_timeout_s: float = 600.0
    # File holding the key of Triton's restricted admin APIs (the repository index the health
    # probe reads); sent as the `dlm-admin-key` header. Empty: no header.
    triton_admin_key_file: str = ""
    # A Triton stream that sends nothing for this long is ended (504 / SSE error event).
    stream_idle_timeout_s: float = 300.0
    # Timeout for health and index calls to Triton.
    health_timeout_s: float = 2.0
    # How often each Triton URL is probed for readiness and its model list.
    health_interval_s: float = 2.0
    # How long a streaming request waits for its first Triton event before sending headers, so
    # that an immediate `invalid request:` from the model becomes a real HTTP 400.
    first_event_wait_s: float = 2.0
    # Seconds to let in-flight requests finish on shutdown before they are cancelled.
    drain_timeout_s: float = 30.0
    # Retry-After value (seconds) on 503 answers.
    retry_after_s: int = 2
    # The browser playground at /playground: "auto" = on only while no API keys are configured
    # (a page anyone can open should not sit in front of a keyed server unless asked), "on", "off".
    playground: str = "auto"
    log_level: str = "info"

    def playground_enabled(self, has_keys: bool) -> bool:
        """`has_keys`: API keys from any source (flags, env, the key file: security.py)."""
        return self.playground == "on" or (self.playground == "auto" and not has_keys)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProxyConfig:
        """Build from `DLM_PROXY_<FIELD>` variables, e.g. DLM_PROXY_TRITON_URLS=a:8001,b:8001."""
        env = os.environ if environ is None else environ
        cfg = cls()
        for f in fields(cls):
            key = ENV_PREFIX + f.name.upper()
            if key in env:
                setattr(cfg, f.name, _convert(f.name, getattr(cfg, f.name), env[key]))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Fail at start-up, not at the first request, on settings that cannot work."""
        if not self.triton_urls:
            raise ValueError("at least one Triton gRPC URL is needed (--triton-url)")
        for name in ("max_tokens_limit", "max_n", "max_fanout", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        validate_targets(self.triton_urls)
        if self.retries < 0:
            raise ValueError("retries must be >= 0")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError("metrics_port must be 0 (off) or a TCP port")
        for name in (
            "request_timeout_s",
            "stream_idle_timeout_s",
            "health_timeout_s",
            "health_interval_s",
            "resolve_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.triton_admin_key_file and not Path(self.triton_admin_key_file).is_file():
            raise ValueError(f"triton_admin_key_file {self.triton_admin_key_file} is not a file")
        if self.first_event_wait_s < 0 or self.drain_timeout_s < 0:
            raise ValueError("first_event_wait_s and drain_timeout_s must be >= 0")
        if self.playground not in PLAYGROUND_MODES:
            raise ValueError(f"playground must be one of {', '.join(PLAYGROUND_MODES)}")


def _convert(name: str, current: object, raw: str) -> object:
    """Convert an environment string to the type of the field's default."""
    if isinstance(current, bool):
        return _parse_bool(raw)
    if isinstance(current, int):
        return int(raw)
    if isinstance(current, float):
        return float(raw)
    if isinstance(current, list):
        return _split_list(raw)
    return raw


def build_arg_parser() -> argparse.ArgumentParser:
    """Flags mirror the config fields; defaults come from the environment (see from_env)."""
    p = argparse.ArgumentParser(
        prog="python -m openai_proxy",
        description="OpenAI-compatible HTTP proxy in front of tritonserver (diffusion LMs).",
    )
    p.add_argument(
        "--host",
        help="bind address (DLM_PROXY_HOST, default 127.0.0.1; others need API keys)",
    )
    p.add_argument("--port", type=int, help="HTTP port (DLM_PROXY_PORT, default 9000)")
    p.add_argument(
        "--triton-url",
        "--triton-grpc",
        action="append",
        dest="triton_urls",
        metavar="HOST:PORT",
        help="Triton gRPC endpoint, or dns:HOST:PORT for every address of HOST (re-resolved); "
        "repeat or comma-separate for several replicas (DLM_PROXY_TRITON_URLS, default "
        "localhost:8001)",
    )
    p.add_argument(
        "--resolve-interval",
        type=float,
        dest="resolve_interval_s",
        help="seconds between DNS look-ups of dns: entries (default 10)",
    )
    p.add_argument(
        "--retries",
        type=int,
        help="attempts on another replica after one failed before any token (default 1)",
    )
    p.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="NAME",
        help="serve only this Triton model (repeatable); default: every ready model",
    )
    p.add_argument("--triton-metrics-url", help="Triton metrics URL shown by /metrics")
    p.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        metavar="KEY",
        help="accepted bearer key; repeat for several; none = auth off (DLM_PROXY_API_KEYS)",
    )
    p.add_argument("--api-keys-file", help="file of accepted keys, one per line")
    p.add_argument(
        "--allow-no-auth",
        action="store_true",
        default=None,
        help="serve without keys on a non-loopback address (DLM_PROXY_ALLOW_NO_AUTH)",
    )
    p.add_argument(
        "--admin-key",
        action="append",
        dest="admin_keys",
        metavar="KEY",
        help="operator key for /metrics and /health's details (not an API key); repeat for "
        "several (DLM_PROXY_ADMIN_KEYS)",
    )
    p.add_argument(
        "--admin-keys-file", help="file of operator keys, one per line (DLM_PROXY_ADMIN_KEYS_FILE)"
    )
    p.add_argument(
        "--share-prefix-cache",
        action="store_true",
        default=None,
        help="with API keys, share cached prompt pages between keys (default: one cache per key; "
        "DLM_PROXY_SHARE_PREFIX_CACHE)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve /metrics on this port only, without keys (keep it private: not published, "
        "or --metrics-host 127.0.0.1)",
    )
    p.add_argument("--metrics-host", help="address of the metrics port (default: --host)")
    p.add_argument("--max-tokens-limit", type=int, help="largest max_tokens accepted")
    p.add_argument("--max-n", type=int, help="largest n accepted")
    p.add_argument("--max-fanout", type=int, help="largest prompts x n per call")
    p.add_argument("--max-request-bytes", type=int, help="body size limit (413 above)")
    p.add_argument(
        "--cors-origin",
        action="append",
        dest="cors_origins",
        metavar="ORIGIN",
        help="allowed CORS origin ('*' for any); repeat for several",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        dest="request_timeout_s",
        help="seconds one generation may take, 504 after (default 600)",
    )
    p.add_argument(
        "--triton-admin-key-file",
        help="file with the key of Triton's restricted admin APIs (DLM_PROXY_TRITON_ADMIN_KEY_FILE)",
    )
    p.add_argument(
        "--stream-idle-timeout",
        type=float,
        dest="stream_idle_timeout_s",
        help="seconds a Triton stream may stay silent before the request ends with 504 "
        "(DLM_PROXY_STREAM_IDLE_TIMEOUT_S, default 300)",
    )
    p.add_argument(
        "--health-timeout",
        type=float,
        dest="health_timeout_s",
        help="seconds one readiness probe of a Triton may take",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        dest="health_interval_s",
        help="seconds between readiness probes of each Triton",
    )
    p.add_argument(
        "--first-event-wait",
        type=float,
        dest="first_event_wait_s",
        help="seconds a stream waits for Triton's first answer before sending headers, so an "
        "immediate model error is a real HTTP 400",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        dest="drain_timeout_s",
        help="on SIGTERM, seconds running requests may finish",
    )
    p.add_argument(
        "--retry-after", type=int, dest="retry_after_s", help="Retry-After seconds on 503 answers"
    )
    p.add_argument(
        "--playground",
        choices=PLAYGROUND_MODES,
        help="browser playground at /playground: auto (default) = on unless API keys are "
        "configured (DLM_PROXY_PLAYGROUND)",
    )
    p.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        help="the proxy's log level",
    )
    _name_env_and_default(p)
    return p


def _default_text(value: object) -> str:
    """A ProxyConfig default as the help shows it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(value) or "none"
    return str(value) if value != "" else "none"


def _name_env_and_default(parser: argparse.ArgumentParser) -> None:
    """End each flag's help with its environment variable and its ProxyConfig default, unless
    the help already names them: `--help` then says what the settings table says."""
    defaults = ProxyConfig()
    for action in parser._actions:
        if not hasattr(defaults, action.dest):
            continue
        env = ENV_PREFIX + action.dest.upper()
        text = (action.help or "").strip()
        extra = [] if env in text else [env]
        if "default" not in text:
            extra.append(f"default {_default_text(getattr(defaults, action.dest))}")
        if extra:
            action.help = f"{text} ({'; '.join(extra)})".lstrip().replace("%", "%%")


def config_from_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ProxyConfig:
    """Environment first, then flags on top."""
    cfg = ProxyConfig.from_env(environ)
    args = build_arg_parser().parse_args(argv)
    for key, value in vars(args).items():
        if value is None:
            continue
        if key in ("triton_urls", "api_keys", "admin_keys", "cors_origins", "models"):
            value = [item for raw in value for item in _split_list(raw)]
        setattr(cfg, key, value)
    cfg.validate()
    return cfg
