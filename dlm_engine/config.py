"""Engine settings: which checkpoint, where it runs, and the limits that protect the server.

The fields, their defaults and their checks come from the server-settings registry
(``dlm_protocol/settings.py``), which also gives each one its config parameter, env var, CLI
flag and docs line: a new setting is one entry there.
"""

from __future__ import annotations

from dlm_protocol import settings


@settings.engine_fields
class EngineConfig:
    """Settings of one engine (one model on one device, or split over `tensor_parallel_size`
    ranks): one field per ``dlm_protocol.settings.SETTINGS`` entry."""

    def __post_init__(self) -> None:
        settings.check_values(self, "EngineConfig")

    @property
    def score_tokens(self) -> int:
        """Scoring's tokens a forward and its earnings cap a step (`score_step_tokens`)."""
        return int(self.score_step_tokens) or max(1, int(self.max_step_tokens) // 64)
