"""The baseline: TRL 1.16's ``GRPOTrainer`` with vLLM colocated, on the end-to-end workload.

    python bench/bench_trl_grpo.py --model DIR --out trl.json [--steps 8] [--warmup 2] [--liger]
    accelerate launch --config_file deploy/accelerate/zero3.yaml --num_processes 4 \
        bench/bench_trl_grpo.py --model DIR --model-shape qwen3-4b --out trl4.json

Same workload as bench_grpo_e2e.py (e2e_common.py): random-weight Qwen3-0.6B shape loaded in
bf16 (``model_init_kwargs={"dtype": "bfloat16"}``, ``bf16=True``), the same 16 chat prompts x
8 samples x up to 256 tokens per optimizer step, the same length reward, learning rate 1e-6,
beta 0, gradient checkpointing on (TRL's default, and ours). TRL counts batches in
completions: ``per_device_train_batch_size`` (16) x ``gradient_accumulation_steps`` (8) = 128 =
16 prompts x 8, and ``steps_per_generation`` defaults to the accumulation steps, so each
optimizer step generates once with the freshly synced weights, as ours does. vLLM runs in the
trainer's process (``vllm_mode="colocate"``, ``vllm_gpu_memory_utilization`` 0.3, TRL's
default; ``--vllm-sleep`` turns TRL's sleep mode on).

Seconds per step: a ``TrainerCallback`` stamps ``on_step_begin`` and ``on_step_end`` (with a
CUDA synchronize, so the optimizer step's kernels are inside) — generation, weight sync to
vLLM, 8 forward/backward micro-batches and the optimizer step. The first ``--warmup`` steps are
dropped; the median of the rest is reported, next to the wall-clock gap between consecutive
step ends and TRL's own logged ``step_time``. vLLM's ``generate`` and ``sync_weights`` are
wrapped with timers for a rough phase split. ``--cpu --no-vllm`` runs the same plumbing on CPU
(transformers generation; numbers mean nothing).

Under ``accelerate launch`` with N processes (the 4-GPU comparison: ZeRO-3, a vLLM engine on
every rank's GPU) the accumulation steps shrink N-fold, so a step is still 16 prompts x 8 in
all; the main process writes the result, with every GPU's peak memory (nvidia-smi) and TRL's
trained tokens per step (its logged ``num_tokens``) for the figures bench_grpo_e2e.py computes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_common import (
    REWARD_TARGET_CHARS,
    BenchError,
    add_workload_args,
    completion_text,
    prompt_rows,
    run_identity,
    seconds_stats,
    table,
    workload,
)
from gpu_common import MODEL_SHAPES, GpuMemoryPeak, shape_mismatch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_trl_grpo.py",
        description="TRL GRPOTrainer + colocated vLLM on the end-to-end GRPO workload.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="model directory (with its tokenizer)")
    p.add_argument("--out", type=Path, required=True, help="result JSON")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps in all")
    add_workload_args(p)
    p.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), help="checked, recorded")
    p.add_argument(
        "--per-device-train-batch-size",
        type=int,
        default=16,
        help="completions per micro-batch and process; accumulation over the processes makes "
        "up one step's prompts x samples",
    )
    p.add_argument("--vllm-gpu-mem", type=float, default=0.3)
    p.add_argument("--vllm-sleep", action="store_true", help="vllm_enable_sleep_mode=True")
    p.add_argument("--liger", action="store_true", help="use_liger_kernel=True")
    p.add_argument(
        "--ignore-eos", action="store_true", help="fixed lengths (ours cannot: off by default)"
    )
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cpu", action="store_true", help="CPU smoke run (needs --no-vllm)")
    p.add_argument("--no-vllm", action="store_true", help="transformers generation")
    p.add_argument(
        "--no-is-correction",
        action="store_true",
        help="vllm_importance_sampling_correction=False (to compare with grpo.tis_cap=none; "
        "TRL still asks vLLM for the log-probs)",
    )
    return p


def trl_config_kwargs(args: argparse.Namespace, output_dir: str, world: int = 1) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments: one optimizer step = prompts_per_step x G completions
    over all ``world`` processes, generated once (pure, so a test can check the arithmetic)."""
    completions = args.prompts_per_step * args.num_generations
    mb = args.per_device_train_batch_size
    if mb < 1 or completions % (mb * world):
        raise BenchError(
            f"--per-device-train-batch-size {mb} x {world} processes must divide {completions} "
            "completions per step (prompts x generations)"
        )
    return {
        "output_dir": output_dir,
        "max_steps": args.steps,
        "per_device_train_batch_size": mb,
        "gradient_accumulation_steps": completions // (mb * world),
        # steps_per_generation defaults to gradient_accumulation_steps: one generation per step
        "num_generations": args.num_generations,
        "max_completion_length": args.max_tokens,
        "temperature": 1.0,
        "learning_rate": 1e-6,
        "beta": 0.0,
        "bf16": not args.cpu,
        "model_init_kwargs": {"dtype": "float32" if args.cpu else "bfloat16"},
        "gradient_checkpointing": args.gradient_checkpointing,
        "use_liger_kernel": args.liger,
        "use_vllm": not args.no_vllm,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": args.vllm_gpu_mem,
        "vllm_max_model_length": args.max_model_len,
        "vllm_enable_sleep_mode": args.vllm_sleep,
        "generation_kwargs": {"ignore_eos": True} if args.ignore_eos else None,
        "use_cpu": args.cpu,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    } | ({"vllm_importance_sampling_correction": False} if args.no_is_correction else {})


def length_chars(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """The learner's built-in ``length`` reward (characters, same target), TRL-callable."""
    from rewards.builtin.length import length_score

    return [length_score(len(completion_text(c)), REWARD_TARGET_CHARS) for c in completions]


def _cuda_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_step_timer() -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall-clock of every optimizer step, CUDA work included, and TRL's per-step logs."""

        def __init__(self) -> None:
            self.begin = 0.0
            self.steps: list[float] = []
            self.ends: list[float] = []
            self.logs: dict[int, dict[str, float]] = {}

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _cuda_sync()
            self.begin = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _cuda_sync()
            now = time.perf_counter()
            self.steps.append(now - self.begin)
            self.ends.append(now)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs:
                nums = {k: float(v) for k, v in logs.items() if isinstance(v, int | float)}
                self.logs.setdefault(state.global_step, {}).update(nums)

    return StepTimer()


def time_calls(obj: Any, name: str, bucket: list[float]) -> None:
    """Wrap ``obj.name`` so each call's seconds (CUDA work included) land in ``bucket``."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            _cuda_sync()
            bucket.append(time.perf_counter() - t0)

    setattr(obj, name, timed)


def summarize_trl(
    timer: Any, calls: dict[str, list[float]], warmup: int, completions: int
) -> dict[str, Any]:
    steps = timer.steps[warmup:]
    intervals = [b - a for a, b in zip(timer.ends, timer.ends[1:], strict=False)][
        max(warmup - 1, 0) :
    ]
    measured_logs = [v for k, v in sorted(timer.logs.items()) if k > warmup]

    def log_mean(key: str) -> float | None:
        xs = [r[key] for r in measured_logs if key in r]
        return statistics.fmean(xs) if xs else None

    gen, sync = calls["generate"][warmup:], calls["sync_weights"][warmup:]
    phases: dict[str, float] = {}
    if len(gen) == len(steps) and len(sync) == len(steps):
        phases = {
            "generate": statistics.median(gen),
            "sync": statistics.median(sync),
            "train": statistics.median(s - g - w for s, g, w in zip(steps, gen, sync, strict=True)),
        }
    # TRL logs num_tokens (prompt + completion, all processes) as a running total
    seen = {k: v["num_tokens"] for k, v in timer.logs.items() if "num_tokens" in v}
    trained = [seen[k] - seen[k - 1] for k in sorted(seen) if k > warmup and k - 1 in seen]
    length = log_mean("completions/mean_length")
    return {
        "steps_logged": len(timer.steps),
        "warmup": warmup,
        "step_s": seconds_stats(steps),
        "tokens_trained_per_step": statistics.median(trained) if trained else None,
        "tokens_generated_per_step": length * completions if length is not None else None,
        "phase_median_s": phases,
        "phase_note": "train = step - generate - sync (rewards and optimizer step included)",
        "wall_interval_s": seconds_stats(intervals) if intervals else None,
        "trl_step_time_s": log_mean("step_time"),
        "completion_len_mean": length,
        "completion_truncated_frac": log_mean("completions/clipped_ratio"),
        "reward_mean": log_mean("reward"),
        "generate_calls": len(calls["generate"]),
        "sync_calls": len(calls["sync_weights"]),
    }


def check_environment(args: argparse.Namespace) -> None:
    for mod, why in (("trl", "TRL 1.16"), ("datasets", "datasets"), ("transformers", "")):
        if importlib.util.find_spec(mod) is None:
            raise BenchError(
                f"{why or mod} is not importable: pip install trl==1.16.0 (the TRL baseline; "
                "bench/gpu_suite.sh's setup step names what is missing)"
            )
    if args.cpu != args.no_vllm:
        raise BenchError("--cpu and --no-vllm go together (vLLM needs a GPU)")
    if not args.no_vllm and importlib.util.find_spec("vllm") is None:
        raise BenchError('vLLM is not importable: pip install -e ".[vllm,deepspeed]"')
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            raise BenchError("no CUDA GPU visible: run on the GPU machine (or --cpu --no-vllm)")
    if args.steps <= args.warmup:
        raise BenchError(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.model_shape and (why := shape_mismatch(args.model, args.model_shape)):
        raise BenchError(why)


def world_size() -> int:
    """Processes of this run (``accelerate launch`` sets WORLD_SIZE; 1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    out_dir = tempfile.mkdtemp(prefix="trl-grpo-")
    world = world_size()
    config = GRPOConfig(**trl_config_kwargs(args, out_dir, world))
    rows = prompt_rows(max(512, args.steps * args.prompts_per_step))
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=str(args.model),
        reward_funcs=length_chars,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(str(args.model)),
    )
    setup_s = time.perf_counter() - t0
    calls: dict[str, list[float]] = {"generate": [], "sync_weights": []}
    if (gen := getattr(trainer, "vllm_generation", None)) is not None:
        for name, bucket in calls.items():
            time_calls(gen, name, bucket)
    timer = make_step_timer()
    trainer.add_callback(timer)
    t0 = time.perf_counter()
    trainer.train()
    completions = args.prompts_per_step * args.num_generations
    return {
        "status": "ok",
        "trl_version": trl.__version__,
        "setup_s": setup_s,
        "train_s": time.perf_counter() - t0,
        "config": {
            k: v for k, v in trl_config_kwargs(args, out_dir, world).items() if k != "output_dir"
        },
        "derived": {
            "generation_batch_size": config.generation_batch_size,
            "steps_per_generation": config.steps_per_generation,
        },
        "step_seconds": timer.steps,
        "summary": summarize_trl(timer, calls, args.warmup, completions),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_environment(args)
    except BenchError as e:
        print(f"bench_trl_grpo: error: {e}", file=sys.stderr)
        return 2
    main_process = int(os.environ.get("RANK", "0")) == 0
    memory = GpuMemoryPeak()  # every GPU, sampled by the main process only
    try:
        with memory if main_process else contextlib.nullcontext():
            result = run(args)
    except Exception as e:  # recorded in the JSON, so the suite's summary shows it
        traceback.print_exc()
        result = {"status": "error", "error": f"{type(e).__name__}: {e}"}
    if not main_process:
        return 0 if result["status"] == "ok" else 1
    result["workload"] = workload(
        args.prompts_per_step, args.num_generations, args.max_tokens, args.model_shape
    )
    result["world_size"] = world_size()
    result["deepspeed_zero_stage"] = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    result["gpu_peak_mib"] = memory.peak_mib
    result["run"] = run_identity()  # ours is compared with it only on the same host and run
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(table({"trl": result}))
    print(f"results: {args.out}", flush=True)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's in-process engine and the external-launcher process group can hang at interpreter
    # teardown; everything is written by now, so leave without it.
    os._exit(code)
