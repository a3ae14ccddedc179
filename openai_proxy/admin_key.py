"""The header that unlocks Triton's restricted admin APIs (the launcher restricts them).

The proxy's health probe reads Triton's model repository index, one of those APIs; the key
comes from the file the launcher generated (``--triton-admin-key-file``).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from .config import ProxyConfig

# gRPC metadata Triton 2.51 checks for `--grpc-restricted-protocol=...:dlm-admin-key=<key>`
# (the launcher's dlm_triton/admin_key.py names the same header).
HEADER = "triton-grpc-protocol-dlm-admin-key"


@cache
def _read(path: str) -> str:
    return Path(path).read_text().strip()


def admin_headers(config: ProxyConfig) -> dict[str, str] | None:
    """``{triton-grpc-protocol-dlm-admin-key: key}`` when a key file is configured, else None."""
    if not config.triton_admin_key_file:
        return None
    return {HEADER: _read(config.triton_admin_key_file)}
