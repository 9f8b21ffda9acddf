"""Triton chunk engine of `learner.fused_loss`: one pass over a chunk's logits, 2 bytes each.

Per chunk of C tokens (the caller runs the per-token loss in between and the two gradient
products with cuBLAS after):

1. `_softmax_tiles_kernel`: logits tiles `hidden @ weight.T` on the tensor cores (fp32
   accumulate), folded into an online log-sum-exp (running max m, Σ 2^(z-m), Σ 2^(z-m)·z per
   vocab split, in base 2) and the target logit (a row dot with the gathered weight row); every
   128-column tile is also stored as p̃ = 2^(z - m) in fp16 — the very values the online sum
   adds, in (0, 1], so fp16 keeps 11 significant bits where it matters — and m per (token,
   tile), `ref`. Logits rounded to 16 bits (bf16 errors of ±|z|·2⁻⁹ in z, i.e. several % in p)
   would not do.
2. The splits' partials are merged in PyTorch ([splits, C], tiny) into lse, log-prob and
   entropy; the caller turns those into g_logp and g_ent.
3. `_logits_grad_kernel`: p = p̃ · 2^(ref - lse) and ∂loss/∂logits from it, written in the
   weight's dtype (bf16/fp16) over p̃ in the same buffer, so cuBLAS reads it directly.

Anchored tiles (bf16 weights; fp16 takes steps 1-3), which replace steps 1 and 3:

1'. `_anchor_kernel` first computes every token's anchor R = its target's logit (base 2; one
   launch a call), then `_anchored_tiles_kernel` stores every tile as 2^(z - R) in bf16 — one
   reference per row, fixed before the pass: no running max, no rescaling — and sums them (and
   their ·(z - R)) over all columns but the target's, whose own value is exactly 1.
   `_anchored_merge_kernel` adds up the vocab splits into log-prob, entropy and the row's sum.
   bf16's 8-bit exponent holds 2^(z - R) while z - R < 128 (base 2): only a target more than
   88·T nats below its row's largest logit (p < 2^-128) overflows; the merge flags such rows and
   `_anchor_fallback_kernel` redoes them (anchored at the row's max instead; the common case is
   one launch that returns).
3'. ∂loss/∂z_j = g (1[j = target] - p_j) = -(g / S) · (stored_j - S·1[j = target]) with S the
   row's sum: once the target's entry is overwritten with 1 - S (= minus the other columns'
   sum, exact in fp32), the gradient is a row scaling of the stored tiles. The caller applies it
   in the two products (`fused_loss.grad_hidden_rows`: scale dH's C rows after the product;
   `grad_weight_add`: scale the C hidden rows before it), so there is no pass over the C × V
   values between the forward kernel and cuBLAS. Precision: the stored values carry bf16's
   2⁻⁹ relative rounding, the same as the materialised ∂loss/∂logits of steps 1-3.
   That is for a token loss that does not differentiate the entropy (`entropy_grad` False,
   GRPO's usual case). With an entropy bonus, ∂loss/∂z_j also holds p_j·log p_j, no row
   scaling of the stored values: `_anchored_ent_grad_kernel` rewrites them in place as bf16
   ∂loss/∂logits (p_j and log p_j from the stored value and the row's total), the same kind
   of pass as step 3 — and the forward is still the anchored kernel, faster than step 1's
   (an H100, fused-ent: 58.1 vs 60.3 ms at the Qwen3-0.6B head, `loss_gpu_regimes.py ab`).

The buffer is C × V 2-byte values, the chunk's only large allocation; nothing N×V exists.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from learner.kernels.triton_logprobs import (
    _MASKED,
    _PRUNE,
    LOG2E,
    _configs,
    _cublas_fp32_addmm_works,
    _logits_tile,
    _num_sms,
    _online_lse_step,
    _set_allocator,
    _target_logit,
)
from learner.logprobs import fp16_grad_scale

TILE_V = 128  # vocab columns per stored tile (one `ref` value per token and tile)
# Tokens a forward launch: larger chunks are run as several (their hidden rows stay in L2).
FWD_ROWS = int(os.environ.get("GRPO_FUSED_FWD_ROWS", "2048"))
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Anchored tiles where they apply (bf16); 0: always the tile-max path.
ANCHORED = os.environ.get("GRPO_FUSED_ANCHORED", "1") != "0"
# Anchored tiles also when the token loss differentiates the entropy (then with one in-place
# pass, `_anchored_ent_grad_kernel`); False: the softmax tiles' path for it.
ANCHORED_ENTROPY = True


@triton.jit
def _tile_program(
    h_ptr, w_ptr, N, V, H, v_per_split,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """What a forward-tile program (grid: token blocks x vocab splits) works on: the hidden
    and weight descriptors, its first row and rows, its vocab range (each kernel makes its own
    store descriptor: its stored block differs)."""
    h_desc = tl.make_tensor_descriptor(h_ptr, [N, H], [H, 1], [BLOCK_N, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [V, H], [H, 1], [BLOCK_V, BLOCK_K])
    row0 = tl.program_id(0) * BLOCK_N
    v_start = tl.program_id(1) * v_per_split
    v_end = tl.minimum(V, v_start + v_per_split)
    return h_desc, w_desc, row0, row0 + tl.arange(0, BLOCK_N), v_start, v_end


_TILE_CONFIGS = _configs(
    [
        ({"BLOCK_N": 128, "BLOCK_K": 64}, 8, 3),
        ({"BLOCK_N": 128, "BLOCK_K": 64}, 8, 4),
        ({"BLOCK_N": 128, "BLOCK_K": 128}, 8, 3),
        ({"BLOCK_N": 64, "BLOCK_K": 64}, 4, 4),
        ({"BLOCK_N": 256, "BLOCK_K": 64}, 8, 3),
    ],
    {"BLOCK_N": 16, "BLOCK_K": 16},
)


@triton.autotune(
    configs=_TILE_CONFIGS,
    key=["H", "V", "IEEE"],
    prune_configs_by=_PRUNE,
)
@triton.jit
def _softmax_tiles_kernel(
    h_ptr,  # [N, H] contiguous
    w_ptr,  # [V, H] contiguous
    tgt_ptr,  # [N]
    pt_ptr,  # [N, P_STRIDE] fp16 out: 2^(z2 - ref) per column
    ref_ptr,  # [V / TILE_V, REF_STRIDE] fp32 out: the running max (base 2) each tile was
    #           stored against, one row per vocab tile (coalesced over tokens)
    m_ptr,  # [S, PART_STRIDE] out: running max (base 2)
    s_ptr,  # [S, PART_STRIDE] out: Σ 2^(z2 - m)
    t_ptr,  # [S, PART_STRIDE] out: Σ 2^(z2 - m) · z2
    tz_ptr,  # [N] out: target logit / T (natural units; written by split 0)
    N,
    V,
    H,
    P_STRIDE,
    REF_STRIDE,
    PART_STRIDE,
    v_per_split,  # a multiple of TILE_V
    inv_t2,  # log2(e) / T: z2 = logits · inv_t2 are base-2 logits
    IEEE: tl.constexpr,
    BLOCK_V: tl.constexpr,  # = TILE_V
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    h_desc, w_desc, row0, rows, v_start, v_end = _tile_program(
        h_ptr, w_ptr, N, V, H, v_per_split, BLOCK_N, BLOCK_V, BLOCK_K
    )
    pt_desc = tl.make_tensor_descriptor(pt_ptr, [N, V], [P_STRIDE, 1], [BLOCK_N, BLOCK_V])
    row_ok = rows < N
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)
    # Flattened (vocab tile, k) loop: the next tile's loads are in flight during this tile's
    # softmax and its TMA store (async, bounds-clipped); 426 -> 501 TFLOP/s on an H100.
    for v0 in tl.range(v_start, v_end, BLOCK_V, flatten=True):
        z2 = _logits_tile(h_desc, w_desc, row0, v0, H, inv_t2, IEEE, BLOCK_N, BLOCK_V, BLOCK_K)
        cols = v0 + tl.arange(0, BLOCK_V)
        if v0 + BLOCK_V > V:
            z2 = tl.where(cols[None, :] < V, z2, _MASKED)
        m, s, t, p = _online_lse_step(m, s, t, z2)
        pt_desc.store([row0, v0], p.to(tl.float16))
        tl.store(ref_ptr + (v0 // BLOCK_V) * REF_STRIDE + rows, m, mask=row_ok)
    out = tl.program_id(1) * PART_STRIDE + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(t_ptr + out, t, mask=row_ok)
    if tl.program_id(1) == 0:
        tz = _target_logit(h_desc, w_ptr, tgt_ptr, rows, row_ok, row0, H, BLOCK_N, BLOCK_K)
        tl.store(tz_ptr + rows, tz * (inv_t2 * 0.6931471805599453), mask=row_ok)


@triton.jit
def _logits_grad_kernel(
    buf_ptr,  # [N, STRIDE] int16: fp16 p̃ in, ∂loss/∂logits (bf16 or fp16 bits) out, in place
    ref_ptr,  # [V / TILE_V, REF_STRIDE] fp32
    lse2_ptr,  # [N] log-sum-exp of z, base 2
    glp_ptr,  # [N] ∂loss/∂logp / T
    gent_ptr,  # [N] ∂loss/∂entropy / T
    ent_ptr,  # [N] entropy
    tgt_ptr,  # [N]
    N,
    V,
    STRIDE,
    REF_STRIDE,
    ENT_GRAD: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,  # = TILE_V
):
    pid_v = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    ok = row_ok[:, None] & (cols < V)[None, :]
    offs = rows[:, None].to(tl.int64) * STRIDE + cols[None, :]
    pt = tl.load(buf_ptr + offs, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    ref = tl.load(ref_ptr + pid_v * REF_STRIDE + rows, mask=row_ok, other=0.0)
    lse2 = tl.load(lse2_ptr + rows, mask=row_ok, other=0.0)
    glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
    shift = ref - lse2  # [BM] log2 of p / p̃ (<= 0)
    p = pt * tl.exp2(shift)[:, None]  # [BM, BV] softmax
    g = -glp[:, None] * p
    if ENT_GRAD:
        gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        # p̃ = 0 (underflow) contributes nothing; 0 · log 0 would be NaN
        logp = (tl.log2(tl.maximum(pt, 1e-30)) + shift[:, None]) * 0.6931471805599453
        g -= gent[:, None] * tl.where(pt > 0.0, p * (logp + ent[:, None]), 0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    g += tl.where(cols[None, :] == tgt[:, None], glp[:, None], 0.0)
    if OUT_BF16:
        bits = g.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        bits = g.to(tl.float16).to(tl.int16, bitcast=True)
    tl.store(buf_ptr + offs, bits, mask=ok)


@triton.jit
def _anchor_kernel(
    h_ptr, w_ptr, tgt_ptr, r_ptr, N, H, inv_t2, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The anchor R of each token: its target's logit, base 2 (`inv_t2` = log2(e) / T)."""
    h_desc = tl.make_tensor_descriptor(h_ptr, [N, H], [H, 1], [BLOCK_N, BLOCK_K])
    row0 = tl.program_id(0) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tz = _target_logit(h_desc, w_ptr, tgt_ptr, rows, row_ok, row0, H, BLOCK_N, BLOCK_K)
    tl.store(r_ptr + rows, tz * inv_t2, mask=row_ok)


# The anchored kernel keeps no per-tile reference, so its vocab tile is free. PIECE_V: the
# epilogue runs on the tile's two column halves of that many, each stored by its own TMA store:
# 128 x 256 tiles in one block spill registers and their 64 KB store buffer leaves room for 3
# stages only; in two blocks no spills, and 4 stages fit. H100, one 1536-row launch of the
# Qwen3-0.6B head (`bench/probe_forward.py`, bench/results/probe_forward*_session15.json):
# 0.854 ms in one block, 0.806 in two, 0.754 in two with 4 stages; 256 x 128 tiles 0.841 and
# 128 x 128 ones 0.82-0.87; the 8B head's 2048 rows: 3.85 / 3.56 / 3.82 ms, 3.70 and 3.9-4.5.
# Only the two 128 x 256 configs are tried: under the H100's power cap the autotuner's timings
# are noisy enough to pick a config 10 % slower (256 x 128 did, in one run).
_ANCHORED_CONFIGS = _configs(
    [
        ({"BLOCK_N": 128, "BLOCK_V": 256, "BLOCK_K": 64, "PIECE_V": 128}, 8, 4),
        ({"BLOCK_N": 128, "BLOCK_V": 256, "BLOCK_K": 64, "PIECE_V": 128}, 8, 3),
    ],
    {"BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_K": 16, "PIECE_V": 8},
)


@triton.jit
def _anchored_piece(z2, c0, r, tgt, hit, V, row0, desc):
    """One column block of an anchored tile (base-2 logits `z2` from column `c0`): stores
    2^(z2 - R) as bf16 and returns its row sums Σ 2^(z2 - R) and Σ 2^(z2 - R)·(z2 - R) over the
    block's columns but the row's target. The compare runs only where `hit`: a tile holds
    some row's target (a fifth of the 128 x 256 tiles for V = 151936)."""
    cols = c0 + tl.arange(0, z2.shape[1])
    d = z2 - r[:, None]
    if c0 + z2.shape[1] > V:
        d = tl.where(cols[None, :] < V, d, _MASKED)
    p = tl.exp2(d)
    desc.store([row0, c0], p.to(tl.bfloat16).to(tl.int16, bitcast=True))
    if hit != 0:  # noqa: SIM108 (a runtime branch: Triton has no tensor ternary)
        q = tl.where(cols[None, :] == tgt[:, None], 0.0, p)  # the target's term: exactly 1
    else:
        q = p
    return tl.sum(q, 1), tl.sum(q * d, 1)


@triton.autotune(configs=_ANCHORED_CONFIGS, key=["H", "V"])
@triton.jit
def _anchored_tiles_kernel(
    h_ptr,  # [N, H] contiguous
    w_ptr,  # [V, H] contiguous
    tgt_ptr,  # [N]
    r_ptr,  # [N] the anchor: target logit, base 2
    pt_ptr,  # [N, P_STRIDE] int16 out: the bf16 bits of 2^(z2 - R) per column
    s_ptr,  # [S, PART_STRIDE] out: Σ 2^(z2 - R) over the split's columns but the target
    t_ptr,  # [S, PART_STRIDE] out: Σ 2^(z2 - R) · (z2 - R), same columns
    N,
    V,
    H,
    P_STRIDE,
    PART_STRIDE,
    v_per_split,  # a multiple of TILE_V
    inv_t2,  # log2(e) / T
    BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PIECE_V: tl.constexpr,  # BLOCK_V / 2: the epilogue runs on the tile's two column halves
):
    """Logits tiles stored as 2^(z2 - R) in bf16 against a per-token anchor fixed in advance:
    no running max, no rescaling, one reference for every tile of a row (so the gradient is a
    row scaling of the stored values: no second pass). bf16's exponent range holds
    2^(z2 - R) for z2 - R < 128: a target logit more than 88·T nats below the row's largest
    (a target probability below 2^-128) overflows, which the merge detects and
    `_anchor_fallback_kernel` redoes for that row."""
    h_desc, w_desc, row0, rows, v_start, v_end = _tile_program(
        h_ptr, w_ptr, N, V, H, v_per_split, BLOCK_N, BLOCK_V, BLOCK_K
    )
    pt_desc = tl.make_tensor_descriptor(pt_ptr, [N, V], [P_STRIDE, 1], [BLOCK_N, PIECE_V])
    row_ok = rows < N
    r = tl.load(r_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    s = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)
    for v0 in tl.range(v_start, v_end, BLOCK_V, flatten=True):
        z2 = _logits_tile(h_desc, w_desc, row0, v0, H, inv_t2, False, BLOCK_N, BLOCK_V, BLOCK_K)
        hit = tl.max(((tgt >= v0) & (tgt < v0 + BLOCK_V)).to(tl.int32), 0)
        # the accumulator's two column halves (a register view, no data movement)
        lo, hi = tl.split(tl.permute(tl.reshape(z2, [BLOCK_N, 2, PIECE_V]), [0, 2, 1]))
        ds, dt = _anchored_piece(lo, v0, r, tgt, hit, V, row0, pt_desc)
        s += ds
        t += dt
        ds, dt = _anchored_piece(hi, v0 + PIECE_V, r, tgt, hit, V, row0, pt_desc)
        s += ds
        t += dt
    out = tl.program_id(1) * PART_STRIDE + rows
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(t_ptr + out, t, mask=row_ok)


@triton.jit
def _row_logits(h_ptr, w_ptr, row, v0, V, H, inv_t2, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """Base-2 logits of one token at columns `v0 + [0, BLOCK_V)` on the CUDA cores (fp32);
    columns past V read as `_MASKED`."""
    cols = v0 + tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        hk = tl.load(h_ptr + row.to(tl.int64) * H + kk, mask=kk < H, other=0.0)
        wk = tl.load(
            w_ptr + cols[:, None].to(tl.int64) * H + kk[None, :],
            mask=(cols < V)[:, None] & (kk < H)[None, :],
            other=0.0,
        )
        acc += tl.sum(wk.to(tl.float32) * hk.to(tl.float32)[None, :], 1)
    return tl.where(cols < V, acc * inv_t2, _MASKED)


@triton.jit
def _log1p(x):
    """log(1 + x) for x >= 0, accurate for small x (Goldberg's trick: the rounding of 1 + x
    cancels in log(u) · x / (u - 1))."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _anchored_merge_kernel(
    sx_ptr, tx_ptr, tgt_ptr, pt_ptr, logp_ptr, ent_ptr, total_ptr, bad_ptr,
    N, S, PART_STRIDE, P_STRIDE, BLOCK: tl.constexpr,
):  # fmt: skip
    """A row's anchored partials summed over the vocab splits, and everything the chunk needs
    from them, in one launch: log-prob, entropy, the row's total Σ 2^(z2 - R) and the target's
    entry of the stored tiles overwritten with -sx (see the module docstring, step 3'). Rows
    whose sums overflowed (or are not finite) are only flagged in `bad`: the fallback kernel
    redoes them."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    sx = tl.zeros([BLOCK], tl.float32)
    tx = tl.zeros([BLOCK], tl.float32)
    for sp in range(S):
        sx += tl.load(sx_ptr + sp * PART_STRIDE + rows, mask=ok, other=0.0)
        tx += tl.load(tx_ptr + sp * PART_STRIDE + rows, mask=ok, other=0.0)
    # sx < 2^100 is false for NaN and +inf too
    sane = (sx < 1.2676506002282294e30) & (tx == tx) & (tl.abs(tx) < float("inf"))
    total = 1.0 + sx  # the target's own stored value is exactly 1
    logp = tl.minimum(-_log1p(sx), 0.0)
    ent = (tl.log2(total) - tx / total) * 0.6931471805599453
    good = ok & sane
    tl.store(logp_ptr + rows, logp, mask=good)
    tl.store(ent_ptr + rows, ent, mask=good)
    tl.store(total_ptr + rows, total, mask=good)
    tl.store(bad_ptr + rows, (~sane).to(tl.int8), mask=ok)
    tgt = tl.load(tgt_ptr + rows, mask=good, other=0)
    bits = (-sx).to(tl.bfloat16).to(tl.int16, bitcast=True)
    tl.store(pt_ptr + rows.to(tl.int64) * P_STRIDE + tgt, bits, mask=good)


@triton.jit
def _anchor_fallback_kernel(
    h_ptr, w_ptr, tgt_ptr, bad_ptr, r_ptr, pt_ptr, logp_ptr, ent_ptr, total_ptr,
    V, H, P_STRIDE, inv_t2, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """For each token flagged in `bad` (its anchored sums overflowed): the row again, one
    token a program, anchored at the row's max m instead (values in (0, 1]): rewrites its
    stored tiles (the target's entry with -sx) and its log-prob, entropy and total. Unflagged
    tokens return at once: the common case costs one launch."""
    row = tl.program_id(0)
    if tl.load(bad_ptr + row) != 0:
        tgt = tl.load(tgt_ptr + row)
        m = float("-inf")
        for v0 in range(0, V, BLOCK_V):
            z2 = _row_logits(h_ptr, w_ptr, row, v0, V, H, inv_t2, BLOCK_V, BLOCK_K)
            m = tl.maximum(m, tl.max(z2, 0))
        sx = 0.0
        tx = 0.0
        for v0 in range(0, V, BLOCK_V):
            z2 = _row_logits(h_ptr, w_ptr, row, v0, V, H, inv_t2, BLOCK_V, BLOCK_K)
            cols = v0 + tl.arange(0, BLOCK_V)
            d = z2 - m
            p = tl.exp2(d)
            bits = p.to(tl.bfloat16).to(tl.int16, bitcast=True)
            tl.store(pt_ptr + row.to(tl.int64) * P_STRIDE + cols, bits, mask=cols < V)
            q = tl.where(cols == tgt, 0.0, p)
            sx += tl.sum(q, 0)
            tx += tl.sum(q * d, 0)
        a = tl.load(r_ptr + row) - m  # log2 of the target's stored value
        pa = tl.exp2(a)
        total = pa + sx
        tl.store(logp_ptr + row, tl.minimum(a * 0.6931471805599453 - tl.log(total), 0.0))
        tl.store(ent_ptr + row, (tl.log2(total) - (tx + pa * a) / total) * 0.6931471805599453)
        tl.store(total_ptr + row, total)
        tl.store(
            pt_ptr + row.to(tl.int64) * P_STRIDE + tgt,
            (-sx).to(tl.bfloat16).to(tl.int16, bitcast=True),
        )


@triton.jit
def _anchored_ent_grad_kernel(
    buf_ptr,  # [N, STRIDE] int16: anchored bf16 tiles 2^(z2 - R) in, ∂loss/∂logits bf16 out
    total_ptr,  # [N] the row's Σ 2^(z2 - R)
    logp_ptr,  # [N] the target's log-prob
    ent_ptr,  # [N] entropy
    glp_ptr,  # [N] ∂loss/∂logp
    gent_ptr,  # [N] ∂loss/∂entropy
    tgt_ptr,  # [N]
    N,
    V,
    STRIDE,
    inv_t,  # 1 / T
    HAS_LP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """∂loss/∂logits of anchored tiles with the entropy differentiated, in place (bf16):
    p_j = stored_j / total, log p_j = log2(stored_j / total)·ln 2 (the stored value's bf16
    rounding is 2^-9 relative: an absolute 2^-9 in log p_j, below the bf16 rounding of the
    result wherever the entropy's gradient is not far larger than the log-prob's), and
    G_j = -p_j (glp + gent (log p_j + H)) / T off the target; the target's entry (overwritten
    by the merge) from the row's log-prob: G_t = (glp (1 - p_t) - gent p_t (log p_t + H)) / T."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    ok = row_ok[:, None] & (cols < V)[None, :]
    offs = rows[:, None].to(tl.int64) * STRIDE + cols[None, :]
    q = tl.load(buf_ptr + offs, mask=ok, other=0).to(tl.bfloat16, bitcast=True).to(tl.float32)
    total = tl.load(total_ptr + rows, mask=row_ok, other=1.0)
    ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
    gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0) * inv_t
    if HAS_LP:
        glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0) * inv_t
    else:
        glp = tl.zeros([BLOCK_M], tl.float32)
    inv_total = 1.0 / total
    p = q * inv_total[:, None]
    # stored 0 (underflow): p = 0 times a finite log (0 · log 0 would be NaN). The clamp is a
    # normal number: at 1e-38 (subnormal) this pass ran 2.5x slower on an H100.
    logp = (tl.log2(tl.maximum(q, 1e-30)) - tl.log2(total)[:, None]) * 0.6931471805599453
    g = -p * (glp[:, None] + gent[:, None] * (logp + ent[:, None]))
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    lp_t = tl.load(logp_ptr + rows, mask=row_ok, other=0.0)
    p_t = tl.exp(lp_t)
    g_t = glp * (1.0 - p_t) - gent * p_t * (lp_t + ent)
    g = tl.where(cols[None, :] == tgt[:, None], g_t[:, None], g)
    tl.store(buf_ptr + offs, g.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=ok)


@triton.jit
def _row_scale_kernel(x_ptr, s_ptr, out_ptr, H, X_STRIDE, OUT_STRIDE, BLOCK: tl.constexpr):
    """out[r] = x[r] · s[r] (fp32 product, one rounding to out's dtype)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row.to(tl.int64) * X_STRIDE + cols, mask=ok, other=0.0)
    y = x.to(tl.float32) * tl.load(s_ptr + row)
    tl.store(
        out_ptr + row.to(tl.int64) * OUT_STRIDE + cols, y.to(out_ptr.dtype.element_ty), mask=ok
    )


def row_scale(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out = diag(scale) @ x` for 2-D row-contiguous CUDA tensors (`out` may be `x`): one
    vectorised pass (PyTorch's broadcast multiply of bf16 by fp32 rows runs ~3x slower)."""
    n, h = x.shape
    assert x.stride(1) == 1 and out.stride(1) == 1 and scale.shape == (n,)
    block = 1024
    _row_scale_kernel[(n, triton.cdiv(h, block))](
        x, scale, out, h, x.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out


@triton.jit
def _anchored_scales_kernel(g_ptr, total_ptr, out_ptr, N, coef, BLOCK: tl.constexpr):
    """out = (coef · g) / total in fp32, the roundings of `(g · inv_t)` then `-glp / total`."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tot = tl.load(total_ptr + offs, mask=ok, other=1.0)
    tl.store(out_ptr + offs, (g * coef) / tot, mask=ok)


@triton.jit
def _scale_kernel(x_ptr, s_ptr, N, BLOCK: tl.constexpr):
    """x *= s (a device scalar); nothing is read or written where s == 1."""
    s = tl.load(s_ptr)
    if s != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        x = tl.load(x_ptr + offs, mask=ok, other=0.0)
        tl.store(x_ptr + offs, (x.to(tl.float32) * s).to(x_ptr.dtype.element_ty), mask=ok)


def scale_(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """`x *= s` in place for a contiguous CUDA tensor and a one-element CUDA tensor `s`,
    without a host sync: with s == 1 (a plain `loss.backward()`) the kernel returns at once."""
    assert x.is_contiguous() and s.numel() == 1
    block = 4096
    _scale_kernel[(triton.cdiv(x.numel(), block),)](x, s, x.numel(), BLOCK=block, num_warps=8)
    return x


@functools.lru_cache(maxsize=256)
def split_plan(rows: int, v: int, sms: int) -> tuple[int, int]:
    """(splits, vocab columns a split, a multiple of 256) for a forward launch over `rows`
    tokens: programs of 128 tokens x one split, one an SM at a time (the kernel's shared
    memory), so the launch takes ~`ceil(programs / SMs)` waves as long as its longest
    program (`columns a split`). The plan minimises that product over splits of at least 2048
    columns and at most ~4 programs an SM; ties go to the most splits (room to balance). For
    the Qwen3-0.6B head's 1536-token chunk on 132 SMs: 33 splits, 396 programs in 3 full waves
    (the former ~4 waves' rule gave 43 splits, 516 programs: 4 waves, 3.7 % longer); its
    512-token last chunk: 66 splits, 2 full waves."""
    n_tiles = triton.cdiv(rows, 128)
    best: tuple[int, int, int] | None = None  # (cost, -splits, columns a split)
    for want in range(1, max(1, triton.cdiv(v, 2048)) + 1):
        per = triton.cdiv(triton.cdiv(v, want), 256) * 256
        splits = triton.cdiv(v, per)
        programs = n_tiles * splits
        if programs > max(4 * sms, n_tiles):
            break
        cand = (triton.cdiv(programs, sms) * per, -splits, per)
        best = cand if best is None or cand < best else best
    assert best is not None
    return -best[1], best[2]


class TritonChunks:
    """Chunk engine with the interface of `fused_loss.TorchChunks`: `stats(s, e)` then
    `logits_grad(g_logp, g_ent)` for the same chunk."""

    def __init__(
        self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
        temperature: float, chunk_size: int, entropy_grad: bool = True,
    ):  # fmt: skip
        if hidden.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != hidden.dtype:
            raise ValueError(
                f"the fused Triton path takes bf16/fp16 hidden and weight of one dtype, got "
                f"{hidden.dtype} and {weight.dtype}; use impl='torch'"
            )
        _set_allocator()
        self.h, self.w, self.tgt = hidden.contiguous(), weight.contiguous(), targets.contiguous()
        n, _ = self.h.shape
        v = self.w.shape[0]
        self.inv_t = 1.0 / temperature
        c = max(1, min(chunk_size, n))
        # The forward kernel runs over at most FWD_ROWS tokens a launch: its hidden rows stay in
        # L2 while the weight streams past, however large the chunk the products see.
        self.fwd_rows = max(1, min(FWD_ROWS, c))
        n_tiles_v = triton.cdiv(v, TILE_V)
        # Row stride a multiple of 8 entries (16 bytes) for cuBLAS and the bulk copies.
        self.buf = torch.empty(c, n_tiles_v * TILE_V, dtype=torch.int16, device=hidden.device)
        # Vocab splits of each forward launch (`split_plan`): a full chunk's, and the last
        # chunk's where it is shorter (its launches are planned on their own rows).
        sms = _num_sms(hidden.device)
        self._plans = {rows: split_plan(rows, v, sms) for rows in {self.fwd_rows, n % c or c}}
        max_splits = max(splits for splits, _ in self._plans.values())
        self.parts = torch.empty(3, max_splits, c, dtype=torch.float32, device=hidden.device)
        self.anchors: torch.Tensor | None = None  # [N] anchored tiles: each token's R
        self._state: tuple | None = None
        # Anchored tiles (bf16): without the entropy gradient ∂loss/∂logits is a row scaling of
        # the stored tiles, applied in the gradient products (no pass over the chunk's
        # logits); with it, one in-place pass turns them into ∂loss/∂logits.
        self.anchored = (
            ANCHORED and self.w.dtype == torch.bfloat16 and (ANCHORED_ENTROPY or not entropy_grad)
        )
        dev = hidden.device
        if self.anchored:
            self.total = torch.empty(c, dtype=torch.float32, device=dev)
            self.bad = torch.empty(c, dtype=torch.int8, device=dev)
            # grad_hidden's product in fp32 before its row scaling (`grad_hidden_rows`; with
            # the entropy gradient G itself is stored: no row scaling)
            self.fp32_rows = None
            if not entropy_grad and _cublas_fp32_addmm_works(dev, self.w.dtype):
                self.fp32_rows = torch.empty(c, self.h.shape[1], dtype=torch.float32, device=dev)
        else:  # the reference (running max) each tile was stored against; target logits
            self.ref = torch.empty(n_tiles_v, c, dtype=torch.float32, device=dev)
            self.tz = torch.empty(c, dtype=torch.float32, device=dev)

    def _plan(self, s: int, e: int) -> tuple[int, int]:
        """(splits, vocab columns a split) of chunk `[s, e)`'s forward launches."""
        rows = min(self.fwd_rows, e - s)
        return self._plans[rows] if rows in self._plans else self._plans[self.fwd_rows]

    def _sub_chunks(self, s: int, e: int):
        """The forward launches of rows `[s, e)`: (offset in the chunk, global start, end)."""
        for r0 in range(s, e, self.fwd_rows):
            yield r0 - s, r0, min(e, r0 + self.fwd_rows)

    def stats(self, s: int, e: int, logp: torch.Tensor, ent: torch.Tensor) -> None:
        """Log-probs and entropies of tokens `[s, e)`, written into `logp` and `ent` ([e - s]
        contiguous fp32 each)."""
        if self.anchored:
            self._anchored_stats(s, e, logp, ent)
        else:
            self._tile_stats(s, e, logp, ent)

    def logits_grad(
        self, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor, float | torch.Tensor]:
        """∂loss/∂logits of the chunk [nb, V] in the weight's dtype, and a scale: a float
        (the matrix is ∂loss/∂logits times it; != 1 for fp16 only, see `fp16_grad_scale`),
        or, anchored, a [nb] fp32 tensor (∂loss/∂logits = diag(scale) @ the matrix)."""
        if self.anchored:
            return self._anchored_grad(g_lp, g_ent)
        return self._tile_grad(g_lp, g_ent)

    def _anchored_stats(self, s: int, e: int, logp: torch.Tensor, ent: torch.Tensor) -> None:
        nb = e - s
        v, hd = self.w.shape
        h, tgt, inv_t2 = self.h[s:e], self.tgt[s:e], LOG2E * self.inv_t
        if self.anchors is None:  # every token's at once: one launch instead of one a chunk
            n = self.h.shape[0]
            self.anchors = torch.empty(n, dtype=torch.float32, device=self.h.device)
            # Many small programs (16 tokens each): a gather-dot, bound by reading 2·N·H values.
            _anchor_kernel[(triton.cdiv(n, 16),)](
                self.h, self.w, self.tgt, self.anchors, n, hd, inv_t2, BLOCK_N=16,
                BLOCK_K=16 if _INTERPRET else 128, num_warps=4,
            )  # fmt: skip
        r = self.anchors[s:e]  # [nb] the anchors
        splits, v_per_split = self._plan(s, e)
        _, sx, tx = self.parts.unbind(0)  # [S, C] each
        buf = self.buf  # int16: bf16 bits
        for off, r0, r1 in self._sub_chunks(s, e):
            rows = r1 - r0

            def grid(meta, rows=rows):
                return (triton.cdiv(rows, meta["BLOCK_N"]), splits)

            _anchored_tiles_kernel[grid](
                self.h[r0:r1], self.w, self.tgt[r0:r1], r[off:], buf[off:], sx[:, off:],
                tx[:, off:], rows, v, hd, buf.shape[1], sx.shape[1], v_per_split, inv_t2,
            )  # fmt: skip
        total, bad = self.total[:nb], self.bad[:nb]
        # 64 rows a program: 24 programs for the 0.6B head's 1536-row chunk, 7.8 µs a launch on
        # an H100 (11.7 µs with 256 rows, 6 programs; `bench_loss_gpu.py --profile`)
        block = 16 if _INTERPRET else 64
        _anchored_merge_kernel[(triton.cdiv(nb, block),)](
            sx, tx, tgt, buf, logp, ent, total, bad, nb, splits, sx.shape[1], buf.shape[1],
            BLOCK=block, num_warps=4,
        )  # fmt: skip
        _anchor_fallback_kernel[(nb,)](
            h, self.w, tgt, bad, r, buf, logp, ent, total, v, hd, buf.shape[1], inv_t2,
            BLOCK_V=16 if _INTERPRET else 128, BLOCK_K=16 if _INTERPRET else 64,
        )  # fmt: skip
        self._state = (s, e, total, logp, ent)

    def _anchored_grad(
        self, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | float]:
        assert self._state is not None
        s, e, total, logp, ent = self._state
        self._state = None
        nb = e - s
        v = self.w.shape[0]
        if g_ent is not None:  # the entropy differentiated: one pass, ∂loss/∂logits itself
            assert g_ent.shape == (nb,) and g_ent.is_contiguous()
            block_m = 16  # as `_logits_grad_kernel`
            _anchored_ent_grad_kernel[(triton.cdiv(nb, block_m), triton.cdiv(v, TILE_V))](
                self.buf, total, logp, ent, g_lp if g_lp is not None else g_ent, g_ent,
                self.tgt[s:e], nb, v, self.buf.shape[1], self.inv_t, HAS_LP=g_lp is not None,
                BLOCK_M=block_m, BLOCK_V=TILE_V, num_warps=4,
            )  # fmt: skip
            return self.buf.view(torch.bfloat16)[:nb, :v], 1.0
        # ∂loss/∂z_j = glp (1[j = target] - p_j) = -(glp / total) · (stored_j - total·1[target])
        # with glp = g_lp / T: the row scales in one launch
        scale = torch.empty_like(total)
        if g_lp is None:
            scale.zero_()
        else:
            assert g_lp.shape == (nb,) and g_lp.is_contiguous()
            block = 1024
            _anchored_scales_kernel[(triton.cdiv(nb, block),)](
                g_lp, total, scale, nb, -self.inv_t, BLOCK=block, num_warps=4
            )
        return self.buf.view(torch.bfloat16)[:nb, : self.w.shape[0]], scale

    def _tile_stats(self, s: int, e: int, logp: torch.Tensor, ent: torch.Tensor) -> None:

        nb = e - s
        v, hd = self.w.shape
        splits, v_per_split = self._plan(s, e)
        m, sm, t = self.parts.unbind(0)  # [S, C] each

        pt = self.buf.view(torch.float16)
        for off, r0, r1 in self._sub_chunks(s, e):
            rows = r1 - r0

            def grid(meta, rows=rows):
                return (triton.cdiv(rows, meta["BLOCK_N"]), splits)

            _softmax_tiles_kernel[grid](
                self.h[r0:r1], self.w, self.tgt[r0:r1], pt[off:], self.ref[:, off:],
                m[:, off:], sm[:, off:], t[:, off:], self.tz[off:], rows, v, hd, pt.shape[1],
                self.ref.shape[1], m.shape[1], v_per_split, LOG2E * self.inv_t, IEEE=False,
                BLOCK_V=TILE_V,
            )  # fmt: skip
        m, sm, t = m[:splits, :nb], sm[:splits, :nb], t[:splits, :nb]  # [S, nb], base 2
        big = m.max(dim=0).values  # [nb]
        scale = torch.exp2(m - big)  # [S, nb]
        total = (sm * scale).sum(0)
        lse2 = big + torch.log2(total)  # [nb]
        lse = lse2 * (1.0 / LOG2E)
        torch.mul(lse2 - (t * scale).sum(0) / total, 1.0 / LOG2E, out=ent)
        torch.clamp_max(self.tz[:nb] - lse, 0.0, out=logp)  # separate dot: rounding above 0
        self._state = (s, e, lse2, ent)

    def _tile_grad(
        self, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor, float]:
        assert self._state is not None
        s, e, lse2, ent = self._state
        self._state = None
        nb = e - s
        v = self.w.shape[0]
        glp = g_lp.float() * self.inv_t if g_lp is not None else torch.zeros_like(lse2)
        ent_grad = g_ent is not None
        gent = g_ent.float() * self.inv_t if ent_grad else glp
        scale = fp16_grad_scale(self.w.dtype, glp, gent if ent_grad else None, v)
        if scale != 1.0:
            glp = glp * scale
            gent = gent * scale if ent_grad else glp
        # 16 rows of 128 columns, 4 warps: 16 entries a thread. An H100 rewrote the 0.6B head's
        # 1536-token chunk in 0.355 ms (2.6 TB/s; a plain copy of the bytes: 0.312) and the 8B
        # head's 4096 in 0.941, against 0.419 and 1.107 with 32 rows (`probe_logits_grad.py`).
        block_m = 16
        grid = (triton.cdiv(nb, block_m), triton.cdiv(v, TILE_V))
        _logits_grad_kernel[grid](
            self.buf, self.ref, lse2, glp, gent, ent, self.tgt[s:e], nb, v,
            self.buf.shape[1], self.ref.shape[1], ENT_GRAD=ent_grad,
            OUT_BF16=self.w.dtype == torch.bfloat16, BLOCK_M=block_m, BLOCK_V=TILE_V, num_warps=4,
        )  # fmt: skip
        return self.buf.view(self.w.dtype)[:nb, :v], scale  # [nb, V], row stride % 128 == 0


@triton.jit
def _grpo_token_grads_kernel(
    lp_ptr, adv_ptr, w_ptr, old_ptr, ref_ptr, samp_ptr, out_ptr, N, lo, hi, beta, tis_cap,
    HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_SAMP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """`GRPOTokenLoss.token_grads`'s ∂loss/∂logp in one pass: the same terms, the same tie
    conventions (see there)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    lp = tl.load(lp_ptr + offs, mask=ok, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=ok, other=0.0)
    if HAS_OLD:  # noqa: SIM108 (a constexpr branch)
        old = tl.load(old_ptr + offs, mask=ok, other=0.0)
    else:  # μ = 1: the ratio is exactly 1
        old = lp
    ratio = tl.exp(lp - old)
    u = ratio * adv
    v = tl.minimum(tl.maximum(ratio, lo), hi) * adv
    g_clip = tl.where((ratio >= lo) & (ratio <= hi), 1.0, 0.0)
    g_min = tl.where(u < v, 1.0, tl.where(u == v, 0.5 * (1.0 + g_clip), g_clip))
    g = -(u * g_min)
    if HAS_SAMP:
        samp = tl.load(samp_ptr + offs, mask=ok, other=0.0)
        g = g * tl.minimum(tl.exp(old - samp), tis_cap)
    if HAS_REF:
        ref = tl.load(ref_ptr + offs, mask=ok, other=0.0)
        g = g + beta * (1.0 - tl.exp(ref - lp))
    tl.store(out_ptr + offs, g * tl.load(w_ptr + offs, mask=ok, other=0.0), mask=ok)


def grpo_token_grads(
    lp: torch.Tensor,
    adv: torch.Tensor,
    w: torch.Tensor,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    samp: torch.Tensor | None,
    clip: tuple[float, float],
    beta: float,
    tis_cap: float | None,
) -> torch.Tensor:
    """The GRPO loss's per-token ∂loss/∂logp from contiguous fp32 [n] inputs (None: unused),
    one launch instead of ~15 elementwise ones (see `GRPOTokenLoss.token_grads`)."""
    n = lp.numel()
    out = torch.empty_like(lp)
    block = 1024
    _grpo_token_grads_kernel[(max(1, triton.cdiv(n, block)),)](
        lp, adv, w, lp if old is None else old, lp if ref is None else ref,
        lp if samp is None else samp, out, n, clip[0], clip[1], beta,
        float("inf") if tis_cap is None else tis_cap, HAS_OLD=old is not None,
        HAS_REF=ref is not None, HAS_SAMP=samp is not None, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out
