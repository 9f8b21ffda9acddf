"""The GPU suite's verdicts without a GPU: a step is ok only on facts.

A real pytest interrupted mid-test (its junit report ends in an empty test case), the real
benchmark scripts on a machine without vLLM / TRL / Liger, the real bench/gpu_suite.sh running
them, and hand-made result files of benchmarks whose every part failed or whose baseline ran
elsewhere: each must come out failed, with pytest's own counts and the missing package named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import bench_grpo_e2e as e2e  # noqa: E402
import e2e_common as common  # noqa: E402
import suite_report  # noqa: E402

INTERRUPTED = """
import os, signal, time
def test_a(): pass
def test_b(): pass
def test_cut():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
def test_never(): pass
"""


def _interrupted_junit(tmp_path: Path) -> tuple[int, Path]:
    (tmp_path / "test_cut.py").write_text(INTERRUPTED)
    xml = tmp_path / "gpu_tests.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_cut.py",
         f"--junitxml={xml}", "-o", "junit_family=xunit2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "2 passed" in proc.stdout, proc.stdout
    return proc.returncode, xml


def test_interrupted_pytest_counts_what_pytest_counted_and_fails(tmp_path: Path) -> None:
    rc, xml = _interrupted_junit(tmp_path)
    assert rc == 2
    assert xml.read_text().count("<testcase") == 3  # pytest writes an empty one for the cut test
    report = suite_report.junit_totals(xml)
    assert report["totals"] == {
        "passed": 2, "failed": 0, "error": 0, "skipped": 0, "interrupted": 1
    }  # fmt: skip
    assert [c["outcome"] for c in report["cases"]] == ["passed", "passed", "interrupted"]
    status, why = suite_report.step_verdict("tests", rc, tmp_path, tmp_path)
    assert status == "failed" and "pytest interrupted" in why and "1 interrupted" in why
    # even an exit code of 0 does not make a report with a cut test a pass
    assert suite_report.step_verdict("tests", 0, tmp_path, tmp_path)[0] == "failed"


def test_summary_uses_pytest_totals_and_fails_the_run(tmp_path: Path) -> None:
    rc, _ = _interrupted_junit(tmp_path)
    status, why = suite_report.step_verdict("tests", rc, tmp_path, tmp_path)
    run = {"host": "h", "boot_id": "b", "suite_run": "r"}
    e2e_result = {"run": run, "verdicts": [], "colocated": {"status": "error", "error": "boom"}}
    (tmp_path / "bench_e2e_colocated.json").write_text(json.dumps(e2e_result))
    (tmp_path / "bench_overlap.json").write_text("[]")  # not a result: reported, no crash
    tsv = tmp_path / "steps.tsv"
    tsv.write_text(f"setup\tok\t3\t0\ttrue\t-\t\ntests\t{status}\t9\t{rc}\tfalse\t-\t{why}\n")
    code = suite_report.main(
        ["summary", str(tsv), "--out", str(tmp_path), "--budget", "560", "--start", "0"]
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 1 and summary["ok"] is False
    assert summary["tests"]["passed"] == 2 and summary["tests"]["interrupted"] == 1
    assert summary["e2e_colocated"]["run"] == run
    assert summary["e2e_colocated"]["median_step_s"] == {"colocated": "boom"}
    assert "unreadable bench_overlap.json" in summary["overlap"]["error"]
    assert summary["steps"][0]["valid"] is True and summary["steps"][0]["target_met"] is None
    assert summary["steps"][1] == {
        "step": "tests", "status": "failed", "seconds": 9, "rc": "2", "valid": False,
        "target_met": None, "why": why,
    }  # fmt: skip


def test_benchmark_failing_in_every_part_fails_even_with_exit_0(tmp_path: Path) -> None:
    parts = {k: {"error": f"ModuleNotFoundError: No module named 'vllm' ({k})"}
             for k in ("offline", "server_start", "http", "sleep", "bandwidth")}  # fmt: skip
    (tmp_path / "bench_rollout_gpu.json").write_text(
        json.dumps({"gpus": 2, **parts, "verdicts": []})
    )
    status, why = suite_report.step_verdict("bench_rollout", 0, tmp_path, tmp_path)
    assert status == "failed"
    assert all(f"part {k}" in why for k in parts) and "vllm" in why
    # a step whose result file never appeared is not ok, whatever its exit code
    assert suite_report.step_verdict("memory", 0, tmp_path, tmp_path) == (
        "failed", "no result file bench_memory_options.json"
    )  # fmt: skip
    assert suite_report.step_verdict("e2e_split", 124, tmp_path, tmp_path)[0] == "timeout"


def test_loss_variant_that_failed_fails_the_step(tmp_path: Path) -> None:
    (tmp_path / "bench_loss").mkdir()
    rows = [{"head": "qwen3-0.6b", "variant": "fused", "tokens": 4096, "ms": 1.0},
            {"head": "qwen3-0.6b", "variant": "liger", "tokens": 4096, "ms": float("nan"),
             "error": "RuntimeError: compile failed"}]  # fmt: skip
    (tmp_path / "bench_loss" / "loss_gpu.json").write_text(json.dumps({"results": rows}))
    status, why = suite_report.step_verdict("bench_loss", 0, tmp_path, tmp_path)
    assert status == "failed" and "liger" in why and "compile failed" in why


def _venv_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    return {**env, "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}"}


@pytest.mark.parametrize(
    ("script", "args", "names"),
    [
        ("bench_rollout_gpu.py", ["--out", "r.json"], ["vllm"]),
        ("bench_loss_gpu.py", ["--out-dir", "."], ["trl==1.16.0", "liger-kernel"]),
        ("bench_native_sync.py", ["--model", ".", "--out", "n.json"], ["vllm"]),
        (
            "bench_native_sync.py",
            ["--model", ".", "--transport", "ipc", "--out", "n.json"],
            ["vllm", "ray"],
        ),
    ],
)
def test_benchmark_without_its_dependencies_exits_2_naming_them(
    tmp_path: Path, script: str, args: list[str], names: list[str]
) -> None:
    for mod in ("vllm", "trl", "liger_kernel", "ray"):
        try:
            __import__(mod)
        except ImportError:
            continue
        pytest.skip(f"{mod} is installed here: the missing-dependency path cannot be shown")
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=tmp_path, env=_venv_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "missing dependencies" in proc.stderr
    assert all(n in proc.stderr for n in names), proc.stderr
    assert not list(tmp_path.glob("*.json")), "no result file for a run that never started"


def test_suite_marks_each_step_failed_and_exits_1(tmp_path: Path) -> None:
    """The real bench/gpu_suite.sh on this machine (no GPU, no vLLM, no TRL): every benchmark
    step fails, each with its reason, and the suite's own exit code says so."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**_venv_env(), "OUT": str(out), "WORK": str(work), "SUITE_RUN_ID": "r1",
           "SUITE_STEPS": "bench_rollout bench_loss e2e_colocated", "SUITE_BUDGET_S": "400"}  # fmt: skip
    logs = work / "runs" / "r1" / "logs"  # this suite run's own
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu_suite.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False
    steps = {s["step"]: s for s in summary["steps"]}
    assert steps["bench_rollout"]["status"] == "failed"
    assert steps["bench_rollout"]["why"] == "exit code 2; no result file bench_rollout_gpu.json"
    assert steps["bench_loss"]["status"] == "failed"
    assert steps["bench_loss"]["why"] == "exit code 2; no result file loss_gpu.json"
    assert "missing dependencies: vllm" in (logs / "bench_rollout.log").read_text()
    assert "liger-kernel" in (logs / "bench_loss.log").read_text()
    assert steps["e2e_colocated"]["status"] == "failed"
    assert "no result file bench_e2e_colocated.json" in steps["e2e_colocated"]["why"]
    assert "TRL 1.16 is not importable" in (logs / "e2e_colocated" / "trl.log").read_text()


def _ok_run(median: float) -> dict:
    return {"status": "ok", "summary": {"step_s": {"median": median}}}


@pytest.mark.parametrize("trl_problem", ["failed", "other_host", "other_run"])
def test_e2e_comparison_needs_the_baseline_from_this_run(
    tmp_path: Path, trl_problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUITE_RUN_ID", "run-1")
    out = tmp_path / "bench_e2e_colocated.json"
    args = e2e.build_parser().parse_args(["--model", "/m", "--out", str(out)])
    ours = common.run_identity()
    trl = {**_ok_run(4.0), "workload": common.workload(16, 8, 256), "run": dict(ours)}
    if trl_problem == "failed":
        trl = {"status": "error", "error": "bench_trl_grpo: error: TRL 1.16 is not importable"}
    elif trl_problem == "other_host":
        trl["run"]["host"] = "another-h100"
    else:
        trl["run"]["suite_run"] = "run-0"
    results = {"run": ours, "trl": trl, "workload": {}, "colocated": _ok_run(2.0)}
    e2e.write_results(args, results, pending=[])
    data = json.loads(out.read_text())
    colocated_vs_trl = data["verdicts"][0]
    assert colocated_vs_trl["check"].startswith("colocated faster than TRL")
    assert colocated_vs_trl["ok"] is None and colocated_vs_trl["bound_s"] is None
    status, why = suite_report.step_verdict("e2e_colocated", 0, tmp_path, tmp_path)
    assert status == "failed"
    assert ("TRL 1.16" in why) if trl_problem == "failed" else ("not compared" in why)


def test_e2e_same_run_is_compared_and_ok(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUITE_RUN_ID", "run-1")
    out = tmp_path / "bench_e2e_colocated.json"
    args = e2e.build_parser().parse_args(["--model", "/m", "--out", str(out)])
    ours = common.run_identity()
    trl = {**_ok_run(4.0), "workload": common.workload(16, 8, 256), "run": dict(ours)}
    colocated = {**_ok_run(2.0), "weights": {"match": True}, "gpu_holders": {"problems": []}}
    results = {"run": ours, "trl": trl, "workload": {}, "colocated": colocated}
    e2e.write_results(args, results, pending=[])
    assert json.loads(out.read_text())["verdicts"][0]["ok"] is True
    assert suite_report.step_verdict("e2e_colocated", 0, tmp_path, tmp_path) == ("ok", "")


def test_overlap_runs_from_two_hosts_are_not_compared(tmp_path: Path) -> None:
    def split(staleness: int, median: float, host: str) -> dict:
        run = {"status": "ok", "config": {"rollout": {"max_staleness": staleness}},
               "summary": {"step_s": {"median": median, "n": 8}, "staleness_mean": staleness}}  # fmt: skip
        return {"workload": {"max_tokens": 256}, "run": {"host": host}, "split": run}

    report = common.overlap_report(split(0, 2.6, "h100-a"), split(1, 1.6, "h100-b"))
    assert report["verdicts"][0]["ok"] is None and "not compared" in report["note"]
    (tmp_path / "bench_overlap.json").write_text(json.dumps(report))
    status, why = suite_report.step_verdict("overlap", 0, tmp_path, tmp_path)
    assert status == "failed" and "different hosts" in why
    same = common.overlap_report(split(0, 2.6, "h100-a"), split(1, 1.6, "h100-a"))
    assert same["verdicts"][0]["ok"] is True and "note" not in same


def test_reports_of_one_pytest_per_file_merge_into_pytests_totals(tmp_path: Path) -> None:
    """The suite runs each GPU test file in its own pytest: the merged report keeps every
    file's totals, and a file whose process left no report is an error, never a pass."""
    _, cut = _interrupted_junit(tmp_path)
    (tmp_path / "test_fine.py").write_text("def test_one(): pass\n")
    fine = tmp_path / "fine.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_fine.py",
         f"--junitxml={fine}", "-o", "junit_family=xunit2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    merged = tmp_path / "out" / "gpu_tests.xml"
    merged.parent.mkdir()
    suite_report.main(["merge", str(merged), str(cut), str(fine), str(tmp_path / "none.xml")])
    totals = suite_report.junit_totals(merged)["totals"]
    assert totals == {"passed": 3, "failed": 0, "error": 1, "skipped": 0, "interrupted": 1}
    status, why = suite_report.step_verdict("tests", 0, merged.parent, tmp_path)
    assert status == "failed" and "1 interrupted" in why, why


def test_lora_sync_needs_both_modes_of_every_transport_and_a_served_adapter(
    tmp_path: Path,
) -> None:
    """bench_lora_sync's rows: a transport whose merged row is missing (its push failed) or
    whose adapter rows left the server with no adapter fails the step; a whole run is ok."""
    row = {"transport": "nccl", "mode": "merged", "served_lora_rank": None}
    adapter = {"transport": "nccl", "mode": "adapter", "served_lora_rank": 64}
    path = tmp_path / "bench_lora_sync.json"

    def verdict(rows: list[dict]) -> tuple[str, str]:
        path.write_text(json.dumps({"setup": {}, "rows": rows}))
        return suite_report.step_verdict("lora_sync", 0, tmp_path, tmp_path)

    assert verdict([row, adapter]) == ("ok", "")
    assert verdict([adapter])[0] == "failed" and "['merged'] not measured" in verdict([adapter])[1]
    unserved = {**adapter, "served_lora_rank": None}
    assert "served no adapter" in verdict([row, unserved])[1]
    assert verdict([]) == ("failed", "no transport was measured")


def test_native_sync_needs_both_sides_of_every_transport(tmp_path: Path) -> None:
    """bench_native_sync's runs joined by transport: a transport whose vLLM side never got a
    time (its server did not start) fails the step; both sides timed, it is ok."""
    run = {
        "transport": "nccl",
        "model": "/w/m",
        "ours": {"median_s": 0.4},
        "vllm": {"median_s": 0.5},
    }
    half = {"transport": "ipc", "model": "/w/m", "ours": {"median_s": 0.2}}
    parts = []
    for name, data in (("n", run), ("i", half)):
        parts.append(tmp_path / f"{name}.json")
        parts[-1].write_text(json.dumps(data))
    dest = tmp_path / "bench_native_sync.json"
    assert suite_report.main(["join-native", str(dest), *map(str, parts)]) == 0
    assert suite_report.step_verdict("native_sync", 0, tmp_path, tmp_path) == (
        "failed", "m/ipc: vllm not measured"
    )  # fmt: skip
    assert suite_report.main(["join-native", str(dest), str(parts[0])]) == 0
    assert suite_report.step_verdict("native_sync", 0, tmp_path, tmp_path) == ("ok", "")
    assert suite_report.main(["join-native", str(dest)]) == 0  # nothing ran
    assert suite_report.step_verdict("native_sync", 0, tmp_path, tmp_path)[0] == "failed"


LANE_TEST = """
import os, sys, time
from pathlib import Path
import pytest
sys.path.insert(0, {bench!r})
from gpu_common import visible_gpus
pytestmark = pytest.mark.gpu
MARKS = Path({marks!r})

def test_lane():
    me, other = {me!r}, {other!r}
    (MARKS / me).write_text(os.environ["CUDA_VISIBLE_DEVICES"] + " " + visible_gpus("{index}"))
    deadline = time.monotonic() + 60
    while not (MARKS / other).exists():  # both lanes run at once, or this one times out
        assert time.monotonic() < deadline, "the other lane never ran beside this one"
        time.sleep(0.1)
"""


def test_test_lanes_run_side_by_side_each_on_its_gpus(tmp_path: Path) -> None:
    """GPU_LANES="4,5|6": the two lanes' pytest processes run at once, each seeing its own
    CUDA_VISIBLE_DEVICES, and a test's "GPU 1" is the second GPU of its lane; the merged report
    counts both."""
    out, work, marks = tmp_path / "out", tmp_path / "work", tmp_path / "marks"
    marks.mkdir()
    for me, other, index in (("a", "b", "1"), ("b", "a", "0")):
        (tmp_path / f"test_{me}.py").write_text(
            LANE_TEST.format(bench=str(BENCH), marks=str(marks), me=me, other=other, index=index)
        )
    env = {**_venv_env(), "OUT": str(out), "WORK": str(work), "SUITE_STEPS": "tests",
           "SUITE_RUN_ID": "lanes",
           "SUITE_BUDGET_S": "300", "GPU_LANES": "4,5|6",
           "GPU_TESTS": f"{tmp_path / 'test_a.py'}|{tmp_path / 'test_b.py'}"}  # fmt: skip
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu_suite.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    logs = work / "runs" / "lanes" / "logs"
    assert proc.returncode == 0, proc.stdout[-3000:] + (logs / "tests.log").read_text()
    assert (marks / "a").read_text() == "4,5 5"
    assert (marks / "b").read_text() == "6 6"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tests"]["passed"] == 2, summary


def test_a_gpu_beyond_the_lane_is_refused_by_name() -> None:
    from gpu_common import visible_gpus

    assert visible_gpus("0,1", parent="") == "0,1"
    assert visible_gpus("1,0", parent="2,3") == "3,2"
    with pytest.raises(ValueError, match=r"GPU '2' asked for.*CUDA_VISIBLE_DEVICES='2,3'"):
        visible_gpus("0,2", parent="2,3")
