"""The Triton kernels of the fused loss's chunk engine (`learner.loss.kernels.triton_fused`).

Only the `@triton.jit` functions and their autotune configs live here. What they compute (steps
1-3, and the anchored tiles' 1'-3', which the kernels' docstrings call "the module docstring")
is described in `triton_fused`'s docstring; the launches, buffers and planning (`TritonChunks`,
`split_plan`) and the module flags they read (`FWD_ROWS`, `ANCHORED`, `ANCHORED_ENTROPY`) are
there too. Apart so that the device code and the host code each read in one sitting.
"""

from __future__ import annotations

import triton
import triton.language as tl

from learner.loss.kernels.triton_common import (
    MASKED,
    PRUNE,
    autotune_configs,
    logits_tile,
    online_lse_step,
    target_logit,
)


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


_TILE_CONFIGS = autotune_configs(
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
    prune_configs_by=PRUNE,
)
@triton.jit
def softmax_tiles_kernel(
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
        z2 = logits_tile(h_desc, w_desc, row0, v0, H, inv_t2, IEEE, BLOCK_N, BLOCK_V, BLOCK_K)
        cols = v0 + tl.arange(0, BLOCK_V)
        if v0 + BLOCK_V > V:
            z2 = tl.where(cols[None, :] < V, z2, MASKED)
        m, s, t, p = online_lse_step(m, s, t, z2)
        pt_desc.store([row0, v0], p.to(tl.float16))
        tl.store(ref_ptr + (v0 // BLOCK_V) * REF_STRIDE + rows, m, mask=row_ok)
    out = tl.program_id(1) * PART_STRIDE + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(t_ptr + out, t, mask=row_ok)
    if tl.program_id(1) == 0:
        tz = target_logit(h_desc, w_ptr, tgt_ptr, rows, row_ok, row0, H, BLOCK_N, BLOCK_K)
        tl.store(tz_ptr + rows, tz * (inv_t2 * 0.6931471805599453), mask=row_ok)


@triton.jit
def logits_grad_kernel(
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
def anchor_kernel(
    h_ptr, w_ptr, tgt_ptr, r_ptr, N, H, inv_t2, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The anchor R of each token: its target's logit, base 2 (`inv_t2` = log2(e) / T)."""
    h_desc = tl.make_tensor_descriptor(h_ptr, [N, H], [H, 1], [BLOCK_N, BLOCK_K])
    row0 = tl.program_id(0) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tz = target_logit(h_desc, w_ptr, tgt_ptr, rows, row_ok, row0, H, BLOCK_N, BLOCK_K)
    tl.store(r_ptr + rows, tz * inv_t2, mask=row_ok)


# The anchored kernel keeps no per-tile reference, so its vocab tile is free. PIECE_V: the
# epilogue runs on the tile's two column halves of that many, each stored by its own TMA store:
# 128 x 256 tiles in one block spill registers and their 64 KB store buffer leaves room for 3
# stages only; in two blocks no spills, and 4 stages fit. H100, one 1536-row launch of the
# Qwen3-0.6B head (`bench/probe_forward.py`, bench/results/probe_forward_epilogue*_h100.json):
# 0.854 ms in one block, 0.806 in two, 0.754 in two with 4 stages; 256 x 128 tiles 0.841 and
# 128 x 128 ones 0.82-0.87; the 8B head's 2048 rows: 3.85 / 3.56 / 3.82 ms, 3.70 and 3.9-4.5.
# Only the two 128 x 256 configs are tried: under the H100's power cap the autotuner's timings
# are noisy enough to pick a config 10 % slower (256 x 128 did, in one run).
_ANCHORED_CONFIGS = autotune_configs(
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
        d = tl.where(cols[None, :] < V, d, MASKED)
    p = tl.exp2(d)
    desc.store([row0, c0], p.to(tl.bfloat16).to(tl.int16, bitcast=True))
    if hit != 0:  # noqa: SIM108 (a runtime branch: Triton has no tensor ternary)
        q = tl.where(cols[None, :] == tgt[:, None], 0.0, p)  # the target's term: exactly 1
    else:
        q = p
    return tl.sum(q, 1), tl.sum(q * d, 1)


@triton.autotune(configs=_ANCHORED_CONFIGS, key=["H", "V"])
@triton.jit
def anchored_tiles_kernel(
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
    `anchor_fallback_kernel` redoes for that row."""
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
        z2 = logits_tile(h_desc, w_desc, row0, v0, H, inv_t2, False, BLOCK_N, BLOCK_V, BLOCK_K)
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
    columns past V read as `MASKED`."""
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
    return tl.where(cols < V, acc * inv_t2, MASKED)


@triton.jit
def _log1p(x):
    """log(1 + x) for x >= 0, accurate for small x (Goldberg's trick: the rounding of 1 + x
    cancels in log(u) · x / (u - 1))."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def anchored_merge_kernel(
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
def anchor_fallback_kernel(
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
def anchored_ent_grad_kernel(
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
def row_scale_kernel(x_ptr, s_ptr, out_ptr, H, X_STRIDE, OUT_STRIDE, BLOCK: tl.constexpr):
    """out[r] = x[r] · s[r] (fp32 product, one rounding to out's dtype)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row.to(tl.int64) * X_STRIDE + cols, mask=ok, other=0.0)
    y = x.to(tl.float32) * tl.load(s_ptr + row)
    tl.store(
        out_ptr + row.to(tl.int64) * OUT_STRIDE + cols, y.to(out_ptr.dtype.element_ty), mask=ok
    )


@triton.jit
def anchored_scales_kernel(g_ptr, total_ptr, out_ptr, N, coef, BLOCK: tl.constexpr):
    """out = (coef · g) / total in fp32, the roundings of `(g · inv_t)` then `-glp / total`."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tot = tl.load(total_ptr + offs, mask=ok, other=1.0)
    tl.store(out_ptr + offs, (g * coef) / tot, mask=ok)


@triton.jit
def scale_kernel(x_ptr, s_ptr, N, BLOCK: tl.constexpr):
    """x *= s (a device scalar); nothing is read or written where s == 1."""
    s = tl.load(s_ptr)
    if s != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        x = tl.load(x_ptr + offs, mask=ok, other=0.0)
        tl.store(x_ptr + offs, (x.to(tl.float32) * s).to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def grpo_token_grads_kernel(
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
