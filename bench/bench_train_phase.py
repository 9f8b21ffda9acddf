"""The learner's training phase alone: ms per step, MFU and peak memory of the real step
(``learner.step.update.train_on`` on the model ``learner.trainer_setup.build_training`` builds,
under the accelerate launch a user runs), for several layouts, against plain transformers
doing the same per-GPU work without any sharding, in the same run.

    python bench/bench_train_phase.py --model DIR --out train_phase.json --ranks 2

Every variant runs in processes of its own (``accelerate launch``) on the same synthetic
rollouts: ``--sequences`` per rank of ``--prompt-tokens`` + ``--completion-tokens`` tokens
(the 4-GPU GRPO workload's share of one rank: 16 prompts x 8 samples / 4 ranks = 32 x 288),
every token trained (advantages +-1). MFU = model FLOPs of the trained tokens
(``learner.run.perf.train_flops``: 6 x weights + attention, no recompute counted) / (median
step seconds x the GPU's dense bf16 peak), per GPU. The variant ``reference`` is plain
transformers on one GPU (full logits, cross-entropy, fused AdamW, no recompute): the
baseline. A profile (``torch.profiler``, top CUDA kernels) is kept for the variants in
``--profile``. The result says whether the run is valid (the baseline and every variant
ran) and whether the target (``--target-mfu``, 35 %) is met by the best variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "learner/configs/demo.toml"

# name -> (accelerate config, learner overrides). "zero3_today" is the second baseline: every
# choice the plan makes set back by hand (ZeRO-3 as launched, DeepSpeed's own bucket sizes,
# recompute on, eager layers, the unfused loss, AdamW in torch's multi-tensor path).
DS_DEFAULT_BUCKETS = [
    "deepspeed.prefetch_bucket_size=none",
    "deepspeed.max_live_parameters=none",
    "deepspeed.param_persistence_threshold=none",
    "deepspeed.reduce_bucket_size=none",
]
VARIANTS: dict[str, tuple[str | None, list[str]]] = {
    "reference": (None, []),
    "zero3_today": ("zero3", ["deepspeed.zero_stage=launch", "model.gradient_checkpointing=true",
                              *DS_DEFAULT_BUCKETS, "optim.fused=false", "model.compile=false"]),
    "zero3_buckets_gc": ("zero3", ["deepspeed.zero_stage=launch",
                                   "model.gradient_checkpointing=true"]),
    "zero3_ds_buckets": ("zero3", ["deepspeed.zero_stage=launch",
                                   "model.gradient_checkpointing=false", *DS_DEFAULT_BUCKETS]),
    "zero3_buckets": ("zero3", ["deepspeed.zero_stage=launch",
                                "model.gradient_checkpointing=false"]),
    "zero2": ("zero3", ["deepspeed.zero_stage=2", "model.gradient_checkpointing=false",
                        "model.compile=false"]),
    "zero2_fused": ("zero3", ["deepspeed.zero_stage=2", "model.gradient_checkpointing=false",
                              "grpo.fused_loss=true", "model.compile=false"]),
    "auto": ("zero3", []),  # what the learner chooses by itself
    "auto_eager": ("zero3", ["model.compile=false"]),
    "auto_fused": ("zero3", ["grpo.fused_loss=true"]),
    "auto_fused_eager": ("zero3", ["grpo.fused_loss=true", "model.compile=false"]),
    "auto_fused_foreach_adam": ("zero3", ["grpo.fused_loss=true", "optim.fused=false",
                                          "model.compile=false"]),
    "auto_fused_compiled": ("zero3", ["grpo.fused_loss=true", "model.compile=true"]),
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory (bf16)")
    p.add_argument("--out", type=Path, required=True, help="result JSON")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    p.add_argument("--ranks", type=int, default=2, help="processes (GPUs) of each variant")
    p.add_argument("--sequences", type=int, default=32, help="sequences per rank")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--completion-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile", default="zero3_today,auto", help="variants to profile")
    p.add_argument("--target-mfu", type=float, default=0.35)
    p.add_argument("--variant-timeout", type=float, default=300.0, help="s per variant")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a variant's process (internal)
    return p.parse_args(argv)


# -- one variant (runs inside its launch) -----------------------------------------------------


def synthetic_rollouts(args: argparse.Namespace, vocab: int, rank: int) -> list[Any]:
    import torch

    from learner.step.batch import Rollout

    g = torch.Generator().manual_seed(rank)
    out = []
    for i in range(args.sequences):
        ids = torch.randint(0, vocab, (args.prompt_tokens + args.completion_tokens,), generator=g)
        c = args.completion_tokens
        out.append(Rollout(prompt_ids=ids[: args.prompt_tokens].tolist(),
                           completion_ids=ids[args.prompt_tokens :].tolist(),
                           sampling_logprobs=[-1.0] * c, completion_mask=[1] * c,
                           advantage=1.0 if i % 2 else -1.0))  # fmt: skip
    return out


def profile_table(step: Any, cuda: bool) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=25)


def run_reference(args: argparse.Namespace) -> dict[str, Any]:
    """Plain transformers on one GPU: full logits, cross-entropy, fused AdamW."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().train()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    seq = args.prompt_tokens + args.completion_tokens
    ids = torch.randint(0, model.config.vocab_size, (args.sequences, seq), device="cuda")

    def step() -> None:
        logits = model(input_ids=ids).logits[:, args.prompt_tokens - 1 : -1]
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), ids[:, args.prompt_tokens :].flatten()
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"config": model.config, "step": step, "layout": "plain transformers, 1 GPU"}


def run_learner(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """The learner's own step under this process's launch."""
    from learner.config import load_config
    from learner.loss.grpo import LossConfig
    from learner.run.runtime import make_accelerator
    from learner.step.update import StepOptions, build_micro_batches, train_on
    from learner.trainer_setup import build_training

    cfg = load_config(DEMO, [
        f"model.name_or_path={args.model}", "model.dtype=bfloat16", "optim.lr=1e-6",
        f"grpo.micro_batch_size={args.sequences}", f"sampling.max_tokens={args.completion_tokens}",
        f"grpo.max_prompt_tokens={args.prompt_tokens}", *overrides,
    ])  # fmt: skip
    acc = make_accelerator()
    policy, ref, opt, _ = build_training(cfg, acc, args.model)
    inner = acc.unwrap_model(policy).model
    rollouts = synthetic_rollouts(args, inner.config.vocab_size, acc.process_index)
    loss_cfg, opts = LossConfig.of(cfg.grpo, cfg.sampling.max_tokens), StepOptions.of(cfg)
    phases: list[dict[str, float]] = []

    def step() -> None:
        batches = build_micro_batches(rollouts, opts, loss_cfg, pad_id=0)
        m = train_on(acc, policy, ref, opt, loss_cfg, batches, opts)
        phases.append({k: v for k, v in m.items() if k.startswith("time/train/")})

    ds = acc.state.deepspeed_plugin
    layout = {
        "zero_stage": ds.zero_stage if ds is not None else None,
        "gradient_checkpointing": bool(
            getattr(inner, "is_activation_checkpointing", None)
            or getattr(inner, "is_gradient_checkpointing", False)
        ),
        "fused_loss": cfg.grpo.fused_loss,
        "compiled": any(getattr(m, "_compiled_call_impl", None) for m in inner.modules()),
        "zero_buckets": (ds.deepspeed_config.get("zero_optimization") if ds else None),
    }
    return {"config": inner.config, "step": step, "layout": layout, "phases": phases, "acc": acc}


def worker(args: argparse.Namespace) -> int:
    import torch

    from learner.run.perf import peak_tflops, train_flops

    name = args.worker
    launch, overrides = VARIANTS[name]
    cuda = torch.cuda.is_available()  # the CPU runs only check the plumbing (tests/bench)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    run = run_reference(args) if launch is None else run_learner(args, overrides)
    step, times = run["step"], []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    acc = run.get("acc")
    profile = profile_table(step, cuda) if name in args.profile.split(",") else None
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    if acc is not None and acc.num_processes > 1:
        t = torch.tensor([peak_gib], device=acc.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        peak_gib = float(t[0])
    if acc is not None and not acc.is_main_process:
        return 0
    lengths = [args.prompt_tokens + args.completion_tokens] * args.sequences
    flops = train_flops(run["config"], lengths)
    median = statistics.median(times)
    peak = peak_tflops()
    result = {
        "variant": name,
        "layout": run["layout"],
        "processes": acc.num_processes if acc is not None else 1,
        "step_s": times,
        "median_s": median,
        "tflops_per_gpu": flops / median / 1e12,
        "mfu": flops / median / 1e12 / peak if peak else None,
        "peak_allocated_gib": peak_gib,
        "phases": run.get("phases", [])[-1:] or None,
        "profile": profile,
    }
    Path(os.environ["TRAIN_PHASE_RESULT"]).write_text(json.dumps(result, default=str))
    return 0


# -- the driver --------------------------------------------------------------------------------


def launch_argv(args: argparse.Namespace, name: str) -> list[str]:
    launch = VARIANTS[name][0]
    me = [str(Path(__file__).resolve()), *sys.argv[1:], f"--worker={name}"]
    if launch is None:
        return [sys.executable, *me]
    from grpo_common.net import free_port

    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / f"deploy/accelerate/{launch}.yaml"),
        "--num_processes", str(args.ranks), "--main_process_port", str(free_port()), *me,
    ]  # fmt: skip


def run_variant(args: argparse.Namespace, name: str, log_dir: Path) -> dict[str, Any]:
    result_file = log_dir / f"{name}.json"
    result_file.unlink(missing_ok=True)
    env = {**os.environ, "TRAIN_PHASE_RESULT": str(result_file), "PYTHONUNBUFFERED": "1"}
    if VARIANTS[name][0] is None:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    t0 = time.monotonic()
    with open(log_dir / f"{name}.log", "w") as log:
        try:
            proc = subprocess.run(launch_argv(args, name), env=env, cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=args.variant_timeout,
                                  start_new_session=True)  # fmt: skip
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc == 0 and result_file.exists():
        return {
            "status": "ok",
            "wall_s": time.monotonic() - t0,
            **json.loads(result_file.read_text()),
        }
    tail = (log_dir / f"{name}.log").read_text()[-2000:]
    return {"status": "error", "variant": name, "error": f"exit {rc}", "log_tail": tail}


def verdict(results: dict[str, Any], target: float) -> dict[str, Any]:
    ok = {k: v for k, v in results.items() if v.get("status") == "ok"}
    missing = sorted(set(results) - set(ok))
    valid = "reference" in ok and "zero3_today" in ok and not missing
    ours = {k: v for k, v in ok.items() if k != "reference" and v.get("mfu") is not None}
    best = max(ours, key=lambda k: ours[k]["mfu"]) if ours else None
    best_mfu = ours[best]["mfu"] if best else None
    return {
        "valid": valid,
        "why_not_valid": None if valid else f"variants that did not run: {missing or 'baseline'}",
        "best": best,
        "best_mfu": best_mfu,
        "target_mfu": target,
        "target_met": bool(valid and best_mfu is not None and best_mfu >= target),
        "speedup_over_today": (ok["zero3_today"]["median_s"] / ours[best]["median_s"])
        if best and "zero3_today" in ok
        else None,
    }


def table(results: dict[str, Any]) -> str:
    rows = [f"{'variant':<18} {'stage':>5} {'gc':>3} {'fused':>5} {'ms/step':>9} {'range':>13} "
            f"{'MFU':>6} {'peak GiB':>9}"]  # fmt: skip
    for name, r in results.items():
        if r.get("status") != "ok":
            rows.append(f"{name:<18} {r.get('error', '?')}")
            continue
        lay = r["layout"] if isinstance(r["layout"], dict) else {}
        ms = [t * 1e3 for t in r["step_s"]]
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        rows.append(
            f"{name:<18} {lay.get('zero_stage', '-')!s:>5} "
            f"{'on' if lay.get('gradient_checkpointing') else 'off':>3} "
            f"{'yes' if lay.get('fused_loss') else 'no':>5} {r['median_s'] * 1e3:>9.0f} "
            f"{min(ms):>6.0f}-{max(ms):<6.0f} {mfu:>6} {r['peak_allocated_gib']:>9.1f}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        print(f"unknown variants {sorted(unknown)}: choose from {', '.join(VARIANTS)}")
        return 2
    import torch

    if not torch.cuda.is_available():
        print("bench_train_phase needs a GPU (it measures GPU utilisation)")
        return 2
    log_dir = args.out.with_suffix("")
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for name in args.variants.split(","):
        results[name] = run_variant(args, name, log_dir)
        print(table({name: results[name]}).splitlines()[-1], flush=True)
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "workload": {k: getattr(args, k) for k in ("model", "ranks", "sequences", "prompt_tokens",
                                                   "completion_tokens", "steps", "warmup")},
        "mfu_formula": "6 x matmul weights + attention FLOPs per trained token (learner.run.perf."
        "train_flops) x tokens / (median step s x dense bf16 peak), per GPU",
        "results": results,
        "verdict": verdict(results, args.target_mfu),
    }  # fmt: skip
    args.out.write_text(json.dumps(out, indent=1, default=str))
    print(table(results))
    print(json.dumps(out["verdict"]))
    return 0 if out["verdict"]["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
