"""Peak learner memory and step time with each memory option on vs off.

    python bench/bench_memory_options.py --out memory.json [--model DIR]   # one CUDA GPU
    python bench/bench_memory_options.py --cpu-smoke --out smoke.json       # same code, CPU

One optimizer step of the real learner code path — ``learner.model.setup.build_models``, then
``learner.step.update.build_micro_batches`` + ``train_on`` under a plain ``accelerate.Accelerator``
with the model in bf16 — on a fixed, seeded synthetic batch (64 rollouts, prompts of 128–256 and
completions of 256–1024 tokens, a Qwen3-0.6B-shaped random model), once per configuration:
everything off (``baseline``, gradient checkpointing included), each option on alone, and all of
them on. The learner's config is a real ``LearnerConfig``, mapped to the loss and step options by
their own constructors (``LossConfig.of``, ``StepOptions.of``), as the trainer maps it, so the
benchmark cannot drift from what ``python -m learner`` runs.

Each configuration runs in a fresh subprocess: the CUDA caching allocator, pinned host buffers and
``ru_maxrss`` never carry over from one configuration to the next. Reported per configuration:
``torch.cuda.max_memory_allocated`` over each timed step (the peak; reset before every step, the
warm-up excluded, so optimizer state is included and one-time compilation buffers are not), the
memory allocated when the step starts (weights + optimizer state), the median step seconds
(``build_micro_batches`` + ``train_on``, synchronised), and whether the decoder layers really
recomputed their activations in the backward (a forward hook counts a layer's calls: 2 per
micro-batch under checkpointing, 1 without).

Time (measured on an H200): 20–30 s per configuration (start-up, loading 1.2 GB, 4 steps of
1.3–2.3 s), except activation offloading alone: 86 s with ``--steps 2`` (its first step pins
tens of GB of host memory; ~7 s per step after), over the default ``--config-timeout`` of 90 s
with 3 timed steps: give it ``--config-timeout 300``. ``--budget-s`` (150) keeps the whole run
under 3 minutes, skipping what no longer fits.

``--cpu-smoke`` runs the same code at a tiny shape on CPU and reports the rise of ``ru_maxrss``
over the steps instead (the numbers mean nothing; a CPU test exercises the plumbing with it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the configurations and checks (pure); tests/bench/test_memory_options_cli.py reads them, the
# option tuples included, from this module
from memory_options_configs import (
    CONFIGS,
    DEFAULT_CONFIGS,
    BenchError,
    checks,
    config_options,
    learner_config_dict,
    packing_budget,
    sequence_lengths,
    table,
)
from memory_options_configs import MEMORY_OPTIONS as MEMORY_OPTIONS
from memory_options_configs import OPTIONS as OPTIONS

ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "RESULT "


# -- one configuration, in its own process -------------------------------------------------


def _probe_layer_forwards(model: Any) -> list[int]:
    """Count forward calls of the first decoder layer's first child (they repeat in backward
    when the layer is checkpointed); an empty list stays empty if the model has no such layer."""
    calls: list[int] = []
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return calls
    layer = next((m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)), None)
    child = next(iter(layer.children()), None) if layer is not None else None
    if child is not None:
        child.register_forward_hook(lambda *_: calls.append(1))
    return calls


def synthetic_rollouts(spec: dict[str, Any], vocab: int) -> list[Any]:
    """The fixed batch: random token ids, server log-probs in [-3, -0.1], group-centred
    advantages (groups of 8), all seeded."""
    from learner.step.batch import Rollout

    b = spec["batch"]
    rng = random.Random(b["seed"] + 1)
    rollouts = []
    for p, c in sequence_lengths(b["sequences"], b["prompt"], b["completion"], b["seed"]):
        rollouts.append(
            Rollout(
                prompt_ids=[rng.randrange(vocab) for _ in range(p)],
                completion_ids=[rng.randrange(vocab) for _ in range(c)],
                sampling_logprobs=[-rng.uniform(0.1, 3.0) for _ in range(c)],
                completion_mask=[1] * c,
                advantage=rng.gauss(0.0, 1.0),
            )
        )
    for g in range(0, len(rollouts), 8):
        group = rollouts[g : g + 8]
        mean = statistics.fmean(r.advantage for r in group)
        for r in group:
            r.advantage -= mean
    return rollouts


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the model and run warm-up + timed steps of one configuration; the measurements."""
    import resource

    import torch
    from accelerate import Accelerator

    from learner.config import LearnerConfig
    from learner.loss.grpo import LossConfig
    from learner.model.setup import build_models
    from learner.step.update import StepOptions, build_micro_batches, train_on

    cuda = spec["device"] == "cuda"
    cfg = LearnerConfig.model_validate(spec["learner_config"])
    torch.manual_seed(spec["batch"]["seed"])
    accelerator = Accelerator(cpu=not cuda)
    policy, ref_policy = build_models(cfg, spec["model"])
    hf = policy.model
    vocab = hf.get_output_embeddings().weight.shape[0]
    pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    params = sum(p.numel() for p in policy.parameters())
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6, betas=cfg.optim.betas)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    loss_cfg, opts = LossConfig.of(cfg.grpo, cfg.sampling.max_tokens), StepOptions.of(cfg)
    rollouts = synthetic_rollouts(spec, vocab)
    calls = _probe_layer_forwards(hf)

    def rss() -> int:  # Linux: KiB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    steps, peaks, starts, seconds, layer_calls = [], [], [], [], []
    rss_before = rss()
    for _ in range(spec["warmup"] + spec["steps"]):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            starts.append(torch.cuda.memory_allocated())
        calls.clear()
        t0 = time.perf_counter()
        step = build_micro_batches(rollouts, opts, loss_cfg, pad_id)
        metrics = train_on(accelerator, policy, ref_policy, optimizer, loss_cfg, step, opts)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated() if cuda else 0)
        layer_calls.append(len(calls) / (len(step.batches) * opts.num_iterations))
        steps.append(metrics)
    timed = slice(spec["warmup"], None)
    last = steps[-1]
    per_mb = statistics.median(layer_calls[timed]) if any(layer_calls) else None  # no probe: 0
    loss_tokens = [b.num_loss_tokens for b in step.batches]
    return {
        "status": "ok",
        "memory_metric": "cuda.max_memory_allocated" if cuda else "ru_maxrss rise over the steps",
        "peak_bytes": max(peaks[timed]) if cuda else rss() - rss_before,
        "step_start_bytes": statistics.median(starts[timed]) if cuda else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "host_maxrss_bytes": rss(),
        "step_s": {
            "median": statistics.median(seconds[timed]),
            "all": seconds,
            "warmup": spec["warmup"],
        },
        "micro_batches": len(step.batches),
        "tokens_trained": int(last["tokens/trained"]),
        "tokens_padded": int(last["tokens/padded"]),
        "trained_tokens_per_s": last["tokens/trained"] / statistics.median(seconds[timed]),
        "layer_forwards_per_micro_batch": per_mb,
        # A compiled layer recomputes inside its compiled backward (transformers runs the
        # checkpoint within the layer's forward, so torch.compile traces it), where no hook
        # fires: not observable here; `checks` compares its peak with the same without it.
        "recomputes_activations": None if per_mb is None or cfg.model.compile else per_mb > 1.5,
        "full_logits_bytes": max(loss_tokens) * vocab * 4,  # what chunking avoids, not allocated
        "params": params,
        "trainable_params": sum(p.numel() for p in trainable),
        "loss": last["loss"],
        "grad_norm": last["grad_norm"],
        "versions": _versions(),
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
    }


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "accelerate", "peft", "triton", "bitsandbytes"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "-"
    return out


def worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    try:
        result = run_worker(spec)
    except Exception as e:  # reported as this configuration's result, the parent goes on
        import torch

        status = "oom" if isinstance(e, torch.OutOfMemoryError) else "error"
        result = {"status": status, "error": f"{type(e).__name__}: {str(e)[:600]}"}
        if torch.cuda.is_available():
            result["peak_bytes_before_failure"] = torch.cuda.max_memory_allocated()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# -- the parent: every configuration in turn -----------------------------------------------


def run_config(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"no result within {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if not lines:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        return {"status": "error", "error": f"worker exited {proc.returncode}: {tail}"}
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["process_s"] = time.monotonic() - t0
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_memory_options.py",
        description="Peak learner memory and step time with each memory option on vs off.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="result JSON")
    p.add_argument("--model", help="model dir (default: a random Qwen3-0.6B shape, built here)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model and batch on CPU")
    p.add_argument(
        "--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma-separated of {list(CONFIGS)}"
    )
    p.add_argument("--sequences", type=int, help="rollouts in the batch (GPU 64, smoke 8)")
    p.add_argument("--prompt-tokens", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--completion-tokens", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--micro-batch-size", type=int, help="grpo.micro_batch_size (GPU 16, smoke 4)")
    p.add_argument("--packing-tokens", type=int, help="default: micro-batch size x mean length")
    p.add_argument("--attn-implementation", help="model.attn_implementation (default: HF's)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config-timeout", type=float, default=90.0, help="s per configuration")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="configurations run at once (> 1 only where step times do not matter: the CPU smoke)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=150.0,
        help="s; no configuration starts later, none "
        "runs past it by more than 10 s (a 3-minute limit holds)",
    )
    return p


def _defaults(args: argparse.Namespace) -> None:
    smoke = args.cpu_smoke
    args.sequences = args.sequences or (8 if smoke else 64)
    args.prompt_tokens = tuple(args.prompt_tokens or ((8, 16) if smoke else (128, 256)))
    args.completion_tokens = tuple(args.completion_tokens or ((8, 32) if smoke else (256, 1024)))
    args.micro_batch_size = args.micro_batch_size or (4 if smoke else 16)
    args.dtype = "float32" if smoke else "bfloat16"
    args.unit = (1e6, "MB") if smoke else (1e9, "GB")  # for the printed table


def check_environment(args: argparse.Namespace, names: list[str]) -> None:
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise BenchError(f"--configs: unknown {bad}; choose from {list(CONFIGS)}")
    if args.model and not (Path(args.model) / "config.json").is_file():
        raise BenchError(
            f"--model {args.model} has no config.json: write one with "
            "`python -m rollout_server.tiny DIR --qwen3-0.6b-shape`, or leave --model out"
        )
    if args.warmup < 0 or args.steps < 1:
        raise BenchError("need --warmup >= 0 and --steps >= 1")
    if not args.cpu_smoke:
        import torch

        if not torch.cuda.is_available():
            raise BenchError(
                "no CUDA GPU visible: run this on the GPU machine, or add --cpu-smoke for the "
                "tiny CPU run"
            )


def make_model(args: argparse.Namespace, tmp: Path) -> str:
    from rollout_server.tiny import QWEN3_0_6B_SHAPE, save_tiny_model

    if args.cpu_smoke:
        return str(save_tiny_model(tmp / "model", seed=args.seed))
    print("building a random-weight Qwen3-0.6B-shaped model (bf16) ...", flush=True)
    return str(save_tiny_model(tmp / "model", seed=args.seed, dtype="bfloat16", **QWEN3_0_6B_SHAPE))


def worker_spec(args: argparse.Namespace, options: dict[str, Any], model: str) -> dict[str, Any]:
    """What one configuration's subprocess runs (JSON-serialisable)."""
    return {
        "device": "cpu" if args.cpu_smoke else "cuda",
        "model": model,
        "learner_config": learner_config_dict(
            options,
            dtype=args.dtype,
            micro_batch_size=args.micro_batch_size,
            packing_tokens=args.packing_tokens,
            attn_implementation=args.attn_implementation,
        ),
        "batch": {
            "sequences": args.sequences,
            "seed": args.seed,
            "prompt": list(args.prompt_tokens),
            "completion": list(args.completion_tokens),
        },
        "warmup": args.warmup,
        "steps": args.steps,
    }


def run_all(args: argparse.Namespace, names: list[str], model: str, argv: list[str]) -> dict:
    """Every configuration in turn; the JSON is rewritten after each, so a kill keeps those done."""
    t_start = time.monotonic()
    lengths = sequence_lengths(
        args.sequences, args.prompt_tokens, args.completion_tokens, args.seed
    )
    args.packing_tokens = args.packing_tokens or packing_budget(lengths, args.micro_batch_size)
    report: dict[str, Any] = {
        "bench": "memory_options",
        "command": shlex.join(["python", "bench/bench_memory_options.py", *argv]),
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "model": model,
        "dtype": args.dtype,
        "memory_unit": "bytes",
        "batch": {
            "sequences": args.sequences,
            "prompt_tokens": list(args.prompt_tokens),
            "completion_tokens": list(args.completion_tokens),
            "total_tokens": sum(p + c for p, c in lengths),
            "loss_tokens": sum(c for _, c in lengths),
            "seed": args.seed,
            "micro_batch_size": args.micro_batch_size,
            "max_tokens_per_micro_batch": args.packing_tokens,
        },
        "configs": [],
    }

    def one(name: str) -> dict[str, Any]:
        options = config_options(name)
        left = args.budget_s - (time.monotonic() - t_start)
        row: dict[str, Any] = {"name": name, "options": options}
        if left < 10:
            return row | {"status": "skipped", "error": f"budget: {left:.0f} s left"}
        print(f"== {name}: {options}", flush=True)
        spec = worker_spec(args, options, model)
        return row | run_config(spec, min(args.config_timeout, left + 10))

    # --jobs > 1: configurations side by side (each its own process, so each peak is its own;
    # the step times then share the CPU/GPU and are not comparable: for the CPU smoke run)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for future in [pool.submit(one, name) for name in names]:  # in order, as each ends
            report["configs"].append(future.result())
            report["checks"] = checks(report["configs"])
            report["wall_s"] = time.monotonic() - t_start
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))
            print(table(report["configs"], *args.unit).splitlines()[-1], flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # one configuration, started by run_config
        return worker_main(argv[1])
    args = build_parser().parse_args(argv)
    _defaults(args)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    try:
        check_environment(args, names)
    except BenchError as e:
        print(f"bench_memory_options: error: {e}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="grpo-memory-"))
    try:
        report = run_all(args, names, args.model or make_model(args, tmp), argv)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(table(report["configs"], *args.unit))
    for c in report["checks"]:
        print(f"{ {True: 'PASS', False: 'FAIL', None: 'n/a'}[c['ok']]:4}  {c['check']}")
    print(f"results: {args.out} ({report['wall_s']:.0f} s)")
    return 0 if all(r["status"] == "ok" for r in report["configs"]) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
