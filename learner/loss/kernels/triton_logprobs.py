"""Triton kernels: token log-probs and entropy through the LM head without logits in memory.

Forward (`fwd_kernel`): each program owns BLOCK_N tokens and a slice of the vocabulary; it
walks the vocab tiles, computes a logits tile `hidden @ weight.T` on the tensor cores (bf16 in,
fp32 accumulate) and folds it into an online log-sum-exp (running max m, Σexp, Σexp·z) and the
target logit. The slices' partials are merged in PyTorch ([splits, N], tiny). Nothing of
size N×V is ever written.

Backward: the three products that matter are the logits recompute (N·H·V), grad_hidden
(G @ W) and grad_weight (Gᵀ @ hidden), where G = ∂loss/∂logits. G is needed by both gradient
products; computing it twice (once per product) costs a fifth product, and fusing both
products into one kernel needs atomics over [V, H] or an fp32 [V, H] buffer. So G is computed
once per (token block × vocab block) into a bounded bf16 workspace (~64 MB,
`backward_blocking`) by `grad_logits_kernel` (recompute + softmax-grad epilogue), and consumed by two tensor-core
products with fp32 accumulation:

    grad_hidden[n] : fp32 [CN, H] block accumulator over all vocab blocks (cuBLAS addmm with
                     an fp32 output where torch has it, else `mm_acc_kernel`), rounded to the
                     output dtype once
    grad_weight[v] : `addmm_` straight into the bf16 gradient (cuBLAS, fp32 accumulate inside),
                     one rounding per token block (a handful: CN is thousands of tokens)

Total: four N·H·V products (forward, recompute, two gradients) — the least possible without
keeping N×V values between forward and backward — and no fp32 matmul, no atomics, no [V, H]
fp32 buffer, no full logits anywhere.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from learner.loss.kernels.triton_common import (
    LOG2E,
    MASKED,
    PRUNE,
    autotune_configs,
    dot,
    logits_tile,
    num_sms,
    online_lse_step,
    set_allocator,
    target_logit,
)
from learner.loss.numerics import cublas_fp32_addmm_works, fp16_grad_scale

_FWD_CONFIGS = autotune_configs(
    [
        ({"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_K": 64}, 8, 3),
        ({"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_K": 64}, 8, 4),
        ({"BLOCK_N": 128, "BLOCK_V": 256, "BLOCK_K": 64}, 8, 3),
        ({"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_K": 128}, 8, 3),
    ],
    {"BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_K": 16},
)
_MM_CONFIGS = autotune_configs(
    [
        ({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP": 8}, 8, 3),
        ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP": 8}, 8, 4),
        ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP": 8}, 4, 4),
        ({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP": 8}, 8, 3),
    ],
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP": 2},
)


@triton.autotune(configs=_FWD_CONFIGS, key=["H", "V", "IEEE"], prune_configs_by=PRUNE)
@triton.jit
def fwd_kernel(
    h_ptr,  # [N, H] contiguous
    w_ptr,  # [V, H] contiguous
    tgt_ptr,  # [N]
    m_ptr,  # [S, N] out: running max (natural units)
    s_ptr,  # [S, N] out: Σ exp(z - m)
    t_ptr,  # [S, N] out: Σ exp(z - m) · z
    tz_ptr,  # [N]    out: target logit (written by split 0)
    N,
    V,
    H,
    v_per_split,  # vocab entries per split, a multiple of every BLOCK_V
    inv_t2,  # log2(e) / temperature: logits are kept in base 2 inside the loop
    IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    # Tensor descriptors: bulk (TMA) tile copies on Hopper; out-of-bounds rows/cols read as 0.
    h_desc = tl.make_tensor_descriptor(h_ptr, [N, H], [H, 1], [BLOCK_N, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [V, H], [H, 1], [BLOCK_V, BLOCK_K])
    row0 = pid_n * BLOCK_N
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)
    v_start = pid_s * v_per_split
    v_end = tl.minimum(V, v_start + v_per_split)
    for v0 in range(v_start, v_end, BLOCK_V):
        z2 = logits_tile(
            h_desc, w_desc, row0, v0, H, inv_t2, IEEE, BLOCK_N, BLOCK_V, BLOCK_K
        )  # base-2 logits
        if v0 + BLOCK_V > V:
            cols = v0 + tl.arange(0, BLOCK_V)
            z2 = tl.where(cols[None, :] < V, z2, MASKED)
        m, s, t, _ = online_lse_step(m, s, t, z2)
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    out = pid_s * N + rows
    tl.store(m_ptr + out, m * 0.6931471805599453, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(t_ptr + out, t * 0.6931471805599453, mask=row_ok)
    if pid_s == 0:
        tz = target_logit(h_desc, w_ptr, tgt_ptr, rows, row_ok, row0, H, BLOCK_N, BLOCK_K)
        tl.store(tz_ptr + rows, tz * (inv_t2 * 0.6931471805599453), mask=row_ok)


@triton.jit
def _tile_ids(pid, M, NC, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """Grouped tile order: GROUP row-tiles share column tiles while they sit in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(NC, BLOCK_N)
    per_group = GROUP * num_n
    first_m = (pid // per_group) * GROUP
    group_m = tl.minimum(num_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.autotune(
    configs=_MM_CONFIGS, key=["H", "V_blk", "IEEE", "ENT_GRAD"], prune_configs_by=PRUNE
)
@triton.jit
def grad_logits_kernel(
    h_ptr,  # [N_blk, H]  hidden rows of this token block (row stride H)
    w_ptr,  # [V_blk, H]  weight rows of this vocab block (row stride H)
    g_ptr,  # [N_blk, V_blk] out, row stride G_STRIDE: ∂loss/∂logits in the input dtype
    tgt_ptr,  # [N_blk] target ids, relative to this vocab block's first id
    lse2_ptr,  # [N_blk] log-sum-exp of z = logits / T, in base 2
    ent_ptr,  # [N_blk] entropy
    glp_ptr,  # [N_blk] ∂loss/∂logp / T
    gent_ptr,  # [N_blk] ∂loss/∂entropy / T
    N_blk,
    V_blk,
    H,
    G_STRIDE,
    inv_t2,  # log2(e) / T
    NUM_PROGS,  # programs launched (grid size)
    IEEE: tl.constexpr,
    ENT_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    h_desc = tl.make_tensor_descriptor(h_ptr, [N_blk, H], [H, 1], [BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [V_blk, H], [H, 1], [BLOCK_N, BLOCK_K])
    g_desc = tl.make_tensor_descriptor(g_ptr, [N_blk, V_blk], [G_STRIDE, 1], [BLOCK_M, BLOCK_N])
    num_tiles = tl.cdiv(N_blk, BLOCK_M) * tl.cdiv(V_blk, BLOCK_N)
    # Persistent when NUM_PROGS < num_tiles: a program's bulk store of one G tile overlaps the
    # loads and products of its next tile instead of idling the SM at the end of each tile.
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS):
        pid_m, pid_n = _tile_ids(tile, N_blk, V_blk, BLOCK_M, BLOCK_N, GROUP)
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            acc = dot(h_desc.load([row0, k0]), w_desc.load([col0, k0]).T, acc, IEEE)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < N_blk
        lse2 = tl.load(lse2_ptr + rows, mask=row_ok, other=0.0)
        glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
        # The epilogue is per-element work on the critical path: keep it to an FMA, an exp2 and a
        # multiply (temperature and log2(e) are folded into the per-row factors).
        logp2 = acc * inv_t2 - lse2[:, None]  # [BM, BN] log2-softmax
        p = tl.exp2(logp2)
        g = -glp[:, None] * p
        if ENT_GRAD:
            ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
            gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
            g -= gent[:, None] * p * (logp2 * 0.6931471805599453 + ent[:, None])
        # The one-hot term: only ~1 tile in 5 holds any of its rows' targets.
        hit = (tgt >= col0) & (tgt < col0 + BLOCK_N)
        if tl.max(hit.to(tl.int32), 0) > 0:
            cols = col0 + tl.arange(0, BLOCK_N)
            g += tl.where(cols[None, :] == tgt[:, None], glp[:, None], 0.0)
        g_desc.store([row0, col0], g.to(g_ptr.dtype.element_ty))


@triton.autotune(
    configs=_MM_CONFIGS,
    key=["M", "NC", "K", "IEEE", "ACCUMULATE"],
    restore_value=["c_ptr"],
    prune_configs_by=PRUNE,
)
@triton.jit
def mm_acc_kernel(
    a_ptr,  # [M, K], row stride A_STRIDE
    b_ptr,  # [K, NC] contiguous
    c_ptr,  # [M, NC] contiguous fp32; c (+)= a @ b
    M,
    NC,
    K,
    A_STRIDE,
    IEEE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, NC, BLOCK_M, BLOCK_N, GROUP)
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [A_STRIDE, 1], [BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, [K, NC], [NC, 1], [BLOCK_K, BLOCK_N])
    c_desc = tl.make_tensor_descriptor(c_ptr, [M, NC], [NC, 1], [BLOCK_M, BLOCK_N])
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = dot(a_desc.load([row0, k0]), b_desc.load([k0, col0]), acc, IEEE)
    if ACCUMULATE:
        acc += c_desc.load([row0, col0])
    c_desc.store([row0, col0], acc)


def forward_stats(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Returns (logp, lse, entropy), each fp32 [N]."""
    set_allocator()
    n, hd = h.shape
    v = w.shape[0]
    # Enough programs to fill the GPU ~4 times over: split the vocabulary when N is small.
    n_tiles = triton.cdiv(n, 128)
    splits = max(1, min(triton.cdiv(4 * num_sms(h.device), n_tiles), triton.cdiv(v, 4096)))
    v_per_split = triton.cdiv(triton.cdiv(v, splits), 256) * 256  # multiple of any BLOCK_V
    splits = triton.cdiv(v, v_per_split)
    parts = torch.empty(3, splits, n, dtype=torch.float32, device=h.device)
    m, s, t = parts.unbind(0)
    tz = torch.empty(n, dtype=torch.float32, device=h.device)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), splits)

    fwd_kernel[grid](
        h, w, targets, m, s, t, tz, n, v, hd, v_per_split, LOG2E / temperature,
        IEEE=h.dtype == torch.float32,
    )  # fmt: skip
    big_m = m.max(dim=0).values  # [N]
    scale = torch.exp(m - big_m)  # [S, N]
    total = (s * scale).sum(0)  # [N]
    lse = big_m + torch.log(total)
    mean_z = (t * scale).sum(0) / total  # E_p[z]
    # The target logit comes from a separate dot product: clamp the rounding above 0.
    return (tz - lse).clamp_max_(0.0), lse, lse - mean_z


# Tests set this to (token block, vocab block) to exercise the multi-block paths at tiny sizes.
FORCE_BLOCKING: tuple[int, int] | None = None
# How `backward_grads` runs grad_hidden's block product: "auto" takes cuBLAS (addmm with bf16 inputs and an fp32
# output, torch >= 2.9 on CUDA) when it works here, else `mm_acc_kernel`; "triton" forces it.
DH_IMPL = "auto"


def backward_blocking(n: int, v: int, hd: int, budget: int = 64 << 20) -> tuple[int, int]:
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


def backward_grads(h, w, targets, lse, ent, g_logp, g_ent, temperature, need_h, need_w):
    """(grad_hidden, grad_weight), None where not needed, from the forward's lse and entropy
    and the incoming ∂loss/∂logp, ∂loss/∂entropy (None where not differentiated)."""
    set_allocator()
    n, hd = h.shape
    v = w.shape[0]
    cn, cv = backward_blocking(n, v, hd)
    ieee = h.dtype == torch.float32
    grad_h = torch.empty_like(h) if need_h else None
    grad_w = torch.empty_like(w) if need_w else None
    # G blocks keep the row stride cv (a multiple of 16 bytes, as bulk copies require).
    g_buf = torch.empty(min(cn, n) * cv, dtype=h.dtype, device=h.device)
    dh_acc = torch.empty(min(cn, n), hd, dtype=torch.float32, device=h.device) if need_h else None
    inv_t = 1.0 / temperature
    glp = g_logp.float() * inv_t if g_logp is not None else torch.zeros_like(lse)
    ent_grad = g_ent is not None
    gent = g_ent.float() * inv_t if ent_grad else lse
    # fp16: G is stored scaled (or its softmax part would underflow); the products divide the
    # scale out: alpha for grad_weight, the fp32 grad_hidden accumulator at the end.
    scale = fp16_grad_scale(h.dtype, glp, gent if ent_grad else None, v)
    if scale != 1.0:
        glp = glp * scale
        gent = gent * scale if ent_grad else gent
    unscale = 1.0 / scale
    lse2 = lse * LOG2E
    dh_cublas = need_h and DH_IMPL == "auto" and cublas_fp32_addmm_works(h.device, h.dtype)
    # Persistent G kernel (one program per SM) unless GRPO_TRITON_PERSISTENT=0.
    progs = num_sms(h.device) if os.environ.get("GRPO_TRITON_PERSISTENT", "1") != "0" else 0
    for n0 in range(0, n, cn):
        n1 = min(n0 + cn, n)
        nb = n1 - n0
        h_blk = h[n0:n1]
        for v0 in range(0, v, cv):
            v1 = min(v0 + cv, v)
            vb = v1 - v0
            g = g_buf[: nb * cv].view(nb, cv)[:, :vb]  # [CN, CV]
            w_blk = w[v0:v1]

            def grid(meta, nb=nb, vb=vb):
                tiles = triton.cdiv(nb, meta["BLOCK_M"]) * triton.cdiv(vb, meta["BLOCK_N"])
                return (min(tiles, progs) if progs else tiles,)

            grad_logits_kernel[grid](
                h_blk, w_blk, g, targets[n0:n1] - v0, lse2[n0:n1],
                ent[n0:n1] if ent_grad else lse[n0:n1], glp[n0:n1], gent[n0:n1],
                nb, vb, hd, cv, LOG2E * inv_t, progs or (1 << 30), IEEE=ieee, ENT_GRAD=ent_grad,
            )  # fmt: skip
            if need_w:  # cuBLAS, fp32 accumulation, one bf16 rounding per token block
                out = grad_w[v0:v1]  # the first token block writes it (beta 0: not read)
                torch.addmm(out, g.T, h_blk, beta=float(n0 > 0), alpha=unscale, out=out)
            if need_h:
                acc = dh_acc[:nb]
                if dh_cublas:
                    if v0 == 0:
                        torch.mm(g, w_blk, out_dtype=torch.float32, out=acc)
                    else:
                        torch.addmm(acc, g, w_blk, out_dtype=torch.float32, out=acc)
                    continue

                def grid_h(meta, nb=nb):
                    return (triton.cdiv(nb, meta["BLOCK_M"]) * triton.cdiv(hd, meta["BLOCK_N"]),)

                mm_acc_kernel[grid_h](
                    g, w_blk, acc, nb, hd, vb, cv, IEEE=ieee, ACCUMULATE=v0 > 0
                )  # fmt: skip
        if need_h:
            grad_h[n0:n1] = dh_acc[:nb] if scale == 1.0 else dh_acc[:nb].mul_(unscale)
    return grad_h, grad_w


class TritonLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy):
        h = hidden.contiguous()
        w = weight.contiguous()
        tgt = targets.contiguous()
        logp, lse, ent = forward_stats(h, w, tgt, temperature)
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
        grad_h, grad_w = backward_grads(
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
    """Triton path of `learner.loss.logprobs.token_logprobs` (same contract; fp32 outputs)."""
    if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"the Triton path takes bf16/fp16/fp32 hidden states, got {hidden.dtype}; use "
            "impl='torch' for float64"
        )
    if hidden.shape[1] * hidden.element_size() % 16:
        raise ValueError(
            f"the Triton path needs rows of a multiple of 16 bytes (bulk tensor copies); hidden "
            f"size {hidden.shape[1]} in {hidden.dtype} is not: use impl='torch'"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32) + weight.sum() * 0
        return empty, (empty.clone() if with_entropy else None)
    logp, ent = TritonLogprobs.apply(hidden, weight, targets, float(temperature), with_entropy)
    return logp, (ent if with_entropy else None)
