"""fp16 gradients at a GRPO batch's magnitudes, for both Triton paths (the 4-product kernels
and the fused loss): a check list like the other Triton checks (name, error, tolerance).

A GRPO token's ∂loss/∂logp is ~1/(tokens in the batch); the softmax part of ∂loss/∂logits is
that times p, ~1/vocab. Stored unscaled in fp16 it falls below the smallest subnormal and the
gradients lose it; the kernels store it scaled by a power of two (`fp16_grad_scale`)."""

from __future__ import annotations

import torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def fp16_small_gradient_checks(
    device: str, n: int, hd: int, v: int, weights=(1e-3, 1e-5), temperature: float = 0.8
) -> list[tuple[str, float, float]]:
    from learner.loss.fused import fused_grpo_loss
    from learner.loss.logprobs import token_logprobs

    g = torch.Generator().manual_seed(3)
    h64 = torch.randn(n, hd, generator=g, dtype=torch.float64)
    w64 = torch.randn(v, hd, generator=g, dtype=torch.float64) * 2 / hd**0.5
    h64, w64 = h64.half().double(), w64.half().double()  # the very values fp16 holds
    t = torch.randint(0, v, (n,), generator=g).to(device)
    h64, w64 = h64.to(device).requires_grad_(), w64.to(device).requires_grad_()
    h16 = h64.detach().half().requires_grad_()
    w16 = w64.detach().half().requires_grad_()
    out = []
    for scale in weights:
        cl = torch.randn(n, generator=g, dtype=torch.float64).to(device) * scale
        ce = torch.randn(n, generator=g, dtype=torch.float64).to(device) * scale

        def loss_of(lp, ent, cl=cl, ce=ce):
            return (lp.double() * cl).sum() + (ent.double() * ce).sum()

        h64.grad = w64.grad = None
        z = (h64 @ w64.T) / temperature
        lsm = torch.log_softmax(z, dim=-1)
        loss_of(lsm.gather(1, t[:, None]).squeeze(1), -(lsm.exp() * lsm).sum(-1)).backward()
        ref_h, ref_w = h64.grad.clone(), w64.grad.clone()
        runs = {
            "kernels": lambda: loss_of(
                *token_logprobs(h16, w16, t, temperature=temperature, impl="triton")
            ),
            "fused": lambda: fused_grpo_loss(
                h16, w16, t, loss_of, temperature=temperature, chunk_size=max(1, n // 3),
                impl="triton",
            )[0],
        }  # fmt: skip
        for name, run in runs.items():
            h16.grad = w16.grad = None
            run().backward()
            # Below ~1e-4 the gradient's own fp16 rounding (many entries are subnormal) is
            # ~1 %; unscaled, the softmax part is lost: 4.9 % (hidden) and 2.2 % (weight)
            # at the interpreter's size (64 tokens, vocab 2048), 6 % and 2.5 % at 48 x 3000.
            tol = 1e-2 if scale >= 1e-4 else 2e-2
            out.append((f"fp16 {name} grad_hidden, weights {scale:g}", _rel(h16.grad, ref_h), tol))
            out.append((f"fp16 {name} grad_weight, weights {scale:g}", _rel(w16.grad, ref_w), tol))
    return out
