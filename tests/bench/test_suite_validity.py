"""What makes a GPU-suite figure stand, without a GPU: the NCCL bandwidth probe sees the two
GPUs it needs; a step records ``valid`` and ``target_met`` and is not ``ok`` with a target
missed; served weights unequal to the learner's, or a GPU held by another process before or
after a run (nvidia-smi's own report, from a stand-in on PATH), make a run not valid; and the
4-GPU layouts take one TRL result per suite run, refusing another run's.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import bench_grpo_e2e as e2e  # noqa: E402
import e2e_common as common  # noqa: E402
import e2e_layouts  # noqa: E402
import gpu_holders  # noqa: E402
import suite_report  # noqa: E402
import weights_check  # noqa: E402

# -- the NCCL bandwidth probe -------------------------------------------------------------------


def test_bandwidth_probe_is_given_both_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe is GPU 0 and its peer GPU 1 (bench_rollout_gpu.measure_bandwidth): its
    process must see two GPUs, counted among the ones this process sees."""
    seen: list[str] = []

    def run(argv, env, **kw):
        seen.append(env["CUDA_VISIBLE_DEVICES"])
        return subprocess.CompletedProcess(argv, 0, 'BANDWIDTH {"gb_per_s": 300.0}\n', "")

    monkeypatch.setattr(e2e_layouts.subprocess, "run", run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4,5")
    assert e2e_layouts.measure_nccl_bandwidth(4) == {"status": "ok", "gb_per_s": 300.0}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert e2e_layouts.measure_nccl_bandwidth(4)["status"] == "ok"
    assert seen == ["2,3", "0,1"]


def test_bandwidth_probe_with_one_gpu_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(*a, **kw):
        raise AssertionError("nothing may start")

    monkeypatch.setattr(e2e_layouts.subprocess, "run", run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    got = e2e_layouts.measure_nccl_bandwidth(1)
    assert got["status"] == "error"
    assert "needs 2 GPUs, 1 visible (CUDA_VISIBLE_DEVICES='3')" in got["error"]
    assert "--no-bandwidth" in got["error"]


# -- valid and target met -----------------------------------------------------------------------


def _rollout_result(sync_verdict: str) -> dict:
    rows = [
        {"what": "/generate vs LLM.generate", "measured": "-", "ratio": "97%", "target": "PASS"},
        {"what": "NCCL sync (prepared, loaded: NCCL ack) vs bytes/bandwidth", "measured": "-",
         "ratio": "2.12x (median 2.77x)", "target": sync_verdict},
        {"what": "  same sends, until their HTTP answers", "measured": "-", "ratio": "-",
         "target": "-"},
    ]  # fmt: skip
    return {"offline": {}, "http": {}, "verdicts": rows}


def test_a_step_whose_target_fails_is_not_ok(tmp_path: Path) -> None:
    """bench_rollout's sync at 2.12x its bound (target 2x): the measurement is valid, the
    target is not met, and the status says so; summary.json keeps both."""
    (tmp_path / "bench_rollout_gpu.json").write_text(json.dumps(_rollout_result("FAIL")))
    j = suite_report.step_judgement("bench_rollout", 0, tmp_path, tmp_path)
    assert j["status"] == "target_missed" and j["valid"] is True and j["target_met"] is False
    assert "target not met: NCCL sync (prepared, loaded: NCCL ack) vs bytes/bandwidth" in j["why"]
    (tmp_path / "bench_rollout_gpu.json").write_text(json.dumps(_rollout_result("PASS")))
    j = suite_report.step_judgement("bench_rollout", 0, tmp_path, tmp_path)
    assert (j["status"], j["valid"], j["target_met"]) == ("ok", True, True)
    # the verdict line the suite writes into steps.tsv, then summary.json from it
    (tmp_path / "bench_rollout_gpu.json").write_text(json.dumps(_rollout_result("FAIL")))
    line = subprocess.run(
        [sys.executable, str(BENCH / "suite_report.py"), "verdict", "bench_rollout", "0",
         "--out", str(tmp_path), "--work", str(tmp_path)],
        capture_output=True, text=True, check=True,
    ).stdout.rstrip("\n")  # fmt: skip
    status, valid, target, why = line.split("\t")
    assert (status, valid, target) == ("target_missed", "true", "false")
    (tmp_path / "steps.tsv").write_text(
        f"bench_rollout\t{status}\t30\t0\t{valid}\t{target}\t{why}\n"
    )
    assert suite_report.main(["summary", str(tmp_path / "steps.tsv"), "--out", str(tmp_path),
                              "--budget", "560", "--start", "0"]) == 1  # fmt: skip
    (step,) = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert (step["valid"], step["target_met"], step["status"]) == (True, False, "target_missed")


CHECKED = {"weights": {"match": True}, "gpu_holders": {"problems": []}}


def _ours(median: float, **more) -> dict:
    return {"status": "ok", "summary": {"step_s": {"median": median, "n": 6}}, **CHECKED, **more}


def test_e2e_exits_3_when_valid_with_a_verdict_failed_and_the_step_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench_grpo_e2e.py's exit code: 0 all holds, 3 valid but a verdict fails (the colocated
    step over its 2.6 s design target), 1 not valid; the suite takes 3 as a missed target."""
    monkeypatch.setenv("SUITE_RUN_ID", "run-3")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "bench_e2e_colocated.json"

    def run_with(colocated: dict) -> int:
        monkeypatch.setattr(e2e, "check_environment", lambda args, modes: None)
        monkeypatch.setattr(e2e, "run_mode", lambda args, mode, work, logs: dict(colocated))
        return e2e.main(["--model", str(model), "--out", str(out), "--modes", "colocated",
                         "--work-dir", str(tmp_path / "w"), "--no-bandwidth"])  # fmt: skip

    assert run_with(_ours(2.0)) == 0
    assert run_with(_ours(3.0)) == e2e.EXIT_TARGET_MISSED
    j = suite_report.step_judgement("e2e_colocated", 3, tmp_path, tmp_path)
    assert (j["status"], j["valid"], j["target_met"]) == ("target_missed", True, False)
    assert "colocated within design target" in j["why"] and "exit code" not in j["why"]
    mismatch = {"match": False, "problem": "served weights differ from the learner's final ones"}
    assert run_with(_ours(2.0, weights=mismatch)) == 1
    j = suite_report.step_judgement("e2e_colocated", 1, tmp_path, tmp_path)
    assert j["status"] == "failed" and j["valid"] is False
    assert "colocated: served weights differ" in j["why"]


# -- served weights against the learner's ----------------------------------------------------------


def test_weights_compare_by_hand() -> None:
    learner = {"checksum": 1234.5}
    same = [{"url": "u1", "weight_version": 8, "checksum": 1234.5 * (1 + 1e-12)}]
    assert weights_check.compare(same, learner)["match"] is True
    off = [*same, {"url": "u2", "weight_version": 7, "checksum": 1234.6}]
    got = weights_check.compare(off, learner)
    assert got["match"] is False and "u2 serves 1234.6 (version 7)" in got["problem"]
    assert "u1" not in got["problem"]
    unread = weights_check.compare([{"url": "u1", "error": "HTTP 409: asleep"}], learner)
    assert unread["problem"] == "served weights not read: u1: HTTP 409: asleep"
    assert "no rollout server" in weights_check.compare([], learner)["problem"]
    unsaved = weights_check.compare(same, {"error": "the learner exited with code 1"})
    assert unsaved["problem"] == "learner's final weights: the learner exited with code 1"
    # a run of ours with no such record is not valid either
    assert common.run_problems({"status": "ok", "gpu_holders": {"problems": []}}) == [
        "the served weights were not compared with the learner's"
    ]


def test_the_ranks_records_of_their_servers_are_read_as_served(tmp_path: Path) -> None:
    """colocated4: what each rank recorded of its own server (learner.servers.embedded.
    record_served), in read_served's form; a rank that recorded an error, or nothing, is an
    error of that rank, and the learner's exit ends the wait for the missing one."""
    (tmp_path / "served_checksum.rank0.json").write_text(
        json.dumps({"rank": 0, "url": "http://127.0.0.1:9", "weight_version": 3, "checksum": 1.5})
    )
    (tmp_path / "served_checksum.rank1.json").write_text(json.dumps(
        {"rank": 1, "url": "http://127.0.0.1:10", "error": "ConnectError: refused"}))  # fmt: skip
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    got = weights_check.served_by_ranks(tmp_path, 3, ended, timeout_s=600)
    assert got[:2] == [
        {"url": "http://127.0.0.1:9", "weight_version": 3, "checksum": 1.5},
        {"url": "http://127.0.0.1:10", "error": "ConnectError: refused"},
    ]
    assert got[2]["url"] == "rank 2" and "no record of its server" in got[2]["error"]
    assert "rank 2: no record" in weights_check.compare(got, {"checksum": 1.5})["problem"]
    assert weights_check.served_by_ranks(tmp_path, 1, None, timeout_s=0)[0]["checksum"] == 1.5


def test_the_digest_of_a_saved_model_is_the_servers(tiny_model_dir: Path) -> None:
    """weights_check's digest of a model directory, in its own process, against the digest a
    server computes over the same weights loaded as a model (rollout_server.weight_digest)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_server.weight_digest import params_checksum

    got = weights_check.final_digest(tiny_model_dir, dict(os.environ), "cpu", 120)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert got["checksum"] == pytest.approx(params_checksum(model), rel=1e-9)
    empty = weights_check.final_digest(tiny_model_dir / "nowhere", dict(os.environ), "cpu", 5)
    assert "saved no final model" in empty["error"]


# -- which process held which GPU -----------------------------------------------------------------

FAKE_SMI = """#!/bin/sh
case "$*" in
  *query-gpu=index,uuid*) printf 'GPU-aaa-0, GPU-aaa\\n1, GPU-bbb\\n' | sed 's/GPU-aaa-0/0/' ;;
  *query-compute-apps*) cat "$SMI_APPS" ;;
  *) exit 9 ;;
esac
"""


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``nvidia-smi`` on PATH that answers the two queries from a file: the holders."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    apps = tmp_path / "apps.csv"
    apps.write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SMI_APPS", str(apps))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return apps


def test_a_gpu_held_before_or_after_a_run_makes_it_invalid(fake_smi: Path, monkeypatch) -> None:
    clean = gpu_holders.snapshot()
    assert clean == {"available": True, "gpus": {"0": "GPU-aaa", "1": "GPU-bbb"}, "holders": []}
    me = os.getpid()  # a real process, so its command line is recorded too
    fake_smi.write_text(f"{me}, python3, 60312, GPU-bbb\n")
    held = gpu_holders.snapshot()
    (h,) = held["holders"]
    assert (h["gpu"], h["pid"], h["process_name"], h["used_mib"]) == ("1", me, "python3", 60312)
    assert "python" in h["cmd"]
    rec = gpu_holders.record(held, clean, on_gpus=True)
    assert rec["problems"] == [f"GPU 1 held by pid {me} (python3, 60312 MiB) before the run"]
    assert "--query-compute-apps=pid,process_name,used_memory,gpu_uuid" in rec["query"]
    after = gpu_holders.record(clean, held, on_gpus=True)["problems"]
    assert after == [f"GPU 1 held by pid {me} (python3, 60312 MiB) after the run"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # a holder on a GPU the run cannot use
    assert gpu_holders.record(held, held, on_gpus=True)["problems"] == []
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi at all
    gone = gpu_holders.snapshot()
    assert gone["available"] is False
    assert gpu_holders.problems(gone, gone, on_gpus=False) == []
    assert gpu_holders.problems(gone, gone, on_gpus=True)[0].startswith("GPU holders unknown")


def test_the_suite_fails_an_e2e_step_whose_gpu_was_held(tmp_path: Path) -> None:
    holders = {"problems": ["GPU 1 held by pid 77 (python3, 60312 MiB) after the run"]}
    run = {"host": "h", "boot_id": "b", "suite_run": "r"}
    data = {"run": run, "verdicts": [], "split": _ours(2.0, gpu_holders=holders),
            "overlap": _ours(1.9)}  # fmt: skip
    (tmp_path / "bench_e2e_split.json").write_text(json.dumps(data))
    j = suite_report.step_judgement("e2e_split", 0, tmp_path, tmp_path)
    assert j["status"] == "failed" and j["valid"] is False
    assert j["why"] == "split: GPU 1 held by pid 77 (python3, 60312 MiB) after the run"
    summary = suite_report.summary([], tmp_path, 560, 0)["e2e_split"]
    assert summary["gpu_holder_problems"]["split"] == holders["problems"]
    assert summary["served_weights_match"] == {"split": True, "overlap": True}


# -- one TRL result per suite run for every 4-GPU layout ----------------------------------------


def test_split4_is_put_beside_this_runs_trl_and_refuses_another_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUITE_RUN_ID", "run-4")
    out = tmp_path / "bench_e2e4_split.json"
    args = e2e.build_parser().parse_args(
        ["--model", "/m", "--out", str(out), "--modes", "split4,overlap4", "--model-shape",
         "qwen3-4b"]
    )  # fmt: skip
    ours = common.run_identity()
    trl = {"status": "ok", "summary": {"step_s": {"median": 7.0}}, "run": dict(ours),
           "workload": common.workload(16, 8, 256, "qwen3-4b")}  # fmt: skip
    runs = {"split4": _ours(2.5), "overlap4": _ours(2.4)}
    base = {"run": ours, "workload": {}, "bandwidth": {"status": "skipped"}}
    e2e.write_results(args, {**base, "trl": trl, **runs}, pending=[])
    checks = {c["check"]: c for c in json.loads(out.read_text())["verdicts"]}
    best = checks["best 4-GPU layout >= 1.5x faster than TRL (4 GPUs, this run)"]
    assert best["measured_s"] == 2.4 and best["ok"] is True
    assert suite_report.step_verdict("e2e4_split", 0, tmp_path, tmp_path)[0] == "ok"
    for key, other in (("run", {**ours, "suite_run": "run-3"}),
                       ("workload", common.workload(16, 8, 256, "qwen3-8b"))):  # fmt: skip
        e2e.write_results(args, {**base, "trl": {**trl, key: other}, **runs}, pending=[])
        data = json.loads(out.read_text())
        assert "not compared" in data["trl_note"]
        status, why = suite_report.step_verdict("e2e4_split", 0, tmp_path, tmp_path)
        assert status == "failed" and "not compared" in why
    e2e.write_results(args, {**base, "trl": None, **runs}, pending=[])
    status, why = suite_report.step_verdict("e2e4_split", 0, tmp_path, tmp_path)
    assert status == "failed" and "no trl baseline in bench_e2e4_split.json" in why


def test_the_suite_makes_trl4_once_per_run_and_reuses_it(tmp_path: Path) -> None:
    """The real gpu_suite.sh: a suite run that has its 4-GPU TRL result does not run TRL again
    in e2e4_colocated, and hands that result to both 4-GPU layouts."""
    out, work = tmp_path / "out", tmp_path / "work"
    trl = work / "runs" / "t4" / "trl4" / "trl.json"
    trl.parent.mkdir(parents=True)
    trl.write_text(json.dumps({"status": "ok", "summary": {"step_s": {"median": 7.0}}}))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES", "GRPO_BENCH_RUN")}  # fmt: skip
    env |= {"PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}", "OUT": str(out),
            "WORK": str(work), "SUITE_RUN_ID": "t4", "SUITE_BUDGET_S": "300",
            "SUITE_STEPS": "trl4 e2e4_colocated e2e4_split"}  # fmt: skip
    subprocess.run(["bash", str(BENCH / "gpu_suite.sh")], env=env, capture_output=True,
                   text=True, timeout=300)  # fmt: skip
    logs = work / "runs" / "t4" / "logs"
    assert "this suite run has its TRL result" in (logs / "trl4.log").read_text()
    assert not (logs / "trl4" / "trl.log").exists()  # TRL never ran again
    colocated = (logs / "e2e4_colocated.log").read_text()
    assert "-- TRL: this suite run's result" in colocated
    split = (logs / "e2e4_split.log").read_text()
    assert "no TRL result in this suite run" not in split
    for log in (colocated, split):  # both layouts' bench commands name it
        assert f"--trl-json {trl}" in log, log[-2000:]
    assert json.loads((out / "bench_trl4.json").read_text())["status"] == "ok"
