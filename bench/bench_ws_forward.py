"""Experiment (not used by the learner): the fused loss's anchored forward tiles as a
warp-specialised Gluon kernel on Hopper, against the Triton kernel it would replace.

    python bench/bench_ws_forward.py --out-dir $OUT      # H100/H200, triton >= 3.6 (Gluon)

The Triton kernel (`triton_fused_kernels.anchored_tiles_kernel`) runs the softmax epilogue of every
logits tile in the same warps as its matrix products, so the tensor cores idle during it. This
kernel splits the work across three warp partitions: one warp issues the TMA loads into a ring
of STAGES shared-memory stages, a 4-warp group runs the wgmma products into a 128 x 128 fp32
accumulator and hands it over through shared memory, and a second 4-warp group does the
epilogue (2^(z - R) stored in bf16, the row sums) while the next tile's products run. Same
inputs, grid and outputs as the Triton kernel; the script checks the stored tiles and sums
against it and times both on the Qwen3-0.6B head (1536 rows) and the Qwen3-8B head (2048 rows,
one forward launch), then writes `ws_forward.json`.

Measured on an H100 (`bench/results/ws_forward_gluon_h100.json`):
identical stored tiles, but 427 vs 532 TFLOP/s on the 0.6B head and 580 vs 684 on the 8B one
(its best of 3 and 4 stages).
With one 4-warp group a 128 x 128 accumulator is the largest tile, and 128 x 128 tiles read
4/3 the L2 bytes per FLOP of the Triton kernel's 128 x 256 ones; a 128 x 256 accumulator
handed over in fp32 needs 128 KB of shared memory on top of the load ring.
"""

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from learner.loss.kernels import triton_fused as tf
from learner.loss.kernels import triton_fused_kernels as tfk
from learner.loss.kernels.triton_common import LOG2E

V = 151_936


# The worker partitions share one signature: (descriptors, shared buffers, barriers, output
# pointers, sizes and offsets), each a tuple.


@gluon.jit
def _ws_load(descs, bufs, bars, ptrs, dims):
    """Loader warp: the (vocab tile, k) loop's hidden and weight blocks into the ring."""
    h_desc, w_desc = descs
    bufs_h, bufs_w, _ = bufs
    ready, empty, _ = bars
    _, _, _, _, row0, _, v_start, n_tiles, ksteps, _ = dims
    S: gl.constexpr = bufs_h.type.shape[0]
    BLOCK_K: gl.constexpr = h_desc.block_type.shape[1]
    BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
    nbytes: gl.constexpr = h_desc.block_type.nbytes + w_desc.block_type.nbytes
    i = 0
    for tile in range(n_tiles):
        v0 = v_start + tile * BLOCK_V
        for k in range(ksteps):
            idx = i % S
            mbarrier.wait(empty.index(idx), ((i // S) & 1) ^ 1)
            bar = ready.index(idx)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(h_desc, [row0, k * BLOCK_K], bar, bufs_h.index(idx))
            tma.async_copy_global_to_shared(w_desc, [v0, k * BLOCK_K], bar, bufs_w.index(idx))
            i += 1


@gluon.jit
def _ws_epilogue(descs, bufs, bars, ptrs, dims):
    """Epilogue group: each handed-over tile as 2^(z2 - R) in bf16, and the row sums."""
    h_desc, w_desc = descs
    _, _, acc_smem = bufs
    _, _, acc_bars = bars
    r_ptr, tgt_ptr, pt_ptr, s_ptr, t_ptr = ptrs
    n, v, p_stride, part_stride, row0, split, v_start, n_tiles, _, inv_t2 = dims
    BLOCK_N: gl.constexpr = h_desc.block_type.shape[0]
    BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    rows = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols0 = gl.arange(0, BLOCK_V, layout=gl.SliceLayout(0, layout))
    row_ok = rows < n
    r = gl.load(r_ptr + rows, mask=row_ok, other=0.0)
    tgt = gl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    s = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, layout))
    t = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, layout))
    for tile in range(n_tiles):
        v0 = v_start + tile * BLOCK_V
        mbarrier.wait(acc_bars.index(0), tile & 1)
        z = acc_smem.load(layout)
        mbarrier.arrive(acc_bars.index(1), count=1)
        cols = v0 + cols0
        d = z * inv_t2 - r[:, None]
        d = gl.where(cols[None, :] < v, d, -1.0e30)
        p = gl.exp2(d)
        offs = rows[:, None].to(gl.int64) * p_stride + cols[None, :]
        gl.store(pt_ptr + offs, p.to(gl.bfloat16), mask=row_ok[:, None] & (cols < v)[None, :])
        q = gl.where(cols[None, :] == tgt[:, None], 0.0, p)
        s += gl.sum(q, 1)
        t += gl.sum(q * d, 1)
    out = split * part_stride + rows
    gl.store(s_ptr + out, s, mask=row_ok)
    gl.store(t_ptr + out, t, mask=row_ok)


@gluon.jit
def _ws_mma(bufs, bars, n_tiles, ksteps, BLOCK_N: gl.constexpr, BLOCK_V: gl.constexpr,
            num_warps: gl.constexpr):  # fmt: skip
    """MMA group: each vocab tile's wgmma products, handed over in shared memory (fp32)."""
    bufs_h, bufs_w, acc_smem = bufs
    ready, empty, acc_bars = bars
    S: gl.constexpr = bufs_h.type.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_V, 16]
    )
    i = 0
    for tile in range(n_tiles):
        acc = gl.zeros((BLOCK_N, BLOCK_V), dtype=gl.float32, layout=mma_layout)
        for k in range(ksteps):
            idx = i % S
            mbarrier.wait(ready.index(idx), (i // S) & 1)
            acc = warpgroup_mma(
                bufs_h.index(idx), bufs_w.index(idx).permute((1, 0)), acc, is_async=True
            )
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((i + S - 1) % S), count=1, pred=k > 0)
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((i + S - 1) % S), count=1)
        mbarrier.wait(acc_bars.index(1), (tile & 1) ^ 1)  # the epilogue has read the last one
        acc_smem.store(acc)
        fence_async_shared()
        mbarrier.arrive(acc_bars.index(0), count=1)


@gluon.jit
def ws_anchored_tiles_kernel(
    h_desc, w_desc, r_ptr, tgt_ptr, pt_ptr, s_ptr, t_ptr, N, V, H, P_STRIDE, PART_STRIDE,
    v_per_split, inv_t2, STAGES: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """`triton_fused_kernels.anchored_tiles_kernel`'s outputs from three warp partitions."""
    BLOCK_N: gl.constexpr = h_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = h_desc.block_type.shape[1]
    BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
    row0 = gl.program_id(0) * BLOCK_N
    split = gl.program_id(1)
    v_start = split * v_per_split
    n_tiles = gl.cdiv(gl.minimum(V, v_start + v_per_split) - v_start, BLOCK_V)
    ksteps = gl.cdiv(H, BLOCK_K)
    bufs_h = gl.allocate_shared_memory(h_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], h_desc.layout)
    bufs_w = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_V, BLOCK_K], w_desc.layout)
    acc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_V], gl.float32)
    acc_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_V], acc_sl)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    acc_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # full, free
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    mbarrier.init(acc_bars.index(0), count=1)
    mbarrier.init(acc_bars.index(1), count=1)
    bufs = (bufs_h, bufs_w, acc_smem)
    bars = (ready, empty, acc_bars)
    wargs = (
        (h_desc, w_desc), bufs, bars, (r_ptr, tgt_ptr, pt_ptr, s_ptr, t_ptr),
        (N, V, P_STRIDE, PART_STRIDE, row0, split, v_start, n_tiles, ksteps, inv_t2),
    )  # fmt: skip
    gl.warp_specialize(
        [
            (_ws_mma, (bufs, bars, n_tiles, ksteps, BLOCK_N, BLOCK_V, num_warps)),
            (_ws_epilogue, wargs),
            (_ws_load, wargs),
        ],
        [4, 1],
        [232, 40],
    )


def ws_launch(h, w, tgt, r, buf, sx, tx, v_per_split, splits, inv_t2, stages=4, maxnreg=168):
    """The Gluon kernel on the Triton kernel's buffers (`maxnreg` x 12 warps fills the SM's
    registers: the workers take 232 + 40, the MMA group what is left)."""
    rows, hd = h.shape
    v = w.shape[0]
    bn, bv, bk = 128, 128, 64
    hl = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    wl = gl.NVMMASharedLayout.get_default_for([bv, bk], gl.bfloat16)
    h_desc = TensorDescriptor.from_tensor(h, [bn, bk], hl)
    w_desc = TensorDescriptor.from_tensor(w, [bv, bk], wl)
    grid = (triton.cdiv(rows, bn), splits)
    ws_anchored_tiles_kernel[grid](
        h_desc,
        w_desc,
        r,
        tgt,
        buf.view(torch.bfloat16),
        sx,
        tx,
        rows,
        v,
        hd,
        buf.shape[1],
        sx.shape[1],
        v_per_split,
        inv_t2,
        STAGES=stages,
        num_warps=4,
        maxnreg=maxnreg,
    )


def bench(fn):
    """Median ms of `fn` (triton's do_bench: L2 flushed before each run)."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def triton_launch(h, w, tgt, r, buf, sx, tx, v_per_split, splits, inv_t2):
    """The learner's anchored forward-tile kernel on the same buffers (autotuned)."""
    rows, hd = h.shape

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_N"]), splits)

    tfk.anchored_tiles_kernel[grid](
        h, w, tgt, r, buf, sx, tx, rows, w.shape[0], hd, buf.shape[1], sx.shape[1],
        v_per_split, inv_t2,
    )  # fmt: skip


def run_head(hd, rows):
    """Triton vs the Gluon kernel (3 and 4 stages) on one head: timings and differences."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(rows, hd, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(V, hd, device="cuda", generator=g, dtype=torch.bfloat16) * hd**-0.5
    tgt = torch.randint(0, V, (rows,), device="cuda", generator=g)
    ch = tf.TritonChunks(h, w, tgt, 0.9, rows, entropy_grad=False)
    inv_t2 = LOG2E / 0.9
    r = torch.empty(rows, dtype=torch.float32, device="cuda")
    tfk.anchor_kernel[(triton.cdiv(rows, 16),)](
        h, w, tgt, r, rows, hd, inv_t2, BLOCK_N=16, BLOCK_K=128, num_warps=4
    )
    _, sx, tx = ch.parts.unbind(0)
    bufs = (h, w, tgt, r, ch.buf, sx, tx, ch.v_per_split, ch.splits, inv_t2)
    ref = functools.partial(triton_launch, *bufs)
    ref()
    torch.cuda.synchronize()
    want = (ch.buf.view(torch.bfloat16)[:, :V].float(), sx.clone(), tx.clone())
    flops = 2 * rows * hd * V
    t_ref = bench(ref)
    cfg = tfk.anchored_tiles_kernel.best_config
    print(f"H={hd} rows={rows}: triton {t_ref:.3f} ms {flops / t_ref / 1e9:.0f} TFLOP/s ({cfg})")
    out = [{"hidden": hd, "rows": rows, "kernel": "triton", "ms": t_ref, "config": str(cfg)}]
    for stages in (4, 3):
        for x in (ch.buf, sx, tx):
            x.zero_()
        ws = functools.partial(ws_launch, *bufs, stages=stages)
        t0 = time.time()
        ws()
        torch.cuda.synchronize()
        print(f"  gluon kernel, {stages} stages: compiled and ran in {time.time() - t0:.1f} s")
        err = (ch.buf.view(torch.bfloat16)[:, :V].float() - want[0]).abs().max().item()
        es = ((sx - want[1]).abs() / want[1].abs().clamp_min(1e-30)).max().item()
        et = ((tx - want[2]).abs() / want[2].abs().clamp_min(1e-30)).max().item()
        t_ws = bench(ws)
        print(
            f"  gluon kernel, {stages} stages: {t_ws:.3f} ms {flops / t_ws / 1e9:.0f} TFLOP/s; "
            f"max |tile diff| {err:.3g}, rel diff of the sums {es:.3g} / {et:.3g}"
        )
        out.append(
            {"hidden": hd, "rows": rows, "kernel": f"gluon-ws-{stages}", "ms": t_ws,
             "max_tile_diff": err, "rel_diff_s": es, "rel_diff_t": et}
        )  # fmt: skip
    for row in out:
        row["tflops"] = flops / row["ms"] / 1e9
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    results = run_head(1024, 1536) + run_head(4096, 2048)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "triton": triton.__version__}
    (args.out_dir / "ws_forward.json").write_text(json.dumps(meta | {"results": results}, indent=2))
    print("\n| head H | rows | kernel | ms | TFLOP/s |\n|---|---|---|---|---|")
    for row in results:
        print(f"| {row['hidden']} | {row['rows']} | {row['kernel']} | {row['ms']:.3f} | "
              f"{row['tflops']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
