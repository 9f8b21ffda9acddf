"""Precision facts every path of the loss shares: the PyTorch reference, the fused loss and the
Triton kernels alike. Kept apart from those paths (and free of triton) so that each of them
imports it and none imports another for it.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch
from torch import Tensor

Impl = Literal["auto", "torch", "triton"]  # which implementation a loss entry point runs

FP16_GRAD_CEILING = 2.0**10  # largest |∂loss/∂logit| after fp16 scaling (see below)

_CUBLAS_OK: dict[tuple, bool] = {}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bf16/float32 inputs, float64 for float64 (the reference precision)."""
    return torch.promote_types(dtype, torch.float32)


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


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


def cublas_fp32_addmm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Probe once per (device, dtype): does `addmm(c, a, b, out_dtype=float32, out=c)` with
    bf16/fp16 `a`, `b` accumulate into `c` correctly (not only: does the call exist)? Then the
    gradient products take fp32 outputs from low-precision inputs without fp32 copies."""
    if device.type != "cuda" or dtype == torch.float32:
        return False
    key = (device, dtype)
    if key not in _CUBLAS_OK:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            a = torch.randn(64, 128, device=device, dtype=dtype, generator=g)
            b = torch.randn(128, 32, device=device, dtype=dtype, generator=g)
            c = torch.ones(64, 32, device=device, dtype=torch.float32)
            torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
            torch.addmm(c, a, b, out_dtype=torch.float32, alpha=0.5, out=c)
            want = 1 + 1.5 * (a.double() @ b.double())
            _CUBLAS_OK[key] = bool(((c - want).abs().max() / want.abs().max()) < 1e-3)
        except (TypeError, RuntimeError):
            _CUBLAS_OK[key] = False
    return _CUBLAS_OK[key]


__all__ = [
    "FP16_GRAD_CEILING",
    "Impl",
    "compute_dtype",
    "cublas_fp32_addmm_works",
    "fp16_grad_scale",
    "triton_importable",
]
