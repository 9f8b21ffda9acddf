"""Shared by the end-to-end GRPO benchmarks (bench_grpo_e2e.py: ours; bench_trl_grpo.py: TRL).

Pure helpers, no torch: the workload both sides run (synthetic chat prompts, the reward), the
medians that become the reported numbers, the comparison verdicts and the printed table. Kept
apart from the process plumbing so a CPU test can check the arithmetic on hand-made metrics.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

# The workload: random-weight Qwen3-0.6B shape, bf16, 16 prompts x 8 samples x
# 256 completion tokens per optimizer step. The reference figure is TRL 1.16's median on an H200.
PROMPTS_PER_STEP = 16
NUM_GENERATIONS = 8
MAX_TOKENS = 256
MAX_MODEL_LEN = 1024  # prompts are ~120 tokens: room for 256 more, same for both sides
REWARD_TARGET_CHARS = 64
TRL_REFERENCE_S = 3.88  # TRL 1.16 GRPOTrainer + colocated vLLM, H200, measured; 3.99 with Liger
DESIGN_TARGET_COLOCATED_S = 2.6  # the colocated step this workload aims at (one GPU)

# Phase timings of one learner step (metrics.jsonl keys, learner/trainer.py and rollouts.py).
# wait_generate = what the training thread waited for generate + score + advantages.
PHASES = ("time/wait_generate", "time/generate", "time/score", "time/train", "time/sync")
# the learner's split of its train phase (GPU timeline on CUDA): learner/train_step.PhaseClock
TRAIN_PHASES = ("prepare", "forward", "backward", "optimizer")

_TOPICS = ("a lighthouse", "a robot", "the sea", "a mountain", "a library", "a garden", "a comet")
_VERBS = ("describe", "explain", "write a poem about", "tell a story about", "list facts about")


class BenchError(RuntimeError):
    """A benchmark run failed; the message says which phase and carries the log tails."""


def prompt_rows(n: int) -> list[dict[str, Any]]:
    """``n`` distinct chat prompts (~90-120 tokens with the template, byte-level tokenizer).

    Chat messages, so both sides apply the same chat template; a random-weight model answers
    anything with the same cost, so the text only has to be realistic in length."""
    rows = []
    for i in range(n):
        verb, topic = _VERBS[i % len(_VERBS)], _TOPICS[(i // len(_VERBS)) % len(_TOPICS)]
        text = f"Prompt {i}: please {verb} {topic}, in plain words, in about fifty words."
        rows.append({"prompt": [{"role": "user", "content": text}]})
    return rows


def write_jsonl(rows: Iterable[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def toml_value(v: Any) -> str:
    """A TOML value: strings, numbers, booleans, lists and inline tables (JSON's escapes are
    valid TOML basic-string escapes)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def toml_text(config: dict[str, Any]) -> str:
    """``{section: {field: value}}`` as TOML; a list of dicts becomes an array of tables."""
    out: list[str] = []
    for section, body in config.items():
        if isinstance(body, list):
            for item in body:
                out.append(f"[[{section}]]")
                out += [f"{k} = {toml_value(v)}" for k, v in item.items()]
        else:
            out.append(f"[{section}]")
            out += [f"{k} = {toml_value(v)}" for k, v in body.items() if v is not None]
        out.append("")
    return "\n".join(out)


def completion_text(completion: Any) -> str:
    """TRL hands conversational completions as ``[{"role": "assistant", "content": ...}]``."""
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion)
    return str(completion)


def seconds_stats(xs: Sequence[float]) -> dict[str, float]:
    if not xs:
        raise ValueError("no measured steps: run more steps than --warmup")
    return {
        "median": statistics.median(xs),
        "mean": statistics.fmean(xs),
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def median_of(records: Sequence[dict[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the records that have it, None if none does."""
    values = [float(r[key]) for r in records if key in r]
    return statistics.median(values) if values else None


def _mean_of(records: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in records if key in r]
    return statistics.fmean(values) if values else None


def summarize_learner(records: Sequence[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The reported numbers of one learner run, from its ``metrics.jsonl`` records (in step
    order). The first ``warmup`` steps (NCCL group set-up, kernel compilation, allocator growth)
    are left out; every figure is a median over the remaining steps.

    ``other`` is what a step spent outside the measured phases (sleep/wake calls, batch
    building, metric reduction); ``wall_interval`` is the wall-clock gap between consecutive
    metric records, i.e. the step including logging."""
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0")
    if len(records) <= warmup:
        raise ValueError(
            f"{len(records)} steps logged, {warmup} of them warm-up: nothing left to measure"
        )
    measured = list(records[warmup:])
    steps = [float(r["time/step"]) for r in measured]
    other = [
        float(r["time/step"])
        - sum(float(r.get(k, 0.0)) for k in ("time/wait_generate", "time/train", "time/sync"))
        for r in measured
    ]
    intervals = [
        float(records[i]["time"]) - float(records[i - 1]["time"])
        for i in range(max(warmup, 1), len(records))
        if "time" in records[i] and "time" in records[i - 1]
    ]
    phases = {k.removeprefix("time/"): median_of(measured, k) for k in PHASES}
    phases |= {f"train/{k}": median_of(measured, f"time/train/{k}") for k in TRAIN_PHASES}
    phases["other"] = statistics.median(other)
    gen_tokens = median_of(measured, "tokens/generated")
    step_median = statistics.median(steps)
    trained = median_of(measured, "tokens/trained")
    return {
        "steps_logged": len(records),
        "warmup": warmup,
        "step_s": seconds_stats(steps),
        "phase_median_s": {k: v for k, v in phases.items() if v is not None},
        "wall_interval_s": seconds_stats(intervals) if intervals else None,
        "completion_len_mean": _mean_of(measured, "completion/len_mean"),
        "completion_truncated_frac": _mean_of(measured, "completion/truncated_frac"),
        "tokens_generated_per_step": gen_tokens,
        "generated_tokens_per_step_s": gen_tokens / step_median if gen_tokens else None,
        "tokens_trained_per_step": trained,
        "gen_tokens_per_s": median_of(measured, "throughput/gen_tokens_per_s"),
        "train_tokens_per_s": median_of(measured, "throughput/train_tokens_per_s"),
        "mfu": median_of(measured, "mfu"),
        "reward_mean": _mean_of(measured, "reward/mean"),
        "staleness_mean": _mean_of(measured, "staleness"),
    }


def run_identity() -> dict[str, str | None]:
    """Which host (name and boot) and which GPU-suite run (``SUITE_RUN_ID``) made a result:
    ours and a baseline are compared only when theirs are equal (hosts of one GPU kind differ
    by a third in step time, docs/benchmarks.md)."""
    boot = None
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return {
        "host": socket.gethostname(),
        "boot_id": boot,
        "suite_run": os.environ.get("SUITE_RUN_ID"),
    }


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return {"status": "error", "error": f"cannot read {path}: {e}"}


def median_step(result: dict[str, Any] | None) -> float | None:
    """The headline number of a run's result (ours or TRL's), or None if it did not finish."""
    if not result or result.get("status") != "ok":
        return None
    return result["summary"]["step_s"]["median"]


def run_problems(run: dict[str, Any] | None) -> list[str]:
    """Why one of our runs is not a valid measurement: it did not finish, its servers' weights
    were not compared with the learner's final ones or differ, the GPU holders were not
    recorded, or a GPU was held by another process before the run or still after it (an
    orphan), or one of its processes outlived it."""
    if run is None:
        return ["never ran"]
    if run.get("status") != "ok":
        return [str(run.get("error") or "not ok")]
    out = []
    weights = run.get("weights")
    if weights is None:
        out.append("the served weights were not compared with the learner's")
    elif not weights.get("match"):
        out.append(str(weights.get("problem")))
    if "gpu_holders" not in run:
        out.append("no record of the GPUs' holders before and after the run")
    out += (run.get("gpu_holders") or {}).get("problems") or []
    left = (run.get("processes_ended") or {}).get("left")
    if left:
        out.append(f"processes still alive after the run: {left}")
    return out


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags every end-to-end benchmark takes (ours and TRL's: one workload)."""
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--prompts-per-step", type=int, default=PROMPTS_PER_STEP)
    p.add_argument("--num-generations", type=int, default=NUM_GENERATIONS)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)


def workload(
    prompts_per_step: int, num_generations: int, max_tokens: int, model_shape: str | None = None
) -> dict[str, Any]:
    """What one optimizer step does; both benchmarks record it, the TRL verdict needs a match
    (the model's shape too, where a run names one: ``--model-shape``)."""
    out: dict[str, Any] = {
        "prompts_per_step": prompts_per_step,
        "num_generations": num_generations,
        "max_tokens": max_tokens,
    }
    if model_shape is not None:
        out["model_shape"] = model_shape
    return out


def verdicts(
    results: dict[str, dict[str, Any] | None],
    *,
    same_workload: bool = True,
    same_run: bool = True,
) -> list[dict[str, Any]]:
    """The acceptance checks on ``{"trl": …, "colocated": …, "split": …, "overlap": …}``
    (overlap optional); the TRL comparison is only made when TRL ran the same workload
    (``same_workload``) on the same host in the same suite run (``same_run``)."""
    trl, colo, split, overlap = (
        median_step(results.get(k)) for k in ("trl", "colocated", "split", "overlap")
    )
    if not (same_workload and same_run):
        trl = None
    checks: list[dict[str, Any]] = []

    def add(check: str, measured: float | None, bound: float | None, what: str) -> None:
        ok = None if measured is None or bound is None else measured < bound
        checks.append(
            {"check": check, "measured_s": measured, "bound_s": bound, "vs": what, "ok": ok}
        )

    add("colocated faster than TRL (same GPU, this run)", colo, trl, "TRL median, this run")
    add("split faster than colocated", split, colo, "colocated median, this run")
    add("colocated faster than TRL reference", colo, TRL_REFERENCE_S, "3.88 s (TRL, H200)")
    add("colocated within design target", colo, DESIGN_TARGET_COLOCATED_S, "2.6 s (target)")
    if "overlap" in results:
        add("overlap faster than synchronous split", overlap, split, "split median, this run")
        # two GPUs must be faster still than one: its best 2-GPU mode
        add("overlap (2 GPUs) faster than colocated", overlap, colo, "colocated median, this run")
    return checks


# -- the 4-GPU layouts: efficiency figures and verdicts ---------------------------------------

#: what the figures of one run hold (each present, None where it cannot be had, e.g. on CPU)
FIGURE_KEYS = (
    "gpus", "step_s", "gen_tokens_per_s", "mfu_train", "mfu_step",
    "peak_gpu_mib", "peak_gpu_mib_max", "sync_s", "sync_bytes", "nccl_gb_per_s",
    "sync_bound_s", "sync_vs_bound",
)  # fmt: skip
SPEEDUP_VS_TRL = 1.5  # the target: ours (best layout) >= 1.5x TRL's colocated step
SYNC_BOUND_FACTOR = 2.0  # a full NCCL sync within 2x of bytes / measured bandwidth


def figures(
    run: dict[str, Any] | None,
    *,
    gpus: int,
    completions: int,
    flops_per_token: Callable[[float], float] | None,
    peak_tflops: float | None,
    sync_bytes: int | None,
    nccl_gb_per_s: float | None,
) -> dict[str, Any]:
    """One run's efficiency figures: generated tokens per second of the whole step (all ranks'),
    MFU of the whole step over every GPU of the layout, every GPU's peak memory, and the weight
    sync against ``sync_bytes`` / measured NCCL bandwidth.

    The step's model FLOPs are the learner's own where it logs ``mfu`` (the ranks' mean over
    their train phase, of prompt + completion tokens: learner/run/perf.py), so times its train
    seconds and learner processes; for a baseline, its trained tokens per step (prompt +
    completion) at ``flops_per_token`` of their mean length. ``mfu_train``: the learner's."""
    out: dict[str, Any] = dict.fromkeys(FIGURE_KEYS)
    out |= {"gpus": gpus, "sync_bytes": sync_bytes, "nccl_gb_per_s": nccl_gb_per_s}
    peak_mem = (run or {}).get("gpu_peak_mib") or {}
    out["peak_gpu_mib"] = peak_mem
    out["peak_gpu_mib_max"] = max(peak_mem.values()) if peak_mem else None
    step = median_step(run)
    if step is None or run is None:
        return out
    s = run["summary"]
    gen, trained = s.get("tokens_generated_per_step"), s.get("tokens_trained_per_step")
    phases = s.get("phase_median_s") or {}
    learners = (run.get("layout") or {}).get("learner_processes")
    out["step_s"] = step
    # the learner logs each rank's share (``tokens/generated``, a mean over its ranks)
    out["gen_tokens_per_s"] = gen * (learners or 1) / step if gen else None
    out["mfu_train"] = s.get("mfu")
    if s.get("mfu") is not None and phases.get("train") and learners:
        out["mfu_step"] = s["mfu"] * phases["train"] * learners / (step * gpus)
    elif trained and flops_per_token is not None and peak_tflops:
        flops = trained * flops_per_token(trained / completions)
        out["mfu_step"] = flops / step / (peak_tflops * 1e12 * gpus)
    out["sync_s"] = phases.get("sync")
    if sync_bytes and nccl_gb_per_s:
        out["sync_bound_s"] = sync_bytes / (nccl_gb_per_s * 1e9)
        if out["sync_s"] is not None:
            out["sync_vs_bound"] = out["sync_s"] / out["sync_bound_s"]
    return out


def verdicts4(
    results: dict[str, dict[str, Any] | None],
    *,
    same_workload: bool = True,
    same_run: bool = True,
) -> list[dict[str, Any]]:
    """The checks on the 4-GPU layouts (``colocated4``, ``split4``, ``overlap4``, with
    ``trl`` TRL's 4-GPU colocated run): the best of ours at least 1.5x faster than TRL in this
    run, the overlapped split faster than the synchronous one, and the synchronous split's sync
    phase within 2x of bytes / bandwidth. TRL is compared only from this run and workload."""
    trl = median_step(results.get("trl")) if same_workload and same_run else None
    ours = {k: median_step(results.get(k)) for k in ("colocated4", "split4", "overlap4")}
    ran = {k: v for k, v in ours.items() if v is not None}
    best = min(ran.values()) if ran else None
    checks: list[dict[str, Any]] = []

    def add(check: str, measured: float | None, bound: float | None, what: str) -> None:
        ok = None if measured is None or bound is None else measured <= bound
        checks.append(
            {"check": check, "measured_s": measured, "bound_s": bound, "vs": what, "ok": ok}
        )

    if "trl" in results:
        add(f"best 4-GPU layout >= {SPEEDUP_VS_TRL}x faster than TRL (4 GPUs, this run)", best,
            trl / SPEEDUP_VS_TRL if trl else None, f"TRL median / {SPEEDUP_VS_TRL}, this run")  # fmt: skip
        if "colocated4" in results:
            add("colocated4 faster than TRL colocated (4 GPUs, this run)",
                ours["colocated4"], trl, "TRL median, this run")  # fmt: skip
    if "split4" in results and "overlap4" in results:
        add("overlap4 faster than synchronous split4", ours["overlap4"], ours["split4"],
            "split4 median, this run")  # fmt: skip
    if "split4" in results:  # overlap4's sync phase also waits for the generation in flight
        f = (results.get("split4") or {}).get("figures") or {}
        bound = f.get("sync_bound_s")
        add(f"split4 NCCL sync within {SYNC_BOUND_FACTOR:g}x of bytes / bandwidth",
            f.get("sync_s"), bound * SYNC_BOUND_FACTOR if bound else None,
            "model bytes / measured NCCL bandwidth")  # fmt: skip
    return checks


def figures_table(results: dict[str, dict[str, Any] | None]) -> str:
    """Per run: GPUs, generated tokens/s, MFU (whole step; train phase), peak memory per GPU
    (GiB) and the weight sync against its bound."""
    head = (
        f"{'run':10} {'gpus':>4} {'gen tok/s':>9} {'mfu':>6} {'mfu_trn':>7} "
        f"{'sync':>6} {'bound':>6} {'x':>5}  peak GiB per GPU"
    )
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        f = (r or {}).get("figures")
        if f is None:
            continue
        peaks = " ".join(
            f"{k}:{v / 1024:.1f}" for k, v in sorted(f["peak_gpu_mib"].items())
        )  # fmt: skip
        lines.append(
            f"{name:10} {f['gpus'] or '-':>4} {_fmt(f['gen_tokens_per_s'], '.0f'):>9} "
            f"{_fmt(f['mfu_step'], '.3f'):>6} "
            f"{_fmt(f['mfu_train'], '.3f'):>7} {_fmt(f['sync_s'], '.3f'):>6} "
            f"{_fmt(f['sync_bound_s'], '.3f'):>6} {_fmt(f['sync_vs_bound']):>5}  {peaks or '-'}"
        )
    return "\n".join(lines)


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(results: dict[str, dict[str, Any] | None]) -> str:
    """A fixed-width table: one row per run, median seconds per step and per phase."""
    head = (
        f"{'run':10} {'status':7} {'steps':>5} {'s/step':>7} {'gen':>6} {'score':>6} "
        f"{'train':>6} {'sync':>6} {'other':>6} {'wall':>6} {'len':>6}  "
        "train: prep/fwd/bwd/opt"
    )
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        if r is None:
            continue
        if r.get("status") != "ok":
            lines.append(f"{name:10} {r.get('status', '?'):7} {r.get('error', '')[:80]}")
            continue
        s = r["summary"]
        ph = s.get("phase_median_s", {})
        wall = (s.get("wall_interval_s") or {}).get("median")
        lines.append(
            f"{name:10} {'ok':7} {s['step_s']['n']:>5} {_fmt(s['step_s']['median']):>7} "
            f"{_fmt(ph.get('generate')):>6} {_fmt(ph.get('score'), '.3f'):>6} "
            f"{_fmt(ph.get('train')):>6} {_fmt(ph.get('sync')):>6} {_fmt(ph.get('other')):>6} "
            f"{_fmt(wall):>6} {_fmt(s.get('completion_len_mean'), '.0f'):>6}  "
            + "/".join(_fmt(ph.get(f"train/{k}")) for k in TRAIN_PHASES)
        )
    return "\n".join(lines)


def verdict_lines(checks: list[dict[str, Any]]) -> str:
    word = {True: "PASS", False: "FAIL", None: "n/a"}
    return "\n".join(
        f"{word[c['ok']]:4}  {c['check']}: {_fmt(c['measured_s'])} s vs {_fmt(c['bound_s'])} s "
        f"({c['vs']})"
        for c in checks
    )


# -- overlap vs synchronous (two split runs of bench_grpo_e2e.py) ------------------------------


def _split_run(result: dict[str, Any]) -> dict[str, Any]:
    """The ``split`` run of a bench_grpo_e2e.py result, or an error record saying why not."""
    run = result.get("split")
    if isinstance(run, dict):
        return run
    return {"status": "error", "error": result.get("error") or "no split run in the result"}


def _overlap_view(run: dict[str, Any]) -> dict[str, Any]:
    ok = run.get("status") == "ok"
    s = run.get("summary") or {}
    return {
        "status": run.get("status"),
        "max_staleness": ((run.get("config") or {}).get("rollout") or {}).get("max_staleness"),
        "median_step_s": median_step(run),
        "phase_median_s": s.get("phase_median_s") if ok else None,
        "staleness_mean": s.get("staleness_mean") if ok else None,
        "steps_timed": (s.get("step_s") or {}).get("n") if ok else None,
        "step_seconds": run.get("step_seconds"),
        "error": run.get("error"),
    }


def overlap_report(sync: dict[str, Any], overlap: dict[str, Any]) -> dict[str, Any]:
    """Two bench_grpo_e2e.py results in mode ``split`` (``--split-max-staleness 0`` and ``1``,
    same machine and workload) as one report with the verdict: overlap faster than
    synchronous. ``overlap_ran_ahead`` says whether the overlapped run really trained on samples
    from older weights (mean staleness > 0); if not, its speed proves nothing about overlap."""
    a, b = _overlap_view(_split_run(sync)), _overlap_view(_split_run(overlap))
    if a["max_staleness"] not in (None, 0) or b["max_staleness"] == 0:
        raise ValueError(
            f"need the synchronous run first (max_staleness 0, got {a['max_staleness']}) and "
            f"the overlapped one second (>= 1, got {b['max_staleness']})"
        )
    same = sync.get("workload") == overlap.get("workload")
    same_run = sync.get("run") == overlap.get("run")
    sy, ov = (a["median_step_s"], b["median_step_s"]) if same and same_run else (None, None)
    note = {} if same_run else {"note": "the two runs come from different hosts or suite runs: "
                                "not compared"}  # fmt: skip
    return {
        **note,
        "workload": sync.get("workload"),
        "same_workload": same,
        "synchronous": a,
        "overlap": b,
        "speedup": sy / ov if sy and ov else None,
        "overlap_ran_ahead": None if b["staleness_mean"] is None else b["staleness_mean"] > 0,
        "verdicts": [
            {
                "check": "overlap faster than synchronous (split, 2 GPUs)",
                "measured_s": ov,
                "bound_s": sy,
                "vs": "synchronous median, this run",
                "ok": None if sy is None or ov is None else ov < sy,
            }
        ],
    }


def write_overlap_report(sync_path: Path, overlap_path: Path, out: Path) -> dict[str, Any]:
    """``overlap_report`` of two result files (a missing one counts as a failed run), written to
    ``out`` and printed."""
    report = overlap_report(read_json(Path(sync_path)), read_json(Path(overlap_path)))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
    for name in ("synchronous", "overlap"):
        v = report[name]
        print(
            f"{name:12} max_staleness={v['max_staleness']} {v['status']}: "
            f"{_fmt(v['median_step_s'])} s/step (staleness mean {_fmt(v['staleness_mean'])})"
            + (f" {v['error']}" if v["error"] else "")
        )
    print(verdict_lines(report["verdicts"]))
    return report
