"""The key that unlocks Triton's administrative APIs.

The launcher starts tritonserver with its model-repository (load / unload / index),
shared-memory, trace and logging APIs restricted to requests carrying the header
``dlm-admin-key: <key>`` (gRPC metadata ``triton-grpc-protocol-dlm-admin-key``;
``--http-restricted-api`` / ``--grpc-restricted-protocol``);
inference, health, metadata, model config and statistics stay open. The key is read from a
file: by default one generated on first use in the user's cache (mode 0600), shared by the
servers this user starts and by the proxy, which needs the repository index for its health
view.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from dlm_triton.launch.server_dist import default_cache_dir

HEADER = "dlm-admin-key"  # HTTP; Triton's gRPC server expects it with this prefix (2.51):
GRPC_HEADER = f"triton-grpc-protocol-{HEADER}"
RESTRICTED = ("model-repository", "shared-memory", "trace", "logging")
ENV_FILE = "DLM_ADMIN_KEY_FILE"


def default_key_file() -> Path:
    return Path(os.environ.get(ENV_FILE) or default_cache_dir() / "admin-key")


def read_or_create(path: Path | None = None) -> tuple[Path, str]:
    """The key in `path` (default :func:`default_key_file`), generated atomically if absent."""
    path = Path(path) if path is not None else default_key_file()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, path)  # fails if another launcher won the race: use theirs
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    key = path.read_text().strip()
    if not key or any(c in key for c in ",:= \t"):
        raise ValueError(f"admin key file {path} must hold one token without ',:= ' characters")
    return path, key


def server_args(key: str) -> list[str]:
    """tritonserver flags restricting the admin APIs on HTTP and gRPC to the key."""
    spec = f"{','.join(RESTRICTED)}:{HEADER}={key}"
    return [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]
