"""Fetch a Hub checkpoint in the launcher, before tritonserver starts.

Downloading inside the model's ``initialize()`` would hide the progress bar in Triton's log and
count the download against the model load. So the launcher resolves the checkpoint the served
model names (its ``config.pbtxt`` parameters, overridden by ``DLM_CHECKPOINT`` /
``DLM_REVISION`` as the model itself does) with :func:`dlm_engine.hub.resolve_checkpoint`, which
prints huggingface_hub's progress bars on this terminal (``docker logs``), and hands the stub
the local snapshot folder through ``DLM_CHECKPOINT``: the stub never touches the network.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from dlm_protocol.settings import BY_NAME, resolve_checkpoint
from dlm_triton.launch import model_repo

CHECKPOINT_VAR = BY_NAME["model"].env
REVISION_VAR = BY_NAME["revision"].env


def served_checkpoint(config: Path, environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(checkpoint, revision) the model of ``config`` will load under ``environ``."""
    params = model_repo.read_parameters(config) if config.exists() else {}
    checkpoint = environ.get(CHECKPOINT_VAR) or params.get("checkpoint") or None
    revision = environ.get(REVISION_VAR) or params.get("revision") or None
    if checkpoint is not None:
        checkpoint = resolve_checkpoint(checkpoint, config.parent)  # paths, embedded assets
    return checkpoint, revision


def fetch_checkpoint(
    repository: Path, name: str, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment for tritonserver: ``DLM_CHECKPOINT`` = the local folder of a Hub id (fetched
    now if needed); empty when the model names a directory, an asset or ``random:``."""
    environ = {**os.environ, **(env or {})}
    checkpoint, revision = served_checkpoint(repository / name / "config.pbtxt", environ)
    if checkpoint is None or "/" not in checkpoint or Path(checkpoint).exists():
        return {}
    from dlm_engine.hub import is_hub_id  # imports torch: only here
    from dlm_engine.hub import resolve_checkpoint as fetch

    if not is_hub_id(checkpoint):
        return {}
    print(f"fetching {checkpoint} (revision {revision or 'main'}) ...", file=sys.stderr)
    folder = fetch(checkpoint, revision, environ=environ)
    print(f"checkpoint {checkpoint}: {folder}", file=sys.stderr)
    return {CHECKPOINT_VAR: str(folder)}
