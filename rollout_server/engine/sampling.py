"""Logit processing and sampling as small pure tensor functions (one row per sequence).

The log-prob reported for a sampled token is its log-prob under the distribution it was drawn
from: repetition penalty, then temperature, then top-k, top-p and min-p filtering, renormalised.
That is what the learner's importance-sampling correction needs (the "behaviour" policy). For
greedy rows (temperature 0) nothing is filtered and the log-prob is the plain log-softmax of the
(penalised) logits, i.e. the model's own probability of its argmax.

Each row carries its own parameters, so requests with different sampling settings share a batch.
"""

from __future__ import annotations

import torch


def apply_repetition_penalty(
    logits: torch.Tensor,  # [B, V]
    seen: torch.Tensor,  # [B, V] bool: token occurs in the prompt or the completion so far
    penalty: torch.Tensor,  # [B]
) -> torch.Tensor:
    """vLLM/HF (CTRL) penalty: seen tokens' positive logits are divided, negative multiplied."""
    pen = penalty[:, None].to(logits.dtype)  # [B, 1]
    penalised = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(seen, penalised, logits)


def sampling_logprobs(
    logits: torch.Tensor,  # [B, V] float32
    temperature: torch.Tensor,  # [B]; 0 = greedy
    top_k: torch.Tensor,  # [B] int; <= 0 disables
    top_p: torch.Tensor,  # [B]; 1 disables
    min_p: torch.Tensor,  # [B]; 0 disables
) -> torch.Tensor:
    """Log-probs of the sampling distribution, [B, V]; filtered-out tokens are -inf."""
    vocab = logits.shape[-1]
    greedy = temperature <= 0  # [B]
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.dtype)
    scaled = logits / temp[:, None]  # [B, V]
    k = torch.where(greedy | (top_k <= 0) | (top_k >= vocab), vocab, top_k)  # [B]
    p = torch.where(greedy, torch.ones_like(top_p), top_p).to(logits.dtype)  # [B]
    if bool((k < vocab).any()) or bool((p < 1).any()):
        scaled = _top_k_top_p(scaled, k, p)
    m = torch.where(greedy, torch.zeros_like(min_p), min_p).to(logits.dtype)  # [B]
    if bool((m > 0).any()):
        probs = scaled.softmax(-1)  # [B, V]
        threshold = probs.amax(-1, keepdim=True) * m[:, None]  # [B, 1]
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
    return scaled.log_softmax(-1)


def _top_k_top_p(
    scaled: torch.Tensor,  # [B, V]
    k: torch.Tensor,  # [B], vocab = off
    p: torch.Tensor,  # [B], 1 = off
) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest prefix of those whose mass reaches p
    (the most likely token always stays). Top-p sees the top-k-renormalised distribution."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab, device=scaled.device)  # [V]
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(-1)  # [B, V]
    mass_before = probs.cumsum(-1) - probs  # [B, V]: mass of the strictly more likely tokens
    drop = (mass_before >= p[:, None]) & (p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)


def sample_tokens(
    logprobs: torch.Tensor,  # [B, V], -inf for filtered tokens
    greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [B] float64 in [0, 1), one draw per row from its own generator
) -> torch.Tensor:
    """Inverse-CDF sampling from each row's distribution (argmax for greedy rows), [B] long.

    Taking one uniform per row from a per-row generator (rather than one ``multinomial`` over
    the batch) makes a row's tokens depend only on its seed, not on what it was batched with."""
    vocab = logprobs.shape[-1]
    probs = logprobs.double().exp()  # [B, V]
    cdf = probs.cumsum(-1)  # [B, V]
    target = uniforms.to(cdf)[:, None] * cdf[:, -1:]  # [B, 1]
    # First index whose cdf exceeds the target: its probability is > 0 by construction.
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [B]
    last_nonzero = vocab - 1 - (probs > 0).flip(-1).int().argmax(-1)  # [B]
    drawn = torch.where(drawn >= vocab, last_nonzero, drawn)
    return torch.where(greedy, logprobs.argmax(-1), drawn)


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index in ``text`` where the earliest stop string starts, or None."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
