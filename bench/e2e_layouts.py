"""The 4-GPU layouts of bench_grpo_e2e.py: which GPUs, processes and servers each
mode uses, what the learner is told, and the figures every run gets (tokens/s, MFU, peak memory,
weight sync against bytes / measured NCCL bandwidth).

- ``colocated4``: ``--ranks`` (4) learner processes under ``accelerate launch`` with ZeRO-3,
  each with its own embedded vLLM server on its own GPU (``[rollout.embedded] per_rank``),
  asleep while the learner trains (``rollout.sleep_while_training``), synced from that rank's
  buffers over CUDA IPC (``--colocated-sync``): TRL's ``vllm_mode="colocate"`` layout.
- ``split4``: learners on GPUs 0..L-1 (``--split4-learners``, 2; ZeRO-3) and rollout servers
  on the next ``--split4-server-gpus`` (2) GPUs: one server per GPU, or with ``--split4-tp 2``
  one tensor-parallel server across them; NCCL sync; synchronous.
- ``overlap4``: ``split4`` with ``rollout.max_staleness = --overlap-max-staleness`` (1).
- ``verl``: veRL's GRPO, where it is installed; where not, a failed run saying so.

On CPU (``--engine transformers``) the same plumbing runs with a tiny model: ``colocated4`` on
``--ranks`` gloo processes with http sync, ``split4``/``overlap4`` with one learner process and
two CPU servers; numbers from it mean nothing. Only the pieces are here; the processes are
started by bench_grpo_e2e.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_common import BenchError, figures
from gpu_common import MODEL_SHAPES, ROOT, gpu_env, model_bytes, visible_gpus

LAYOUTS4 = ("colocated4", "split4", "overlap4")
SPLIT4 = ("split4", "overlap4")
BASELINES4 = ("verl",)  # other systems' runs on the same 4 GPUs


def add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-shape",
        choices=sorted(MODEL_SHAPES),
        help="the shape --model must have (checked against its config.json; recorded in the "
        "workload, so a baseline of another shape is not compared)",
    )
    p.add_argument("--ranks", type=int, default=4, help="colocated4: learner processes (GPUs)")
    p.add_argument("--split4-learners", type=int, default=2, help="split4: learner GPUs")
    p.add_argument("--split4-server-gpus", type=int, default=2, help="split4: server GPUs")
    p.add_argument(
        "--split4-tp",
        type=int,
        default=1,
        help="split4: --tensor-parallel-size of each server (1: a server per GPU; 2: one "
        "TP-2 server over two GPUs)",
    )
    p.add_argument(
        "--no-bandwidth",
        dest="bandwidth",
        action="store_false",
        help="skip measuring the NCCL bandwidth (GPU 0 -> GPU 1) the sync figures compare with",
    )


def learner_gpus(args: argparse.Namespace, mode: str) -> list[str]:
    if mode == "colocated4":
        return [str(i) for i in range(args.ranks)]
    if mode in SPLIT4:
        return [str(i) for i in range(args.split4_learners)]
    return ["0"]


def server_gpu_groups(args: argparse.Namespace, mode: str) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` of each rollout server the bench starts for ``mode`` (the
    colocated4 learners start their own)."""
    if mode not in SPLIT4:
        return []
    first, tp = args.split4_learners, args.split4_tp
    gpus = [str(first + i) for i in range(args.split4_server_gpus)]
    return [",".join(gpus[i : i + tp]) for i in range(0, len(gpus), tp)]


def layout(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """What ``mode`` occupies, recorded with its result (``gpus``: the MFU's denominator)."""
    learners = learner_gpus(args, mode)
    servers = server_gpu_groups(args, mode)
    used = {*learners, *(g for group in servers for g in group.split(","))}
    return {
        "learner_gpus": learners,
        "learner_processes": len(learners) if mode == "colocated4" or mode in SPLIT4 else 1,
        "server_gpus": servers if mode != "colocated4" else learners,
        "servers_started_by": "learner ranks" if mode == "colocated4" else "bench",
        "tensor_parallel": args.split4_tp if mode in SPLIT4 else 1,
        "gpus": len(used),
    }


def embedded_section(args: argparse.Namespace) -> dict[str, Any]:
    """``[rollout.embedded]`` of colocated4: a server per rank, on that rank's GPU."""
    cpu = args.engine == "transformers"
    extra = ["--max-model-len", str(args.max_model_len)]
    if not cpu:
        extra += ["--gpu-memory-utilization", str(args.colocated_gpu_mem), "--enable-sleep-mode"]
    return {
        "engine": args.engine,
        "dtype": "float32" if cpu else "bfloat16",
        "per_rank": True,
        "startup_timeout_s": args.server_timeout,
        "extra_args": extra,
    }


def learner_head(args: argparse.Namespace, mode: str, port: int) -> list[str]:
    """The launcher of ``mode``'s learner processes: ZeRO-3 over its GPUs on the GPU machine;
    on CPU gloo processes for colocated4 and one plain process for split4."""
    n = len(learner_gpus(args, mode))
    if args.engine == "transformers":
        if mode != "colocated4":
            return [sys.executable, "-m", "learner"]
        return [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", str(n), "--num_machines", "1", "--main_process_port", str(port),
            "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "learner",
        ]  # fmt: skip
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "deploy/accelerate/zero3.yaml"),
        "--num_processes", str(n), "--main_process_port", str(port), "-m", "learner",
    ]  # fmt: skip


def check_layouts(args: argparse.Namespace, modes: list[str], gpus: int | None) -> None:
    """Refuse, before anything starts, a 4-GPU layout this machine or these flags cannot run
    (``gpus`` None: the CPU run)."""
    if args.model_shape and (why := shape_mismatch_of(args)):
        raise BenchError(why)
    if not set(LAYOUTS4) & set(modes):
        return
    if gpus is None:
        if "colocated4" in modes and args.colocated_sync != "http":
            raise BenchError(
                "--engine transformers (CPU) colocated4 syncs each rank's server over http: "
                "--colocated-sync http"
            )
        if set(SPLIT4) & set(modes) and args.split4_tp != 1:
            raise BenchError("--split4-tp > 1 needs vLLM (tensor parallel) on GPUs")
        return
    if args.split4_server_gpus % args.split4_tp:
        raise BenchError(f"--split4-tp {args.split4_tp} must divide --split4-server-gpus")
    for mode in set(LAYOUTS4) & set(modes):
        need = layout(args, mode)["gpus"]
        if need > gpus:
            raise BenchError(f"{mode} needs {need} GPUs, {gpus} visible: the 4-GPU machine")


def shape_mismatch_of(args: argparse.Namespace) -> str:
    from gpu_common import shape_mismatch

    return shape_mismatch(args.model, args.model_shape)


# -- figures -----------------------------------------------------------------------------------


def bandwidth_probe_gpus(gpus: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` of the NCCL bandwidth probe: the first two of the GPUs this
    process sees (``gpus`` of them; the probe is GPU 0 and its peer GPU 1). Fewer than two is
    a ``BenchError`` naming what is visible."""
    if gpus < 2:
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise BenchError(
            f"the NCCL bandwidth probe needs 2 GPUs, {gpus} visible"
            + (f" (CUDA_VISIBLE_DEVICES={seen!r})" if seen is not None else "")
            + ": run it on a machine with two, or pass --no-bandwidth"
        )
    try:
        return visible_gpus("0,1")
    except ValueError as e:
        raise BenchError(f"the NCCL bandwidth probe needs 2 GPUs: {e}") from None


def measure_nccl_bandwidth(gpus: int, timeout_s: float = 180.0) -> dict[str, Any]:
    """bench_rollout_gpu.py's NCCL broadcast bandwidth, GPU 0 -> GPU 1 (1 GiB x 10), in a
    process of its own that sees both GPUs (``gpus``: how many this process sees): this one
    holds no CUDA context while the learners run. An error record when it cannot run."""
    code = (
        "import json, sys; sys.path.insert(0, 'bench'); import bench_rollout_gpu as b; "
        "print('BANDWIDTH', json.dumps(b.measure_bandwidth()))"
    )
    try:
        env = {**gpu_env(), "CUDA_VISIBLE_DEVICES": bandwidth_probe_gpus(gpus)}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
            timeout=timeout_s,
        )  # fmt: skip
    except BenchError as e:
        return {"status": "error", "error": str(e)}
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"no result in {timeout_s:.0f} s"}
    for line in out.stdout.splitlines():
        if line.startswith("BANDWIDTH "):
            return {"status": "ok", **json.loads(line.removeprefix("BANDWIDTH "))}
    return {"status": "error", "error": f"rc {out.returncode}: {out.stderr[-1500:]}"}


def flops_per_token_of(model: str | Path) -> Any:
    """``learner.run.perf.train_flops_per_token`` for ``model``'s architecture, or None where its
    config.json lacks the sizes."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not {"hidden_size", "num_hidden_layers", "intermediate_size"} <= config.keys():
        return None
    from learner.run.perf import train_flops_per_token

    cfg = SimpleNamespace(**config)
    return lambda seq_len: train_flops_per_token(cfg, seq_len)


def peak_tflops_of(gpu_names: list[str]) -> float | None:
    """The dense bf16 peak the learner reports MFU against, for the first GPU's name."""
    if not gpu_names:
        return None
    from learner.run.perf import PEAK_TFLOPS

    return next((v for k, v in PEAK_TFLOPS.items() if k in gpu_names[0]), None)


def attach_figures(
    results: dict[str, Any], runs: dict[str, Any], model: str, completions: int
) -> None:
    """``figures`` of every run in ``runs`` (ours: its layout's GPUs; TRL: its processes), all
    against the one bandwidth measured in this run; ``completions``: sequences per step."""
    fpt = flops_per_token_of(model)
    peak = peak_tflops_of((results.get("workload") or {}).get("gpus") or [])
    bw = results.get("bandwidth") or {}
    size = model_bytes(model) or None
    for run in runs.values():
        if not isinstance(run, dict):
            continue
        gpus = (run.get("layout") or {}).get("gpus") or run.get("world_size") or 1
        run["figures"] = figures(
            run, gpus=gpus, completions=completions, flops_per_token=fpt, peak_tflops=peak,
            sync_bytes=size, nccl_gb_per_s=bw.get("gb_per_s"),
        )  # fmt: skip


# -- other systems on the same GPUs --------------------------------------------------------------


def verl_run() -> dict[str, Any]:
    """veRL's GRPO on the same GPUs and workload: only where ``verl`` and ``ray`` import; a
    missing baseline is a failed run, never an ok one."""
    missing = [m for m in ("verl", "ray") if importlib.util.find_spec(m) is None]
    if missing:
        where = os.environ.get("PYTHONPATH") or "(no PYTHONPATH)"
        return {
            "status": "error",
            "error": f"verl not installed: no module {', '.join(missing)} importable (PYTHONPATH "
            f"{where}): pip install verl ray",
        }
    return {
        "status": "error",
        "error": "verl imports, but bench_grpo_e2e.py has no veRL GRPO runner for this workload",
    }
