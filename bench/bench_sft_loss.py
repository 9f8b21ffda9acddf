"""Peak extra memory and time of the SFT loss (fwd+bwd): full-logits cross entropy vs chunked NLL.

    python bench/bench_sft_loss.py --out bench/results/sft_memory_cpu.json
    python bench/bench_sft_loss.py --device cuda --dtype bfloat16 --hidden 5120 \\
        --batch 1 --seq 16384 --trl --out bench/results/sft_loss_gpu.json   # Qwen3-14B head, 16k

Variants: ``full`` is what a Hugging Face model's ``loss`` does — the ``[tokens, vocab]`` logits
of every token (prompt tokens too), upcast to float32, then ``cross_entropy(ignore_index=-100)``;
``chunked-C`` is ``learner.loss.nll.chunked_nll`` with ``chunk_size=C`` (the torch path on CPU,
the Triton kernel on CUDA), which sends only the target rows through the head and never holds
more than one chunk's logits; ``trl`` (``--trl``, needs TRL 1.16) is TRL's SFT loss as its
``SFTTrainer`` computes it (``loss_type="nll"``, the successor of v1.4's ``chunked_nll``): the
target rows through ``trl.kernels.ChunkedLogProbFunction`` with the vocab chunk and the extra
outputs (entropy, top-1) its fused LM head asks for; ``fused`` is ``chunked_nll(fused=True)``
(``sft.fused_loss``, the learner's default): the NLL fused with the LM head (3 N·H·V products
instead of 4, both gradients in the forward, ``auto_chunk_size`` tokens' logits at a time). All
produce the same loss and the same grad_hidden / grad_weight.

Method: each variant runs in a fresh Python subprocess. On CPU the worker builds its inputs, runs
a tiny warm-up at a short vocab (so torch's lazy CPU state is created and counted in the baseline,
not in the measurement), reads the process's peak resident set size (``ru_maxrss``), runs one
fwd+bwd at the benchmark shape and reads the peak again; on CUDA it uses
``torch.cuda.max_memory_allocated`` around the same call. The difference is the peak extra
memory of one fwd+bwd (inputs and weights excluded, gradients included). Times are the median of
``--repeats`` further runs. ``--target-fraction`` of the tokens are loss targets (the completion;
the rest is prompt).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _loss_fn(variant: str):
    import torch
    import torch.nn.functional as F

    from learner.loss.nll import chunked_nll

    def run(h, w, targets, mask):
        if variant == "full":
            logits = h @ w.T  # [N, V], in the model's dtype, as an LM head
            labels = targets.masked_fill(mask == 0, -100)
            loss = F.cross_entropy(logits.float(), labels, ignore_index=-100)
        elif variant == "trl":
            from trl.kernels import ChunkedLogProbFunction
            from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

            keep = mask.bool()  # as TRL's fused LM head: only the target rows reach the head
            lp, *_ = ChunkedLogProbFunction.apply(
                h[keep], w, None, targets[keep], 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                ("log_probs", "entropy", "is_top1"),
            )  # fmt: skip
            loss = -lp.sum() / keep.sum().clamp(min=1)
        elif variant == "fused":
            loss = chunked_nll(h, w, targets, mask, fused=True)
        else:
            chunk = int(variant.split("-")[1])
            loss = chunked_nll(h, w, targets, mask, chunk_size=chunk)
        loss.backward()
        return loss.detach()

    return run, torch


def _make_inputs(n: int, h: int, v: int, frac: float, device: str, dtype: str, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    hid = torch.randn(n, h, generator=g).to(device, dt).requires_grad_()
    w = (torch.randn(v, h, generator=g) / h**0.5).to(device, dt).requires_grad_()
    tgt = torch.randint(0, v, (n,), generator=g).to(device)
    mask = torch.zeros(n, dtype=torch.long)
    mask[int(n * (1 - frac)) :] = 1  # the prompt first, then the completion
    return hid, w, tgt, mask.to(device)


def worker(args: argparse.Namespace) -> None:
    import resource

    run, torch = _loss_fn(args.worker)
    torch.manual_seed(0)
    cuda = args.device == "cuda"
    run(*_make_inputs(16, args.hidden, 64, 0.5, args.device, args.dtype))  # warm-up
    inputs = _make_inputs(
        args.batch * args.seq,
        args.hidden,
        args.vocab,
        args.target_fraction,
        args.device,
        args.dtype,
    )
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    loss = float(run(*inputs))
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(args.repeats):
        inputs[0].grad = inputs[1].grad = None
        t0 = time.perf_counter()
        run(*inputs)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {
        "variant": args.worker,
        "loss": loss,
        "peak_extra_mb": (peak - base) / 2**20,
        "median_s": statistics.median(times) if times else None,
    }
    print(json.dumps(out))


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936, help="Qwen3's")
    p.add_argument("--target-fraction", type=float, default=0.5)
    p.add_argument("--chunk-sizes", default="1024,256", help="one chunked variant per size")
    p.add_argument("--trl", action="store_true", help="also TRL 1.16's SFT loss (needs trl)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    shape = ["--batch", args.batch, "--seq", args.seq, "--hidden", args.hidden]
    shape += ["--vocab", args.vocab, "--target-fraction", args.target_fraction]
    shape += ["--device", args.device, "--dtype", args.dtype, "--repeats", args.repeats]
    variants = ["full"] + (["trl"] if args.trl else [])
    variants += [f"chunked-{c}" for c in args.chunk_sizes.split(",")] + ["fused"]
    rows = {}
    root = Path(__file__).resolve().parents[1]
    for variant in variants:
        cmd = [sys.executable, __file__, "--worker", variant, *map(str, shape)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=root)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    full = rows["full"]["peak_extra_mb"]
    n = args.batch * args.seq
    result = {
        "shape": {
            "tokens": n,
            "targets": n - int(n * (1 - args.target_fraction)),
            "batch": args.batch,
            "seq": args.seq,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "dtype": args.dtype,
            "device": args.device,
        },
        "gpu": _gpu_name() if args.device == "cuda" else None,
        "method": "fresh subprocess per variant; peak extra memory over one fwd+bwd "
        + ("(max_memory_allocated)" if args.device == "cuda" else "(ru_maxrss delta)"),
        "variants": rows,
        "memory_ratio_over_full": {k: r["peak_extra_mb"] / full for k, r in rows.items()},
    }
    targets = result["shape"]["targets"]
    print(
        f"{n} tokens ({targets} targets), H={args.hidden}, V={args.vocab}, {args.dtype} on {args.device}"
    )
    print(f"{'variant':<15}{'peak extra MiB':>15}{'vs full':>10}{'median ms':>12}{'loss':>10}")
    for name, r in rows.items():
        ms = f"{r['median_s'] * 1e3:.1f}" if r["median_s"] is not None else "-"
        ratio = r["peak_extra_mb"] / full
        print(f"{name:<15}{r['peak_extra_mb']:>15.1f}{ratio:>10.1%}{ms:>12}{r['loss']:>10.4f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
