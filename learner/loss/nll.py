"""The SFT warm-start loss: the mean negative log-likelihood of the masked tokens, through the
LM head without full logits, either on `token_logprobs` or fused with the head
(`fused_grpo_loss` with `NLLTokenLoss`)."""

from __future__ import annotations

import torch
from torch import Tensor

from learner.loss.fused import fused_grpo_loss
from learner.loss.logprobs import token_logprobs
from learner.loss.numerics import Impl, compute_dtype


class NLLTokenLoss:
    """The mean negative log-likelihood of `n` tokens as a `TokenLoss` (the SFT loss).

    ∂loss/∂logp_t = -1/n for every token whatever the values (`constant_grads`: differentiated
    once a call) and the entropy is never differentiated (`entropy_grad = False`: the Triton
    engine applies G as a row scaling of its anchored tiles)."""

    constant_grads = True
    entropy_grad = False

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"NLLTokenLoss needs at least one token, got n={n}")
        self.n = n

    def token_grads(self, logp: Tensor, entropy: Tensor, s: int, e: int) -> tuple[Tensor, None]:
        return torch.full((e - s,), -1.0 / self.n, dtype=logp.dtype, device=logp.device), None

    def __call__(self, logp: Tensor, entropy: Tensor) -> Tensor:
        return -logp.sum() / self.n


def chunked_nll(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    impl: Impl = "auto",
    fused: bool = False,
    fused_chunk_size: int | None = None,
) -> Tensor:
    """Mean negative log-likelihood over masked tokens, without full logits (SFT warm-start).

    hidden `[..., H]`, targets and mask `[...]` (same leading shape). Only rows with mask != 0
    go through the LM head, so prompt tokens cost nothing; their targets may be anything
    (e.g. -100). `fused` (`sft.fused_loss`): the loss fused with the LM head
    (`learner.loss.fused`, 3 N·H·V products instead of 4, both gradients in the forward,
    `fused_chunk_size` tokens' logits at a time) instead of `token_logprobs` (`chunk_size`
    tokens a chunk, the logits recomputed in the backward, less memory).
    """
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    keep = mask.reshape(-1) != 0  # [N]
    if keep.shape[0] != h.shape[0] or targets.numel() != h.shape[0]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, targets {tuple(targets.shape)} and mask "
            f"{tuple(mask.shape)} must share their leading shape"
        )
    if not bool(keep.any()):
        return (h.sum() * 0.0 + weight.sum() * 0.0).to(compute_dtype(h.dtype))
    h, t = h[keep], targets.reshape(-1)[keep]  # [n, H], [n]: the target rows only
    if fused:
        loss, _, _ = fused_grpo_loss(
            h, weight, t, NLLTokenLoss(h.shape[0]), temperature=temperature,
            chunk_size=fused_chunk_size, impl=impl,
        )  # fmt: skip
        return loss
    logp, _ = token_logprobs(
        h, weight, t, temperature=temperature, chunk_size=chunk_size, with_entropy=False, impl=impl
    )
    return -logp.mean()


__all__ = ["NLLTokenLoss", "chunked_nll"]
