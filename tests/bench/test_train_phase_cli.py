"""The training-phase benchmark without a GPU: a variant's worker through the learner's own
setup and step on the tiny model (the plumbing the GPU run relies on), its variants accepted by
the real config, the refusal without CUDA, and the verdict's two answers (valid, target met)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SCRIPT = BENCH / "bench_train_phase.py"
sys.path.insert(0, str(BENCH))

import bench_train_phase as tp  # noqa: E402


@pytest.mark.parametrize("variant", ["auto", "zero2_fused"])
def test_a_variant_s_worker_runs_the_learner_step(tmp_path, tiny_model_dir, variant):
    result = tmp_path / "r.json"
    cmd = [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--out",
           str(tmp_path / "x.json"), f"--worker={variant}", "--sequences", "4",
           "--prompt-tokens", "8", "--completion-tokens", "12", "--steps", "2", "--warmup", "1",
           "--profile", variant]  # fmt: skip
    env = {**os.environ, "TRAIN_PHASE_RESULT": str(result), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["variant"] == variant and len(r["step_s"]) == 2
    # no DeepSpeed on the CPU: the plan keeps no ZeRO; recompute off with nothing to fit
    assert r["layout"]["zero_stage"] is None
    assert r["layout"]["gradient_checkpointing"] is False
    assert r["layout"]["compiled"] is False  # "auto" compiles on a GPU only
    assert r["layout"]["fused_loss"] is (variant == "zero2_fused")
    assert set(r["phases"][0]) >= {"time/train/forward", "time/train/backward"}
    assert "Self CPU" in r["profile"]  # the profiler's table
    assert r["mfu"] is None  # no GPU peak to divide by


def test_every_variant_s_overrides_are_valid_config():
    from learner.config import load_config

    for _, overrides in tp.VARIANTS.values():
        load_config(tp.DEMO, overrides)  # raises on a misspelt field


def test_without_cuda_the_driver_refuses(tmp_path, tiny_model_dir):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--out",
           str(tmp_path / "x.json")]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "needs a GPU" in out.stdout
    assert not (tmp_path / "x.json").exists()


def _ok(mfu: float | None, s: float) -> dict:
    return {"status": "ok", "mfu": mfu, "median_s": s}


def test_the_verdict_separates_valid_from_target_met():
    runs = {"reference": _ok(0.37, 0.6), "zero3_today": _ok(0.08, 3.0), "auto": _ok(0.36, 0.66)}
    v = tp.verdict(runs, 0.35)
    assert v["valid"] and v["target_met"] and v["best"] == "auto"
    assert v["speedup_over_today"] == pytest.approx(3.0 / 0.66)
    v = tp.verdict({**runs, "auto": _ok(0.2, 1.2)}, 0.35)
    assert v["valid"] and not v["target_met"]
    # a variant that failed makes the run invalid, whatever the others reached
    v = tp.verdict({**runs, "zero2": {"status": "error", "error": "exit 1"}}, 0.35)
    assert not v["valid"] and not v["target_met"] and "zero2" in v["why_not_valid"]
    # no baseline: not valid
    v = tp.verdict({"auto": _ok(0.5, 0.5)}, 0.35)
    assert not v["valid"] and not v["target_met"]


def test_the_suite_judges_the_train_phase_step_by_its_verdict(tmp_path):
    import suite_report

    def judge(runs: dict) -> dict:
        out = {"results": runs, "verdict": tp.verdict(runs, 0.35)}
        (tmp_path / "bench_train_phase.json").write_text(json.dumps(out))
        rc = 0 if out["verdict"]["valid"] else 1  # the script's own exit code
        return suite_report.step_judgement("train_phase", rc, tmp_path, tmp_path)

    base = {"reference": _ok(0.37, 0.6), "zero3_today": _ok(0.16, 1.4)}
    met = judge({**base, "auto": _ok(0.41, 0.55)})
    assert (met["status"], met["valid"], met["target_met"]) == ("ok", True, True)
    missed = judge({**base, "auto": _ok(0.30, 0.75)})
    assert (missed["status"], missed["valid"], missed["target_met"]) == (
        "target_missed", True, False
    )  # fmt: skip
    broken = judge({**base, "auto": {"status": "error", "error": "exit 1"}})
    assert broken["status"] == "failed" and not broken["valid"] and "auto" in broken["why"]
