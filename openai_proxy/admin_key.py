"""Model states for the health probe, with or without the key of Triton's admin APIs.

The launcher restricts Triton's model-repository API (the index the probe reads) to a key from
a file (``--triton-admin-key-file``). Without the key, or with a wrong one, the probe falls back
to each configured model's readiness (the open health API), so a proxy given ``--model`` keeps
working; without ``--model`` the index is needed to know what is served.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from .config import ProxyConfig

# gRPC metadata Triton 2.51 checks for `--grpc-restricted-protocol=...:dlm-admin-key=<key>`
# (the launcher's dlm_triton/launch/admin_key.py names the same header).
HEADER = "triton-grpc-protocol-dlm-admin-key"


@cache
def _read(path: str) -> str:
    return Path(path).read_text().strip()


def admin_headers(config: ProxyConfig) -> dict[str, str] | None:
    """``{triton-grpc-protocol-dlm-admin-key: key}`` when a key file is configured, else None."""
    if not config.triton_admin_key_file:
        return None
    return {HEADER: _read(config.triton_admin_key_file)}


async def model_states(client: Any, config: ProxyConfig, timeout: float) -> dict[str, str]:
    """``{model name: state}`` (``READY``, ``UNAVAILABLE``, ...), limited to the configured
    models when there are some."""
    try:
        index = await client.get_model_repository_index(
            as_json=True, client_timeout=timeout, headers=admin_headers(config)
        )
    except Exception as exc:
        if not config.models or "restricted" not in str(exc).lower():
            raise
        return {
            name: "READY"
            if await client.is_model_ready(name, client_timeout=timeout)
            else "UNAVAILABLE"
            for name in config.models
        }
    states = {m["name"]: m.get("state", "") for m in index.get("models", [])}
    if config.models:
        states = {k: v for k, v in states.items() if k in config.models}
    return states
