"""The learner's HTTP client for its rollout servers, of the API they speak
(``rollout.server_api``): ours, or a stock ``vllm serve``'s (``rollout_server.client_vllm``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout_server.client import RolloutClient

if TYPE_CHECKING:
    from learner.config import LearnerConfig


def make_client(
    cfg: LearnerConfig,
    tokenizer: Any,
    urls: list[str],
    api_key: str | None,
    vocab_size: int | None = None,
) -> RolloutClient:
    """A client for ``urls``; a stock vLLM server does not report the model's dtype, vocabulary
    (``vocab_size``: the model's, else the tokenizer's) or EOS ids, so its client is given the
    learner's."""
    rollout = cfg.rollout
    options: dict[str, Any] = {
        "api_key": api_key,
        "timeout_s": rollout.timeout_s,
        "max_retries": rollout.max_retries,
    }
    if rollout.server_api == "vllm":
        from rollout_server.client_vllm import VllmServeClient

        eos = tokenizer.eos_token_id
        return VllmServeClient(
            urls,
            dtype=cfg.model.dtype,
            vocab_size=vocab_size or len(tokenizer),
            eos_token_ids=[eos] if eos is not None else [],
            tokenizer=tokenizer,
            **options,
        )
    return RolloutClient(urls, **options)
