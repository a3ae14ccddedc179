"""DiffusionGemma's uniform-state sampler (decoding/uniform_diffusion.py): canvases of random
tokens denoised for `steps` steps under a falling temperature, a canvas ending early once
stable and below `stop_entropy`; its rows run on their own runner (uniform_runner.py). A thin
registration: the request keys and their checks live in decoding/uniform_params.py."""

from __future__ import annotations

from typing import Any

from .base import UNIFORM, Strategy


class Uniform(Strategy):
    name = "uniform"
    summary = (
        "DiffusionGemma: every position of a canvas resampled each step under a falling "
        "temperature; the canvas ends when stable (uniform-state diffusion)"
    )
    source = "transformers DiffusionGemma generate (uniform-state sampler)"
    models = UNIFORM
    selected_by_algorithm = False  # the family's only sampler: `algorithm` is refused
    selection = "every DiffusionGemma request"
    threshold_doc = "the checkpoint's entropy_bound (0.1)"

    @property
    def keys(self) -> tuple[str, ...]:  # type: ignore[override]
        from ..uniform_params import UNIFORM_KEYS

        return UNIFORM_KEYS

    def resolve_request(
        self, p, defaults: dict[str, Any], max_canvas: int, default_max_tokens: int
    ) -> Any:
        from ..uniform_params import resolve_uniform

        return resolve_uniform(p, defaults, max_canvas, default_max_tokens)

    def refuse_keys(self, p) -> None:
        """Other families: DiffusionGemma's own keys are an error naming the key."""
        from ..uniform_params import refuse_uniform_keys

        refuse_uniform_keys(p)


UNIFORM_STRATEGY = Uniform()
STRATEGIES = (UNIFORM_STRATEGY,)
