"""Peak extra memory and time of the GRPO loss (fwd+bwd) on CPU: full logits vs chunked.

    python bench/bench_chunked_loss_cpu.py --out bench/results/chunked_loss_cpu.json

Method: each variant runs in a fresh Python subprocess. The worker builds its inputs, runs a
tiny warm-up at a shape with a short vocab (so torch's lazy CPU state — thread pools, kernels —
is created and counted in the baseline, not in the measurement), then reads the process's peak
resident set size (`resource.getrusage(RUSAGE_SELF).ru_maxrss`), runs the loss forward and
backward once at the benchmark shape and reads the peak again. The difference is the peak
extra memory of one fwd+bwd (inputs and weights excluded, gradients included: both variants
produce the same grad_hidden and grad_weight). Times are the median of `--repeats` further
runs. Loss: DAPO with KL and the truncated-IS weight, entropy computed, float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _loss_fn(variant: str, chunk_size: int):
    import torch

    from learner.loss.grpo import LossConfig, LossInputs, grpo_loss
    from learner.loss.logprobs import token_logprobs

    def full_logprobs(h, w, t):
        logits = (h @ w.T).float()  # [N, V]: the whole thing, as TRL's default path
        lp = torch.log_softmax(logits, dim=-1)
        return lp.gather(1, t[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1)

    def run(h, w, t, old, sampling, ref, adv, mask):
        b, tt = mask.shape
        if variant == "full":
            lp, ent = full_logprobs(h, w, t)
        else:
            lp, ent = token_logprobs(h, w, t, chunk_size=chunk_size, impl="torch")
        inputs = LossInputs(
            lp.view(b, tt),
            old,
            adv,
            mask,
            sampling_logprobs=sampling,
            ref_logprobs=ref,
            entropy=ent.view(b, tt),
        )
        loss, _ = grpo_loss(inputs, LossConfig(beta=0.04))
        loss.backward()
        return loss.detach()

    return run


def _make_inputs(b: int, t: int, h: int, v: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(b * t, h, generator=g).requires_grad_()
    w = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_()
    tgt = torch.randint(0, v, (b * t,), generator=g)
    old = -torch.rand(b, t, generator=g) * 5
    return (
        hid,
        w,
        tgt,
        old,
        old - 0.1 * torch.rand(b, t, generator=g),
        old + 0.1 * torch.randn(b, t, generator=g),
        torch.randn(b, generator=g),
        torch.ones(b, t),
    )


def worker(args: argparse.Namespace) -> None:
    import resource

    import torch

    torch.manual_seed(0)
    run = _loss_fn(args.worker, args.chunk_size)
    run(*_make_inputs(2, 8, args.hidden, 64))  # warm-up: lazy torch state into the baseline
    inputs = _make_inputs(args.batch, args.seq, args.hidden, args.vocab)
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run(*inputs)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(args.repeats):
        inputs[0].grad = inputs[1].grad = None
        t0 = time.perf_counter()
        run(*inputs)
        times.append(time.perf_counter() - t0)
    print(
        json.dumps(
            {
                "variant": args.worker,
                "peak_extra_mb": (peak_kb - base_kb) / 1024,  # ru_maxrss is in KiB on Linux
                "median_s": statistics.median(times),
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--worker", choices=["full", "chunked"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    shape = ["--batch", args.batch, "--seq", args.seq, "--hidden", args.hidden]
    shape += ["--vocab", args.vocab, "--chunk-size", args.chunk_size, "--repeats", args.repeats]
    rows = {}
    root = Path(__file__).resolve().parents[1]
    for variant in ("full", "chunked"):
        cmd = [sys.executable, __file__, "--worker", variant, *map(str, shape)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=root)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    ratio = rows["chunked"]["peak_extra_mb"] / rows["full"]["peak_extra_mb"]
    result = {
        "shape": {
            "tokens": args.batch * args.seq,
            "batch": args.batch,
            "seq": args.seq,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "chunk_size": args.chunk_size,
            "dtype": "float32",
        },
        "method": "fresh subprocess per variant; peak RSS (ru_maxrss) delta over one fwd+bwd",
        "variants": rows,
        "memory_ratio_chunked_over_full": ratio,
    }
    print(f"{'variant':<10}{'peak extra MB':>15}{'median ms':>12}")
    for name, r in rows.items():
        print(f"{name:<10}{r['peak_extra_mb']:>15.1f}{r['median_s'] * 1e3:>12.1f}")
    print(f"chunked / full peak memory: {ratio:.1%} (target <= 25%)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
