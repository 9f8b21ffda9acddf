"""The fused loss's in-place ∂loss/∂logits passes (the entropy-bonus path), per block shape,
against a plain copy of the same bytes (CUDA only).

`fused_grpo_loss` differentiating the entropy rewrites its forward kernel's tiles as bf16
∂loss/∂logits in one elementwise pass over the chunk's C × V values: fp16 softmax tiles
(`triton_fused_kernels.logits_grad_kernel`, fp16 weights) or bf16 anchored ones
(`anchored_ent_grad_kernel`, bf16 weights), 4 bytes an entry, bound by memory bandwidth.
This times both at the Qwen3-0.6B and Qwen3-8B heads' chunk sizes:

    python3 bench/probe_logits_grad.py --out $OUT/probe_logits_grad.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.loss.kernels.triton_fused import TILE_V
from learner.loss.kernels.triton_fused_kernels import anchored_ent_grad_kernel, logits_grad_kernel

VOCAB = 151936
CHUNKS = {"qwen3-0.6b": 1536, "qwen3-8b": 4096}
CONFIGS = [(8, 2), (8, 4), (16, 2), (16, 4), (16, 8), (32, 4), (32, 8), (64, 8)]  # (BLOCK_M, warps)


def probe_head(head: str, c: int, dev: torch.device) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(0)
    n_tiles = triton.cdiv(VOCAB, TILE_V)
    stride = n_tiles * TILE_V
    src = torch.rand(c, stride, device=dev, generator=g).to(torch.float16).view(torch.int16)
    buf = torch.empty(c, stride, dtype=torch.int16, device=dev)
    ref = torch.randn(n_tiles, c, device=dev, generator=g)
    lse2 = ref.max(0).values + 17.0
    glp = torch.randn(c, device=dev, generator=g)
    gent = torch.randn(c, device=dev, generator=g) * 0.01
    ent = torch.rand(c, device=dev, generator=g) * 10
    tgt = torch.randint(0, VOCAB, (c,), device=dev, generator=g)
    nbytes = 4 * c * VOCAB
    ms = triton.testing.do_bench(lambda: buf.copy_(src), rep=50)
    print(f"{head} C={c}: copy of the same bytes {ms:.3f} ms ({nbytes / ms / 1e6:.0f} GB/s)")
    out = [{"head": head, "rows": c, "what": "copy", "ms": ms, "gbps": nbytes / ms / 1e6}]
    want = None
    for block_m, warps in CONFIGS:
        grid = (triton.cdiv(c, block_m), n_tiles)

        def run(grid=grid, block_m=block_m, warps=warps):
            logits_grad_kernel[grid](
                buf, ref, lse2, glp, gent, ent, tgt, c, VOCAB, stride, c, ENT_GRAD=True,
                OUT_BF16=True, BLOCK_M=block_m, BLOCK_V=TILE_V, num_warps=warps,
            )  # fmt: skip

        buf.copy_(src)
        run()
        if want is None:
            want = buf.clone()
        elif not torch.equal(buf, want):
            raise SystemExit(f"{head} BLOCK_M={block_m}: results differ")
        # timed on its own output (other values, the same bytes and instructions)
        ms_k = triton.testing.do_bench(run, rep=50)
        row = {"head": head, "rows": c, "what": "logits_grad", "BLOCK_M": block_m,
               "warps": warps, "ms": ms_k, "gbps": nbytes / ms_k / 1e6}  # fmt: skip
        out.append(row)
        print(f"  BLOCK_M={block_m:<4} warps={warps}: {ms_k:.3f} ms ({row['gbps']:.0f} GB/s)")
    # the anchored pass as the loss launches it, on bf16 values 2^(z - R) (restored each time:
    # its own output holds negative values, whose log is another code path)
    q = (torch.rand(c, stride, device=dev, generator=g) ** 8).to(torch.bfloat16).view(torch.int16)
    total = torch.rand(c, device=dev, generator=g) * 100 + 1
    logp = -5 * torch.rand(c, device=dev, generator=g)
    grid = (triton.cdiv(c, 16), n_tiles)

    def anchored():
        buf.copy_(q)
        anchored_ent_grad_kernel[grid](
            buf, total, logp, ent, glp, gent, tgt, c, VOCAB, stride, 1.0, HAS_LP=True,
            BLOCK_M=16, BLOCK_V=TILE_V, num_warps=4,
        )  # fmt: skip

    ms_a = triton.testing.do_bench(anchored, rep=50) - ms  # less the restoring copy
    out.append({"head": head, "rows": c, "what": "anchored_ent_grad", "BLOCK_M": 16, "warps": 4,
                "ms": ms_a, "gbps": nbytes / ms_a / 1e6})  # fmt: skip
    print(f"  anchored pass (BLOCK_M=16 warps=4): {ms_a:.3f} ms ({nbytes / ms_a / 1e6:.0f} GB/s)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/probe_logits_grad.json"))
    args = p.parse_args()
    dev = torch.device("cuda")
    out = []
    for head, c in CHUNKS.items():
        out += probe_head(head, c, dev)
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
