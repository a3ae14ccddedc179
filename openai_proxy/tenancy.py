"""Tenants of the prefix cache: with API keys, each key's requests share cached prompt pages
only with each other.

Block-diffusion models reuse the KV pages of a prompt's leading blocks across requests
(dlm_engine/prefix_cache.py). Shared between callers, a cache hit tells one caller that
another sent the same prefix: a guess at someone else's prompt is confirmed by
`cached_tokens`, the hit counter or the time to the first token. The engine shares pages only
between requests with the same `cache_salt`; the proxy sets that salt for every call made
with a key to an HMAC under the key's own secret of the caller's `cache_salt` (if any). The
key itself never leaves the proxy, a caller cannot pick another key's salt, and callers of
one key still share their pages (and may split them further with their own `cache_salt`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from .converters import TritonJob

CACHE_SALT = "cache_salt"
# Domain of the per-key secret: a salt of this proxy is no hash any other system computes.
_DOMAIN = b"dlm-triton prefix-cache tenant v1"


def key_secret(key: bytes) -> bytes:
    """The key's salting secret (a one-way function of the key)."""
    return hmac.new(_DOMAIN, key, hashlib.sha256).digest()


def tenant_salt(key: bytes, user_salt: str | None) -> str:
    """The `cache_salt` Triton gets for a call made with `key`: equal for equal (key, salt)
    pairs, unrelated otherwise."""
    message = b"" if user_salt is None else b"\x01" + user_salt.encode()
    return "key-" + hmac.new(key_secret(key), message, hashlib.sha256).hexdigest()


def salt_jobs(jobs: Iterable[TritonJob], key: bytes | None) -> None:
    """Give every job of a call made with `key` its tenant's salt (None: leave them as they
    are: no keys, or the cache shared on purpose)."""
    if key is None:
        return
    for job in jobs:
        params = job.sampling_parameters
        params[CACHE_SALT] = tenant_salt(key, params.get(CACHE_SALT))
