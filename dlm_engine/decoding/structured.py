"""The engine's structured-output service: checks a request's constraint against the model's
tokenizer, and gives each constrained request its matcher.

llguidance's tokenizer view and the closing-preference vector are built on the first
constrained request, so servers that never see one pay nothing.
"""

from __future__ import annotations

import math
import threading
from typing import Any

from ..sampling_params import ResolvedParams
from .constraints import ConstraintRuntime, RowConstraint
from .grammar import GrammarCompiler, error_field
from .strategies import strategy_of


class StructuredOutput:
    """Per-engine grammar support (thread-safe: `check` runs on request threads)."""

    def __init__(self, loaded: Any, runner: Any) -> None:
        self._loaded = loaded
        self._runner = runner
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                lm = self._loaded
                self._compiler = GrammarCompiler(lm.tokenizer, self._runner.model_vocab, lm.eos_id)
            return self._compiler

    def check(self, params: ResolvedParams) -> ResolvedParams:
        """Raise `InvalidRequestError` naming the field if the constraint cannot be served
        (compiled here, on the request's thread, so the row starts with it ready)."""
        if params.constraint is not None:
            self.compiler().check(params.constraint, tokens_per_step(params))
        return params

    def row_constraint(self, params: ResolvedParams) -> RowConstraint | None:
        """A fresh matcher for one request (on the engine thread)."""
        if params.constraint is None:
            return None
        compiler = self.compiler()
        if self._runner.constraint_runtime is None:
            lm = self._loaded
            self._runner.constraint_runtime = ConstraintRuntime(
                lm.tokenizer,
                self._runner.model_vocab,
                lm.stop_ids,
                lm.eos_id,
                lm.device,
                mask_vocab=compiler.ll_tokenizer.vocab_size,
            )
        return RowConstraint(
            compiler.matcher(params.constraint), params.max_tokens, error_field(params.constraint)
        )


def tokens_per_step(p: ResolvedParams) -> int:
    """The most tokens a constrained row commits in one step: its block in threshold mode
    (while confident) and with Dream's `origin`, else its schedule's share of the block."""
    if p.threshold is not None or strategy_of(p.algorithm).draws_positions or p.accel.multi_block:
        return p.block_length
    return math.ceil(p.block_length / max(1, p.steps_per_block))
