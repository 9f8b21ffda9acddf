"""Per-token log-probs and entropy from hidden states and the LM-head weight, chunk by chunk.

The `[tokens, vocab]` logits are the largest tensor of a GRPO step (16×2048 tokens × 151936
vocab is 10 GB in bf16, 20 GB in fp32), yet the loss needs only two numbers per token: the
log-prob of the sampled token and the entropy. So the logits are produced a chunk of tokens
at a time, reduced to those numbers (and the log-sum-exp), and dropped; the backward pass
recomputes each chunk's logits from the saved hidden states and weight. Peak memory is one
chunk's logits instead of all of them, for the price of one more `hidden @ weight.T`.

This module holds the dispatching entry point and the plain-PyTorch implementation, which is
the reference (tests compare it to float64 full logits) and the CPU path; the Triton kernels
in `learner/loss/kernels/` are the GPU path and are checked against it. The fused loss
(`learner.loss.fused`) builds its PyTorch path on the same pieces: the input checks, a
chunk's `scaled_logits` and their gradient `logits_grad`.

The maths, with z = logits / T (temperature-scaled), p = softmax(z), lse = logsumexp(z):
    logp_t   = z_t - lse
    entropy  = lse - Σ_j p_j z_j
    ∂logp_t/∂z_j  = 1[j = t] - p_j
    ∂entropy/∂z_j = -p_j (z_j - lse + entropy)
and ∂/∂logits = ∂/∂z / T, then grad_hidden = G @ W and grad_weight = Gᵀ @ hidden.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.loss.numerics import Impl, compute_dtype, triton_importable


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
    check_head_inputs(hidden, weight, targets, temperature, chunk_size)
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


def check_head_inputs(
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


def scaled_logits(h: Tensor, weight: Tensor, inv_t: float, cdtype: torch.dtype) -> Tensor:
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
            z = scaled_logits(hidden[s:e], weight, inv_t, cdtype)  # [C, V]
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
            z = scaled_logits(hidden[s:e], weight, ctx.inv_t, cdtype)  # [C, V]
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
