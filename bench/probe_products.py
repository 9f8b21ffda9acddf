"""The fused loss's two gradient products for one chunk, in turn or side by side (CUDA only).

Each chunk of `fused_grpo_loss` ends with dH = diag(s) g @ W (fp32 rows, then scaled) and
dW += gᵀ (diag(s) h) (cuBLAS, beta = 1 after the first chunk). This times, at the Qwen3-0.6B and
Qwen3-8B heads' chunk shapes, a run of chunks the way the loss issues them against the same
products with dH on a second CUDA stream (both read the same g tile), and dW with beta = 0:

    python3 bench/probe_products.py --out $OUT/probe_products.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.loss.products import grad_hidden_rows, grad_weight_add

HEADS = {"qwen3-0.6b": (1024, 1536), "qwen3-8b": (4096, 4096)}  # H, chunk rows
VOCAB = 151936


def run(mode: str, g, s, w, h, grad_h, grad_w, fp32_rows, chunks: int, side) -> None:
    main = torch.cuda.current_stream()
    for c in range(chunks):
        first = c == 0 or mode == "beta0"
        if mode == "streams":
            side.wait_stream(main)
            with torch.cuda.stream(side):
                grad_hidden_rows(g, s, w, grad_h, 0, g.shape[0], fp32_rows)
            grad_weight_add(g, s, h, grad_w, first=first)
            main.wait_stream(side)
        elif mode == "dw-first":
            grad_weight_add(g, s, h, grad_w, first=first)
            grad_hidden_rows(g, s, w, grad_h, 0, g.shape[0], fp32_rows)
        else:  # serial, beta0: as the loss issues them
            grad_hidden_rows(g, s, w, grad_h, 0, g.shape[0], fp32_rows)
            grad_weight_add(g, s, h, grad_w, first=first)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/probe_products.json"))
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--modes", nargs="+", default=["serial", "streams", "dw-first", "beta0"])
    args = p.parse_args()
    dev = torch.device("cuda")
    side = torch.cuda.Stream(dev)
    out = []
    for head, (hd, rows) in HEADS.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        g = torch.randn(rows, VOCAB, device=dev, dtype=torch.bfloat16, generator=gen)
        w = torch.randn(VOCAB, hd, device=dev, dtype=torch.bfloat16, generator=gen)
        h = torch.randn(rows, hd, device=dev, dtype=torch.bfloat16, generator=gen)
        s = torch.rand(rows, device=dev, generator=gen) + 0.5
        grad_h = torch.empty(rows, hd, device=dev, dtype=torch.bfloat16)
        grad_w = torch.empty(VOCAB, hd, device=dev, dtype=torch.bfloat16)
        fp32_rows = torch.empty(rows, hd, device=dev, dtype=torch.float32)
        flops = 4.0 * rows * hd * VOCAB * args.chunks
        ref = None
        for mode in args.modes:  # same results whichever way they are issued
            run(mode, g, s, w, h, grad_h, grad_w, fp32_rows, 1, side)
            torch.cuda.synchronize()
            got = (grad_h.clone(), grad_w.clone())
            if ref is None:
                ref = got
            elif not all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)):
                raise SystemExit(f"{head} {mode}: the products differ from the serial ones")
        times: dict[str, list[float]] = {m: [] for m in args.modes}
        for _ in range(args.reps):  # interleaved: the power cap hits every mode alike
            for mode in args.modes:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run(mode, g, s, w, h, grad_h, grad_w, fp32_rows, args.chunks, side)
                b.record()
                torch.cuda.synchronize()
                times[mode].append(a.elapsed_time(b) / args.chunks)
        for mode, ts in times.items():
            ms = statistics.median(ts)
            row = {"head": head, "rows": rows, "H": hd, "mode": mode, "ms_per_chunk": ms,
                   "tflops": flops / args.chunks / ms / 1e9}  # fmt: skip
            out.append(row)
            print(f"{head:11s} rows={rows} {mode:9s} {ms:.3f} ms a chunk "
                  f"({row['tflops']:.0f} TFLOP/s)", flush=True)  # fmt: skip
        del g, w, h, grad_h, grad_w, fp32_rows
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
