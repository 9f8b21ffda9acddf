"""Triton pieces every kernel module of the loss shares: the autotune config helpers, the
logits tile on the tensor cores, the online log-sum-exp step, the target-logit dot, and the
host helpers for launches (SM count, the descriptors' scratch allocator)."""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Triton's CPU interpreter computes bf16 x bf16 dots wrongly (seen with triton 3.9): upcast there.
_UPCAST = tl.constexpr(INTERPRET)
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


def autotune_configs(shapes, interpret_shape):
    """Autotune configs: a few H100-friendly tile shapes; one tiny one under the interpreter."""
    if INTERPRET:
        return [triton.Config(interpret_shape, num_warps=4, num_stages=1)]
    return [triton.Config(kw, num_warps=w, num_stages=s) for kw, w, s in shapes]


def _prune(configs, named_args, **kwargs):
    """fp32 inputs (exact, no tensor cores) take twice the shared memory a tile: halve K."""
    if not (kwargs.get("IEEE") or named_args.get("IEEE")) or INTERPRET:
        return configs
    out = []
    for c in configs:
        kw = dict(c.kwargs, BLOCK_K=32)
        out.append(triton.Config(kw, num_warps=c.num_warps, num_stages=2))
    return out


PRUNE = {"early_config_prune": _prune}  # for `triton.autotune(prune_configs_by=)`


# logits of vocab columns past V: exp2 gives exactly 0, and 0 * -1e30 = 0
MASKED = tl.constexpr(-1.0e30)


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b on the tensor cores (bf16/fp16 inputs); exact fp32 when IEEE."""
    if _UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def logits_tile(
    h_desc, w_desc, row0, v0, H, inv_t2,
    IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The base-2 logits tile ``hidden[row0:+BN] @ weight[v0:+BV].T · inv_t2``, fp32."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        acc = dot(h_desc.load([row0, k0]), w_desc.load([v0, k0]).T, acc, IEEE)
    return acc * inv_t2


@triton.jit
def online_lse_step(m, s, t, z2):
    """Fold one tile of base-2 logits ``z2`` [BN, BV] into the running max ``m``, Σ 2^(z2 - m)
    and Σ 2^(z2 - m)·z2 (rescaled to the new max); also returns the tile's 2^(z2 - m_new)."""
    m_new = tl.maximum(m, tl.max(z2, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(z2 - m_new[:, None])  # [BN, BV] in (0, 1]
    return m_new, s * alpha + tl.sum(p, 1), t * alpha + tl.sum(p * z2, 1), p


@triton.jit
def target_logit(
    h_desc, w_ptr, tgt_ptr, rows, row_ok, row0, H, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Each row's target logit (before temperature) as a dot with the gathered weight row:
    cheaper than a compare-and-select over every logits tile."""
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=0)
    offs_k = tl.arange(0, BLOCK_K)
    tz = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + offs_k
        a = h_desc.load([row0, k0]).to(tl.float32)
        wt = tl.load(
            w_ptr + tgt[:, None].to(tl.int64) * H + kk[None, :],
            mask=row_ok[:, None] & (kk < H)[None, :],
            other=0.0,
        )
        tz += tl.sum(a * wt.to(tl.float32), 1)
    return tz


def num_sms(device: torch.device) -> int:
    """The device's SMs (4 off CUDA: the interpreter's launches), for grid sizes."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def set_allocator() -> None:
    """Device-side tensor descriptors need a little global scratch memory from the caller."""

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    if hasattr(triton, "set_allocator") and not INTERPRET:
        triton.set_allocator(alloc)
