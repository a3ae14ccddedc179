"""Uniform-state diffusion decoding (DiffusionGemma): one canvas at a time, every row alone.

A canvas starts as uniformly random tokens. Each denoising step the decoder predicts every
position; the logits are divided by a temperature falling linearly from `t_max` to `t_min`;
a token is sampled per position; the lowest-entropy positions are accepted while their
summed entropy minus the largest stays within `entropy_bound` (approximately independent
tokens), and every other position is renoised with a fresh random token. The step's logits
condition the next step (self-conditioning). A canvas ends once its argmax canvas has been
the same for `stability_threshold` steps and its mean entropy is below `stop_entropy`
(adaptive stopping), or after `steps` steps; its argmax canvas is the text, encoded into the
cache before the next canvas. The answer ends with the canvas that holds an end-of-text id.

Every random draw comes from the row's own generator, seeded by the request's `seed`, in the
order transformers' `DiffusionGemmaForBlockDiffusion.generate` makes them at batch size 1
after `torch.manual_seed(seed)`: per canvas one `randint` for the initial canvas, then per
step one `multinomial` over the canvas and one `randint` for renoising (also on the step that
ends the canvas). So a row's tokens do not depend on what else runs in its batch.

What rows have to encode (prompts, finished canvases) goes through the encoder as one packed
forward a step, under a token budget (`encode_rows`): a row whose prompt is longer than the
budget is encoded in chunks over several steps while the other rows keep denoising, and
starts its first canvas once all of it is in its cache. Encoding draws nothing, so when a
row's tokens are encoded never changes its draws.

A row with structured output (`uniform_constraints.py`) returns, instead of its argmax canvas,
the grammar-constrained argmax of the same last-step logits; its draws are unchanged. A row
with `logit_bias` adds it to each step's logits before anything reads them, as a
`logits_processor` given to transformers' `generate` does (`logit_bias.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..models.common import FusedKernels
from ..models.diffusion_gemma import DiffusionGemmaModel, RowCache, soft_cap
from .logit_bias import Biases, LogitBiasStep
from .logprobs import TokenLogprob

if TYPE_CHECKING:
    from .uniform_constraints import CanvasConstraint


@dataclass(frozen=True)
class UniformSettings:
    """One request's sampler settings (the checkpoint's generation_config unless given)."""

    steps: int  # max_denoising_steps per canvas
    t_min: float
    t_max: float
    entropy_bound: float
    stability_threshold: int | None  # adaptive stopping needs both of these
    stop_entropy: float | None  # generation_config `confidence_threshold`
    canvases: int  # ceil(max_tokens / canvas_length)

    @property
    def adaptive_stop(self) -> bool:
        return self.stability_threshold is not None and self.stop_entropy is not None


def temperature(s: UniformSettings, remaining: int, device: torch.device) -> torch.Tensor:
    """The schedule's temperature with `remaining` steps left (N at the first step, 1 at the
    last), in float32 as the reference computes it from an int32 step tensor."""
    step = torch.tensor(remaining, dtype=torch.int32, device=device)
    return s.t_min + (s.t_max - s.t_min) * (step / s.steps)


def token_entropy(logits: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of each position's categorical distribution (nats), unvalidated (validation
    would wait on the GPU every step). On the GPU, from the softmax `probs` already taken:
    logsumexp - sum(p * logits), a few passes over L x V instead of about ten; on the CPU
    as `torch.distributions.Categorical` computes it, as the reference does. The logits are
    finite (soft-capped, plus bounded biases), so p * logits never meets 0 * inf."""
    if probs is not None and logits.is_cuda:
        return logits.logsumexp(dim=-1) - (probs * logits).sum(dim=-1)
    return torch.distributions.Categorical(logits=logits, validate_args=False).entropy()


def _sampler_statistics(
    product: torch.Tensor, cap: float | None, temp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a step reads of its logits, from the head's product [1, L, V]: the tempered
    distribution in float32 (sampled from) and in the product's dtype (self-conditioning's
    input), each position's argmax and entropy (as `token_entropy` on the GPU)."""
    processed = soft_cap(product, cap) / temp
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    entropy = processed.logsumexp(dim=-1) - (probs * processed).sum(dim=-1)
    return probs, probs.to(product.dtype), processed.argmax(dim=-1), entropy


# On the GPU one compiled kernel chain instead of some twenty passes over L x V float32 a
# row (the cast, soft cap, temperature, softmax, argmax, entropy, the cast for the soft
# embeddings): at 32 rows of a 262,144-token vocabulary those passes are a third of a step.
sampler_statistics = FusedKernels(_sampler_statistics)


def accepted_mask(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """Entropy-bound acceptance: the k lowest-entropy positions with sum - max <= bound."""
    ordered, order = torch.sort(entropy, dim=-1, descending=False)
    keep = torch.cumsum(ordered, dim=-1) - ordered <= bound
    return torch.scatter(torch.zeros_like(keep), -1, order, keep)


class UniformRow:
    """One request's decoding state: its cache, generator, canvas and step counters."""

    def __init__(
        self,
        prompt: torch.Tensor,
        settings: UniformSettings,
        *,
        seed: int | None,
        n_layers: int,
        canvas_length: int,
        vocab_size: int,
        stop_ids: torch.Tensor,
        logprobs: int | None = None,
        constraint: CanvasConstraint | None = None,
        logit_bias: Biases | None = None,
    ) -> None:
        self.settings = settings
        # OpenAI's logit_bias, staged once: added to every step's logits before anything
        # reads them (decoding/logit_bias.py)
        self.bias = LogitBiasStep.of_rows([logit_bias], prompt.device)
        self.constraint = constraint  # structured output: the returned canvas is constrained
        self.failure: str | None = None  # set when the constraint failed (the row ends)
        self.logprobs = logprobs  # alternatives per token; None: record no logprobs
        self.canvas_length = canvas_length
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.generator = torch.Generator(device=prompt.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.cache = RowCache(n_layers, room=canvas_length)
        # what is left to encode: the prompt, then each finished canvas (None: nothing)
        self.to_encode: torch.Tensor | None = prompt if prompt.numel() else None
        self.current: torch.Tensor | None = None  # the canvas fed to the next step [1, L]
        self.argmax: torch.Tensor | None = None
        # the self-conditioning input: the last step's soft embeddings [1, L, H], not its
        # logits (L x V floats per row would cap the batch on one GPU)
        self.soft: torch.Tensor | None = None
        self.history: torch.Tensor | None = None  # last argmax canvases, adaptive stopping
        self.remaining = 0  # steps left in this canvas (the schedule's cur_step)
        self.canvases_done = 0
        self.forwards = 0
        self.done = False
        self.last_logits: torch.Tensor | None = None  # the canvas's last step (the walk)
        self.model_logits: torch.Tensor | None = None  # the same without logit_bias (logprobs)
        self.canvas_logprobs: list[TokenLogprob] = []  # the finished canvas's, if asked

    def _random_canvas(self) -> torch.Tensor:
        return torch.randint(
            0,
            self.vocab_size,
            (1, self.canvas_length),
            generator=self.generator,
            device=self.generator.device,
        )

    @property
    def encoding(self) -> bool:
        """Tokens are left to encode (its prompt, or its last canvas): the row does not
        denoise until they are all in its cache."""
        return self.to_encode is not None

    def take_span(self, most: int) -> torch.Tensor:
        """The next at most `most` tokens to encode, taken off what is left (`encode_rows`)."""
        assert self.to_encode is not None
        span, rest = self.to_encode[:most], self.to_encode[most:]
        self.to_encode = rest if rest.numel() else None
        return span

    def start_canvas(self) -> None:
        """Draw the new canvas (everything before it is encoded)."""
        assert self.to_encode is None
        self.current = self._random_canvas()
        self.argmax = self.current
        self.soft = None
        self.history = None
        self.remaining = self.settings.steps

    def absorb_hidden(
        self, hidden: torch.Tensor, model: DiffusionGemmaModel
    ) -> torch.Tensor | None:
        """`absorb` of one step's normed hidden states [1, L, H]. On the GPU with fused
        kernels on, and when nothing reads the processed logits themselves (no `logit_bias`,
        structured output or logprobs), from one fused pass over the head's product
        (`sampler_statistics`); the draws are the same calls on the row's generator."""
        if not self.fuses(hidden, model):
            return self.absorb(model.head(hidden), model)
        temp = temperature(self.settings, self.remaining, hidden.device)
        probs, probs_low, argmax, entropy = sampler_statistics(
            model.head_product(hidden), model.logit_cap, temp
        )
        return self._take(probs, argmax, entropy, model, probs_low)

    def fuses(self, hidden: torch.Tensor, model: DiffusionGemmaModel) -> bool:
        """Whether `absorb_hidden` takes the fused pass (see there)."""
        return (
            FusedKernels.enabled
            and hidden.is_cuda
            and hasattr(model, "head_product")
            and self.bias is None
            and self.constraint is None
            and self.logprobs is None
        )

    def absorb(self, logits: torch.Tensor, model: DiffusionGemmaModel) -> torch.Tensor | None:
        """Sample, accept and renoise from one step's logits [1, L, V] without waiting on the
        device. Returns the adaptive-stopping verdict as a device bool (None: this row has no
        adaptive stopping); `end_step` takes it as a host bool once every row has sampled."""
        s = self.settings
        temp = temperature(s, self.remaining, logits.device)
        if self.bias is not None:
            if self.logprobs is not None:  # logprobs read the model's own distribution
                self.model_logits = logits / temp
            self.bias.apply(logits)  # in place: this row's slice of the step's logits
        processed = logits / temp
        probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
        # L x V floats are kept past this call only where the canvas's end reads them
        if self.constraint is not None or self.logprobs is not None:
            self.last_logits = processed
        argmax = torch.argmax(processed, dim=-1)
        return self._take(probs, argmax, token_entropy(processed, probs), model, probs)

    def _take(
        self,
        probs: torch.Tensor,
        argmax: torch.Tensor,
        entropy: torch.Tensor,
        model: DiffusionGemmaModel,
        soft_input: torch.Tensor,
    ) -> torch.Tensor | None:
        """The step's draws from `probs`: sample every position, accept the lowest-entropy
        ones within the bound, renoise the rest; the next step's self-conditioning from
        `soft_input` (`probs`, or the same in the weights' dtype)."""
        s = self.settings
        sampled = torch.multinomial(
            probs.view(-1, self.vocab_size), num_samples=1, generator=self.generator
        ).view(1, self.canvas_length)
        self.argmax = argmax
        accept = accepted_mask(entropy, s.entropy_bound)
        accepted = torch.where(accept, sampled, self.current)
        self.current = torch.where(~accept, self._random_canvas(), accepted)
        verdict = None
        if s.adaptive_stop:
            verdict = self._stable() & (entropy.mean(dim=-1)[0] < s.stop_entropy)
        self.remaining -= 1
        self.forwards += 1
        # the next step's self-conditioning (unused if the canvas ends: the next starts bare)
        self.soft = model.soft_embedding(soft_input)
        return verdict

    def end_step(self, stopped: bool) -> list[int] | None:
        """After `absorb`: the finished canvas's tokens, or None if the canvas goes on
        (`stopped`: the adaptive-stopping verdict)."""
        if not (stopped or self.remaining == 0):
            return None
        canvas = self._finish_canvas()
        self.last_logits = self.model_logits = None
        return canvas

    def _stable(self) -> torch.Tensor:
        """The argmax canvas equals each of the last `stability_threshold` ones (a device
        bool)."""
        n = self.settings.stability_threshold
        if n == 0:
            return torch.ones((), dtype=torch.bool, device=self.argmax.device)
        if self.history is None:
            self.history = torch.full((n, *self.argmax.shape), -1, device=self.argmax.device)
        stable = (self.history == self.argmax[None]).all()
        self.history = torch.roll(self.history, shifts=-1, dims=0)
        self.history[-1] = self.argmax
        return stable

    def _finish_canvas(self) -> list[int]:
        canvas = self.argmax
        if self.constraint is not None:
            start = self.canvases_done * self.canvas_length
            walked = self.constraint.walk(self.last_logits[0], start)
            canvas, self.failure = walked.tokens[None], walked.failure
            self.done |= walked.failure is not None
        if self.logprobs is not None:
            model = self.model_logits if self.model_logits is not None else self.last_logits
            self.canvas_logprobs = canvas_logprobs(
                model[0], canvas[0], self.logprobs, self.forwards
            )
        self.canvases_done += 1
        self.to_encode = canvas[0]
        self.current = None  # the next canvas is drawn once this one is encoded
        if self.canvases_done >= self.settings.canvases or bool(
            torch.isin(canvas, self.stop_ids).any()
        ):
            self.done = True
        return canvas[0].tolist()


def canvas_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: int, step: int
) -> list[TokenLogprob]:
    """Each canvas token's log-probability under the last step's distribution (the logits at
    that step's temperature, from which the token is the argmax), with `top_n` alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, tokens[:, None])[:, 0].tolist()
    top_v, top_i = torch.topk(logp, top_n, dim=-1) if top_n else (None, None)
    out = []
    for pos, (token, value) in enumerate(zip(tokens.tolist(), chosen, strict=True)):
        alts = ()
        if top_v is not None:
            alts = tuple(zip(top_i[pos].tolist(), top_v[pos].tolist(), strict=True))
        out.append(TokenLogprob(token, value, step, alts))
    return out


def encode_rows(
    model: DiffusionGemmaModel, rows: list[UniformRow], budget: int | None = None
) -> int:
    """Encode what the rows have pending in one packed encoder forward (`model.encode`) of
    at most `budget` tokens (None: no limit): finished canvases of rows already denoising
    first (they wait on it to go on), then prompts in row order (arrival order). A span that
    does not fit is cut; its rest waits for the next step, so a long prompt is encoded in
    chunks while the other rows keep denoising. Returns the tokens encoded (0: no forward)."""
    pending = [r for r in rows if r.encoding]
    pending.sort(key=lambda r: r.canvases_done == 0)  # stable: canvases, then prompts
    left = budget if budget is not None else sum(r.to_encode.numel() for r in pending)
    spans = []
    for row in pending:
        if left <= 0:
            break
        span = row.take_span(left)
        left -= span.numel()
        spans.append((span, row.cache))
    if spans:
        model.encode(spans)
    return sum(span.numel() for span, _ in spans)


def step_rows(
    model: DiffusionGemmaModel,
    rows: list[UniformRow],
    decode: Callable | None = None,
    encode_budget: int | None = None,
) -> list[list[int] | None]:
    """One step for every row: `encode_rows` (at most `encode_budget` tokens), then
    `denoise_rows`."""
    encode_rows(model, rows, encode_budget)
    return denoise_rows(model, rows, decode)


def denoise_rows(
    model: DiffusionGemmaModel, rows: list[UniformRow], decode: Callable | None = None
) -> list[list[int] | None]:
    """One denoising step for every row with nothing left to encode: a new canvas where the
    last one ended, one decoder forward over all their canvases (`decode`, e.g. a
    `DecodeGraph`; the model's `decode_hidden` if None), then each row samples, accepts and
    renoises with its own generator. Per row: its finished canvas, or None (the canvas goes
    on, or the row is still encoding and did not denoise)."""
    live = [row for row in rows if not row.encoding]
    for row in live:
        if row.current is None:
            row.start_canvas()
    if not live:
        return [None] * len(rows)
    hidden = (decode or model.decode_hidden)(
        torch.cat([r.current for r in live]), [r.soft for r in live], [r.cache for r in live]
    )
    # each row's logits alone (L x V float32 each), sampled from and dropped
    verdicts = [row.absorb_hidden(hidden[i : i + 1], model) for i, row in enumerate(live)]
    # one wait on the device per step, for every row's adaptive-stopping verdict
    pending = [v for v in verdicts if v is not None]
    stopped = iter(torch.stack(pending).tolist() if pending else [])
    ended = {
        id(row): row.end_step(v is not None and next(stopped))
        for row, v in zip(live, verdicts, strict=True)
    }
    return [ended.get(id(row)) for row in rows]


def generate(
    model: DiffusionGemmaModel,
    prompts: list[list[int]],
    settings: list[UniformSettings],
    seeds: list[int | None],
    stop_ids: list[int],
) -> list[list[int]]:
    """Decode prompts together to the end (the engine's rows, without a server): the tokens
    of each row's finished canvases, whole (the caller cuts at stops and max_tokens)."""
    return run_rows(model, make_rows(model, prompts, settings, seeds, stop_ids))


def make_rows(
    model: DiffusionGemmaModel,
    prompts: list[list[int]],
    settings: list[UniformSettings],
    seeds: list[int | None],
    stop_ids: list[int],
) -> list[UniformRow]:
    device = next(model.parameters()).device
    stops = torch.tensor(stop_ids, device=device)
    return [
        UniformRow(
            torch.tensor(p, device=device),
            s,
            seed=seed,
            n_layers=len(model.model.decoder.layers),
            canvas_length=model.canvas_length,
            vocab_size=model.vocab_size,
            stop_ids=stops,
        )
        for p, s, seed in zip(prompts, settings, seeds, strict=True)
    ]


def run_rows(model: DiffusionGemmaModel, rows: list[UniformRow]) -> list[list[int]]:
    """Step `rows` together until each is done; each row's finished canvases, whole."""
    out: list[list[int]] = [[] for _ in rows]
    while True:
        live = [i for i, r in enumerate(rows) if not r.done]
        if not live:
            return out
        for i, canvas in zip(live, step_rows(model, [rows[i] for i in live]), strict=True):
            if canvas is not None:
                out[i].extend(canvas)
