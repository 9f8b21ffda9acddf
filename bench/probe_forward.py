"""Where the fused loss's forward kernel spends its time, on one chunk (CUDA only).

The anchored-tiles kernel of `learner.loss.kernels.triton_fused` is a bf16 GEMM (hidden @ weight.T)
with a softmax epilogue per tile. This script times copies of its loop with parts of the
epilogue removed, for every tile config, against cuBLAS's plain GEMM of the same shape:

    full      the kernel's epilogue (exp2, bf16 TMA store, target-excluded sums)
    ptrstore  the same with a pointer store instead of the TMA store
    nostore   the epilogue without any store (sums only)
    halves    the full epilogue in two column halves (lower register pressure)
    mmaonly   the GEMM with a row sum of each tile (the loop's own ceiling)
    cond      full, the target compare only in tiles that hold a row's target
    halvescond  cond in two column halves
    halvesfast  halvescond with a flush-to-zero ex2.approx

    python3 bench/probe_forward.py --out $OUT/probe_forward.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.loss.kernels.triton_common import MASKED, logits_tile, num_sms, set_allocator

MODES = {
    "full": 0,
    "ptrstore": 1,
    "nostore": 2,
    "halves": 3,
    "mmaonly": 4,
    "cond": 5,
    "halvescond": 6,
    "halvesfast": 7,
}


@triton.jit
def _exp2_ftz(x):
    return tl.inline_asm_elementwise(
        "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _piece(z2, c0, r, tgt, hit, V, row0, desc, FAST: tl.constexpr):
    """One column block of a tile: store 2^(z2 - r) (bf16) and return its row sums (the target's
    column excluded, the compare only where the tile holds a target)."""
    cols = c0 + tl.arange(0, z2.shape[1])
    d = z2 - r[:, None]
    if c0 + z2.shape[1] > V:
        d = tl.where(cols[None, :] < V, d, MASKED)
    if FAST:  # noqa: SIM108 (a constexpr branch)
        p = _exp2_ftz(d)
    else:
        p = tl.exp2(d)
    desc.store([row0, c0], p.to(tl.bfloat16).to(tl.int16, bitcast=True))
    if hit != 0:  # noqa: SIM108 (a runtime branch: no ternary in Triton)
        q = tl.where(cols[None, :] == tgt[:, None], 0.0, p)
    else:
        q = p
    return tl.sum(q, 1), tl.sum(q * d, 1)


@triton.jit
def _probe_kernel(
    h_ptr, w_ptr, tgt_ptr, r_ptr, pt_ptr, s_ptr, t_ptr, N, V, H, P_STRIDE, PART_STRIDE,
    v_per_split, inv_t2, MODE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, WS: tl.constexpr = False, FLAT: tl.constexpr = True,
):  # fmt: skip
    h_desc = tl.make_tensor_descriptor(h_ptr, [N, H], [H, 1], [BLOCK_N, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [V, H], [H, 1], [BLOCK_V, BLOCK_K])
    pt_desc = tl.make_tensor_descriptor(pt_ptr, [N, V], [P_STRIDE, 1], [BLOCK_N, BLOCK_V])
    half_desc = tl.make_tensor_descriptor(pt_ptr, [N, V], [P_STRIDE, 1], [BLOCK_N, BLOCK_V // 2])
    row0 = tl.program_id(0) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    v_start = tl.program_id(1) * v_per_split
    v_end = tl.minimum(V, v_start + v_per_split)
    row_ok = rows < N
    r = tl.load(r_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    s = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)
    for v0 in tl.range(v_start, v_end, BLOCK_V, flatten=FLAT, warp_specialize=WS):
        z2 = logits_tile(h_desc, w_desc, row0, v0, H, inv_t2, False, BLOCK_N, BLOCK_V, BLOCK_K)
        if MODE == 4:
            s += tl.sum(z2, 1)
        elif MODE >= 5:  # pieces, a conditional target exclusion, optionally a ftz exp2
            hit = tl.max(((tgt >= v0) & (tgt < v0 + BLOCK_V)).to(tl.int32), 0)
            if MODE == 5:
                ds, dt = _piece(z2, v0, r, tgt, hit, V, row0, pt_desc, MODE == 7)
                s += ds
                t += dt
            else:
                lo, hi = tl.split(tl.permute(tl.reshape(z2, [BLOCK_N, 2, BLOCK_V // 2]), [0, 2, 1]))
                ds, dt = _piece(lo, v0, r, tgt, hit, V, row0, half_desc, MODE == 7)
                s += ds
                t += dt
                ds, dt = _piece(hi, v0 + BLOCK_V // 2, r, tgt, hit, V, row0, half_desc, MODE == 7)
                s += ds
                t += dt
        elif MODE == 3:
            both = tl.permute(tl.reshape(z2, [BLOCK_N, 2, BLOCK_V // 2]), [0, 2, 1])
            lo, hi = tl.split(both)
            for half in tl.static_range(2):
                zh = lo if half == 0 else hi
                cols = v0 + half * (BLOCK_V // 2) + tl.arange(0, BLOCK_V // 2)
                d = zh - r[:, None]
                if v0 + BLOCK_V > V:
                    d = tl.where(cols[None, :] < V, d, MASKED)
                p = tl.exp2(d)
                half_desc.store(
                    [row0, v0 + half * (BLOCK_V // 2)], p.to(tl.bfloat16).to(tl.int16, bitcast=True)
                )
                q = tl.where(cols[None, :] == tgt[:, None], 0.0, p)
                s += tl.sum(q, 1)
                t += tl.sum(q * d, 1)
        else:
            cols = v0 + tl.arange(0, BLOCK_V)
            d = z2 - r[:, None]
            if v0 + BLOCK_V > V:
                d = tl.where(cols[None, :] < V, d, MASKED)
            p = tl.exp2(d)
            bits = p.to(tl.bfloat16).to(tl.int16, bitcast=True)
            if MODE == 0:
                pt_desc.store([row0, v0], bits)
            elif MODE == 1:
                offs = rows[:, None].to(tl.int64) * P_STRIDE + cols[None, :]
                tl.store(pt_ptr + offs, bits, mask=row_ok[:, None] & (cols < V)[None, :])
            q = tl.where(cols[None, :] == tgt[:, None], 0.0, p)
            s += tl.sum(q, 1)
            t += tl.sum(q * d, 1)
    out = tl.program_id(1) * PART_STRIDE + rows
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(t_ptr + out, t, mask=row_ok)


CONFIGS = [  # (BLOCK_N, BLOCK_V, BLOCK_K, warps, stages)
    (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 5),
    (128, 128, 128, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 64, 4, 3),
    (128, 128, 64, 4, 2),
    (64, 256, 64, 4, 3),
    (64, 256, 64, 4, 2),
    (64, 128, 64, 4, 4),
]
DETAIL = {(128, 128, 64, 8, 4), (128, 256, 64, 8, 3)}  # the configs probed in every mode


def probe(
    hd: int, rows: int, vocab: int, modes: list[str], configs: list, extra: dict
) -> list[dict]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(rows, hd, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(vocab, hd, device=dev, dtype=torch.bfloat16, generator=g) * hd**-0.5
    tgt = torch.randint(0, vocab, (rows,), device=dev, generator=g)
    inv_t2 = 1.4426950408889634 / 0.9
    r = (h.float() * w[tgt].float()).sum(1) * inv_t2
    buf = torch.empty(rows, triton.cdiv(vocab, 128) * 128, dtype=torch.int16, device=dev)
    n_tiles = triton.cdiv(rows, 128)
    splits = max(1, min(triton.cdiv(4 * num_sms(dev), n_tiles), triton.cdiv(vocab, 2048)))
    vps = triton.cdiv(triton.cdiv(vocab, splits), 256) * 256
    splits = triton.cdiv(vocab, vps)
    parts = torch.empty(2, splits, rows, dtype=torch.float32, device=dev)
    flops = 2.0 * rows * hd * vocab
    out = []
    ms = triton.testing.do_bench(lambda: torch.mm(h, w.T), warmup=5, rep=50)
    out.append({"H": hd, "rows": rows, "mode": "cublas", "ms": ms, "tflops": flops / ms / 1e9})
    print(f"H={hd} rows={rows} splits={splits}: cuBLAS bf16 mm {ms:.3f} ms "
          f"({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)  # fmt: skip
    for cfg in configs:
        bn, bv, bk, warps, stages = cfg[:5]
        maxnreg = cfg[5] if len(cfg) > 5 else None  # 128: two 8-warp programs an SM
        detail = tuple(cfg) in DETAIL or configs is not CONFIGS
        ref = None  # the full epilogue's outputs: every storing mode must give the same
        for mode in [m for m in modes if detail or m in ("full", "mmaonly")]:
            grid = (triton.cdiv(rows, bn), splits)
            args = (h, w, tgt, r, buf, parts[0], parts[1], rows, vocab, hd, buf.shape[1],
                    rows, vps, inv_t2)  # fmt: skip
            kw = dict(**extra, MODE=MODES[mode], BLOCK_V=bv, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                      num_stages=stages)  # fmt: skip
            if maxnreg:
                kw["maxnreg"] = maxnreg
            row = {
                "H": hd,
                "rows": rows,
                "mode": mode,
                "config": list(cfg),
                **extra,
            }
            try:
                parts.zero_()
                buf.zero_()
                k = _probe_kernel[grid](*args, **kw)
                if mode == "full":
                    ref = (parts.clone(), buf.clone())
                elif ref is not None and mode not in ("nostore", "mmaonly"):
                    row["parts_rel_err"] = (
                        (parts - ref[0]).abs().max() / ref[0].abs().max()
                    ).item()
                    row["buf_equal"] = bool(torch.equal(buf, ref[1]))
                ms = triton.testing.do_bench(
                    lambda grid=grid, args=args, kw=kw: _probe_kernel[grid](*args, **kw), rep=50
                )
                row.update(ms=ms, tflops=flops / ms / 1e9, regs=k.n_regs, spills=k.n_spills)
                row["smem_kb"] = k.metadata.shared / 1024
            except Exception as exc:  # out of shared memory, say
                row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            out.append(row)
            if "ms" in row:
                print(f"  {row['config']!s:24s} {mode:9s} {row['ms']:.3f} ms "
                      f"{row['tflops']:5.0f} TFLOP/s  regs {row['regs']} spills {row['spills']} "
                      f"smem {row['smem_kb']:.0f} KB "
                      f"{row.get('parts_rel_err', '')} {row.get('buf_equal', '')}",
                      flush=True)  # fmt: skip
            else:
                print(f"  {row['config']!s:24s} {mode:9s} {row['error']}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/probe_forward.json"))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--ws", action="store_true", help="tl.range(warp_specialize=True)")
    p.add_argument("--no-flatten", action="store_true", help="tl.range(flatten=False)")
    p.add_argument(
        "--configs", nargs="+", help="BLOCK_N,BLOCK_V,BLOCK_K,warps,stages[,maxnreg] each"
    )
    p.add_argument("--shapes", nargs="+", default=["1024:1536", "4096:2048"], help="H:rows")
    args = p.parse_args()
    set_allocator()
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__)
    results = []
    for spec in args.shapes:
        hd, rows = (int(x) for x in spec.split(":"))
        configs = CONFIGS
        if args.configs:
            configs = [tuple(int(x) for x in c.split(",")) for c in args.configs]
        extra = {"WS": args.ws, "FLAT": not args.no_flatten}
        results += probe(hd, rows, 151_936, args.modes, configs, extra)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
