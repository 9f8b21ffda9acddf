"""The fused loss's two gradient products, grad_hidden = G @ W and grad_weight += Gᵀ @ hidden
with G = ∂loss/∂logits, from a chunk engine's `logits_grad` output (`fused.TorchChunks`,
`kernels.triton_fused.TritonChunks`): a [C, V] matrix in the weight's dtype and a scale, either
a float (the matrix is G times it: a power of two for fp16 weights, else 1) or, for anchored
tiles, a [C] tensor (G = diag(scale) @ the matrix). The scale is applied inside the products,
so no pass over the chunk's C × V values comes between the chunk engine and cuBLAS.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.loss.numerics import cublas_fp32_addmm_works, triton_importable


def _row_scaled(x: Tensor, scale: Tensor, out: Tensor) -> Tensor:
    """`out = diag(scale) @ x`, one rounding (out may be x)."""
    if x.is_cuda and triton_importable():
        from learner.loss.kernels.triton_fused import row_scale

        return row_scale(x, scale, out)
    return torch.mul(x, scale[:, None], out=out)


def grad_hidden_rows(
    g: Tensor, scale: float | Tensor, weight: Tensor, grad_h: Tensor | None, s: int, e: int,
    fp32_rows: Tensor | None = None,
) -> None:  # fmt: skip
    """`grad_h[s:e] = ∂loss/∂logits @ weight` from a chunk engine's `logits_grad` output.
    `fp32_rows` (anchored tiles, CUDA): a [≥ e - s, H] fp32 buffer the product is written to
    before its row scaling (one rounding, and cuBLAS's fp32-output kernel is faster at the
    8B head's shape: 6.86 vs 8.08 ms for 4096 × 151936 × 4096 on an H100, `--breakdown`)."""
    if grad_h is None:
        return
    out = grad_h[s:e]
    if isinstance(scale, Tensor):  # ∂loss/∂logits = diag(scale) @ g
        if fp32_rows is not None:
            y = torch.mm(g, weight, out_dtype=torch.float32, out=fp32_rows[: e - s])
        else:
            y = torch.mm(g, weight, out=out)
        _row_scaled(y, scale, out)
    else:  # beta 0: the rows' old values are not read
        torch.addmm(out, g, weight, beta=0, alpha=1.0 / scale, out=out)


def grad_weight_add(
    g: Tensor, scale: float | Tensor, hidden: Tensor, grad_w: Tensor, *, first: bool
) -> None:
    """`grad_w (+)= ∂loss/∂logitsᵀ @ hidden` (the chunk's rows) from `logits_grad`'s output."""
    if isinstance(scale, Tensor):  # Gᵀ h = gᵀ (diag(scale) h): the small operand is scaled
        hidden = _row_scaled(hidden, scale, torch.empty_like(hidden))
        _accumulate(grad_w, g.T, hidden, first=first)
    else:
        _accumulate(grad_w, g.T, hidden, first=first, alpha=1.0 / scale)


def _accumulate(acc: Tensor, a: Tensor, b: Tensor, *, first: bool, alpha: float = 1.0) -> None:
    """`acc (+)= alpha · a @ b` with fp32 accumulation inside the product (cuBLAS does so for
    bf16); `acc` is in a's dtype or, for `fp32_weight_grad`, fp32. `first`: `acc` holds nothing
    yet (beta 0: its values are not read)."""
    beta = 0.0 if first else 1.0
    if acc.dtype != a.dtype and _fp32_output_mm_works(acc.device, a.dtype):
        # bf16/fp16 inputs, fp32 output: no fp32 copies
        torch.addmm(acc, a, b, out_dtype=acc.dtype, beta=beta, alpha=alpha, out=acc)
        return
    if acc.dtype != a.dtype:  # fp32 copies (CPU, or torch without out_dtype)
        a, b = a.to(acc.dtype), b.to(acc.dtype)
    torch.addmm(acc, a, b, beta=beta, alpha=alpha, out=acc)


def _fp32_output_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """cuBLAS `addmm(out_dtype=float32)` where the Triton kernels run (CUDA, triton imports),
    probed once (`cublas_fp32_addmm_works`); elsewhere the plain fp32 copies."""
    if device.type != "cuda" or not triton_importable():
        return False
    return cublas_fp32_addmm_works(device, dtype)


__all__ = ["grad_hidden_rows", "grad_weight_add"]
