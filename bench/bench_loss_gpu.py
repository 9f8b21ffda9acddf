"""GRPO loss through the LM head on a GPU: full logits vs TRL vs Liger vs ours vs fused (fwd+bwd, bf16).

    python bench/bench_loss_gpu.py --out-dir $OUT            # both heads, token sweep, plot
    python bench/bench_loss_gpu.py --breakdown               # time each kernel of ours
    python bench/bench_loss_gpu.py --breakdown --variants fused   # ... of fused, per chunk

Variants, all computing the same DAPO loss (beta 0.04 with reference log-probs, clip
0.2/0.28, temperature 0.9) and gradients w.r.t. hidden states and LM-head weight:

- full:  logits = hidden @ W.T materialised in bf16, divided by T, log-softmax (bf16) and
         gather, entropy from it under no_grad (a metric, as TRL logs it): plain PyTorch.
- full-trl: the same materialised logits through TRL 1.16's Triton log-prob + entropy kernel
         (`trl.kernels.logprob_entropy.selective_log_softmax_and_entropy`): full logits as
         TRL computes them (one pass over the bf16 logits each way).
- trl-chunked: TRL 1.16's fused LM head (`trl.kernels.chunked_logprob.ChunkedLogProbFunction`,
         vocab chunks of 32768 as its GRPO trainer passes, entropy requested): cuBLAS tiles of
         4096 tokens folded by a Triton kernel, recomputed in the backward (4 products, fp32
         gradient accumulation), then `grpo_loss`.
- liger: liger-kernel 0.8.5 `LigerFusedLinearGRPOLoss` (defaults: compiled, chunk_size=1).
- ours:  `token_logprobs(impl="triton")` + `grpo_loss` (4 N·H·V products).
- fused: `fused_grpo_loss(impl="triton")` with `GRPOTokenLoss` (3 products: both gradients
         in the forward, `--fused-chunk` tokens' logits at a time, 2 bytes an entry;
         default `auto_chunk_size`: 1536 tokens on the 0.6B head, 4096 on the 8B one).

- fused-ent, ours-ent: fused and ours with an entropy bonus (`entropy_coef` 0.01, so the
         entropy is differentiated: fused's anchored tiles then take one in-place pass that
         turns them into G, instead of a row scaling inside the products).

- gemm-floor: no loss, only fused's three bf16 cuBLAS products a chunk (logits, then G W and
         G^T h with the logits as G): what the same chunking costs with nothing but matmuls.
- gemm-floor-whole: the same three products over all tokens at once (N x V logits): the
         6·N·H·V floor as cuBLAS runs it on this GPU, power cap included.

Accuracy (`fused`, `ours`, their `-ent` forms and the TRL variants, at each head's largest token count): loss and gradients against
float64 (`token_logprobs(impl="torch")` on float64 copies of the same bf16 inputs); the bar
is a relative error <= 1e-2 for the gradients.

Time: median of CUDA-event-timed fwd+bwd iterations after warm-up, back to back (so the H100
runs at its 700 W power cap, ~1.4-1.6 GHz instead of 1.98; `--cooldown S` idles the GPU S
seconds before each timed call instead, and reads nearer its boost clock). Memory: peak
`torch.cuda.max_memory_allocated()` during one fwd+bwd minus the memory allocated just before
it (inputs allocated, .grad None), so the gradients themselves (grad_hidden, grad_weight) are
counted in every variant. The floor is 6·N·H·V FLOPs (forward logits, grad_hidden,
grad_weight) at the measured bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import require_modules

# the variants and their measurement; loss_gpu_regimes.py reads make_inputs, run_fused and
# VARIANTS from this module
from loss_gpu_variants import (
    COOLDOWN,
    ENT_COEF,
    FUSED_CHUNK,
    TEMP,
    VARIANTS,
    VOCAB,
    accuracy,
    fused_at,
    make_inputs,
    matmul_tflops,
    measure,
    run_fused,
    run_fused_ent,
)

from learner.loss.fused import auto_chunk_size

# the baselines the variants name: a requested one that cannot be imported fails the run
BASELINES = {"liger": {"liger_kernel": "liger-kernel"}, "full-trl": {"trl": "trl==1.16.0"}}
BASELINES["trl-chunked"] = BASELINES["full-trl"]
HEADS = {"qwen3-0.6b": (1024, 2048, [2, 4, 8, 16]), "qwen3-8b": (4096, 4096, [1, 2, 4, 8])}


def _print_tile_configs():
    """The forward kernels' autotuned configs, per (H, V) key."""
    from learner.loss.kernels.triton_fused_kernels import (
        anchored_tiles_kernel,
        softmax_tiles_kernel,
    )

    for kern in (anchored_tiles_kernel, softmax_tiles_kernel):
        for key, cfg in getattr(kern, "cache", {}).items():
            print(f"{kern.fn.__name__} {key[:2]}: {cfg}")


def breakdown(hd, b, t):
    """Time each stage of ours at one shape (forward kernel, then the backward's pieces)."""
    from learner.loss.kernels import triton_logprobs as tk
    from learner.loss.numerics import cublas_fp32_addmm_works

    h, w, ids, *_ = make_inputs(b, t, hd)
    h2, ids2 = h.detach().view(-1, hd), ids.view(-1)
    w = w.detach()
    n = h2.shape[0]

    def ev(fn, iters=5):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        return statistics.median(ts)

    _, lse, ent = tk.forward_stats(h2, w, ids2, TEMP)
    g_lp = torch.randn(n, device="cuda")
    flop = 2 * n * hd * VOCAB
    rows = {
        "forward kernel": ev(lambda: tk.forward_stats(h2, w, ids2, TEMP)),
        "backward (both grads)": ev(
            lambda: tk.backward_grads(h2, w, ids2, lse, ent, g_lp, None, TEMP, True, True)
        ),
        "backward grad_weight only": ev(
            lambda: tk.backward_grads(h2, w, ids2, lse, ent, g_lp, None, TEMP, False, True)
        ),
        "backward grad_hidden only": ev(
            lambda: tk.backward_grads(h2, w, ids2, lse, ent, g_lp, None, TEMP, True, False)
        ),
        "cuBLAS h @ W.T (bf16 out)": ev(lambda: h2 @ w.T),
    }
    tk.DH_IMPL = "triton"
    rows["backward, grad_hidden by Triton"] = ev(
        lambda: tk.backward_grads(h2, w, ids2, lse, ent, g_lp, None, TEMP, True, True)
    )
    tk.DH_IMPL = "auto"
    print(f"cuBLAS fp32-output addmm for grad_hidden: {cublas_fp32_addmm_works(w.device, w.dtype)}")
    print(f"breakdown H={hd} N={n} (one N·H·V product = {flop / 1e12:.2f} TFLOP)")
    for k, ms in rows.items():
        print(f"  {k:<32}{ms:9.2f} ms  ({flop / ms / 1e9:6.0f} TFLOP/s per product)")
    print(f"  blocking (CN, CV) = {tk.backward_blocking(n, VOCAB, hd)}")
    for kern in (tk.fwd_kernel, tk.grad_logits_kernel, tk.mm_acc_kernel):
        print(f"  {kern.fn.__name__}: {getattr(kern, 'best_config', None)}")
    return rows


def breakdown_fused(hd, b, t, chunk, entropy_coef=0.0):
    """Time each stage of one chunk of fused (and the whole fwd+bwd) at one shape; with
    `entropy_coef`, of fused-ent."""
    from learner.loss.grpo import LossConfig
    from learner.loss.kernels.triton_fused import TritonChunks
    from learner.loss.kernels.triton_fused_kernels import (
        anchored_tiles_kernel,
        softmax_tiles_kernel,
    )
    from learner.loss.products import grad_hidden_rows, grad_weight_add
    from learner.loss.token import GRPOTokenLoss
    from learner.loss.token_grads import GraphedTokenGrads, autograd_token_grads

    h, w, ids, old, ref, adv, _ = make_inputs(b, t, hd)
    n = b * t
    h2, w2, ids2 = h.detach().view(-1, hd), w.detach(), ids.view(-1)
    seq = torch.arange(b * t, device="cuda") // t
    cfg = LossConfig(beta=0.04, entropy_coef=entropy_coef)
    token_loss = GRPOTokenLoss(cfg, seq, adv, old_logprobs=old, ref_logprobs=ref)
    chunks = TritonChunks(h2, w2, ids2, TEMP, chunk, token_loss.entropy_grad)
    print(f"anchored tiles: {chunks.anchored}")
    c = min(chunk, n)
    logp = torch.zeros(n, device="cuda")
    ent = torch.zeros(n, device="cuda")
    chunks.stats(0, c, logp[:c], ent[:c])
    g_lp, g_ent = autograd_token_grads(token_loss, logp, ent, 0, c)
    g, scale = chunks.logits_grad(g_lp, g_ent)
    grad_w = torch.empty_like(w2)
    gh = torch.empty(c, hd, device="cuda", dtype=h2.dtype)

    def ev(fn, iters=10):
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / iters

    def stats_and_grad():
        chunks.stats(0, c, logp[:c], ent[:c])
        chunks.logits_grad(g_lp, g_ent)

    stats_ms = ev(lambda: chunks.stats(0, c, logp[:c], ent[:c]))
    # the autograd path of a token loss without closed-form gradients, as a CUDA graph
    graphed = GraphedTokenGrads(token_loss, logp, ent)
    rows = [  # (stage, ms, is an N·H·V product)
        ("softmax tiles + merge", stats_ms, True),
        ("token loss gradients (closed form)", ev(lambda: token_loss.token_grads(logp, ent, 0, c)), False),
        ("dlogits (row scales if anchored)", ev(stats_and_grad) - stats_ms, False),
        ("grad_hidden = G @ W", ev(lambda: grad_hidden_rows(g, scale, w2, gh, 0, c, getattr(chunks, "fp32_rows", None))), True),
        ("grad_weight += Gᵀ @ h", ev(lambda: grad_weight_add(g, scale, h2[:c], grad_w, first=False)), True),
    ]  # fmt: skip
    extra = [  # not part of the sum
        ("token loss gradients, autograd", ev(lambda: autograd_token_grads(token_loss, logp, ent, 0, c)), False),
        ("token loss gradients, CUDA graph", ev(lambda: graphed(0, c)), False),
        ("grad_weight = Gᵀ @ h (beta 0)", ev(lambda: torch.mm(g.T, h2[:c], out=grad_w)), True),
        ("grad_hidden, bf16 product", ev(lambda: grad_hidden_rows(g, scale, w2, gh, 0, c)), True),
    ]  # fmt: skip
    flop = 2 * c * hd * VOCAB
    nchunks = -(-n // c)
    print(f"fused breakdown H={hd} N={n}, chunk {c} ({nchunks} chunks), per chunk:")
    for name, ms, product in rows:
        rate = f"({flop / ms / 1e9:4.0f} TFLOP/s)" if product else ""
        print(f"  {name:<36}{ms:8.3f} ms  x{nchunks} = {ms * nchunks:7.1f} ms {rate}")
    print(f"  sum x chunks: {sum(r[1] for r in rows) * nchunks:.1f} ms")
    for name, ms, product in extra:
        rate = f"({flop / ms / 1e9:4.0f} TFLOP/s)" if product else ""
        print(f"  (alt) {name:<30}{ms:8.3f} ms  x{nchunks} = {ms * nchunks:7.1f} ms {rate}")
    h.grad = w.grad = None
    whole = run_fused_ent if entropy_coef else run_fused
    print(f"  whole fwd+bwd (median): {measure(whole, make_inputs(b, t, hd), 5)[0]:.1f} ms")
    kernel = anchored_tiles_kernel if chunks.anchored else softmax_tiles_kernel
    print(f"  {kernel.fn.__name__} config: {getattr(kernel, 'best_config', None)}")
    return rows


def profile_fused(hd, b, t, out_dir):
    """Host time vs GPU time of one fused fwd+bwd, and its kernels by total GPU time."""
    import time

    from torch.profiler import ProfilerActivity, profile

    inputs = make_inputs(b, t, hd)
    h, w = inputs[0], inputs[1]
    run_fused(*inputs)
    for _ in range(2):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_fused(*inputs)
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    print(f"profile H={hd} N={b * t}: host returns after {host * 1e3:.1f} ms, GPU done at "
          f"{wall * 1e3:.1f} ms")  # fmt: skip
    h.grad = w.grad = None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_fused(*inputs)
        torch.cuda.synchronize()
    avgs = prof.key_averages()
    busy = sum(a.self_device_time_total for a in avgs) / 1e3
    print(f"  GPU busy (sum of kernel times, profiled run): {busy:.1f} ms")
    print(avgs.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
    out_dir.mkdir(parents=True, exist_ok=True)
    chunk = FUSED_CHUNK["size"] or auto_chunk_size(hd)
    prof.export_chrome_trace(str(out_dir / f"fused_trace_h{hd}_c{chunk}.json"))


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, head in enumerate(HEADS):
        rows = [r for r in results if r["head"] == head]
        for name in VARIANTS:
            pts = sorted((r["tokens"], r["ms"], r["gb"]) for r in rows if r["variant"] == name)
            if not pts:
                continue
            xs, ms, gb = zip(*pts, strict=True)
            axes[0][col].plot(xs, ms, marker="o", label=name)
            axes[1][col].plot(xs, gb, marker="o", label=name)
        floor = [(r["tokens"], r["floor_ms"]) for r in rows if r["variant"] == "ours"]
        if floor:
            xs, fl = zip(*sorted(floor), strict=True)
            axes[0][col].plot(xs, fl, "k--", label="6·N·H·V floor")
        axes[0][col].set_title(f"{head} head: fwd+bwd time")
        axes[1][col].set_title(f"{head} head: peak extra memory")
        axes[0][col].set_ylabel("ms (median)")
        axes[1][col].set_ylabel("GB")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("tokens")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--no-sweep", action="store_true", help="only the headline token count")
    p.add_argument("--breakdown", action="store_true", help="time the stages of ours and exit")
    p.add_argument(
        "--fused-chunk", type=int, default=None, help="tokens per chunk of fused (default: auto)"
    )
    p.add_argument(
        "--fused-configs",
        nargs="+",
        default=[],
        metavar="CHUNK[:FWD_ROWS]",
        help="also run fused at these settings (tuning): tokens a chunk, tokens a forward launch"
        " (triton_fused.FWD_ROWS)",
    )
    p.add_argument("--profile", action="store_true", help="profile one fused fwd+bwd and exit")
    p.add_argument("--no-accuracy", action="store_true", help="skip the float64 comparison")
    p.add_argument(
        "--cooldown",
        type=float,
        default=0.0,
        help="seconds of idle GPU before each timed call (default 0: back to back, the H100 at"
        " its 700 W power cap, clocks ~1.4-1.6 GHz instead of 1.98)",
    )
    args = p.parse_args()
    FUSED_CHUNK["size"] = args.fused_chunk
    COOLDOWN["s"] = args.cooldown
    # a baseline is dropped only by leaving it out of --variants, never because it is missing
    require_modules(
        "bench_loss_gpu.py",
        {m: pip for v in args.variants for m, pip in BASELINES.get(v, {}).items()},
    )
    if args.profile:
        for head in args.heads:
            hd, t, bs = HEADS[head]
            profile_fused(hd, bs[-1], t, args.out_dir)
        return 0
    if args.breakdown:
        for head in args.heads:
            hd, t, bs = HEADS[head]
            if "fused" in args.variants:
                breakdown_fused(hd, bs[-1], t, args.fused_chunk or auto_chunk_size(hd))
            if "fused-ent" in args.variants:
                chunk = args.fused_chunk or auto_chunk_size(hd)
                breakdown_fused(hd, bs[-1], t, chunk, entropy_coef=ENT_COEF)
            if "ours" in args.variants:
                breakdown(hd, bs[-1], t)
        return 0
    tflops = matmul_tflops()
    print(f"device: {torch.cuda.get_device_name()}, bf16 8192^3 matmul: {tflops:.0f} TFLOP/s")
    results = []
    for head in args.heads:
        hd, t, batches = HEADS[head]
        for b in batches[-1:] if args.no_sweep else batches:
            n = b * t
            floor_ms = 6 * n * hd * VOCAB / (tflops * 1e12) * 1e3
            for name in args.variants + [f"fused@{c}" for c in args.fused_configs]:
                inputs = make_inputs(b, t, hd)
                fn = VARIANTS.get(name) or fused_at(name.split("@")[1])
                iters = args.iters if name != "liger" else max(2, args.iters // 3)
                if name == "liger":  # compile each shape afresh: torch 2.11's dynamic-shape
                    torch._dynamo.reset()  # recompile of Liger's loss fails on the second shape
                error = None
                try:
                    ms, gb = measure(fn, inputs, iters)
                except Exception as e:  # one failing variant must not end the run: it fails it
                    error = f"{type(e).__name__}: {str(e)[:200]}"
                    print(f"{head} {name} N={n} failed: {error}")
                    ms, gb = float("nan"), float("nan")
                del inputs
                torch.cuda.empty_cache()
                row = {"head": head, "variant": name, "tokens": n, "batch": b, "seq": t}
                row |= {"hidden": hd, "vocab": VOCAB, "ms": ms, "gb": gb, "floor_ms": floor_ms}
                row |= {"error": error} if error else {}
                results.append(row)
                print(
                    f"{head:<11}{name:<12} B={b:<3}T={t:<5}N={n:<6}{ms:9.1f} ms {gb:8.2f} GB"
                    f"  (floor {floor_ms:.1f} ms)",
                    flush=True,
                )
    checked = ("ours", "fused", "ours-ent", "fused-ent", "full-trl", "trl-chunked")
    checked = [v for v in checked if v in args.variants]
    acc = []
    if checked and not args.no_accuracy:
        for head in args.heads:
            hd, t, batches = HEADS[head]
            acc += [{"head": head, **r} for r in accuracy(hd, batches[-1], t, checked)]
            torch.cuda.empty_cache()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "matmul_tflops": tflops}
    meta |= {"torch": torch.__version__, "temperature": TEMP, "cooldown_s": args.cooldown}
    meta |= {"results": results}
    _print_tile_configs()
    chunks = {head: args.fused_chunk or auto_chunk_size(HEADS[head][0]) for head in args.heads}
    meta |= {"fused_chunk": chunks, "accuracy": acc}
    meta["persistent_grad_kernel"] = os.environ.get("GRPO_TRITON_PERSISTENT", "1") != "0"
    (args.out_dir / "loss_gpu.json").write_text(json.dumps(meta, indent=2) + "\n")
    plot(results, args.out_dir / "loss_gpu.png")
    print("\n| head | variant | tokens | median ms | peak extra GB |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['head']} | {r['variant']} | {r['tokens']} | {r['ms']:.1f} | {r['gb']:.2f} |")
    if acc:
        print("\n| head | variant | tokens | loss rel err | grad_hidden | grad_weight |")
        print("|---|---|---|---|---|---|")
        for r in acc:
            print(
                f"| {r['head']} | {r['variant']} | {r['tokens']} | {r['loss']:.1e} | "
                f"{r['grad_hidden']:.1e} | {r['grad_weight']:.1e} |"
            )
    if failed := [f"{r['head']} {r['variant']} N={r['tokens']}" for r in results if "error" in r]:
        print(f"bench_loss_gpu.py: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
