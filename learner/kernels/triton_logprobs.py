"""Triton kernels: token log-probs and entropy through the LM head without logits in memory.

Forward (`_fwd_kernel`): each program owns BLOCK_N tokens and a slice of the vocabulary; it
walks the vocab tiles, computes a logits tile `hidden @ weight.T` on the tensor cores (bf16 in,
fp32 accumulate) and folds it into an online log-sum-exp (running max m, Σexp, Σexp·z) and the
target logit. The slices' partials are merged in PyTorch ([splits, N], tiny). Nothing of
size N×V is ever written.

Backward: the three products that matter are the logits recompute (N·H·V), grad_hidden
(G @ W) and grad_weight (Gᵀ @ hidden), where G = ∂loss/∂logits. G is needed by both gradient
products; computing it twice (once per product) costs a fifth product, and fusing both
products into one kernel needs atomics over [V, H] or an fp32 [V, H] buffer. So G is computed
once per (token block × vocab block) into a bounded bf16 workspace (~64 MB, `_blocking`) by
`_grad_logits_kernel` (recompute + softmax-grad epilogue), and consumed by two tensor-core
products with fp32 accumulation:

    grad_hidden[n] : fp32 [CN, H] block accumulator over all vocab blocks (`_mm_acc_kernel`),
                     rounded to the output dtype once
    grad_weight[v] : `addmm_` straight into the bf16 gradient (cuBLAS, fp32 accumulate inside),
                     one rounding per token block (a handful: CN is thousands of tokens)

Total: four N·H·V products (forward, recompute, two gradients) — the least possible without
keeping N×V values between forward and backward — and no fp32 matmul, no atomics, no [V, H]
fp32 buffer, no full logits anywhere.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Triton's CPU interpreter computes bf16 x bf16 dots wrongly (seen with triton 3.9): upcast there.
_UPCAST = tl.constexpr(_INTERPRET)
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


def _configs(shapes, interpret_shape):
    """Autotune configs: a few H100-friendly tile shapes; one tiny one under the interpreter."""
    if _INTERPRET:
        return [triton.Config(interpret_shape, num_warps=4, num_stages=1)]
    return [triton.Config(kw, num_warps=w, num_stages=s) for kw, w, s in shapes]


_FWD_CONFIGS = _configs(
    [
        ({"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_K": 64}, 8, 3),
        ({"BLOCK_N": 128, "BLOCK_V": 256, "BLOCK_K": 64}, 8, 3),
        ({"BLOCK_N": 64, "BLOCK_V": 256, "BLOCK_K": 64}, 4, 4),
        ({"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_K": 128}, 8, 2),
    ],
    {"BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_K": 16},
)
_MM_CONFIGS = _configs(
    [
        ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP": 8}, 8, 3),
        ({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP": 8}, 8, 3),
        ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP": 8}, 4, 4),
        ({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP": 8}, 4, 4),
    ],
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP": 2},
)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b on the tensor cores (bf16/fp16 inputs); exact fp32 when IEEE."""
    if _UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.autotune(configs=_FWD_CONFIGS, key=["H", "V", "IEEE"])
@triton.jit
def _fwd_kernel(
    h_ptr,  # [N, H]
    w_ptr,  # [V, H]
    tgt_ptr,  # [N]
    m_ptr,  # [S, N] running max (natural units)
    s_ptr,  # [S, N] Σ exp(z - m)
    t_ptr,  # [S, N] Σ exp(z - m) · z
    tz_ptr,  # [S, N] target logit (0 in splits that do not hold the target)
    N,
    V,
    H,
    stride_h,
    stride_w,
    v_per_split,  # vocab entries per split, a multiple of every BLOCK_V
    inv_t2,  # log2(e) / temperature: logits are kept in base 2 inside the loop
    IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    offs_k = tl.arange(0, BLOCK_K)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)
    tz = tl.zeros([BLOCK_N], tl.float32)
    v_start = pid_s * v_per_split
    v_end = tl.minimum(V, v_start + v_per_split)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < H
            a = tl.load(
                h_ptr + rows[:, None] * stride_h + kk[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                w_ptr + cols[None, :] * stride_w + kk[:, None],
                mask=col_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            acc = _dot(a, b, acc, IEEE)
        z2 = tl.where(col_ok[None, :], acc * inv_t2, float("-inf"))  # base-2 logits
        m_new = tl.maximum(m, tl.max(z2, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(z2 - m_new[:, None])
        s = s * alpha + tl.sum(p, 1)
        t = t * alpha + tl.sum(tl.where(col_ok[None, :], p * z2, 0.0), 1)
        tz += tl.sum(tl.where(cols[None, :] == tgt[:, None], z2, 0.0), 1)
        m = m_new
    out = pid_s * N + rows
    tl.store(m_ptr + out, m * 0.6931471805599453, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(t_ptr + out, t * 0.6931471805599453, mask=row_ok)
    tl.store(tz_ptr + out, tz * 0.6931471805599453, mask=row_ok)


@triton.jit
def _tile_ids(M, NC, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """Grouped tile order: GROUP row-tiles share column tiles while they sit in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(NC, BLOCK_N)
    per_group = GROUP * num_n
    first_m = (pid // per_group) * GROUP
    group_m = tl.minimum(num_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.autotune(configs=_MM_CONFIGS, key=["H", "V_blk", "IEEE", "ENT_GRAD"])
@triton.jit
def _grad_logits_kernel(
    h_ptr,  # [N_blk, H]  hidden rows of this token block
    w_ptr,  # [V_blk, H]  weight rows of this vocab block
    g_ptr,  # [N_blk, V_blk] out: ∂loss/∂logits (bf16)
    tgt_ptr,  # [N_blk] target ids, relative to this vocab block's first id
    lse_ptr,  # [N_blk] log-sum-exp of z = logits / T
    ent_ptr,  # [N_blk] entropy
    glp_ptr,  # [N_blk] ∂loss/∂logp
    gent_ptr,  # [N_blk] ∂loss/∂entropy
    N_blk,
    V_blk,
    H,
    stride_h,
    stride_w,
    stride_g,
    inv_t,
    IEEE: tl.constexpr,
    ENT_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(N_blk, V_blk, BLOCK_M, BLOCK_N, GROUP)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N_blk
    col_ok = cols < V_blk
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < H
        a = tl.load(
            h_ptr + rows[:, None] * stride_h + kk[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + cols[None, :] * stride_w + kk[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        acc = _dot(a, b, acc, IEEE)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    logp = acc * inv_t - lse[:, None]  # [BM, BN] log-softmax
    p = tl.exp(logp)
    g = -glp[:, None] * p
    if ENT_GRAD:
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        g -= gent[:, None] * p * (logp + ent[:, None])
    g += tl.where(cols[None, :] == tgt[:, None], glp[:, None], 0.0)
    g = g * inv_t
    tl.store(
        g_ptr + rows[:, None] * stride_g + cols[None, :],
        g.to(g_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.autotune(
    configs=_MM_CONFIGS, key=["M", "NC", "K", "IEEE", "ACCUMULATE"], restore_value=["c_ptr"]
)
@triton.jit
def _mm_acc_kernel(
    a_ptr,  # [M, K]
    b_ptr,  # [K, NC] row-major
    c_ptr,  # [M, NC] fp32; c (+)= a @ b
    M,
    NC,
    K,
    stride_a,
    stride_b,
    stride_c,
    IEEE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, NC, BLOCK_M, BLOCK_N, GROUP)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < NC
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_a + kk[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + kk[:, None] * stride_b + cols[None, :],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc = _dot(a, b, acc, IEEE)
    c_ptrs = c_ptr + rows[:, None] * stride_c + cols[None, :]
    c_mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0)
    tl.store(c_ptrs, acc, mask=c_mask)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _forward(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Returns (logp, lse, entropy), each fp32 [N]."""
    n, hd = h.shape
    v = w.shape[0]
    # Enough programs to fill the GPU ~4 times over: split the vocabulary when N is small.
    n_tiles = triton.cdiv(n, 64)
    splits = max(1, min(triton.cdiv(4 * _num_sms(h.device), n_tiles), triton.cdiv(v, 4096)))
    v_per_split = triton.cdiv(triton.cdiv(v, splits), 256) * 256  # multiple of any BLOCK_V
    splits = triton.cdiv(v, v_per_split)
    parts = torch.empty(4, splits, n, dtype=torch.float32, device=h.device)
    m, s, t, tz = parts.unbind(0)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), splits)

    _fwd_kernel[grid](
        h,
        w,
        targets,
        m,
        s,
        t,
        tz,
        n,
        v,
        hd,
        h.stride(0),
        w.stride(0),
        v_per_split,
        LOG2E / temperature,
        IEEE=h.dtype == torch.float32,
    )
    big_m = m.max(dim=0).values  # [N]
    scale = torch.exp(m - big_m)  # [S, N]
    total = (s * scale).sum(0)  # [N]
    lse = big_m + torch.log(total)
    mean_z = (t * scale).sum(0) / total  # E_p[z]
    return tz.sum(0) - lse, lse, lse - mean_z


# Tests set this to (token block, vocab block) to exercise the multi-block paths at tiny sizes.
FORCE_BLOCKING: tuple[int, int] | None = None


def _blocking(n: int, v: int, hd: int, budget: int = 64 << 20) -> tuple[int, int]:
    """Token-block and vocab-block sizes of the backward workspace (G in bf16 + fp32 dH).

    The vocab block is large enough that grad_weight's product (output [CV, H]) fills the GPU;
    the token block takes what is left of `budget` (G: 2·CV bytes a token, dH: 4·H), evened
    out over the blocks. Fewer token blocks also mean fewer bf16 roundings of grad_weight.
    """
    if FORCE_BLOCKING is not None:
        return FORCE_BLOCKING
    cv = min(triton.cdiv(v, 128) * 128, 8192 if hd <= 2048 else 4096)
    cn_max = max(128, budget // (2 * cv + 4 * hd) // 128 * 128)
    blocks = triton.cdiv(n, cn_max)
    cn = min(n, triton.cdiv(triton.cdiv(n, blocks), 128) * 128)
    return max(cn, 1), cv


def _backward(h, w, targets, lse, ent, g_logp, g_ent, temperature, need_h, need_w):
    n, hd = h.shape
    v = w.shape[0]
    cn, cv = _blocking(n, v, hd)
    ieee = h.dtype == torch.float32
    grad_h = torch.empty_like(h) if need_h else None
    grad_w = torch.empty_like(w) if need_w else None
    g_buf = torch.empty(cn * cv, dtype=h.dtype, device=h.device)
    dh_acc = torch.empty(cn, hd, dtype=torch.float32, device=h.device) if need_h else None
    glp = g_logp.float().contiguous() if g_logp is not None else torch.zeros_like(lse)
    ent_grad = g_ent is not None
    gent = g_ent.float().contiguous() if ent_grad else lse
    inv_t = 1.0 / temperature
    for n0 in range(0, n, cn):
        n1 = min(n0 + cn, n)
        nb = n1 - n0
        h_blk = h[n0:n1]
        for v0 in range(0, v, cv):
            v1 = min(v0 + cv, v)
            vb = v1 - v0
            g = g_buf[: nb * vb].view(nb, vb)  # [CN, CV]
            w_blk = w[v0:v1]

            def grid(meta, nb=nb, vb=vb):
                return (triton.cdiv(nb, meta["BLOCK_M"]) * triton.cdiv(vb, meta["BLOCK_N"]),)

            _grad_logits_kernel[grid](
                h_blk,
                w_blk,
                g,
                targets[n0:n1] - v0,
                lse[n0:n1],
                ent[n0:n1] if ent_grad else lse[n0:n1],
                glp[n0:n1],
                gent[n0:n1],
                nb,
                vb,
                hd,
                h.stride(0),
                w.stride(0),
                g.stride(0),
                inv_t,
                IEEE=ieee,
                ENT_GRAD=ent_grad,
            )
            if need_w:
                if n0 == 0:
                    torch.mm(g.T, h_blk, out=grad_w[v0:v1])
                else:
                    grad_w[v0:v1].addmm_(g.T, h_blk)
            if need_h:
                acc = dh_acc[:nb]

                def grid_h(meta, nb=nb):
                    return (triton.cdiv(nb, meta["BLOCK_M"]) * triton.cdiv(hd, meta["BLOCK_N"]),)

                _mm_acc_kernel[grid_h](
                    g,
                    w_blk,
                    acc,
                    nb,
                    hd,
                    vb,
                    g.stride(0),
                    w.stride(0),
                    acc.stride(0),
                    IEEE=ieee,
                    ACCUMULATE=v0 > 0,
                )
        if need_h:
            grad_h[n0:n1] = dh_acc[:nb]
    return grad_h, grad_w


class TritonLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy):
        h = hidden.contiguous()
        w = weight.contiguous()
        tgt = targets.contiguous()
        logp, lse, ent = _forward(h, w, tgt, temperature)
        ctx.save_for_backward(h, w, tgt, lse, ent)
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, w, tgt, lse, ent = ctx.saved_tensors
        if not ctx.with_entropy:
            g_ent = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None
        grad_h, grad_w = _backward(
            h, w, tgt, lse, ent, g_logp, g_ent, ctx.temperature, need_h, need_w
        )
        return grad_h, grad_w, None, None, None


def triton_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton path of `learner.logprobs.token_logprobs` (same contract; fp32 outputs)."""
    if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"the Triton path takes bf16/fp16/fp32 hidden states, got {hidden.dtype}; use "
            "impl='torch' for float64"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32) + weight.sum() * 0
        return empty, (empty.clone() if with_entropy else None)
    logp, ent = TritonLogprobs.apply(hidden, weight, targets, float(temperature), with_entropy)
    return logp, (ent if with_entropy else None)
