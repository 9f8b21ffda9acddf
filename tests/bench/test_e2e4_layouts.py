"""The 4-GPU layouts of bench_grpo_e2e.py without a GPU: what each hands to the real learner,
launcher and rollout server, the model shapes, the figures and verdicts (by hand on made-up
runs), the GPU suite's verdicts on their result files (a missing TRL or veRL baseline fails the
step), and real CPU runs of the layouts that can run here: colocated on every rank with two
gloo processes (a server each, http sync) and disaggregated with one learner and two servers.
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
import bench_trl_grpo as trl_bench  # noqa: E402
import e2e_common as common  # noqa: E402
import gpu_common  # noqa: E402
import suite_report  # noqa: E402


def _args(*extra: str):
    return e2e.build_parser().parse_args(["--model", "/m", "--out", "/tmp/x.json", *extra])


# -- what the 4-GPU runs will hand to the learner, the launcher and the servers ----------------


def _loaded(args, mode: str, urls: list[str], tmp_path: Path):
    from learner.config import load_config

    cfg = e2e.learner_config(args, mode, urls, tmp_path / "run", tmp_path / "p.jsonl", tmp_path)
    path = tmp_path / f"{mode}.toml"
    path.write_text(common.toml_text(cfg))
    return cfg, load_config(path, [])


def test_colocated4_is_a_sleeping_vllm_server_per_zero3_rank_synced_over_ipc(tmp_path):
    args = _args("--model-shape", "qwen3-4b")
    _, loaded = _loaded(args, "colocated4", [], tmp_path)
    r = loaded.rollout
    assert r.servers == [] and not r.external and r.embedded.per_rank
    assert (r.sync.type, r.sleep_while_training, r.max_staleness) == ("ipc", 1, 0)
    assert (r.embedded.engine, r.embedded.dtype) == ("vllm", "bfloat16")
    extra = r.embedded.extra_args
    assert extra[extra.index("--gpu-memory-utilization") + 1] == "0.3"
    assert "--enable-sleep-mode" in extra and extra[extra.index("--max-model-len") + 1] == "1024"
    assert loaded.run.steps == 8 and loaded.grpo.prompts_per_step == 16
    argv = e2e.learner_argv(args, "colocated4", Path("/c.toml"))
    assert argv[1:3] == ["-m", "accelerate.commands.launch"]
    assert Path(argv[argv.index("--config_file") + 1]).name == "zero3.yaml"
    assert argv[argv.index("--num_processes") + 1] == "4"
    assert argv[-4:] == ["-m", "learner", "--config", "/c.toml"]
    assert e2e.server_specs(args, "colocated4") == []  # the ranks start their own
    lay = e2e.layout(args, "colocated4")
    assert lay["learner_gpus"] == ["0", "1", "2", "3"] and lay["gpus"] == 4
    assert lay["learner_processes"] == 4 and lay["servers_started_by"] == "learner ranks"


@pytest.mark.parametrize(("mode", "staleness"), [("split4", 0), ("overlap4", 1)])
def test_split4_is_two_zero3_learners_and_two_servers_over_nccl(mode, staleness, tmp_path):
    from gpu_common import ServerProcess

    from rollout_server.cli import build_parser, settings_from_args

    args = _args()
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    _, loaded = _loaded(args, mode, urls, tmp_path)
    r = loaded.rollout
    assert r.servers == urls and not r.embedded.per_rank
    assert (r.sync.type, r.sleep_while_training, r.max_staleness) == ("nccl", None, staleness)
    argv = e2e.learner_argv(args, mode, Path("/c.toml"))
    assert argv[argv.index("--num_processes") + 1] == "2"
    assert e2e.layout(args, mode) == {
        "learner_gpus": ["0", "1"], "learner_processes": 2, "server_gpus": ["2", "3"],
        "servers_started_by": "bench", "tensor_parallel": 1, "gpus": 4,
    }  # fmt: skip
    assert [s["gpu"] for s in e2e.server_specs(args, mode)] == ["2", "3"]
    tp = _args("--split4-tp", "2")
    (spec,) = e2e.server_specs(tp, mode)  # one TP-2 server over both server GPUs
    assert spec["gpu"] == "2,3" and e2e.layout(tp, mode)["gpus"] == 4
    server = ServerProcess("/m", log_path=tmp_path / "s.log", **spec)
    server.http.close()
    settings = settings_from_args(build_parser().parse_args(server.argv[3:]))
    assert settings.tensor_parallel_size == 2 and settings.gpu_memory_utilization == 0.5


def test_layouts_that_cannot_run_are_refused_before_anything_starts(tmp_path):
    common_flags = ["--model", str(tmp_path), "--out", str(tmp_path / "o.json")]
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))

    def refused(*flags: str) -> str:
        proc = subprocess.run(
            [sys.executable, str(BENCH / "bench_grpo_e2e.py"), *common_flags, *flags],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        return proc.stderr

    cpu = ["--engine", "transformers", "--split-sync", "http"]
    assert "--colocated-sync http" in refused(*cpu, "--modes", "colocated4")
    assert "needs vLLM" in refused(*cpu, "--modes", "split4", "--split4-tp", "2")
    shape = refused(*cpu, "--modes", "split4", "--model-shape", "qwen3-8b")
    assert "is not the qwen3-8b shape" in shape and "hidden_size 64 (want 4096)" in shape
    assert not (tmp_path / "o.json").exists()


def test_model_shapes_are_the_published_configs(tmp_path):
    s4, s8 = gpu_common.MODEL_SHAPES["qwen3-4b"], gpu_common.MODEL_SHAPES["qwen3-8b"]
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "head_dim")  # fmt: skip
    assert [s4[k] for k in keys] == [2560, 36, 32, 8, 9728, 151936, 128]
    assert [s8[k] for k in keys] == [4096, 36, 32, 8, 12288, 151936, 128]
    assert s4["tie_word_embeddings"] and not s8["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(s8))
    assert gpu_common.shape_mismatch(tmp_path, "qwen3-8b") == ""
    assert "tie_word_embeddings False (want True)" in gpu_common.shape_mismatch(
        tmp_path, "qwen3-4b"
    )


def test_trl_on_four_processes_makes_the_same_step_of_16_prompts_by_8():
    args = trl_bench.build_parser().parse_args(
        ["--model", "/m", "--out", "/o", "--model-shape", "qwen3-4b"]
    )
    kw = trl_bench.trl_config_kwargs(args, "/tmp/trl-out", world=4)
    assert kw["per_device_train_batch_size"] == 16 and kw["gradient_accumulation_steps"] == 2
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] * 4 == 16 * 8
    assert trl_bench.trl_config_kwargs(args, "/x")["gradient_accumulation_steps"] == 8
    with pytest.raises(common.BenchError, match="x 3 processes must divide 128"):
        trl_bench.trl_config_kwargs(args, "/x", world=3)


def test_trl_tokens_per_step_come_from_its_running_total():
    from types import SimpleNamespace

    logs = {
        k: {"num_tokens": 1000.0 * k * k, "completions/mean_length": 200.0} for k in (1, 2, 3, 4)
    }
    timer = SimpleNamespace(steps=[9.0, 5.0, 4.0, 6.0], ends=[9.0, 14.0, 18.0, 24.0], logs=logs)
    calls = {"generate": [1.0] * 4, "sync_weights": [0.1] * 4}
    s = trl_bench.summarize_trl(timer, calls, warmup=2, completions=128)
    # steps 3 and 4 trained 9000 - 4000 and 16000 - 9000 tokens
    assert s["tokens_trained_per_step"] == 6000.0 and s["step_s"]["median"] == 5.0
    assert s["tokens_generated_per_step"] == 200.0 * 128


# -- figures and verdicts by hand ---------------------------------------------------------------


def _run(median: float, sync: float | None = None, **summary) -> dict:
    s = {"step_s": {"median": median, "n": 6}, "phase_median_s": {"sync": sync}, **summary}
    return {"status": "ok", "summary": s, "gpu_peak_mib": {"0": 40000, "1": 52000}}


def test_figures_of_a_run_by_hand():
    kw = {"completions": 128, "flops_per_token": lambda seq: 1e9 * seq / 320,
          "peak_tflops": 1000.0, "sync_bytes": 8_000_000_000, "nccl_gb_per_s": 400.0}  # fmt: skip
    # a baseline (TRL): 40960 trained tokens (prompt + completion), mean sequence 320
    trl = common.figures(
        _run(4.0, 0.5, tokens_generated_per_step=32768.0, tokens_trained_per_step=40960.0),
        gpus=4, **kw,
    )  # fmt: skip
    assert set(trl) == set(common.FIGURE_KEYS)
    assert trl["gen_tokens_per_s"] == 8192 and trl["mfu_train"] is None
    # 40960 tokens x 1e9 FLOPs / 4 s / (4 GPUs x 1e15 FLOP/s)
    assert trl["mfu_step"] == pytest.approx(40960 * 1e9 / 4.0 / 4e15)
    assert trl["sync_bound_s"] == pytest.approx(0.02) and trl["sync_vs_bound"] == pytest.approx(25)
    assert trl["peak_gpu_mib_max"] == 52000 and trl["gpus"] == 4
    # ours: the learner's MFU 0.3 over a 2 s train phase on 2 learner ranks, 4 GPUs, 4 s a step
    run = _run(4.0, 0.1, tokens_generated_per_step=32768.0, mfu=0.3,
               tokens_trained_per_step=1.0)  # fmt: skip
    run["summary"]["phase_median_s"]["train"] = 2.0
    run["layout"] = {"learner_processes": 2, "gpus": 4}
    ours = common.figures(run, gpus=4, **kw)
    assert ours["mfu_step"] == pytest.approx(0.3 * 2.0 * 2 / (4.0 * 4)) and ours["mfu_train"] == 0.3
    failed = common.figures(
        {"status": "error", "error": "x"}, gpus=4, completions=128, flops_per_token=None,
        peak_tflops=None, sync_bytes=None, nccl_gb_per_s=None,
    )  # fmt: skip
    assert set(failed) == set(common.FIGURE_KEYS) and failed["step_s"] is None


def test_four_gpu_verdicts_follow_the_issue():
    split = _run(3.0)
    split["figures"] = {"sync_s": 0.05, "sync_bound_s": 0.02}
    runs = {"trl": _run(9.0), "colocated4": _run(5.0), "split4": split, "overlap4": _run(2.5)}
    checks = {c["check"]: c for c in common.verdicts4(runs)}
    best = checks["best 4-GPU layout >= 1.5x faster than TRL (4 GPUs, this run)"]
    assert best["measured_s"] == 2.5 and best["bound_s"] == 6.0 and best["ok"] is True
    assert checks["colocated4 faster than TRL colocated (4 GPUs, this run)"]["ok"] is True
    assert checks["overlap4 faster than synchronous split4"]["ok"] is True
    nccl = checks["split4 NCCL sync within 2x of bytes / bandwidth"]
    assert nccl["bound_s"] == 0.04 and nccl["ok"] is False
    elsewhere = common.verdicts4(runs, same_run=False)
    assert elsewhere[0]["bound_s"] is None and elsewhere[0]["ok"] is None
    slow = common.verdicts4({"trl": _run(6.0), "colocated4": _run(5.0)})
    assert [c["ok"] for c in slow] == [False, True]  # faster, but not 1.5x


# -- the suite's verdicts on the 4-GPU result files ---------------------------------------------


def _write(tmp_path: Path, name: str, data: dict) -> None:
    (tmp_path / name).write_text(json.dumps(data))


# what every run of ours records besides its times: its weights and GPU holders checked
CHECKED = {"weights": {"match": True}, "gpu_holders": {"problems": []}}


def test_missing_trl_baseline_fails_e2e4_colocated(tmp_path: Path) -> None:
    run = {"host": "h", "boot_id": "b", "suite_run": "r"}
    ours = {**_run(3.0), "figures": {}, **CHECKED}
    base = {"run": run, "verdicts": [], "bandwidth": {"status": "ok", "gb_per_s": 300.0}}
    _write(tmp_path, "bench_e2e4_colocated.json", {**base, "trl": None, "colocated4": ours})
    status, why = suite_report.step_verdict("e2e4_colocated", 0, tmp_path, tmp_path)
    assert status == "failed" and "no trl baseline" in why
    failed = {"status": "error", "error": "TRL run (4 processes): rc 124"}
    _write(tmp_path, "bench_e2e4_colocated.json", {**base, "trl": failed, "colocated4": ours})
    status, why = suite_report.step_verdict("e2e4_colocated", 0, tmp_path, tmp_path)
    assert status == "failed" and "TRL run (4 processes)" in why
    trl = {**_run(6.0), "run": run}
    _write(tmp_path, "bench_e2e4_colocated.json", {**base, "trl": trl, "colocated4": ours})
    assert suite_report.step_verdict("e2e4_colocated", 0, tmp_path, tmp_path) == ("ok", "")
    no_bw = {**base, "bandwidth": {"status": "error", "error": "NCCL peer failed"}}
    _write(tmp_path, "bench_e2e4_split.json", {**no_bw, "split4": ours, "overlap4": ours})
    status, why = suite_report.step_verdict("e2e4_split", 0, tmp_path, tmp_path)
    assert status == "failed" and "NCCL bandwidth: NCCL peer failed" in why
    assert suite_report.step_verdict("e2e4_verl", 0, tmp_path, tmp_path) == (
        "failed", "no result file bench_e2e4_verl.json"
    )  # fmt: skip


def test_verl_not_installed_is_a_failed_baseline(tiny_model_dir, tmp_path: Path) -> None:
    out = tmp_path / "bench_e2e4_verl.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_grpo_e2e.py"), "--engine", "transformers",
         "--model", str(tiny_model_dir), "--out", str(out), "--modes", "verl",
         "--log-dir", str(tmp_path / "logs"), "--work-dir", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["verl"]["status"] == "error"
    assert data["verl"]["error"].startswith("verl not installed: no module verl")
    assert "verl not installed" in proc.stdout  # the table
    status, why = suite_report.step_verdict("e2e4_verl", 1, tmp_path, tmp_path)
    assert status == "failed" and "verl: verl not installed" in why
    summary = suite_report.summary([], tmp_path, 580, 0)
    assert summary["e2e4_verl"]["median_step_s"]["verl"].startswith("verl not installed")


def test_suite_fails_each_4gpu_step_on_a_machine_without_them(tmp_path: Path) -> None:
    """The real bench/gpu_suite.sh here (no GPU, DeepSpeed, TRL or model): every 4-GPU step is
    failed with its reason, and the suite exits 1."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") or importlib.util.find_spec("trl"):
        pytest.skip("DeepSpeed or TRL is installed here: the missing-baseline path cannot be shown")
    out, work = tmp_path / "out", tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    env |= {"PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}", "OUT": str(out),
            "WORK": str(work), "SUITE_STEPS": "e2e4_colocated e2e4_split e2e4_verl",
            "SUITE_BUDGET_S": "400", "SUITE_RUN_ID": "r4"}  # fmt: skip
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu_suite.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    steps = {s["step"]: s for s in json.loads((out / "summary.json").read_text())["steps"]}
    for step in ("e2e4_colocated", "e2e4_split", "e2e4_verl"):
        assert steps[step]["status"] == "failed"
        assert f"no result file bench_{step}.json" in steps[step]["why"]
    run_work = work / "runs" / "r4"  # this suite run's own files
    trl_log = (run_work / "logs" / "trl4" / "trl.log").read_text()
    assert "DeepSpeed is not installed" in trl_log
    trl = json.loads((run_work / "trl4" / "trl.json").read_text())
    assert trl["status"] == "error" and "TRL run (4 processes)" in trl["error"]
    assert json.loads((out / "bench_trl4.json").read_text()) == trl
    step_log = (run_work / "logs" / "e2e4_colocated.log").read_text()
    assert "gpu_common.py build-model --shape qwen3-4b" in step_log


# -- the layouts' plumbing on CPU -----------------------------------------------------------------

CPU_WORKLOAD = ["--steps-colocated", "3", "--steps-split", "3", "--warmup", "1",
                "--prompts-per-step", "2", "--num-generations", "2", "--max-tokens", "8",
                "--micro-batch-size", "4", "--timeout", "240", "--server-timeout", "120",
                # the tiny model's equal rewards would leave nothing to train: train on them
                "--learner-set", "grpo.skip_zero_advantage=false"]  # fmt: skip


def _cpu_run(tiny_model_dir: Path, tmp_path: Path, *flags: str) -> tuple[dict, str]:
    out = tmp_path / "e2e4.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_grpo_e2e.py"), "--engine", "transformers",
         "--model", str(tiny_model_dir), "--out", str(out), "--log-dir", str(tmp_path / "logs"),
         "--work-dir", str(tmp_path / "runs"), *CPU_WORKLOAD, *flags],
        capture_output=True, text=True, timeout=800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _assert_reported(result: dict, mode: str, stdout: str) -> None:
    r = result[mode]
    assert r["status"] == "ok", r
    s = r["summary"]
    assert s["steps_logged"] == 3 and s["step_s"]["n"] == 2
    assert s["tokens_trained_per_step"] > 0 and s["tokens_generated_per_step"] > 0
    assert set(r["figures"]) == set(common.FIGURE_KEYS)
    f = r["figures"]
    assert f["step_s"] == s["step_s"]["median"] and f["gen_tokens_per_s"] > 0
    assert f["gpus"] == r["layout"]["gpus"] and f["peak_gpu_mib"] == {}  # no nvidia-smi here
    assert f["sync_s"] is not None and f["sync_bytes"] > 0 and f["sync_bound_s"] is None
    assert mode in stdout and "gen tok/s" in stdout and "peak GiB per GPU" in stdout
    assert result["run"]["host"] and result["bandwidth"]["status"] == "skipped"
    assert "CPU smoke run" in result["note"] and "pending_modes" not in result
    # every server (the bench's, or each rank's own) served the learner's final weights
    w = r["weights"]
    assert w["match"] is True, w
    assert len(w["served"]) == 2 and all(s["weight_version"] >= 3 for s in w["served"])
    assert all(s["checksum"] == pytest.approx(w["learner"]["checksum"], rel=1e-9)
               for s in w["served"])  # fmt: skip
    assert r["processes_ended"]["left"] == [] and r["gpu_holders"]["problems"] == []


@pytest.mark.slow
def test_cpu_colocated4_runs_a_server_per_rank(tiny_model_dir, tmp_path, proc_scan):
    result, stdout = _cpu_run(
        tiny_model_dir, tmp_path, "--modes", "colocated4", "--ranks", "2",
        "--colocated-sync", "http",
    )  # fmt: skip
    _assert_reported(result, "colocated4", stdout)
    r = result["colocated4"]
    assert r["layout"]["learner_processes"] == 2 and r["server_argvs"] == []
    f, s = r["figures"], r["summary"]  # each rank generates its share; the figure is both ranks'
    assert f["gen_tokens_per_s"] * f["step_s"] == pytest.approx(2 * s["tokens_generated_per_step"])
    assert r["config"]["rollout"]["embedded"]["per_rank"] is True
    for k in range(2):  # each rank's own server, every sync pushed to it
        log = (tmp_path / "logs" / "colocated4" / f"rollout_server.rank{k}.log").read_text()
        assert "weights v3 loaded over http" in log
        # what the rank read of its server right before stopping it: what the bench compared
        record = tmp_path / "logs" / "colocated4" / f"served_checksum.rank{k}.json"
        kept = json.loads(record.read_text())
        served = r["weights"]["served"][k]
        assert kept == {"rank": k, **served}, (kept, served)
    assert proc_scan(str(tmp_path)) == []


@pytest.mark.slow
def test_cpu_split4_runs_one_learner_and_two_servers(tiny_model_dir, tmp_path, proc_scan):
    result, stdout = _cpu_run(
        tiny_model_dir, tmp_path, "--modes", "split4,overlap4", "--split-sync", "http"
    )
    for mode, staleness in (("split4", 0), ("overlap4", 1)):
        _assert_reported(result, mode, stdout)
        r = result[mode]
        assert len(r["server_argvs"]) == 2 and len(r["config"]["rollout"]["servers"]) == 2
        assert r["config"]["rollout"]["max_staleness"] == staleness
        for log in ("server.log", "server1.log"):  # both servers generated
            text = (tmp_path / "logs" / mode / log).read_text()
            assert '"POST /generate HTTP/1.1" 200' in text, text[-2000:]
    assert proc_scan(str(tmp_path)) == []
