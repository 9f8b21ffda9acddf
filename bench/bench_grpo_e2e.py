"""End-to-end GRPO steps of this project on GPUs, with the per-phase time breakdown.

    python bench/bench_grpo_e2e.py --model DIR --out e2e.json [--trl-json trl.json]
        [--modes colocated,split,overlap] [--steps-colocated 8] [--steps-split 20] [--warmup 2]
    python bench/bench_grpo_e2e.py --model DIR --model-shape qwen3-4b --out e2e4.json
        --modes colocated4 [--trl-json trl4.json] | --modes split4,overlap4 | --modes verl

Workload (the same as bench_trl_grpo.py's): random-weight Qwen3-0.6B shape, bf16,
16 chat prompts x 8 samples x up to 256 completion tokens per optimizer step, the built-in
``length`` reward (characters, target 64). The learner has no ignore-EOS option, so lengths
are not forced; a random-weight model over a 151,936-token vocabulary almost never samples
EOS, and the mean completion length is reported to show it.

Modes, each a real rollout server process and a real learner process:
- ``colocated`` (one GPU): ``rollout-server --engine vllm`` on GPU 0 with sleep mode and a
  modest ``--gpu-memory-utilization``, started first; then ``python -m learner`` on the same
  GPU with ``rollout.sleep_while_training`` (the server sleeps while the learner trains) and
  weight sync over ``ipc`` (CUDA IPC handles to the learner's packed buckets; the default),
  ``file`` (a safetensors file in /dev/shm) or ``http``: NCCL cannot join two ranks on one GPU.
- ``split`` (two GPUs): the server on GPU 1, the learner on GPU 0 under
  ``accelerate launch --config_file deploy/accelerate/zero3.yaml --num_processes 1`` with
  ``rollout.sync = "nccl"``; both start at once (the learner waits for the server). Synchronous
  by default, like the colocated run and TRL; ``--split-max-staleness 1`` lets the learner
  generate the next batch while it trains (then ``wait_generate`` is the exposed part only).
- ``overlap`` (two GPUs): ``split`` with ``rollout.max_staleness`` = ``--overlap-max-staleness``
  (1): generation of step k+1 runs while step k trains; compared with ``split`` in the verdicts.
- ``colocated4``, ``split4``, ``overlap4`` (four GPUs) and ``verl``: e2e_layouts.py.

Every run also gets its figures (e2e_common.figures): tokens/s, MFU, every GPU's peak memory
(sampled with nvidia-smi) and the weight sync against model bytes / the NCCL bandwidth measured
at the start (``--no-bandwidth`` skips it).

Every step's metrics come from the learner's own ``metrics.jsonl``; the first ``--warmup``
steps are dropped and medians taken over the rest. Once the last step is logged the servers'
weight digest is read, the learner saves its last checkpoint and final model (not part of the
step times), and the two are compared (weights_check.py): a server that does not serve the
learner's final weights makes the run not valid. So does a process holding one of the GPUs
before the run or after it (gpu_holders.py: nvidia-smi per PID, recorded in the result).
Logs, configs and metrics go to ``--log-dir``. Every process started here carries the mode's
run marker in its environment and is ended with all it started, in whatever session
(proc_tree.py), before its run directory is removed: on success, failure, timeout or SIGTERM.

Exit code: 0 when every run is valid and every verdict holds; 3 when the measurement is valid
but a verdict fails (a target not met); 1 when it is not valid (a run failed, a baseline is
missing or from another run, a weight or GPU-holder check failed); 2 when it cannot start.
With ``--engine transformers`` the same plumbing runs on CPU with a tiny model (the CPU test
uses it); numbers from it mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_holders
from e2e_common import (
    REWARD_TARGET_CHARS,
    BenchError,
    add_workload_args,
    figures_table,
    prompt_rows,
    read_json,
    run_identity,
    run_problems,
    summarize_learner,
    table,
    toml_text,
    verdict_lines,
    verdicts,
    verdicts4,
    workload,
    write_jsonl,
)
from e2e_layouts import (
    BASELINES4,
    LAYOUTS4,
    SPLIT4,
    add_layout_args,
    attach_figures,
    check_layouts,
    embedded_section,
    layout,
    learner_gpus,
    learner_head,
    measure_nccl_bandwidth,
    server_gpu_groups,
    verl_run,
)
from e2e_procs import (
    end_mode,
    gpu_names,
    ram_dir,
    start_process,
    start_servers,
    tail,
    wait_for_steps,
)
from gpu_common import API_KEY, ROOT, GpuMemoryPeak, ServerProcess, gpu_env
from host_probe import host_facts
from proc_tree import MARK_ENV, mark
from weights_check import learner_final_check, read_served, served_by_ranks

from grpo_common.net import free_port

MODES = ("colocated", "split", "overlap", *LAYOUTS4, *BASELINES4)
EXIT_TARGET_MISSED = 3  # measured completely, but a verdict fails (1: not a valid measurement)
SPLIT_LIKE = ("split", "overlap", *SPLIT4)  # servers on GPUs of their own, NCCL
COLOCATED = ("colocated", "colocated4")  # servers asleep on the learners' GPUs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_grpo_e2e.py",
        description="End-to-end GRPO steps (rollout server + learner), colocated and split.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="model directory (Qwen3-0.6B shape on GPU)")
    p.add_argument("--out", type=Path, required=True, help="result JSON")
    p.add_argument("--modes", default="colocated,split", help="comma-separated: " + ",".join(MODES))
    p.add_argument("--trl-json", type=Path, help="bench_trl_grpo.py's result, for the verdicts")
    p.add_argument("--log-dir", type=Path, help="logs, configs, metrics (default: next to --out)")
    p.add_argument("--work-dir", type=Path, help="run directories (default: a temp dir)")
    p.add_argument("--keep-run-dirs", action="store_true", help="keep checkpoints and models")
    p.add_argument("--engine", choices=["vllm", "transformers"], default="vllm")
    p.add_argument("--steps-colocated", type=int, default=8)
    p.add_argument("--steps-split", type=int, default=20)
    add_workload_args(p)
    add_layout_args(p)
    p.add_argument("--micro-batch-size", type=int, default=32, help="grpo.micro_batch_size")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--colocated-gpu-mem", type=float, default=0.3, help="server, colocated")
    p.add_argument("--split-gpu-mem", type=float, default=0.5, help="server, split (own GPU)")
    p.add_argument("--sleep-level", type=int, choices=[1, 2], default=1, help="colocated")
    p.add_argument("--colocated-sync", choices=["ipc", "file", "http"], default="ipc")
    p.add_argument("--split-sync", choices=["nccl", "http", "file"], default="nccl")
    p.add_argument(
        "--split-max-staleness",
        type=int,
        default=0,
        help="split: rollout.max_staleness (1 = generate the next batch while training)",
    )
    p.add_argument(
        "--overlap-max-staleness", type=int, default=1, help="overlap: rollout.max_staleness"
    )
    p.add_argument("--colocated-launcher", choices=["python", "zero3"], default="python")
    p.add_argument("--split-launcher", choices=["python", "zero3"], default="zero3")
    p.add_argument(
        "--bucket-mb", type=int, default=1024, help="rollout.sync.bucket_mb (not for file)"
    )
    p.add_argument(
        "--learner-set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="extra learner override for every mode (repeatable)",
    )
    p.add_argument("--server-args", default="", help="extra rollout-server flags (one string)")
    p.add_argument("--server-timeout", type=float, default=240.0, help="s until /ready")
    p.add_argument(
        "--no-prepare-sync",
        dest="prepare_sync",
        action="store_false",
        help="nccl: rollout.sync.prepare = false (announce each sync with its send; to time "
        "what preparing during training costs or saves)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=240.0,
        help="s per mode, from the server's /ready to the last step (a cold vLLM compile "
        "cache can take ~100 s of --server-timeout, not of this; colocated4: from the start, "
        "its learner ranks start their servers)",
    )
    p.add_argument(
        "--finish-timeout",
        type=float,
        default=240.0,
        help="s the learner has after its last step to save its checkpoint and final model, "
        "whose weights are compared with the servers' (and as long again for their digest)",
    )
    return p


# -- what each mode runs (pure) ------------------------------------------------------------


def sync_section(args: argparse.Namespace, transport: str, sync_dir: Path) -> dict[str, Any]:
    """[rollout.sync] for ``transport``: the shared directory for file, the bucket size for
    the others, and whether NCCL prepares each sync while the learner trains."""
    if transport == "file":
        return {"type": "file", "dir": str(sync_dir)}
    section: dict[str, Any] = {"type": transport, "bucket_mb": args.bucket_mb}
    if transport == "nccl":
        section["prepare"] = args.prepare_sync
    return section


def learner_config(
    args: argparse.Namespace,
    mode: str,
    url: str | list[str],
    run_dir: Path,
    data: Path,
    sync_dir: Path,
) -> dict[str, Any]:
    """The learner's TOML config for ``mode`` as a dict (written next to the logs); ``url``: the
    server or servers the bench started (none for colocated4: every rank starts its own)."""
    cpu = args.engine == "transformers"
    transport = args.colocated_sync if mode in COLOCATED else args.split_sync
    steps = args.steps_colocated if mode in COLOCATED else args.steps_split
    urls = [url] if isinstance(url, str) else url
    return {
        "model": {
            "name_or_path": str(args.model),
            "dtype": "float32" if cpu else "bfloat16",
            "gradient_checkpointing": args.gradient_checkpointing,
        },
        "data": {"path": str(data), "seed": 0},
        "rollout": {
            "servers": urls,
            "sync": sync_section(args, transport, sync_dir),
            "ready_timeout_s": args.server_timeout,
            "sleep_while_training": args.sleep_level if mode in COLOCATED else None,
            "max_staleness": {
                "split": args.split_max_staleness,
                "split4": args.split_max_staleness,
            }.get(mode, args.overlap_max_staleness if mode in ("overlap", "overlap4") else 0),
            **({"embedded": embedded_section(args)} if mode == "colocated4" else {}),
        },
        "sampling": {
            "num_generations": args.num_generations,
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
        },
        "rewards": [{"name": "length", "kwargs": {"target": REWARD_TARGET_CHARS, "unit": "chars"}}],
        "grpo": {
            "prompts_per_step": args.prompts_per_step,
            "micro_batch_size": args.micro_batch_size,
        },
        "optim": {"lr": 1e-6},
        "run": {
            "steps": steps,
            "run_dir": str(run_dir),
            "checkpoint_every": 1_000_000,  # only the final one, which the bench cuts short
            "tensorboard": False,
            "progress_bar": False,
        },
    }


def learner_argv(args: argparse.Namespace, mode: str, config: Path) -> list[str]:
    tail = [f"--set={o}" for o in args.learner_set]
    if mode in LAYOUTS4:
        return [*learner_head(args, mode, free_port()), "--config", str(config), *tail]
    launcher = args.colocated_launcher if mode == "colocated" else args.split_launcher
    if args.engine == "transformers":
        launcher = "python"  # the CPU smoke run: no DeepSpeed
    head = [sys.executable, "-m", "learner"]
    if launcher == "zero3":
        head = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(ROOT / "deploy/accelerate/zero3.yaml"),
            "--num_processes", "1", "--main_process_port", str(free_port()),
            "-m", "learner",
        ]  # fmt: skip
    return [*head, "--config", str(config), *tail]


def server_specs(args: argparse.Namespace, mode: str) -> list[dict[str, Any]]:
    """``ServerProcess`` keyword arguments of every server the bench starts for ``mode``."""
    if mode == "colocated4":
        return []  # every learner rank starts its own
    if mode not in SPLIT4:
        return [server_options(args, mode)]
    specs = []
    for gpus in server_gpu_groups(args, mode):
        opts = server_options(args, "split")
        opts["gpu"] = gpus
        if args.split4_tp > 1:
            opts["extra_args"] += ["--tensor-parallel-size", str(args.split4_tp)]
        specs.append(opts)
    return specs


def server_options(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """``ServerProcess`` keyword arguments: GPU, memory share and flags of this mode's server."""
    extra = ["--dtype", "bfloat16"]
    if mode == "colocated":
        extra.append("--enable-sleep-mode")
    if args.engine == "transformers":  # argparse keeps the last --engine / --dtype given
        extra = ["--engine", "transformers", "--dtype", "float32", "--device", "cpu"]
    extra += shlex.split(args.server_args)
    return {
        "gpu": "0" if mode == "colocated" else "1",  # split and overlap: the server on GPU 1
        "gpu_memory_utilization": args.colocated_gpu_mem
        if mode == "colocated"
        else args.split_gpu_mem,
        "max_model_len": args.max_model_len,
        "extra_args": extra,
    }


def run_mode(args: argparse.Namespace, mode: str, work: Path, logs: Path) -> dict[str, Any]:
    if mode == "verl":
        return {"mode": mode, **verl_run()}
    from learner.run.metrics import read_metrics

    t_start = time.monotonic()
    run_dir, mode_logs = work / mode, logs / mode
    mode_logs.mkdir(parents=True, exist_ok=True)
    sync_dir = Path(tempfile.mkdtemp(prefix=f"grpo-e2e-{mode}-", dir=ram_dir(4 << 30)))
    data = write_jsonl(prompt_rows(512), work / "prompts.jsonl")
    # every process of this mode carries this marker, whatever session it starts
    tag = mark(dict(os.environ), f"{args.run_tag}-{mode}")[MARK_ENV]
    servers = []
    for i, opts in enumerate(server_specs(args, mode)):
        opts["extra_args"] += ["--weights-dir", str(sync_dir)]  # where file sync writes
        log = mode_logs / ("server.log" if i == 0 else f"server{i}.log")
        servers.append(ServerProcess(args.model, log_path=log, env={MARK_ENV: tag}, **opts))
    config = learner_config(args, mode, [s.url for s in servers], run_dir, data, sync_dir)
    config_path = mode_logs / "learner.toml"
    config_path.write_text(toml_text(config))
    learner_log = mode_logs / "learner.log"
    argv = learner_argv(args, mode, config_path)
    gpus = None if args.engine == "transformers" else ",".join(learner_gpus(args, mode))
    env = gpu_env(gpus, ROLLOUT_API_KEY=API_KEY, TOKENIZERS_PARALLELISM="false", **{MARK_ENV: tag})
    result: dict[str, Any] = {
        "mode": mode,
        "learner_argv": argv,
        "server_argv": servers[0].argv if servers else None,
        "server_argvs": [s.argv for s in servers],
        "server_gpu": servers[0].gpu if servers else None,
        "learner_gpu": gpus or "cpu",
        "layout": layout(args, mode),
        "config": config,
        "processes_marked": tag,
    }
    learner: subprocess.Popen | None = None
    steps = config["run"]["steps"]
    memory = GpuMemoryPeak()
    holders_before = gpu_holders.snapshot()
    try:
        with memory:
            if mode == "colocated":  # vLLM sizes its memory share from what is free at start
                start_servers(servers, args.server_timeout)
                result["server_ready_s"] = time.monotonic() - t_start
                learner = start_process(argv, env, learner_log)
            else:  # separate GPUs, or servers the learner ranks start: load all at once
                learner = start_process(argv, env, learner_log)
                start_servers(servers, args.server_timeout)
                result["server_ready_s"] = time.monotonic() - t_start
            # the servers' start has its own limit (colocated4's servers start inside it)
            deadline = time.monotonic() + args.timeout
            result["learner_cut_short"] = wait_for_steps(learner, servers, run_dir, steps, deadline)
            # the last step's weights are on the servers now: read them before they stop
            if servers:
                served = read_served([(s.url, API_KEY) for s in servers])
            else:  # colocated4: each rank records its own server's right before it stops it
                ranks = result["layout"]["learner_processes"]
                served = served_by_ranks(run_dir, ranks, learner, args.finish_timeout)
        result["wall_s"] = time.monotonic() - t_start
        records = read_metrics(run_dir)
        result["step_seconds"] = [r.get("time/step") for r in records]
        result["summary"] = summarize_learner(records, args.warmup)
        result["status"] = "ok"
        result["weights"] = learner_final_check(
            learner, served, run_dir / "final", cpu=args.engine == "transformers",
            timeout_s=args.finish_timeout,
        )  # fmt: skip
    except (BenchError, RuntimeError, TimeoutError, ValueError, KeyboardInterrupt) as e:
        result.update(status="error", error=f"{type(e).__name__}: {e}")
        result["learner_log_tail"] = tail(learner_log)
        result["server_log_tail"] = "\n".join(s.tail(40) for s in servers)
        print(
            f"== {mode}: {result['error']}\n-- learner log ({learner_log}):\n"
            f"{result['learner_log_tail']}\n-- server logs:\n{result['server_log_tail']}",
            file=sys.stderr,
        )
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        result["gpu_peak_mib"] = memory.peak_mib
        # every process of the mode, in any session, is gone before its run directory goes
        result["processes_ended"] = end_mode(
            tag, [learner, *(s.proc for s in servers)], grace_s=10.0
        )
        for server in servers:
            server.stop()  # closes its HTTP client; its processes are already gone
        result["gpu_holders"] = gpu_holders.record(
            holders_before, gpu_holders.snapshot(), on_gpus=args.engine == "vllm"
        )
        keep = ["metrics.jsonl", "config.json", "rank_checksums.json"]
        keep += [f.name for f in run_dir.glob("rollout_server.rank*.log")]  # colocated4
        keep += [f.name for f in run_dir.glob("served_checksum.rank*.json")]
        for name in keep:
            with contextlib.suppress(OSError):
                shutil.copy(run_dir / name, mode_logs / name)
        for table in sorted((run_dir / "profile").glob("*.txt")):  # --learner-set
            shutil.copy(table, mode_logs / f"profile_{table.name}")  # run.profile_steps=[N]
        shutil.rmtree(sync_dir, ignore_errors=True)
        if not args.keep_run_dirs:
            shutil.rmtree(run_dir, ignore_errors=True)
    return result


# -- checks and main -------------------------------------------------------------------------


def check_environment(args: argparse.Namespace, modes: list[str]) -> None:
    """Fail before starting anything, with what to do about it."""
    if not (Path(args.model) / "config.json").is_file():
        build = (
            f"python3 bench/gpu_common.py build-model --shape {args.model_shape} DIR"
            if args.model_shape
            else "python -m rollout_server.tiny DIR --qwen3-0.6b-shape"
        )
        raise BenchError(f"--model {args.model} has no config.json: write one with `{build}`")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise BenchError(f"--modes: unknown {bad}; choose from {list(MODES)}")
    if args.engine == "transformers":
        if args.split_sync == "nccl" and set(SPLIT_LIKE) & set(modes):
            raise BenchError("--engine transformers (CPU) cannot sync over NCCL: --split-sync http")
        if args.colocated_sync == "ipc" and "colocated" in modes:
            raise BenchError(
                "--engine transformers (CPU) cannot sync over CUDA IPC: --colocated-sync file"
            )
        check_layouts(args, modes, None)
        return
    from gpu_common import gpu_count

    gpus = gpu_count()
    if gpus == 0:
        raise BenchError(
            "no CUDA GPU visible: run this on the GPU machine (or --engine "
            "transformers for a CPU smoke run)"
        )
    check_layouts(args, modes, gpus)
    if set(SPLIT_LIKE) & set(modes) and gpus < 2:
        raise BenchError(
            f"modes split/overlap need 2 GPUs (server on GPU 1, learner on GPU 0); "
            f"{gpus} visible: use --modes colocated or the 2-GPU machine"
        )
    if importlib.util.find_spec("vllm") is None:
        raise BenchError(
            'vLLM is not importable: pip install -e ".[vllm,deepspeed]" (bench/gpu_suite.sh\'s '
            "setup step names what is missing)"
        )
    zero3 = args.split_launcher == "zero3" and bool(set(SPLIT_LIKE) & set(modes))
    zero3 |= args.colocated_launcher == "zero3" and "colocated" in modes
    zero3 |= bool(set(LAYOUTS4) & set(modes))  # always ZeRO-3 over their learner GPUs
    if zero3 and importlib.util.find_spec("deepspeed") is None:
        raise BenchError(
            'the zero3 launcher needs DeepSpeed: pip install -e ".[deepspeed]", or '
            "--split-launcher python"
        )


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def write_results(
    args: argparse.Namespace, results: dict[str, Any], pending: list[str]
) -> dict[str, Any]:
    """Verdicts over the runs so far, and the whole of ``results`` written to ``--out``
    (``pending``: the modes not run yet, listed in the file while there are any)."""
    runs = {k: results.get(k) for k in ("trl", *MODES)}
    ours = workload(args.prompts_per_step, args.num_generations, args.max_tokens, args.model_shape)
    trl = results["trl"] or {}
    trl_workload = trl.get("workload")
    same_run = trl.get("status") != "ok" or trl.get("run") == results["run"]
    if trl_workload is not None and trl_workload != ours:
        results["trl_note"] = f"TRL ran {trl_workload}, ours {ours}: not compared"
    elif not same_run:
        results["trl_note"] = (
            f"TRL ran on {trl.get('run')}, ours on {results['run']}: another host or suite "
            "run, not compared"
        )
    attach_figures(results, runs, str(args.model), args.prompts_per_step * args.num_generations)
    four = bool(set(LAYOUTS4) & set(args.modes.split(",")))  # the 4-GPU checks instead
    if args.engine == "vllm":
        given = {k: v for k, v in runs.items() if v is not None} if four else runs
        results["verdicts"] = (verdicts4 if four else verdicts)(
            given, same_workload=trl_workload in (None, ours), same_run=same_run
        )
    else:
        results["verdicts"] = []
        results["note"] = "CPU smoke run (--engine transformers): the numbers mean nothing"
    if pending:
        results["pending_modes"] = pending
    else:
        results.pop("pending_modes", None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2))
    tmp.replace(args.out)  # never a half-written file, even if killed mid-write
    return runs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        check_environment(args, modes)
    except BenchError as e:
        print(f"bench_grpo_e2e: error: {e}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # `timeout` -> clean up
    try:
        return _run_modes(args, modes)
    finally:
        signal.signal(signal.SIGTERM, previous)  # called in-process (tests): put it back


def _run_modes(args: argparse.Namespace, modes: list[str]) -> int:
    logs = args.log_dir or args.out.parent / "e2e_logs"
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="grpo-e2e-"))
    args.run_tag = f"bench-e2e-{os.getpid()}-{int(time.time())}"  # its processes' marker
    results: dict[str, Any] = {
        "run": run_identity(),  # the TRL result must carry the same to be compared
        "trl": read_json(args.trl_json) if args.trl_json else None,
        "workload": {
            **workload(
                args.prompts_per_step, args.num_generations, args.max_tokens, args.model_shape
            ),
            "model": str(args.model),
            "engine": args.engine,
            "forced_lengths": False,  # the learner has no ignore_eos option
            "warmup_steps_dropped": args.warmup,
            "gpus": gpu_names(),
            "host": host_facts(),  # CPU and launch speeds: hosts of one GPU kind differ
        },
    }
    if args.engine == "vllm" and args.bandwidth and set(SPLIT_LIKE + COLOCATED) & set(modes):
        print("== NCCL bandwidth GPU 0 -> GPU 1 (the sync figures' bound)", flush=True)
        from gpu_common import gpu_count

        results["bandwidth"] = measure_nccl_bandwidth(gpu_count())
    else:
        results["bandwidth"] = {"status": "skipped", "why": "CPU run or --no-bandwidth"}
    try:
        for i, mode in enumerate(modes):
            # what is done so far is on disk before each mode starts: a run killed outright
            # (SIGKILL, the machine's call limit) keeps the modes it finished
            write_results(args, results, pending=modes[i:])
            print(f"== {mode}: starting (limit {args.timeout:.0f} s)", flush=True)
            results[mode] = run_mode(args, mode, work, logs)
            print(f"== {mode}: {results[mode]['status']}", flush=True)
    except KeyboardInterrupt as e:
        results["interrupted"] = str(e)
    finally:
        if args.work_dir is None and not args.keep_run_dirs:
            shutil.rmtree(work, ignore_errors=True)
    runs = write_results(args, results, pending=[])
    print(table(runs))
    print(figures_table(runs))
    print(verdict_lines(results["verdicts"]))
    for key in ("trl_note", "note"):
        if key in results:
            print(results[key])
    print(f"results: {args.out}; logs: {logs}")
    invalid = [f"{m}: {why}" for m in modes for why in run_problems(results.get(m))]
    # a baseline named (--trl-json) that did not run, or ran elsewhere, fails the comparison
    if results["trl"] is not None and (
        results["trl"].get("status") != "ok" or "trl_note" in results
    ):
        invalid.append(f"trl: {results.get('trl_note') or results['trl'].get('error')}")
    if invalid or "interrupted" in results:
        print("not valid:\n  " + "\n  ".join(invalid or [str(results.get("interrupted"))]))
        return 1
    missed = [v["check"] for v in results["verdicts"] if v["ok"] is False]  # None: n/a here
    if missed:
        print(f"valid, but {len(missed)} target(s) not met: {'; '.join(missed)}")
        return EXIT_TARGET_MISSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
