"""Train-phase time with and without leaving zero-advantage rollouts out (`grpo.skip_zero_advantage`).

A group whose G completions all got the same reward has zero advantage: with no KL term and no
entropy bonus its tokens have a zero gradient, yet TRL's GRPOTrainer (and this learner with
`skip_zero_advantage = false`, the baseline here) runs them through the forward and backward.
For each fraction of such groups, one GRPO train step (`build_micro_batches` + `train_on`, the
learner's own code) on the same rollouts, skipping off and on: median seconds of `--repeats`
steps after a warm-up, each from the same starting weights; and how far apart the two steps'
loss, gradient norm and weight updates are (the update's largest difference over its largest
entry).

    python bench/bench_skip_zero_advantage.py --out bench/results/skip_zero_advantage_cpu.json
    python bench/bench_skip_zero_advantage.py --device cuda --shape qwen3-0.6b --prompt 128 \\
        --completion 512 --micro-batch-size 32 --out $OUT/skip_zero_advantage_gpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate import Accelerator  # noqa: E402

from learner.loss.grpo import LossConfig  # noqa: E402
from learner.model.policy import PolicyLogprobs  # noqa: E402
from learner.step.batch import Rollout  # noqa: E402
from learner.step.update import StepOptions, build_micro_batches, train_on  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    # small enough for 2 CPU cores, real Qwen3 layers
    "small": {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 64,
              "intermediate": 768, "vocab_size": 8192},
    "qwen3-0.6b": {},  # rollout_server.tiny.QWEN3_0_6B_SHAPE
}  # fmt: skip


def make_model(shape: str, device: str) -> torch.nn.Module:
    from transformers import Qwen3ForCausalLM

    from rollout_server.tiny import QWEN3_0_6B_SHAPE, tiny_qwen3_config

    kw = dict(SHAPES[shape] or QWEN3_0_6B_SHAPE)
    config = tiny_qwen3_config(kw.pop("vocab_size"), **kw)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Qwen3ForCausalLM(config).to(device=device, dtype=dtype)
    model.config.use_cache = False
    if device == "cuda":
        model.gradient_checkpointing_enable()
    return model


def make_rollouts(args: argparse.Namespace, vocab: int, zero_frac: float) -> list[Rollout]:
    """`--groups` groups of `--group-size`; the first `zero_frac` of the groups all-equal."""
    rng = random.Random(0)
    zero_groups = round(zero_frac * args.groups)
    out = []
    for g in range(args.groups):
        rewards = [rng.random() for _ in range(args.group_size)]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        for r in rewards:
            c = rng.randint(args.completion // 2, args.completion)
            out.append(
                Rollout(
                    [rng.randrange(vocab) for _ in range(args.prompt)],
                    [rng.randrange(vocab) for _ in range(c)],
                    [-rng.random() * 5 for _ in range(c)],
                    [1] * c,
                    advantage=0.0 if g < zero_groups else (r - mean) / (std + 1e-4),
                )
            )
    rng.shuffle(out)
    return out


def one_step(acc, model, initial, rollouts, args, skip: bool) -> tuple[float, dict, dict]:
    model.load_state_dict(initial)
    policy = PolicyLogprobs(model, chunk_size=1024)
    opts = StepOptions(
        micro_batch_size=args.micro_batch_size,
        fused_loss=args.fused_loss,
        skip_zero_advantage=skip,
    )
    cfg = LossConfig(loss_type=args.loss_type, max_completion_length=args.completion)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # updates well above rounding
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step = build_micro_batches(rollouts, opts, cfg, pad_id=0)
    metrics = train_on(acc, policy, None, opt, cfg, step, opts)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    delta = {k: p.detach().float() - initial[k].float() for k, p in model.named_parameters()}
    return seconds, metrics, delta


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    acc = Accelerator(cpu=args.device == "cpu")
    model = make_model(args.shape, args.device)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    vocab = model.config.vocab_size
    results = []
    for frac in args.fractions:
        rollouts = make_rollouts(args, vocab, frac)
        row: dict[str, Any] = {"zero_advantage_groups": frac}
        deltas = {}
        for skip in (False, True):
            one_step(acc, model, initial, rollouts, args, skip)  # warm-up
            times, metrics = [], {}
            for _ in range(args.repeats):
                secs, metrics, deltas[skip] = one_step(acc, model, initial, rollouts, args, skip)
                times.append(secs)
            key = "skip" if skip else "all"
            row[f"{key}_s"] = statistics.median(times)
            row[f"{key}_times"] = times
            row[f"{key}_loss"], row[f"{key}_grad_norm"] = metrics["loss"], metrics["grad_norm"]
            row[f"{key}_trained_tokens"] = metrics["tokens/trained"]
        scale = max(d.abs().max().item() for d in deltas[False].values())
        diff = max((deltas[True][k] - deltas[False][k]).abs().max().item() for k in deltas[False])
        row["update_rel_diff"] = diff / scale if scale else 0.0
        row["speedup"] = row["all_s"] / row["skip_s"]
        results.append(row)
        print(_line(row), flush=True)
    return results


HEADER = (
    "| zero-adv groups | tokens trained (skip / all) | all s | skip s | speedup "
    "| loss rel diff | grad-norm rel diff | update rel diff |\n|---|---|---|---|---|---|---|---|"
)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _line(r: dict[str, Any]) -> str:
    return (
        f"| {r['zero_advantage_groups']:.0%} | {r['skip_trained_tokens']:.0f} / "
        f"{r['all_trained_tokens']:.0f} | {r['all_s']:.3f} | {r['skip_s']:.3f} | "
        f"{r['speedup']:.2f}x | {_rel(r['skip_loss'], r['all_loss']):.1e} | "
        f"{_rel(r['skip_grad_norm'], r['all_grad_norm']):.1e} | {r['update_rel_diff']:.1e} |"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--groups", type=int, default=8, help="prompts in the step")
    p.add_argument("--group-size", type=int, default=8, help="completions a prompt (G)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--completion", type=int, default=96, help="longest completion")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--loss-type", default="dapo", choices=["grpo", "bnpo", "dr_grpo", "dapo"])
    p.add_argument("--fused-loss", action="store_true")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    args = p.parse_args(argv)
    print(HEADER, flush=True)
    results = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        meta = {"device": device, "torch": torch.__version__}
        payload = {"args": {**vars(args), "out": str(args.out)}, **meta, "results": results}
        args.out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
