"""Turn a checkpoint reference into a complete local folder: a directory, or a Hub id.

A local directory always wins. Anything else shaped ``org/name`` is a Hugging Face Hub id:
``huggingface_hub.snapshot_download`` fetches only the files the loader reads (config,
generation config, tokenizer, safetensors shards and their index) into the Hub cache
(``HF_HUB_CACHE``, else ``HF_HOME/hub``) with a progress bar, honouring ``HF_TOKEN`` (or a
token file, ``HF_TOKEN_PATH``: a compose secret), ``HF_HUB_OFFLINE`` and a pinned revision.

Then the folder is checked before any tensor is read, so a partial download or a truncated
shard is one clear error instead of a crash deep inside loading: every shard the index names
must exist, and each shard's size must equal what its own safetensors header says. With
``verify="sha256"`` (``DLM_VERIFY_CHECKPOINT=sha256``) shards stored in the Hub cache are also
hashed and compared with the content hash the cache names them by.

Environment variables are read at call time (not at import, as ``huggingface_hub.constants``
does), so one process can resolve under different settings (tests, the launcher).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path

# What the loader reads. Modelling code (*.py) and other weight formats are never fetched.
CHECKPOINT_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TRUE = ("1", "true", "yes", "on")


class CheckpointNotFoundError(FileNotFoundError):
    """The reference is neither a local directory nor a Hub id that could be resolved."""


class CorruptCheckpointError(ValueError):
    """A checkpoint folder is incomplete or a weight file does not match its header or hash."""


def is_hub_id(ref: str) -> bool:
    """``org/name`` with Hub-legal characters (and no ``..``)."""
    return bool(HUB_ID.match(ref)) and ".." not in ref


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The Hub cache folder under the current environment (huggingface_hub's own rules)."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_token(environ: Mapping[str, str] | None = None) -> str | None:
    """``HF_TOKEN``, else the first line of the file ``HF_TOKEN_PATH`` names (a compose secret);
    None lets huggingface_hub use a stored login, or go anonymous."""
    env = os.environ if environ is None else environ
    if env.get("HF_TOKEN", "").strip():
        return env["HF_TOKEN"].strip()
    path = env.get("HF_TOKEN_PATH")
    if path and Path(path).is_file():
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:  # a secret file this user (in the image: uid 1000) may not read
            raise ValueError(f"cannot read the Hub token file {path}: {exc.strerror}") from exc
        return token or None
    return None


def resolve_checkpoint(
    ref: str | Path,
    revision: str | None = None,
    *,
    verify: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Path:
    """A local folder holding a complete checkpoint for ``ref`` (downloading it if needed).

    ``verify``: ``size`` (default; cheap, always on) or ``sha256`` (hash Hub-cached shards).
    """
    env = os.environ if environ is None else environ
    verify = verify or env.get("DLM_VERIFY_CHECKPOINT") or "size"
    path = Path(ref).expanduser()
    if path.is_dir():
        folder = path
    elif is_hub_id(str(ref)):
        folder = _snapshot(str(ref), revision or None, env)
    else:
        raise CheckpointNotFoundError(
            f"checkpoint {str(ref)!r} is neither a local directory nor a Hugging Face Hub id "
            "(org/name)"
        )
    verify_checkpoint(folder, hashes=verify == "sha256", origin=str(ref))
    return folder


def _snapshot(repo_id: str, revision: str | None, env: Mapping[str, str]) -> Path:
    from huggingface_hub import errors, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # huggingface_hub >= 2.x: a cached snapshot that its tree listing shows to be partial
    incomplete = getattr(errors, "IncompleteSnapshotError", ())

    cache = hub_cache_dir(env)
    offline = hub_offline(env)
    rev = revision or "main"
    where = f"{repo_id!r} (revision {rev})"
    seed_hint = (
        f"on a host with internet run `hf download {repo_id} --revision {rev}` with the same "
        f"HF_HOME, then copy its hub/ folder to {cache}"
    )
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=CHECKPOINT_FILES,
            cache_dir=str(cache),
            local_files_only=offline,
            token=hub_token(env),
            endpoint=env.get("HF_ENDPOINT") or None,  # a mirror, read now (not at import)
        )
    except GatedRepoError as exc:
        raise CheckpointNotFoundError(
            f"Hub model {where} is gated: accept its licence on huggingface.co and give a token "
            f"(HF_TOKEN, or a file named by HF_TOKEN_PATH) ({_first_line(exc)})"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"Hub model {repo_id!r} does not exist or is private (a private one needs a token: "
            f"HF_TOKEN or HF_TOKEN_PATH) ({_first_line(exc)})"
        ) from exc
    except RevisionNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"Hub model {repo_id!r} has no revision {rev!r} ({_first_line(exc)})"
        ) from exc
    except incomplete as exc:
        raise CorruptCheckpointError(
            f"Hub model {where} is only partly in the cache {cache} ({_first_line(exc)}); "
            f"run the download again with network access, or {seed_hint}"
        ) from exc
    except LocalEntryNotFoundError as exc:
        reason = (
            "HF_HUB_OFFLINE is set, so nothing is downloaded"
            if offline
            else "the Hub could not be reached"
        )
        raise CheckpointNotFoundError(
            f"Hub model {where} is not in the Hugging Face cache {cache} and {reason}: {seed_hint}"
        ) from exc
    except (HfHubHTTPError, OSError) as exc:
        raise CheckpointNotFoundError(
            f"could not download Hub model {where} into {cache}: {_first_line(exc)}; "
            f"for hosts without internet, {seed_hint} and set HF_HUB_OFFLINE=1"
        ) from exc
    return Path(folder)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ----------------------------------------------------------------------------- verification
def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else every one there."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"{index} is not a safetensors index: {exc}") from exc
        return [folder / n for n in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def safetensors_data_size(path: Path) -> tuple[int, int]:
    """(expected file size from the header, actual size) of one safetensors file.

    Layout: 8-byte little-endian header length N, N bytes of JSON header whose tensors carry
    ``data_offsets`` [begin, end) into the data block that follows; the file ends where the
    last tensor ends.
    """
    actual = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CorruptCheckpointError(f"{path} is {actual} bytes: not a safetensors file")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(actual - 8, 100 << 20):
            raise CorruptCheckpointError(
                f"{path} is truncated or not safetensors: its header claims {header_len} bytes "
                f"of a {actual}-byte file"
            )
        try:
            header = json.loads(f.read(header_len))
        except ValueError as exc:
            raise CorruptCheckpointError(f"{path} has an unreadable header: {exc}") from exc
    ends = [
        int(entry["data_offsets"][1])
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    return 8 + header_len + max(ends, default=0), actual


def verify_checkpoint(folder: Path, *, hashes: bool = False, origin: str | None = None) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``folder`` holds a complete checkpoint."""
    label = origin or str(folder)
    advice = (
        f"delete {folder} (or re-run `hf download {origin} --force-download`) and fetch it again"
        if origin and is_hub_id(origin)
        else "copy the checkpoint again"
    )
    if not (folder / "config.json").is_file():
        raise CorruptCheckpointError(f"checkpoint {label} lacks config.json in {folder}; {advice}")
    for path in weight_files(folder):
        if not path.is_file():
            raise CorruptCheckpointError(
                f"checkpoint {label} is incomplete: {path.name} (named by its index) is missing "
                f"in {folder}; {advice}"
            )
        expected, actual = safetensors_data_size(path)
        if expected != actual:
            raise CorruptCheckpointError(
                f"checkpoint {label}: {path.name} is {actual} bytes but its header describes "
                f"{expected} (partial download or damaged file); {advice}"
            )
        if hashes:
            _check_blob_hash(path, label, advice)


def _check_blob_hash(path: Path, label: str, advice: str) -> None:
    """Hub-cache files link to ``blobs/<sha256>`` (LFS files): the name is the content hash."""
    blob = path.resolve()
    if not _SHA256.match(blob.name) or blob.parent.name != "blobs":
        return  # a plain directory: no recorded hash to compare with
    digest = hashlib.sha256()
    with blob.open("rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    if digest.hexdigest() != blob.name:
        raise CorruptCheckpointError(
            f"checkpoint {label}: {path.name} fails its sha256 check (cache blob {blob.name}, "
            f"content {digest.hexdigest()}); {advice}"
        )
