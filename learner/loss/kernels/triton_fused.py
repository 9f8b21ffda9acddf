"""Triton chunk engine of `learner.loss.fused`: one pass over a chunk's logits, 2 bytes each.

Per chunk of C tokens (the caller runs the per-token loss in between and the two gradient
products with cuBLAS after):

1. `softmax_tiles_kernel`: logits tiles `hidden @ weight.T` on the tensor cores (fp32
   accumulate), folded into an online log-sum-exp (running max m, Σ 2^(z-m), Σ 2^(z-m)·z per
   vocab split, in base 2) and the target logit (a row dot with the gathered weight row); every
   128-column tile is also stored as p̃ = 2^(z - m) in fp16 — the very values the online sum
   adds, in (0, 1], so fp16 keeps 11 significant bits where it matters — and m per (token,
   tile), `ref`. Logits rounded to 16 bits (bf16 errors of ±|z|·2⁻⁹ in z, i.e. several % in p)
   would not do.
2. The splits' partials are merged in PyTorch ([splits, C], tiny) into lse, log-prob and
   entropy; the caller turns those into g_logp and g_ent.
3. `logits_grad_kernel`: p = p̃ · 2^(ref - lse) and ∂loss/∂logits from it, written in the
   weight's dtype (bf16/fp16) over p̃ in the same buffer, so cuBLAS reads it directly.

Anchored tiles (bf16 weights; fp16 takes steps 1-3), which replace steps 1 and 3:

1'. `anchor_kernel` first computes every token's anchor R = its target's logit (base 2; one
   launch a call), then `anchored_tiles_kernel` stores every tile as 2^(z - R) in bf16 — one
   reference per row, fixed before the pass: no running max, no rescaling — and sums them (and
   their ·(z - R)) over all columns but the target's, whose own value is exactly 1.
   `anchored_merge_kernel` adds up the vocab splits into log-prob, entropy and the row's sum.
   bf16's 8-bit exponent holds 2^(z - R) while z - R < 128 (base 2): only a target more than
   88·T nats below its row's largest logit (p < 2^-128) overflows; the merge flags such rows and
   `anchor_fallback_kernel` redoes them (anchored at the row's max instead; the common case is
   one launch that returns).
3'. ∂loss/∂z_j = g (1[j = target] - p_j) = -(g / S) · (stored_j - S·1[j = target]) with S the
   row's sum: once the target's entry is overwritten with 1 - S (= minus the other columns'
   sum, exact in fp32), the gradient is a row scaling of the stored tiles. The caller applies it
   in the two products (`products.grad_hidden_rows`: scale dH's C rows after the product;
   `grad_weight_add`: scale the C hidden rows before it), so there is no pass over the C × V
   values between the forward kernel and cuBLAS. Precision: the stored values carry bf16's
   2⁻⁹ relative rounding, the same as the materialised ∂loss/∂logits of steps 1-3.
   That is for a token loss that does not differentiate the entropy (`entropy_grad` False,
   GRPO's usual case). With an entropy bonus, ∂loss/∂z_j also holds p_j·log p_j, no row
   scaling of the stored values: `anchored_ent_grad_kernel` rewrites them in place as bf16
   ∂loss/∂logits (p_j and log p_j from the stored value and the row's total), the same kind
   of pass as step 3 — and the forward is still the anchored kernel, faster than step 1's
   (an H100, fused-ent: 58.1 vs 60.3 ms at the Qwen3-0.6B head, `loss_gpu_regimes.py ab`).

The buffer is C × V 2-byte values, the chunk's only large allocation; nothing N×V exists.

The kernels themselves are in `learner.loss.kernels.triton_fused_kernels`; this module launches
them.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from learner.loss.kernels.triton_common import INTERPRET, LOG2E, num_sms, set_allocator
from learner.loss.kernels.triton_fused_kernels import (
    anchor_fallback_kernel,
    anchor_kernel,
    anchored_ent_grad_kernel,
    anchored_merge_kernel,
    anchored_scales_kernel,
    anchored_tiles_kernel,
    grpo_token_grads_kernel,
    logits_grad_kernel,
    row_scale_kernel,
    scale_kernel,
    softmax_tiles_kernel,
)
from learner.loss.numerics import cublas_fp32_addmm_works, fp16_grad_scale

TILE_V = 128  # vocab columns per stored tile (one `ref` value per token and tile)
# Tokens a forward launch: larger chunks are run as several (their hidden rows stay in L2).
FWD_ROWS = int(os.environ.get("GRPO_FUSED_FWD_ROWS", "2048"))
# Anchored tiles where they apply (bf16); 0: always the tile-max path.
ANCHORED = os.environ.get("GRPO_FUSED_ANCHORED", "1") != "0"
# Anchored tiles also when the token loss differentiates the entropy (then with one in-place
# pass, `anchored_ent_grad_kernel`); False: the softmax tiles' path for it.
ANCHORED_ENTROPY = True


def row_scale(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out = diag(scale) @ x` for 2-D row-contiguous CUDA tensors (`out` may be `x`): one
    vectorised pass (PyTorch's broadcast multiply of bf16 by fp32 rows runs ~3x slower)."""
    n, h = x.shape
    assert x.stride(1) == 1 and out.stride(1) == 1 and scale.shape == (n,)
    block = 1024
    row_scale_kernel[(n, triton.cdiv(h, block))](
        x, scale, out, h, x.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out


def scale_(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """`x *= s` in place for a contiguous CUDA tensor and a one-element CUDA tensor `s`,
    without a host sync: with s == 1 (a plain `loss.backward()`) the kernel returns at once."""
    assert x.is_contiguous() and s.numel() == 1
    block = 4096
    scale_kernel[(triton.cdiv(x.numel(), block),)](x, s, x.numel(), BLOCK=block, num_warps=8)
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
    """Chunk engine with the interface of `fused.TorchChunks`: `stats(s, e)` then
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
        set_allocator()
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
        sms = num_sms(hidden.device)
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
            if not entropy_grad and cublas_fp32_addmm_works(dev, self.w.dtype):
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
            anchor_kernel[(triton.cdiv(n, 16),)](
                self.h, self.w, self.tgt, self.anchors, n, hd, inv_t2, BLOCK_N=16,
                BLOCK_K=16 if INTERPRET else 128, num_warps=4,
            )  # fmt: skip
        r = self.anchors[s:e]  # [nb] the anchors
        splits, v_per_split = self._plan(s, e)
        _, sx, tx = self.parts.unbind(0)  # [S, C] each
        buf = self.buf  # int16: bf16 bits
        for off, r0, r1 in self._sub_chunks(s, e):
            rows = r1 - r0

            def grid(meta, rows=rows):
                return (triton.cdiv(rows, meta["BLOCK_N"]), splits)

            anchored_tiles_kernel[grid](
                self.h[r0:r1], self.w, self.tgt[r0:r1], r[off:], buf[off:], sx[:, off:],
                tx[:, off:], rows, v, hd, buf.shape[1], sx.shape[1], v_per_split, inv_t2,
            )  # fmt: skip
        total, bad = self.total[:nb], self.bad[:nb]
        # 64 rows a program: 24 programs for the 0.6B head's 1536-row chunk, 7.8 µs a launch on
        # an H100 (11.7 µs with 256 rows, 6 programs; `bench_loss_gpu.py --profile`)
        block = 16 if INTERPRET else 64
        anchored_merge_kernel[(triton.cdiv(nb, block),)](
            sx, tx, tgt, buf, logp, ent, total, bad, nb, splits, sx.shape[1], buf.shape[1],
            BLOCK=block, num_warps=4,
        )  # fmt: skip
        anchor_fallback_kernel[(nb,)](
            h, self.w, tgt, bad, r, buf, logp, ent, total, v, hd, buf.shape[1], inv_t2,
            BLOCK_V=16 if INTERPRET else 128, BLOCK_K=16 if INTERPRET else 64,
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
            block_m = 16  # as `logits_grad_kernel`
            anchored_ent_grad_kernel[(triton.cdiv(nb, block_m), triton.cdiv(v, TILE_V))](
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
            anchored_scales_kernel[(triton.cdiv(nb, block),)](
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

            softmax_tiles_kernel[grid](
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
        logits_grad_kernel[grid](
            self.buf, self.ref, lse2, glp, gent, ent, self.tgt[s:e], nb, v,
            self.buf.shape[1], self.ref.shape[1], ENT_GRAD=ent_grad,
            OUT_BF16=self.w.dtype == torch.bfloat16, BLOCK_M=block_m, BLOCK_V=TILE_V, num_warps=4,
        )  # fmt: skip
        return self.buf.view(self.w.dtype)[:nb, :v], scale  # [nb, V], row stride % 128 == 0


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
    grpo_token_grads_kernel[(max(1, triton.cdiv(n, block)),)](
        lp, adv, w, lp if old is None else old, lp if ref is None else ref,
        lp if samp is None else samp, out, n, clip[0], clip[1], beta,
        float("inf") if tis_cap is None else tis_cap, HAS_OLD=old is not None,
        HAS_REF=ref is not None, HAS_SAMP=samp is not None, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out
