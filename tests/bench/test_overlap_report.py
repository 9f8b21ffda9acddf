"""The overlap-vs-synchronous report of the GPU suite's ``overlap`` step, on hand-made
bench_grpo_e2e.py results: medians, speed-up and verdict by hand, the staleness evidence, swapped
or failed runs; and that the two invocations the suite makes are accepted by the real CLI and
learner config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_grpo_e2e as e2e  # noqa: E402
import e2e_common as common  # noqa: E402

WORKLOAD = {"prompts_per_step": 16, "num_generations": 8, "max_tokens": 256}


def _result(staleness: int, median: float | None, staleness_mean: float = 0.0) -> dict:
    run = {
        "status": "ok" if median is not None else "error",
        "config": {"rollout": {"max_staleness": staleness}},
        "step_seconds": [7.8, 2.6, median or 0.0],
    }
    if median is None:
        run["error"] = "BenchError: timed out with 5 of 12 steps logged"
    else:
        run["summary"] = {
            "step_s": {"median": median, "n": 10},
            "phase_median_s": {"wait_generate": 0.2, "train": 1.3},
            "staleness_mean": staleness_mean,
        }
    return {"workload": dict(WORKLOAD), "split": run, "verdicts": []}


def test_overlap_faster_by_hand():
    r = common.overlap_report(_result(0, 2.68), _result(1, 1.60, staleness_mean=0.9))
    assert r["synchronous"]["median_step_s"] == 2.68 and r["overlap"]["median_step_s"] == 1.60
    assert r["speedup"] == pytest.approx(2.68 / 1.60)
    assert r["overlap"]["max_staleness"] == 1 and r["synchronous"]["max_staleness"] == 0
    assert r["overlap_ran_ahead"] is True and r["same_workload"]
    (v,) = r["verdicts"]
    assert (v["measured_s"], v["bound_s"], v["ok"]) == (1.60, 2.68, True)
    assert "PASS" in common.verdict_lines(r["verdicts"])


def test_overlap_not_faster_or_never_ahead_or_failed():
    slower = common.overlap_report(_result(0, 2.0), _result(1, 2.0, staleness_mean=0.0))
    assert slower["verdicts"][0]["ok"] is False  # equal is not faster
    assert slower["overlap_ran_ahead"] is False  # no sample came from older weights
    failed = common.overlap_report(_result(0, 2.5), _result(1, None))
    assert failed["verdicts"][0]["ok"] is None and failed["speedup"] is None
    assert "timed out" in failed["overlap"]["error"] and failed["overlap_ran_ahead"] is None
    other = _result(1, 1.5, 1.0)
    other["workload"]["max_tokens"] = 128
    assert common.overlap_report(_result(0, 2.5), other)["verdicts"][0]["ok"] is None


def test_swapped_runs_are_refused():
    with pytest.raises(ValueError, match="synchronous run first"):
        common.overlap_report(_result(1, 1.5, 1.0), _result(0, 2.5))


def test_missing_result_file_counts_as_a_failed_run(tmp_path, capsys):
    (tmp_path / "s0.json").write_text(json.dumps(_result(0, 2.5)))
    out = tmp_path / "o" / "bench_overlap.json"
    r = common.write_overlap_report(tmp_path / "s0.json", tmp_path / "missing.json", out)
    assert json.loads(out.read_text()) == r
    assert r["overlap"]["status"] == "error" and "cannot read" in r["overlap"]["error"]
    assert r["verdicts"][0]["ok"] is None
    assert "n/a" in capsys.readouterr().out


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_suite_invocations_give_split_runs_with_that_staleness(staleness, tmp_path):
    from learner.config import load_config

    args = e2e.build_parser().parse_args(
        ["--model", "/m", "--out", str(tmp_path / "o.json"), "--modes", "split",
         "--split-max-staleness", str(staleness), "--steps-split", "12"]
    )  # fmt: skip
    assert args.modes == "split"
    cfg = e2e.learner_config(args, "split", "http://127.0.0.1:9", tmp_path, tmp_path, tmp_path)
    path = tmp_path / "learner.toml"
    path.write_text(common.toml_text(cfg))
    loaded = load_config(path)
    assert loaded.rollout.max_staleness == staleness and loaded.run.steps == 12
    assert loaded.rollout.sync.type == "nccl" and loaded.rollout.sleep_while_training is None


def test_summary_reports_the_mean_staleness_of_the_measured_steps():
    records = [
        {"time/step": 9.0, "staleness": 0.0},  # warm-up: the first batch is never stale
        {"time/step": 2.0, "staleness": 1.0},
        {"time/step": 2.0, "staleness": 0.0},
        {"time/step": 2.0, "staleness": 1.0},
        {"time/step": 2.0, "staleness": 1.0},
    ]
    # measured steps 2..5: (1 + 0 + 1 + 1) / 4 = 0.75
    assert common.summarize_learner(records, warmup=1)["staleness_mean"] == 0.75
    assert common.summarize_learner([{"time/step": 1.0}], warmup=0)["staleness_mean"] is None
