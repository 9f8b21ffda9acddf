"""Per-token log-probs and entropy from hidden states and the LM-head weight, chunk by chunk.

The `[tokens, vocab]` logits are the largest tensor of a GRPO step (16×2048 tokens × 151936
vocab is 10 GB in bf16, 20 GB in fp32), yet the loss needs only two numbers per token: the
log-prob of the sampled token and the entropy. So the logits are produced a chunk of tokens
at a time, reduced to those numbers (and the log-sum-exp), and dropped; the backward pass
recomputes each chunk's logits from the saved hidden states and weight. Peak memory is one
chunk's logits instead of all of them, for the price of one more `hidden @ weight.T`.

This module holds the dispatching entry point and the plain-PyTorch implementation, which is
the reference (tests compare it to float64 full logits) and the CPU path; the Triton kernels
in `learner/loss/kernels/` are the GPU path and are checked against it.

The maths, with z = logits / T (temperature-scaled), p = softmax(z), lse = logsumexp(z):
    logp_t   = z_t - lse
    entropy  = lse - Σ_j p_j z_j
    ∂logp_t/∂z_j  = 1[j = t] - p_j
    ∂entropy/∂z_j = -p_j (z_j - lse + entropy)
and ∂/∂logits = ∂/∂z / T, then grad_hidden = G @ W and grad_weight = Gᵀ @ hidden.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch
from torch import Tensor

Impl = Literal["auto", "torch", "triton"]


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    impl: Impl = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of `targets` and entropy under `softmax(hidden @ weight.T / temperature)`.

    hidden `[N, H]`, weight `[V, H]`, targets `[N]` (int64, each in `[0, V)`; put any valid id,
    e.g. 0, at positions the loss masks out). Returns `(logprobs [N], entropy [N] | None)` in
    float32 (float64 when the inputs are float64). Differentiable w.r.t. hidden and weight,
    through both outputs. `chunk_size` tokens are materialised at a time on the torch path.

    `impl="auto"` takes the Triton kernels for CUDA tensors when triton imports (unless the
    dtype is float64 or a row of hidden is not a multiple of 16 bytes), else the torch path.
    """
    _check_inputs(hidden, weight, targets, temperature, chunk_size)
    if impl == "auto":
        impl = "triton" if _triton_usable(hidden) else "torch"
    if impl == "triton":
        from learner.loss.kernels.triton_logprobs import triton_token_logprobs

        return triton_token_logprobs(
            hidden, weight, targets, temperature=temperature, with_entropy=with_entropy
        )
    if impl != "torch":
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    logp, ent = ChunkedLogprobs.apply(
        hidden, weight, targets, float(temperature), int(chunk_size), bool(with_entropy)
    )
    return logp, (ent if with_entropy else None)


def _check_inputs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float,
    chunk_size: int,
    *,
    target_range: bool = True,
) -> None:
    """Shapes, dtypes and values; `target_range` False leaves the targets' range (a host
    sync on CUDA) to the caller (`check_target_range`)."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H]; got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)} (flatten batch and time first: hidden.reshape(-1, H))"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden is {tuple(hidden.shape)}, weight {tuple(weight.shape)}"
        )
    if targets.shape != (hidden.shape[0],) or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"targets must be an integer tensor of shape [{hidden.shape[0]}], got "
            f"{tuple(targets.shape)} {targets.dtype}"
        )
    if target_range and targets.numel():
        lo, hi = torch.stack(torch.aminmax(targets)).tolist()  # one host sync for both
        check_target_range(lo, hi, weight.shape[0])
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def check_target_range(lo: int, hi: int, vocab: int) -> None:
    """ValueError unless the targets' min `lo` and max `hi` lie in `[0, vocab)`."""
    if lo < 0 or hi >= vocab:
        raise ValueError(
            f"targets must lie in [0, {vocab}); got min {lo}, max {hi} "
            "(replace ignore-index padding such as -100 by 0 and mask it)"
        )


def _triton_usable(hidden: Tensor) -> bool:
    if not hidden.is_cuda or hidden.dtype == torch.float64:
        return False
    if hidden.shape[1] * hidden.element_size() % 16:  # bulk tensor copies need 16-byte rows
        return False
    return triton_importable()


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bf16/float32 inputs, float64 for float64 (the reference precision)."""
    return torch.promote_types(dtype, torch.float32)


def _scaled_logits(h: Tensor, weight: Tensor, inv_t: float, cdtype: torch.dtype) -> Tensor:
    """`h @ weight.T * inv_t` in `cdtype`: [C, V]. Low-precision inputs accumulate in fp32."""
    if h.dtype == cdtype and weight.dtype == cdtype:
        z = h @ weight.T
    elif h.is_cuda:
        try:
            z = torch.mm(h, weight.T, out_dtype=cdtype)  # bf16 tensor cores, fp32 output
        except (TypeError, RuntimeError):  # torch without mm(out_dtype=)
            z = (h @ weight.T).to(cdtype)
    else:
        z = h.to(cdtype) @ weight.to(cdtype).T
    return z.mul_(inv_t) if inv_t != 1.0 else z


FP16_GRAD_CEILING = 2.0**10  # largest |∂loss/∂logit| after fp16 scaling (see below)


def fp16_grad_scale(
    dtype: torch.dtype, g_logp: Tensor | None, g_ent: Tensor | None, vocab: int
) -> float:
    """The power of two by which ∂loss/∂logits is multiplied before it is stored in fp16 for
    the tensor-core gradient products (1.0 for any other dtype); the products divide it out.

    A per-token GRPO gradient is ~1/(tokens in the batch), and its softmax part is that times
    p, ~1/vocab: 1e-5 · 1e-5 is far below fp16's smallest subnormal (6e-8), so unscaled the
    gradient would lose its softmax part and keep only the target term. bf16 has fp32's range
    and needs none. Bound used: |∂loss/∂logit_v| <= |g_logp| + |g_ent| · (1 + log V), since
    p·|log p| <= 1/e and the entropy <= log V. The ceiling 2^10 keeps ``G @ W`` (a sum of
    |G| <= 2 · ceiling weighted by W) inside fp16's 65504 for weights below 32."""
    if dtype != torch.float16:
        return 1.0
    bound = 0.0
    if g_logp is not None and g_logp.numel():
        bound += float(g_logp.abs().max())
    if g_ent is not None and g_ent.numel():
        bound += float(g_ent.abs().max()) * (1.0 + math.log(max(vocab, 2)))
    if not math.isfinite(bound) or bound <= 0.0:
        return 1.0
    return 2.0 ** math.floor(math.log2(FP16_GRAD_CEILING / bound))


def logits_grad(
    z: Tensor,  # [C, V] temperature-scaled logits
    lse: Tensor,  # [C]
    entropy: Tensor | None,  # [C]
    targets: Tensor,  # [C]
    g_logp: Tensor | None,  # [C]
    g_ent: Tensor | None,  # [C]
    inv_t: float,
) -> Tensor:
    """∂loss/∂(raw logits) for one chunk, in place of `z` (which is consumed): [C, V]."""
    logp_full = z.sub_(lse[:, None])  # [C, V] log-softmax; z is consumed
    ent_term = None
    if g_ent is not None:
        # -g_ent * p * (z - lse + entropy), with z - lse = log p taken before exp (no underflow).
        ent_term = logp_full + entropy[:, None]  # [C, V]
    p = logp_full.exp_()  # [C, V] softmax
    if ent_term is not None:
        ent_term.mul_(p).mul_(-g_ent[:, None])
    if g_logp is not None:
        grad = p.mul_(-g_logp[:, None])
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, targets] += g_logp
    else:
        grad = p.zero_()
    if ent_term is not None:
        grad += ent_term
    return grad.mul_(inv_t) if inv_t != 1.0 else grad


class ChunkedLogprobs(torch.autograd.Function):
    """Chunked log-softmax + gather (+ entropy) that saves only inputs and per-token stats."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy):
        n = hidden.shape[0]
        cdtype = compute_dtype(hidden.dtype)
        inv_t = 1.0 / temperature
        logp = torch.empty(n, dtype=cdtype, device=hidden.device)  # [N]
        lse = torch.empty(n, dtype=cdtype, device=hidden.device)  # [N]
        ent = torch.empty(n, dtype=cdtype, device=hidden.device) if with_entropy else None
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = _scaled_logits(hidden[s:e], weight, inv_t, cdtype)  # [C, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [C]
            lse[s:e] = lse_c
            logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse_c
            if ent is not None:
                p = (z - lse_c[:, None]).exp_()  # [C, V]
                ent[s:e] = lse_c - (p * z).sum(dim=-1)
            del z
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.inv_t = inv_t
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        if ent is None:
            g_ent = None
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cdtype = lse.dtype
        n = hidden.shape[0]
        grad_h = torch.empty(hidden.shape, dtype=cdtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdtype, device=weight.device) if need_w else None
        w_c = weight.to(cdtype)  # [V, H]; a no-op in fp32/fp64
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            z = _scaled_logits(hidden[s:e], weight, ctx.inv_t, cdtype)  # [C, V]
            g = logits_grad(
                z,
                lse[s:e],
                None if ent is None else ent[s:e],
                targets[s:e],
                None if g_logp is None else g_logp[s:e].to(cdtype),
                None if g_ent is None else g_ent[s:e].to(cdtype),
                ctx.inv_t,
            )  # [C, V]
            if grad_h is not None:
                grad_h[s:e] = g @ w_c
            if grad_w is not None:
                grad_w.addmm_(g.T, hidden[s:e].to(cdtype))
            del z, g
        grad_h = None if grad_h is None else grad_h.to(hidden.dtype)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None


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
        from learner.loss.fused import fused_grpo_loss
        from learner.loss.token import NLLTokenLoss

        loss, _, _ = fused_grpo_loss(
            h, weight, t, NLLTokenLoss(h.shape[0]), temperature=temperature,
            chunk_size=fused_chunk_size, impl=impl,
        )  # fmt: skip
        return loss
    logp, _ = token_logprobs(
        h, weight, t, temperature=temperature, chunk_size=chunk_size, with_entropy=False, impl=impl
    )
    return -logp.mean()
