"""The learner's client for stock ``vllm serve`` servers (``rollout.server_api = "vllm"``).

A ``RolloutClient`` whose calls go to vLLM's own routes: generation through
``/v1/completions`` with token-id prompts, ``return_token_ids`` and the sampled tokens'
log-probs; readiness through ``/health``; sleep and wake-up through vLLM's ``/sleep`` and
``/wake_up`` (query parameters); the weights through vLLM's RL routes (``RolloutClient.native``,
driven by ``learner.sync.vllm``). vLLM needs ``VLLM_SERVER_DEV_MODE=1`` for the sleep and RL
routes, and ``--weight-transfer-config`` for the weights.

What a stock server does not have is kept here or taken from the learner:

- **versions**: vLLM serves no weight version; this client counts the updates it finished on
  each server, so ``/info``'s ``weight_version`` is the learner's own bookkeeping;
- **model facts** vLLM does not report (dtype, vocabulary size, EOS ids) are the learner's, given
  to the constructor; ``max_model_len`` and the model id come from ``/v1/models``;
- **limits**: vLLM has no per-request limits like our server's, so none are reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_server.client import RolloutClient
from rollout_server.client_http import RolloutError
from rollout_server.protocol import (
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    Limits,
    PromptResult,
    Sample,
    SleepStatus,
)

UNLIMITED = 1 << 30  # vLLM enforces no per-request limit of ours; max_model_len bounds tokens


class VllmServeClient(RolloutClient):
    """Talks to stock vLLM servers; ``dtype``, ``vocab_size`` and ``eos_token_ids``: the
    learner's model's (vLLM does not report them)."""

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        dtype: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        tokenizer: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(base_urls, **options)
        self._facts = {"dtype": dtype, "vocab_size": vocab_size, "eos": list(eos_token_ids)}
        self.tokenizer = tokenizer  # renders chat prompts (vLLM's completions take ids or text)
        self.versions: dict[str, int] = {}  # updates finished per server, as the learner counts
        self._models: dict[str, dict[str, Any]] = {}  # /v1/models' card, per server

    def subset(self, urls: Sequence[str]) -> VllmServeClient:
        f = self._facts
        sub = VllmServeClient(
            list(urls), dtype=f["dtype"], vocab_size=f["vocab_size"], eos_token_ids=f["eos"],
            tokenizer=self.tokenizer, **self._options,
        )  # fmt: skip
        sub.versions = self.versions  # one count per server, whichever client finished it
        return sub

    async def _probe(self, server: str, path: str, *, auth_fails: bool = False) -> str | None:
        # vLLM's /health answers 200 once the engine serves; it has no /ready
        return await super()._probe(server, "/health" if path == "/ready" else path,
                                    auth_fails=auth_fails)  # fmt: skip

    async def _card(self, server: str) -> dict[str, Any]:
        if server not in self._models:
            resp = await self._calls.call(server, "GET", "/v1/models")
            cards = resp.json().get("data") or []
            if not cards:
                raise RolloutError(server, "GET /v1/models listed no model")
            self._models[server] = cards[0]
        return self._models[server]

    async def info_of(self, server: str) -> InfoResponse:
        card = await self._card(server)
        asleep = (await self._calls.call(server, "GET", "/is_sleeping")).json()["is_sleeping"]
        max_len = int(card.get("max_model_len") or UNLIMITED)
        f = self._facts
        return InfoResponse(
            model=str(card["id"]), engine="vllm-serve", dtype=f["dtype"], device="cuda",
            max_model_len=max_len, vocab_size=f["vocab_size"], eos_token_ids=f["eos"],
            weight_version=self.versions.get(server, 0), sleeping=bool(asleep),
            sleep_level=0, tensor_parallel_size=await self.world_size(server),
            limits=Limits(max_n=UNLIMITED, max_tokens=max_len, max_prompt_len=max_len,
                          max_batch_size=UNLIMITED, max_body_mb=UNLIMITED,
                          max_json_body_mb=UNLIMITED),
            weight_transports=["vllm"],
        )  # fmt: skip

    async def info(self) -> list[InfoResponse]:
        return await self._calls.all(self.info_of)

    async def _generate_request(self, server: str, sub: GenerateRequest) -> GenerateResponse:
        """``sub`` as one ``POST /v1/completions``; choice ``i`` is prompt ``i // n``'s."""
        body = completion_body(sub, str((await self._card(server))["id"]), self.tokenizer)
        resp = await self._calls.call(server, "POST", "/v1/completions", body=body)
        version = self.versions.get(server, 0)
        return GenerateResponse(
            results=completion_results(resp.json(), sub, version, server),
            weight_version=version,
        )

    async def sleep(self, level: int = 1) -> None:
        await self._calls.all(
            lambda s: self._calls.call(s, "POST", "/sleep", params={"level": level}, retry=False)
        )

    async def wake_up(self, tags: list[str] | None = None) -> None:
        params = {"tags": tags} if tags else None
        await self._calls.all(
            lambda s: self._calls.call(s, "POST", "/wake_up", params=params, retry=False)
        )

    async def is_sleeping(self) -> list[SleepStatus]:
        async def one(server: str) -> SleepStatus:
            asleep = (await self._calls.call(server, "GET", "/is_sleeping")).json()
            return SleepStatus(is_sleeping=bool(asleep["is_sleeping"]), level=0)

        return await self._calls.all(one)

    async def weights_checksum(self) -> Any:
        raise RolloutError(
            ",".join(self.servers), "a stock vllm serve has no weights checksum route"
        )


def completion_body(req: GenerateRequest, model: str, tokenizer: Any = None) -> dict[str, Any]:
    """``/v1/completions``'s body for ``req``: token ids and text as they are, chat messages
    rendered to ids with ``tokenizer``'s chat template (as our server renders them)."""
    prompts: list[Any] = []
    for p in req.prompts:
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if tokenizer is None:
                raise ValueError(
                    "chat-message prompts need the model's chat template: give "
                    "VllmServeClient the tokenizer, or send token ids or text"
                )
            from rollout_server.engine.base import prompt_ids

            messages = [m.model_dump(exclude_none=True) for m in p]
            p = prompt_ids(
                tokenizer, messages, add_generation_prompt=req.add_generation_prompt,
                chat_template_kwargs=req.chat_template_kwargs, tools=req.tools,
            )  # fmt: skip
        prompts.append(p)
    body: dict[str, Any] = {
        "model": model, "prompt": prompts, "n": req.n, "max_tokens": req.max_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "repetition_penalty": req.repetition_penalty, "stop": req.stop,
        "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "return_token_ids": True, "skip_special_tokens": False,
    }  # fmt: skip
    if req.seed is not None:
        body["seed"] = req.seed
    if req.logprobs:
        body["logprobs"] = 0  # the sampled tokens' own log-probs, no alternatives
    return body


def completion_results(
    answer: dict[str, Any], req: GenerateRequest, version: int, server: str
) -> list[PromptResult]:
    """``/v1/completions``' choices as ``n`` samples per prompt, in prompt order."""
    choices = sorted(answer.get("choices") or [], key=lambda c: c["index"])
    if len(choices) != len(req.prompts) * req.n:
        raise RolloutError(
            server, f"/v1/completions returned {len(choices)} choices for "
            f"{len(req.prompts)} prompt(s) x n={req.n}",
        )  # fmt: skip
    results = []
    for k in range(len(req.prompts)):
        mine = choices[k * req.n : (k + 1) * req.n]
        samples = [_sample(c, req.logprobs, version, server) for c in mine]
        prompt_ids = mine[0].get("prompt_token_ids")
        if prompt_ids is None:
            raise RolloutError(server, "/v1/completions returned no prompt_token_ids")
        results.append(PromptResult(prompt_token_ids=prompt_ids, samples=samples))
    return results


def _sample(choice: dict[str, Any], logprobs: bool, version: int, server: str) -> Sample:
    ids = choice.get("token_ids")
    if ids is None:
        raise RolloutError(server, "/v1/completions returned no token_ids (a vLLM before 0.10.2?)")
    lps: list[float] = []
    if logprobs:
        lps = [float(x) for x in ((choice.get("logprobs") or {}).get("token_logprobs") or [])]
        if len(lps) != len(ids):
            raise RolloutError(
                server, f"/v1/completions returned {len(lps)} log-probs for {len(ids)} tokens"
            )
    reason = choice.get("finish_reason") or "length"
    return Sample(
        token_ids=ids, logprobs=lps, text=choice.get("text") or "",
        finish_reason=reason if reason in ("stop", "length", "abort") else "stop",
        weight_version=version,
    )  # fmt: skip
