"""The engine: requests in, denoising steps over a continuously changing batch, outputs out.

Single-threaded by design (servers wrap it in `EngineLoop`). Each `step()` admits waiting
requests, runs one batched forward for every running row, and retires rows that finished:
early, once their committed prefix holds an end-of-text / end-of-turn token or a stop string,
or at the end of their canvas.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from dlm_protocol.response import CHAT_ROLES, FINISH_TOOL_CALLS
from dlm_protocol.tool_rules import check_tool_call_ids

from .config import EngineConfig
from .decoding.checkpoint_defaults import generation_length
from .decoding.logit_bias import check_vocab
from .decoding.logprobs import LogprobStream, TokenTexts
from .decoding.structured import StructuredOutput
from .errors import InvalidRequestError
from .loader import LoadedModel, load_checkpoint
from .model_runner import ModelRunner
from .models.expert_gemm import ExpertGemm
from .output_state import OutputState
from .outputs import RequestOutput
from .paged_kv import cpu_pool_tokens, page_size
from .prompt_limits import check_prompt_bytes, prompt_byte_cap, prompt_bytes
from .sampling_params import ResolvedParams, SamplingParams, resolve
from .scheduler import Scheduler
from .scoring import ScoreJob, ScoringQueue, run_chunk, summary
from .sequence import Sequence
from .text import StableText
from .tools import (
    ToolCallText,
    ToolSpec,
    bind_format,
    check_call_budget,
    closing_reserve,
    prompt_messages,
    template_has_tools,
    tool_format,
)
from .uniform_runner import UniformRunner


class Engine:
    """Diffusion LM engine over one model (LLaDA or Dream family)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if loaded is None and config.tensor_parallel_size > 1:  # rank 0 of N ranks
            from .parallel import start_tensor_parallel

            loaded = start_tensor_parallel(config)
        self.loaded = loaded or load_checkpoint(
            config.model, config.dtype, config.device, config.quantization, config.revision
        )
        lm = self.loaded
        self.family = lm.family
        self.tokenizer = lm.tokenizer
        self.mask_id = lm.mask_id
        self.stop_ids = lm.stop_ids
        pad_id = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else lm.eos_id
        ExpertGemm.set_mode(config.expert_gemm)  # the MoE experts' kernel, this process
        # DiffusionGemma rows run on their own runner (uniform_runner.py), the rest here
        self.runner = (
            UniformRunner(
                lm,
                config.encode_step_tokens,
                config.encoder_prefix_cache_bytes,
                fused_kernels=config.fused_kernels,
                cuda_graphs=config.cuda_graphs,
            )
            if lm.family.uniform_diffusion
            else ModelRunner(
                lm.model,
                lm.family.name,
                lm.mask_id,
                lm.eos_id,
                pad_id,
                lm.device,
                max_rows=config.max_rows,
                cuda_graphs=config.cuda_graphs,
                max_cuda_graphs=config.max_cuda_graphs,
                cuda_graph_max_tokens=config.cuda_graph_max_tokens,
                fused_kernels=config.fused_kernels,
                lookahead=config.lookahead,
                paged_attention=config.paged_attention,
            )
        )
        self.scheduler = Scheduler(
            config.max_rows,
            config.max_queue,
            config.max_step_tokens,
            config.phase_wait_steps,
            reserve=self.runner.admit,
        )
        self._outputs: dict[str, OutputState] = {}  # per request, admission to final output
        self._token_texts = TokenTexts(lm.tokenizer)
        self._template_tools = template_has_tools(lm.tokenizer)
        self.tool_format = tool_format(lm.family.tool_format, lm.tokenizer)  # the call syntax
        # scoring requests, below generation in the steps' share (scoring.py)
        self._scoring = ScoringQueue(config.score_tokens, int(lm.model.vocab_size))
        self._aborted: list[str] = []
        self.total_forwards = 0
        self.last_step_rows = 0
        self.last_step_seconds = 0.0
        self.mask_token = (  # DiffusionGemma has none (mask_id -1)
            lm.tokenizer.convert_ids_to_tokens(lm.mask_id) if lm.mask_id >= 0 else None
        )
        self.structured = StructuredOutput(lm, self.runner)  # grammar-constrained rows
        self.prompt_byte_cap = prompt_byte_cap(lm.tokenizer, config.max_prompt)
        # max_tokens of a request that names none: the server's, else the checkpoint's published
        # generation length (capped by max_canvas where it is used)
        self.default_max_tokens = config.default_max_tokens or generation_length(
            lm.path, lm.family.name
        )
        # a block-diffusion model's trained block (SDAR config `block_size`); 0 = not
        self.model_block = (
            int(
                lm.config.get("block_size")
                or lm.config.get("bd_size")  # Fast-dLLM v2's name for it
                or lm.family.default_block_length
            )
            if getattr(lm.family, "block_diffusion", False)
            else 0
        )
        if self.model_block:  # their keys/values live in pages of one pool, made now
            # a longest row: prompt, canvas, and the last block's and last page's rounding
            row = config.max_prompt + config.max_canvas + 2 * page_size(self.model_block)
            self.runner.use_pages(
                self.model_block,
                tokens=config.kv_cache_tokens,
                memory_fraction=config.kv_cache_memory_fraction,
                cpu_tokens=cpu_pool_tokens(config.max_rows, row),
                prefix_cache_tokens=config.prefix_cache_tokens,
            )

    # ---- requests -------------------------------------------------------------------------
    def encode_prompt(
        self,
        text: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        input_ids: list[int] | None = None,
        tools: ToolSpec | None = None,
    ) -> list[int]:
        """Prompt token ids from exactly one of: raw text, chat messages, token ids. `tools`
        (a resolved request's `params.tools`) go into the chat template with the messages."""
        given = [
            n
            for n, v in (("text_input", text), ("messages", messages), ("input_ids", input_ids))
            if v is not None
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                "prompt", "give exactly one of text_input, messages, input_ids"
            )
        size = prompt_bytes(text, messages)  # before tokenizing: a len(), not seconds
        check_prompt_bytes(size, self.prompt_byte_cap, self.config.max_prompt, given[0])
        if messages is not None:
            ids = self._encode_messages(messages, tools)
        elif text is not None:
            if not isinstance(text, str):
                raise InvalidRequestError("text_input", "must be a string")
            if self.mask_token and self.mask_token in text:
                raise InvalidRequestError(
                    "text_input", f"must not contain the mask token {self.mask_token}"
                )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self._check_ids(input_ids)
        return self._check_length(ids, given[0])

    def _check_length(self, ids: list[int], field: str) -> list[int]:
        if not ids:
            raise InvalidRequestError(field, "prompt is empty")
        if len(ids) > self.config.max_prompt:
            raise InvalidRequestError(
                field, f"prompt has {len(ids)} tokens; the limit is {self.config.max_prompt}"
            )
        return ids

    def _encode_messages(self, messages: Any, tools: ToolSpec | None = None) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages", "must be a non-empty list")
        for i, m in enumerate(messages):
            calls = m.get("tool_calls") if isinstance(m, dict) else None
            content = m.get("content") if isinstance(m, dict) else None
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not (isinstance(content, str) or (content is None and calls))
            ):
                raise InvalidRequestError(
                    "messages", f"message {i} needs string 'role' and 'content'"
                )
            if m["role"] not in CHAT_ROLES:
                raise InvalidRequestError("messages", f"message {i} has unknown role {m['role']!r}")
            if calls is not None and (m["role"] != "assistant" or not _valid_calls(calls)):
                raise InvalidRequestError(
                    "messages",
                    f"message {i}: tool_calls belong to assistant messages, each "
                    "{function: {name, arguments}}",
                )
            texts = [content or ""] + [json.dumps(c) for c in calls or ()]
            if self.mask_token and any(self.mask_token in t for t in texts):
                raise InvalidRequestError(
                    "messages", f"message {i} contains the mask token {self.mask_token}"
                )
        check_tool_call_ids(messages)
        messages, tool_list = prompt_messages(
            messages, tools, self._template_tools, self.tool_format
        )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tool_list, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # template errors are the request's fault, not the server's
            raise InvalidRequestError("messages", f"chat template failed: {exc}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _check_ids(self, input_ids: Any) -> list[int]:
        if not isinstance(input_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in input_ids
        ):
            raise InvalidRequestError("input_ids", "must be a list of integers")
        vocab = self.runner.model_vocab
        bad = [t for t in input_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError("input_ids", f"token id {bad[0]} outside [0, {vocab})")
        if self.mask_id in input_ids:
            raise InvalidRequestError(
                "input_ids", f"must not contain the mask token id {self.mask_id}"
            )
        return list(input_ids)

    def resolve_params(self, params: SamplingParams | dict[str, Any] | None) -> ResolvedParams:
        """Validate request settings for this model (pure: safe to call from any thread)."""
        if not isinstance(params, SamplingParams):
            params = SamplingParams.from_dict(params)
        resolved = resolve(
            params,
            family=self.family.name,
            default_algorithm=self.family.default_algorithm,
            uses_blocks=self.family.uses_blocks_by_default,
            max_canvas=self.config.max_canvas,
            default_max_tokens=self.default_max_tokens,
            model_defaults=self.loaded.decoding_defaults,
            model_block=self.model_block,
        )
        check_vocab(resolved.logit_bias, self.runner.model_vocab)
        resolved = bind_format(resolved, self.tool_format)  # calls in the family's syntax
        resolved = self.structured.check(resolved)  # the constraint compiles, then its budget
        check_call_budget(resolved.tools, resolved.max_tokens, self.tokenizer)
        return resolved

    def add_request(
        self,
        request_id: str | None,
        prompt_ids: list[int],
        params: SamplingParams | ResolvedParams | dict[str, Any] | None = None,
    ) -> str:
        """Queue a request; it joins the batch at the next step that has room."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.scheduler or request_id in self._scoring:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        resolved = params if isinstance(params, ResolvedParams) else self.resolve_params(params)
        prompt_ids = self._check_length(self._check_ids(list(prompt_ids)), "prompt")
        if resolved.score is not None:  # score the prompt, generate nothing
            self._scoring.add(self._score_job(request_id, prompt_ids, resolved))
            return request_id
        seq = Sequence(
            request_id,
            prompt_ids,
            resolved,
            family=self.family.name,
            mask_id=self.mask_id,
            device=self.loaded.device,
            stop_ids=self.stop_ids,
            eos_id=self.loaded.eos_id,
        )
        seq.constraint = self.structured.row_constraint(resolved)
        if self.family.uniform_diffusion:  # a step feeds its decoder one canvas
            seq.decoder_tokens = self.runner.canvas_length
        if seq.constraint is not None and resolved.tools is not None:
            seq.constraint.reserve += closing_reserve(resolved.tools, self.tokenizer)
        if not self.runner.fits_pool(seq):
            pool = self.runner.block_pages.pool
            raise InvalidRequestError(
                "max_tokens",
                f"prompt + max_tokens need {self.runner.block_pages.worst_case(seq)} KV pages "
                f"of {pool.page_tokens} tokens; this server's pool holds {pool.pages}",
            )
        self.scheduler.add(seq)
        self._outputs[request_id] = OutputState(
            StableText(
                self.tokenizer,
                self.stop_ids,
                resolved.stop,
                keep=self.tool_format.kept if resolved.tools else None,  # markup to parse
            ),
            tools=None if resolved.tools is None else ToolCallText(resolved.tools),
            logprobs=None if resolved.logprobs is None else LogprobStream(self._token_texts),
        )
        return request_id

    def abort(self, request_id: str) -> None:
        """Mark a request to leave before the next step (a final `abort` output follows)."""
        self._aborted.append(request_id)

    def warm_up(self, force: bool = False) -> float | None:
        """Run one short chat request before serving, so that on a CUDA device the fused
        kernels compile and the first CUDA graphs (one row's prompt forward and in-block
        steps) are captured here, not inside the first client's request. Returns the seconds
        it took; None where it does nothing (the CPU compiles nothing), unless `force`. No
        later request's tokens change: the request leaves compiled kernels and graphs behind,
        and its prompt's cached pages carry a salt no other request has."""
        if not force and self.loaded.device.type != "cuda":
            return None
        t0 = time.perf_counter()
        keys: dict[str, Any] = {"max_tokens": 32}
        if self.model_block or self.family.uniform_diffusion:  # models with a prompt cache
            keys["cache_salt"] = f"warm-up {uuid.uuid4().hex}"
        if getattr(self.tokenizer, "chat_template", None):  # as chat requests come
            prompt = self.encode_prompt(messages=[{"role": "user", "content": "Hello!"}])
        else:  # a base model's tokenizer has no template
            prompt = self.encode_prompt(text="Hello!")
        out = self.generate([prompt], keys)[0]
        if out.error:
            raise RuntimeError(f"the warm-up request failed: {out.error}")
        return time.perf_counter() - t0

    def fault(self) -> str | None:
        """Why this engine can serve no request any more, or None: a tensor-parallel worker
        rank exited, or a forward failed part-way and left the ranks out of step. Only a new
        engine (a restarted model) mends it, so a server reports the model dead on it."""
        fault = getattr(self.loaded.model, "fault", None)
        return fault() if fault is not None else None

    def has_unfinished(self) -> bool:
        return bool(
            self.scheduler.running or self.scheduler.waiting or self._aborted or self._scoring
        )

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit, run one denoising step for every running row, retire finished rows.

        The step runs with the model's GPU as the current device, whichever thread calls it:
        streams, events and kernels made without a device take the current one, and a
        replica on cuda:1 stepped from a thread still on cuda:0 (the warm-up, run where the
        server loads the model) would read a copy before it had landed."""
        if self.loaded.device.type != "cuda":
            return self._step()
        with torch.cuda.device(self.loaded.device):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        outputs = self.drain_aborted()
        if not self.runner.holds_lookahead_for(self.scheduler.running):
            self.scheduler.admit()  # else arrivals join next step: the forward ahead is taken
        if self._scoring:  # a chunk of samples, when scoring's share of the steps allows
            outputs += self._score_step()
        seqs = list(self.scheduler.running)
        self.last_step_rows = len(seqs)
        if not seqs:
            self.runner.drop_lookahead()
            return outputs
        # the next step's forward may be queued ahead only if nobody waits to join then
        generation_tokens = self.scheduler.running_tokens()
        windows = self.runner.step(seqs, look_ahead=not self.scheduler.waiting)
        self.total_forwards += 1
        self._scoring.earn(generation_tokens)
        now = time.monotonic()
        failed = self.runner.failed_rows
        for i, (seq, window) in enumerate(zip(seqs, windows, strict=False)):
            if i in failed:  # this row alone ends with an error; the others go on
                outputs.append(self._fail_row(seq, failed[i]))
                continue
            seq.absorb(window)
            out = self._output_for(seq, now)
            if out is not None:
                outputs.append(out)
        for seq in seqs:
            if seq.finished:
                self.runner.release(seq.request_id)
        self.scheduler.retire_finished()
        self.last_step_seconds = time.monotonic() - t0
        return outputs

    def _output_for(self, seq: Sequence, now: float) -> RequestOutput | None:
        state = self._outputs[seq.request_id]
        st = state.text
        # max_nfe spent: the last forward committed the active block; the request ends there.
        done_canvas = seq.canvas_done or seq.nfe_spent
        update = st.update(seq.committed_prefix(), canvas_complete=done_canvas)
        if update.finished:
            seq.finished = True
            seq.finish_reason = update.finish_reason
        delta, text, tool_calls = update.delta, st.sent, None
        tool_text = state.tools
        if tool_text is not None:  # content stops where a tool call may begin
            cut = seq.finish_reason == "length"
            delta, tool_calls = tool_text.update(st.sent, seq.finished, cut)
            text = tool_text.sent
            if tool_calls and seq.finish_reason in ("stop", "length") and not tool_text.answer.cut:
                seq.finish_reason = FINISH_TOOL_CALLS  # a call cut unfinished stays `length`
        if delta and seq.first_token_time is None:
            seq.first_token_time = now
        canvas = self._canvas_strings(seq) if seq.params.stream_mode == "denoise" else None
        if not (delta or seq.finished or canvas is not None):
            return None
        logprobs = None
        stream = state.logprobs
        if stream is not None:
            # with call markup in the answer, only the content's tokens have entries
            markup = tool_text is not None and tool_text.answer and tool_text.answer.markup
            logprobs = stream.release(seq, st.token_ids, text, seq.finished and not markup)
        if seq.finished:
            del self._outputs[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            text=text,
            delta_text=delta,
            token_ids=list(st.token_ids),
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.prompt_len,
            completion_tokens=st.completion_tokens,
            steps=seq.forwards,
            canvas=canvas,
            metrics=self._timing(seq, now),
            logprobs=logprobs,
            tool_calls=tool_calls,
            cached_tokens=seq.cached_tokens,
        )

    @staticmethod
    def _timing(seq: Sequence, now: float) -> dict[str, float]:
        m = {"elapsed_s": now - seq.arrival_time}
        if seq.first_token_time is not None:
            m["first_token_s"] = seq.first_token_time - seq.arrival_time
        return m

    def _canvas_strings(self, seq: Sequence) -> list[str | None]:
        tok = self.tokenizer
        # DiffusionGemma has no masks: its canvas in progress is shown, renoised tokens included
        canvas = self.runner.shown_canvas(seq) if self.family.uniform_diffusion else seq.canvas
        return [None if t == seq.mask_id else tok.decode([t]) for t in canvas]

    # ---- scoring ------------------------------------------------------------------------
    def _score_job(
        self, request_id: str, prompt_ids: list[int], params: ResolvedParams
    ) -> ScoreJob:
        shift = self.runner.shift
        if len(prompt_ids) <= shift:
            raise InvalidRequestError("prompt", f"needs at least {shift + 1} tokens to be scored")
        generator = torch.Generator()
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        return ScoreJob(
            request_id, prompt_ids, params.score or 1, generator, shift, params.priority
        )

    def _score_step(self) -> list[RequestOutput]:
        """One chunk of the next scoring request's samples if scoring's share of the steps
        allows it (generation rows go first); its output once it has all."""
        turn = self._scoring.take_turn(bool(self.scheduler.running))
        if turn is None:
            return []
        job, rows = turn
        try:
            run_chunk(job, self.runner.model, self.mask_id, self.loaded.device, rows)
        except Exception as exc:  # this request alone fails; generation goes on
            self._scoring.remove(job.request_id)
            return [
                self._score_output(job, "error", f"internal error: {type(exc).__name__}: {exc}")
            ]
        self.total_forwards += 1
        if not job.finished:
            return []
        self._scoring.remove(job.request_id)
        return [self._score_output(job, "length")]

    def _score_output(self, job: ScoreJob, reason: str, error: str | None = None) -> RequestOutput:
        """The one output of a scoring request: the text (echo), per-token values in
        `logprobs` (`logprob` = the estimate, `variance`) and the totals in `score`."""
        logprobs = score = None
        text = ""
        if reason == "length":
            values, variances, score = summary(job)
            logprobs = [
                {**self._token_texts.entry(t, v), "variance": var}
                for t, v, var in zip(job.ids, values, variances, strict=True)
            ]
            text = self.tokenizer.decode(
                job.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        return RequestOutput(
            request_id=job.request_id,
            text=text,
            delta_text=text,
            token_ids=list(job.ids),
            finished=True,
            finish_reason=reason,
            prompt_tokens=len(job.ids),
            completion_tokens=0,
            steps=job.forwards,
            error=error,
            logprobs=logprobs,
            score=score,
        )

    def drain_aborted(self) -> list[RequestOutput]:
        """Remove aborted requests now; one final `abort` output each."""
        outs = []
        for rid in self._aborted:
            job = self._scoring.remove(rid)
            if job is not None:
                outs.append(self._score_output(job, "abort"))
                continue
            seq = self.scheduler.remove(rid)
            if seq is None:
                continue
            self.runner.release(rid)
            outs.append(self._ended_output(seq, "abort"))
        self._aborted.clear()
        return outs

    def _fail_row(self, seq: Sequence, message: str) -> RequestOutput:
        seq.finished = True
        seq.finish_reason = "error"
        return self._ended_output(seq, "error", message)

    def _ended_output(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        """The final output of a request ended early (aborted, or its row failed): the text
        already sent stands, nothing more is added."""
        state = self._outputs.pop(seq.request_id)
        st = state.text
        return RequestOutput(
            request_id=seq.request_id,
            text=state.sent,
            delta_text="",
            token_ids=list(st.token_ids),
            finished=True,
            finish_reason=reason,
            prompt_tokens=seq.prompt_len,
            completion_tokens=st.completion_tokens,
            steps=seq.forwards,
            error=error,
            metrics=self._timing(seq, time.monotonic()),
            cached_tokens=seq.cached_tokens,
        )

    def drop_running(self) -> list[tuple[str, int]]:
        """Remove every running row (after a failed step); returns (request id, prompt tokens)."""
        dropped = []
        for seq in list(self.scheduler.running):
            self.scheduler.remove(seq.request_id)
            self.runner.release(seq.request_id)
            self._outputs.pop(seq.request_id, None)
            dropped.append((seq.request_id, seq.prompt_len))
        return dropped

    # ---- convenience ------------------------------------------------------------------------
    def outputs(self) -> Iterator[RequestOutput]:
        """Step until every request has finished, yielding outputs as they come; requests may
        be added or aborted between items."""
        while self.has_unfinished():
            yield from self.step()

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams
        | dict[str, Any]
        | list[SamplingParams | dict[str, Any]]
        | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion together (batched); final outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(None, p, sp) for p, sp in zip(prompts, plist, strict=False)]
        final = {o.request_id: o for o in self.outputs() if o.finished}
        return [final[i] for i in ids]


def _valid_calls(calls: Any) -> bool:
    """OpenAI's assistant `tool_calls`: [{id?, type?, function: {name, arguments}}]."""
    return isinstance(calls, list) and all(
        isinstance(c, dict)
        and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", "{}"), str | dict)
        for c in calls
    )
