"""Generation: every prompt checked against the limits and the vocabulary, then sampled under the
pause gate's read side, so that no sample mixes two weight versions."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import TYPE_CHECKING

from rollout_server.engine.base import EngineError, UnsupportedError
from rollout_server.engine.prompt_render import (
    CHARS_PER_TOKEN,
    PromptTooLong,
    RenderTimeout,
    text_chars,
)
from rollout_server.errors import BadRequest, NonFiniteWeights, ServiceError, Unavailable
from rollout_server.generation.client_work import ClientWork
from rollout_server.protocol import (
    GenerateRequest,
    GenerateResponse,
    PromptResult,
    Sample,
    SamplingParams,
)

if TYPE_CHECKING:
    from rollout_server.core import ServerCore
    from rollout_server.engine.base import SampleOutput


class NonFiniteLogprobs(ServiceError):
    """Finite weights gave NaN/inf log-probs: the server cannot answer the request (500), and
    the message says what may have caused it rather than blaming NaN weights."""

    status_code = 500


def _finite(logprobs: list[float]) -> bool:
    return math.isfinite(sum(logprobs))


class GenerationService:
    def __init__(self, core: ServerCore) -> None:
        self.core = core
        self.client_work = ClientWork()

    def close(self) -> None:
        self.client_work.close()

    def check_limits(self, req: GenerateRequest) -> None:
        lim = self.core.limits
        for field, value, limit, flag in (
            ("prompts", len(req.prompts), lim.max_batch_size, "--max-batch-size"),
            ("n", req.n, lim.max_n, "--max-n"),
            ("max_tokens", req.max_tokens, lim.max_tokens, "--max-tokens"),
        ):
            if value > limit:
                what = f"{value} prompts" if field == "prompts" else f"{field}={value}"
                raise BadRequest(
                    f"{what} exceeds the server limit of {limit} (lower it, or restart the "
                    f"server with a larger {flag})"
                )

    def _prompt_limit(self, max_model_len: int) -> tuple[int, str, str]:
        """A prompt's token limit, its name and the flag that raises it."""
        max_prompt_len = self.core.limits.max_prompt_len
        limit = min(max_prompt_len, max_model_len - 1)
        if limit == max_prompt_len:
            return limit, "max_prompt_len", "--max-prompt-len"
        return limit, "max_model_len - 1 (room for one completion token)", "--max-model-len"

    def _tokenize(self, stop: threading.Event, req: GenerateRequest) -> list[list[int]]:
        """Token ids of every prompt, each checked against the limits and the vocabulary.

        Runs on the client-work thread; ``stop`` is set when the client left, and the prompts
        not yet tokenized are then skipped."""
        engine = self.core.engine
        info = engine.info()
        limit, which, flag = self._prompt_limit(info.max_model_len)
        max_chars = limit * CHARS_PER_TOKEN
        out = []
        for i, prompt in enumerate(req.prompts):
            if stop.is_set():
                raise BadRequest("the client left before its prompts were tokenized")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = [m.model_dump() for m in prompt]
                chars = text_chars(prompt) + text_chars(req.tools)
                what = "of chat messages and tools"
            else:
                chars = len(prompt) if isinstance(prompt, str) else 0
                what = "of text"
            too_long = (
                f"more than the {max_chars} allowed before tokenizing ({CHARS_PER_TOKEN} per "
                f"token of the limit {which} = {limit}): send a shorter prompt, or restart the "
                f"server with a larger {flag}"
            )
            if chars > max_chars:
                raise BadRequest(f"prompts[{i}] has {chars} characters {what}, {too_long}")
            try:
                ids = engine.tokenize_prompt(
                    prompt,
                    add_generation_prompt=req.add_generation_prompt,
                    chat_template_kwargs=req.chat_template_kwargs,
                    tools=req.tools,
                    max_chars=max_chars,
                )
            except PromptTooLong as exc:
                raise BadRequest(
                    f"prompts[{i}] renders through the chat template to {exc.chars} "
                    f"characters, {too_long}"
                ) from None
            except RenderTimeout as exc:
                raise BadRequest(
                    f"prompts[{i}]: {exc} (its messages or chat_template_kwargs keep the "
                    "server's template looping); nothing was generated"
                ) from None
            except Exception as exc:  # template errors, bad message structure
                raise BadRequest(
                    f"prompts[{i}] could not be tokenized: {type(exc).__name__}: {exc}"
                ) from exc
            out.append(self._check_prompt(i, ids, info.vocab_size, limit, which, flag))
        for t in req.stop_token_ids:
            if not 0 <= t < info.vocab_size:
                raise BadRequest(f"stop_token_ids: {t} is not a token id (vocab {info.vocab_size})")
        return out

    async def tokenize(self, req: GenerateRequest) -> list[list[int]]:
        """``_tokenize`` in a thread of the loop's own when every prompt is token ids (checked
        in bounded time, nothing to render or encode), else on the client-work thread, so that
        no text or chat prompt holds up the requests that send ids."""
        if all(isinstance(p, list) and (not p or isinstance(p[0], int)) for p in req.prompts):
            return await asyncio.to_thread(self._tokenize, threading.Event(), req)
        return await self.client_work.run(self._tokenize, req)

    def _check_prompt(
        self, i: int, ids: list[int], vocab: int, limit: int, which: str, flag: str
    ) -> list[int]:
        if not ids:
            raise BadRequest(f"prompts[{i}] is empty (no tokens); send at least one token")
        if len(ids) > limit:
            raise BadRequest(
                f"prompts[{i}] has {len(ids)} tokens, more than the limit {which} = {limit}: "
                f"send a shorter prompt, or restart the server with a larger {flag}"
            )
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(
                f"prompts[{i}] contains token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
            )
        return ids

    @staticmethod
    def check_tools(req: GenerateRequest) -> None:
        """``tools`` reach the model only through the chat template: refuse them with a prompt
        the template never sees, rather than drop them silently."""
        if not req.tools:
            return
        for i, prompt in enumerate(req.prompts):
            if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
                kind = "text" if isinstance(prompt, str) else "token ids"
                raise BadRequest(
                    f"prompts[{i}] is {kind}, but tools apply only to chat-message prompts "
                    "(the chat template renders them): send the prompt as chat messages, or "
                    "leave tools out"
                )

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        core = self.core
        core.require_loaded()
        self.check_limits(req)
        self.check_tools(req)
        if req.return_routed_experts and (why := core.engine.routed_experts_refusal()):
            raise BadRequest(f"return_routed_experts: {why}")
        prompt_ids = await self.tokenize(req)
        params = req.sampling()
        async with core.gate.read(abortable=True):
            core.require_ready()
            version = core.version
            start = time.perf_counter()
            try:
                outputs = await core.engine.generate(prompt_ids, req.n, params)
                if params.logprobs:  # under the gate: the weights checked are those that sampled
                    await self._check_finite_logprobs(outputs, version, params)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or not core.gate.take_aborted(task):
                    raise  # the client left, or the server stops
                task.uncancel()
                raise Unavailable(
                    "generation aborted by POST /pause?mode=abort (a trainer's weight update): "
                    "send the request again; it starts once the server is resumed"
                ) from None
        results = [
            PromptResult(
                prompt_token_ids=ids,
                samples=[
                    Sample(
                        token_ids=o.token_ids,
                        logprobs=o.logprobs if params.logprobs else [],
                        text=o.text,
                        finish_reason=o.finish_reason,
                        weight_version=version,
                        routed_experts=o.routed_experts,
                    )
                    for o in outs
                ],
            )
            for ids, outs in zip(prompt_ids, outputs, strict=True)
        ]
        self._record_generation(results, time.perf_counter() - start)
        return GenerateResponse(results=results, weight_version=version)

    async def _check_finite_logprobs(
        self, outputs: list[list[SampleOutput]], version: int, params: SamplingParams
    ) -> None:
        """JSON has no NaN/inf (they would go out as null and break ``list[float]``). Log-probs
        are <= 0, so a finite list sums to a finite number, and one ``sum`` per sample finds a
        NaN or an inf. The weights are then checked before they are blamed: finite weights can
        overflow too (values near float32's limit), and so can extreme sampling values."""
        bad = next(
            (i for i, samples in enumerate(outputs) for o in samples if not _finite(o.logprobs)),
            None,
        )
        if bad is None:
            return
        what = (
            f"the served weights (version {version}) produce non-finite log-probs (NaN or inf) "
            f"for prompts[{bad}] under the request's sampling values ({params.describe()})"
        )
        try:
            checksum = await self.core.engine.weights_checksum()
        except (UnsupportedError, EngineError):
            raise NonFiniteLogprobs(
                f"{what}: either those values are numerically degenerate for this model, or the "
                "weights hold NaN/inf or values large enough to overflow (this engine cannot "
                "scan them: compare GET /weights/checksum with the learner's)"
            ) from None
        if not math.isfinite(checksum):
            raise NonFiniteWeights(
                f"{what}: the weights hold NaN/inf values, which came with the checkpoint the "
                "server started from (updates holding them are refused); load finite weights"
            )
        raise NonFiniteLogprobs(
            f"{what}; the weights hold no NaN or inf, so either those sampling values are "
            "numerically degenerate for this model, or the weights are finite but large enough "
            "to overflow the forward pass: try other sampling values, or load weights of a "
            "sane scale"
        )

    def _record_generation(self, results: list[PromptResult], seconds: float) -> None:
        m = self.core.metrics
        generated = sum(len(s.token_ids) for r in results for s in r.samples)
        m.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in results))
        m.generation_tokens.inc(generated)
        for r in results:
            for s in r.samples:
                m.samples.labels(s.finish_reason).inc()
        if seconds > 0:
            m.tokens_per_second.set(generated / seconds)
