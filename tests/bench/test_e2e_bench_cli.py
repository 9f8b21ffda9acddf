"""The end-to-end GRPO benchmarks without a GPU: their CLIs, the configs and server flags they
hand to the real learner and rollout server, the medians they report (checked by hand on
made-up metrics), the verdicts, and one real CPU run of the whole plumbing (transformers engine,
tiny model) that must leave no process behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import bench_grpo_e2e as e2e  # noqa: E402
import bench_trl_grpo as trl_bench  # noqa: E402
import e2e_common as common  # noqa: E402


def _args(*extra: str):
    return e2e.build_parser().parse_args(["--model", "/m", "--out", "/tmp/x.json", *extra])


# -- CLIs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", ["bench_grpo_e2e.py", "bench_trl_grpo.py"])
def test_help_is_instant_and_imports_no_torch(script):
    out = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "--model" in out.stdout and "--out" in out.stdout and "--warmup" in out.stdout
    probe = (
        f"import sys; sys.path.insert(0, {str(BENCH)!r}); import {script[:-3]}; "
        "print(sorted(m for m in ('torch', 'vllm', 'trl', 'transformers') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert loaded.stdout.strip() == "[]", loaded.stderr


def test_missing_model_and_cpu_nccl_or_ipc_are_refused_before_anything_starts(tmp_path):
    missing = subprocess.run(
        [sys.executable, str(BENCH / "bench_grpo_e2e.py"), "--model", str(tmp_path / "none"),
         "--out", str(tmp_path / "o.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2
    assert "has no config.json" in missing.stderr and "--qwen3-0.6b-shape" in missing.stderr
    (tmp_path / "config.json").write_text("{}")
    nccl = subprocess.run(
        [sys.executable, str(BENCH / "bench_grpo_e2e.py"), "--model", str(tmp_path),
         "--out", str(tmp_path / "o.json"), "--engine", "transformers"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert nccl.returncode == 2 and "--split-sync http" in nccl.stderr
    ipc = subprocess.run(
        [sys.executable, str(BENCH / "bench_grpo_e2e.py"), "--model", str(tmp_path),
         "--out", str(tmp_path / "o.json"), "--engine", "transformers", "--modes", "colocated"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ipc.returncode == 2 and "--colocated-sync file" in ipc.stderr
    assert not (tmp_path / "o.json").exists()


# -- what the GPU runs will hand to the learner and the server ---------------------------------


@pytest.mark.parametrize("mode", ["colocated", "split", "overlap"])
def test_learner_config_is_accepted_by_the_real_learner(mode, tmp_path):
    from learner.config import load_config

    args = _args("--learner-set", "grpo.pad_to_multiple_of=8", "--overlap-max-staleness", "2")
    cfg = e2e.learner_config(
        args, mode, "http://127.0.0.1:9", tmp_path / "run", tmp_path / "p.jsonl", tmp_path / "s"
    )
    path = tmp_path / "learner.toml"
    path.write_text(common.toml_text(cfg))
    assert tomllib.loads(path.read_text()) == {
        s: ({k: v for k, v in b.items() if v is not None} if isinstance(b, dict) else b)
        for s, b in cfg.items()
    }
    loaded = load_config(path, args.learner_set)
    assert loaded.model.dtype == "bfloat16"
    assert loaded.grpo.prompts_per_step == 16 and loaded.sampling.num_generations == 8
    assert loaded.sampling.max_tokens == 256 and loaded.grpo.pad_to_multiple_of == 8
    assert loaded.rewards[0].name == "length" and loaded.rewards[0].kwargs["unit"] == "chars"
    assert loaded.rollout.servers == ["http://127.0.0.1:9"]
    if mode == "colocated":
        assert (loaded.rollout.sync.type, loaded.rollout.sleep_while_training) == ("ipc", 1)
        assert loaded.rollout.max_staleness == 0  # no overlap while the server sleeps
        assert not hasattr(loaded.rollout.sync, "dir") and loaded.run.steps == 8
    else:
        assert (loaded.rollout.sync.type, loaded.rollout.sleep_while_training) == ("nccl", None)
        assert loaded.rollout.max_staleness == (2 if mode == "overlap" else 0)
        assert loaded.run.steps == 20
    assert loaded.rollout.sync.bucket_mb == 1024
    assert loaded.rollout.sync.prepares is (mode != "colocated")  # NCCL prepares, IPC has none
    unprepared = e2e.learner_config(
        _args("--no-prepare-sync"), mode, "http://x:9", tmp_path / "r", tmp_path / "p", tmp_path
    )
    assert unprepared["rollout"]["sync"].get("prepare") is (None if mode == "colocated" else False)


def test_split_learner_runs_under_zero3_with_one_process():
    argv = e2e.learner_argv(_args(), "split", Path("/c.toml"))
    assert argv[1:3] == ["-m", "accelerate.commands.launch"]
    config_file = Path(argv[argv.index("--config_file") + 1])
    assert config_file.name == "zero3.yaml" and config_file.is_file()
    assert argv[argv.index("--num_processes") + 1] == "1"
    assert argv[-4:] == ["-m", "learner", "--config", "/c.toml"]
    assert e2e.learner_argv(_args(), "colocated", Path("/c.toml"))[1:3] == ["-m", "learner"]


@pytest.mark.parametrize(
    ("mode", "gpu", "mem", "sleep"), [("colocated", "0", 0.3, True), ("split", "1", 0.5, True)]
)
def test_server_flags_are_accepted_by_the_real_server_cli(mode, gpu, mem, sleep, tmp_path):
    from gpu_common import ServerProcess

    from rollout_server.cli import build_parser, settings_from_args

    opts = e2e.server_options(_args(), mode)
    assert opts["gpu"] == gpu
    server = ServerProcess("/m", log_path=tmp_path / "s.log", **opts)
    server.http.close()
    argv = server.argv[server.argv.index("rollout_server") + 1 :]
    settings = settings_from_args(build_parser().parse_args(argv))
    assert (settings.engine, settings.dtype) == ("vllm", "bfloat16")
    assert settings.gpu_memory_utilization == mem and settings.enable_sleep_mode is sleep
    assert settings.max_model_len == common.MAX_MODEL_LEN


def test_trl_batches_make_one_generation_of_16_prompts_by_8_per_step():
    args = trl_bench.build_parser().parse_args(["--model", "/m", "--out", "/o"])
    kw = trl_bench.trl_config_kwargs(args, "/tmp/trl-out")
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == 16 * 8
    assert (kw["num_generations"], kw["max_completion_length"]) == (8, 256)
    assert kw["use_vllm"] and kw["vllm_mode"] == "colocate" and kw["bf16"]
    assert kw["model_init_kwargs"] == {"dtype": "bfloat16"}
    assert "vllm_importance_sampling_correction" not in kw  # TRL's default (on)
    no_is = trl_bench.build_parser().parse_args(
        ["--model", "/m", "--out", "/o", "--no-is-correction"]
    )
    assert trl_bench.trl_config_kwargs(no_is, "/x") == kw | {
        "output_dir": "/x",
        "vllm_importance_sampling_correction": False,
    }
    bad = trl_bench.build_parser().parse_args(
        ["--model", "/m", "--out", "/o", "--per-device-train-batch-size", "48"]
    )
    with pytest.raises(common.BenchError, match="must divide 128"):
        trl_bench.trl_config_kwargs(bad, "/tmp/trl-out")


def test_trl_reward_reads_conversational_completions():
    # length_score(n, 64) = max(0, 1 - |n - 64| / 64): 32 chars -> 0.5, 64 -> 1.0, "" -> 0.0
    chat = [[{"role": "assistant", "content": "x" * 32}], [{"role": "assistant", "content": ""}]]
    assert trl_bench.length_chars([], [*chat, "y" * 64]) == [0.5, 0.0, 1.0]


# -- medians and verdicts ---------------------------------------------------------------------


def _record(step: int, t: float, total: float, wait: float, train: float, sync: float, **kw):
    return {
        "step": step, "time": t, "time/step": total, "time/wait_generate": wait,
        "time/generate": wait - 0.1, "time/score": 0.05, "time/train": train, "time/sync": sync,
        "tokens/generated": 32768.0, "completion/len_mean": kw.get("length", 256.0),
        "time/train/forward": 0.4 * train,
    }  # fmt: skip


def test_summary_of_a_metrics_file_by_hand(tmp_path):
    from learner.run.metrics import read_metrics

    records = [
        _record(1, 100.0, 10.0, 6.0, 3.0, 1.0),  # warm-up
        _record(2, 110.0, 9.0, 5.0, 3.0, 1.0),  # warm-up
        _record(3, 999.0, 7.0, 1.0, 1.0, 1.0),  # replaced by the resumed run's step 3 below
        _record(3, 119.0, 3.0, 1.0, 1.5, 0.25, length=250.0),  # other 0.25
        _record(4, 122.5, 4.0, 1.5, 2.0, 0.4, length=255.0),  # other 0.1
        _record(5, 127.5, 5.0, 2.0, 2.5, 0.25),  # other 0.25
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    s = common.summarize_learner(read_metrics(tmp_path), warmup=2)
    assert s["steps_logged"] == 5
    assert s["step_s"]["median"] == 4.0 and s["step_s"]["n"] == 3
    assert s["step_s"]["mean"] == pytest.approx(4.0) and s["step_s"]["max"] == 5.0
    ph = s["phase_median_s"]
    assert ph["wait_generate"] == 1.5 and ph["generate"] == pytest.approx(1.4)
    assert ph["train"] == 2.0 and ph["sync"] == 0.25 and ph["score"] == 0.05
    assert ph["other"] == pytest.approx(0.25)
    assert ph["train/forward"] == pytest.approx(0.8) and "train/backward" not in ph
    # wall gaps of the measured steps: 119 - 110, 122.5 - 119, 127.5 - 122.5
    assert s["wall_interval_s"]["median"] == 5.0 and s["wall_interval_s"]["n"] == 3
    assert s["completion_len_mean"] == pytest.approx((250 + 255 + 256) / 3)
    assert s["generated_tokens_per_step_s"] == 32768 / 4.0
    with pytest.raises(ValueError, match="nothing left to measure"):
        common.summarize_learner(read_metrics(tmp_path)[:2], warmup=2)


def _ok(median: float) -> dict:
    return {"status": "ok", "summary": {"step_s": {"median": median, "n": 3}}}


def test_verdicts_follow_the_issue():
    runs = {"trl": _ok(3.9), "colocated": _ok(2.5), "split": _ok(1.8)}
    assert [v["ok"] for v in common.verdicts(runs)] == [True, True, True, True]
    slow = {"trl": _ok(3.9), "colocated": _ok(4.0), "split": _ok(4.5)}
    assert [v["ok"] for v in common.verdicts(slow)] == [False, False, False, False]
    failed = {"trl": {"status": "error", "error": "boom"}, "colocated": _ok(2.7), "split": None}
    assert [v["ok"] for v in common.verdicts(failed)] == [None, None, True, False]
    with_overlap = common.verdicts({**runs, "overlap": _ok(1.5)})
    assert with_overlap[-2]["check"] == "overlap faster than synchronous split"
    assert with_overlap[-2]["ok"] is True and with_overlap[-2]["bound_s"] == 1.8
    assert with_overlap[-1]["check"] == "overlap (2 GPUs) faster than colocated"
    assert with_overlap[-1]["ok"] is True and with_overlap[-1]["bound_s"] == 2.5
    slower = common.verdicts({**runs, "overlap": _ok(2.6)})  # overlap slower than both
    assert [v["ok"] for v in slower[-2:]] == [False, False]
    no_split = common.verdicts({"colocated": _ok(3.19), "overlap": _ok(2.2)})
    assert no_split[-2]["ok"] is None and no_split[-1]["ok"] is True
    other = common.verdicts(runs, same_workload=False)
    assert other[0]["ok"] is None and other[0]["bound_s"] is None
    text = common.table({**failed, "split": _ok(1.8)})
    assert "boom" in text and "1.80" in text


def test_each_finished_mode_is_on_disk_before_the_next_starts(tmp_path, monkeypatch):
    """A run killed outright (the GPU machine's call limit sends no signal it can catch)
    keeps what it finished: the result file is rewritten before every mode."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "e2e.json"
    seen: list[dict] = []

    def run_mode(args, mode, work, logs):
        seen.append(json.loads(out.read_text()))
        if mode == "split":
            raise KeyboardInterrupt("signal 15")  # what SIGTERM becomes in main
        return _ok(2.5)

    monkeypatch.setattr(e2e, "run_mode", run_mode)
    rc = e2e.main(
        ["--model", str(model), "--out", str(out), "--engine", "transformers",
         "--split-sync", "http", "--colocated-sync", "file", "--modes", "colocated,split",
         "--work-dir", str(tmp_path / "runs"), "--log-dir", str(tmp_path / "logs")]
    )  # fmt: skip
    assert rc == 1
    assert seen[0]["pending_modes"] == ["colocated", "split"] and "colocated" not in seen[0]
    assert seen[1]["pending_modes"] == ["split"] and seen[1]["colocated"]["status"] == "ok"
    final = json.loads(out.read_text())
    assert final["interrupted"] == "signal 15" and "pending_modes" not in final
    assert final["colocated"]["summary"]["step_s"]["median"] == 2.5 and "split" not in final
    assert not list(tmp_path.glob("*.tmp"))


def test_host_probe_measures_this_machine_in_a_subprocess():
    import host_probe

    facts = host_probe.host_facts()
    assert "probe_error" not in facts, facts
    assert 1 <= facts["cpus_usable"] <= facts["cpu_count"]
    assert 1 < facts["python_call_ns"] < 10_000 and 0.01 < facts["torch_cpu_op_us"] < 1_000
    assert facts["cuda_launch_us"] == {}  # no GPU here; one entry per GPU on the GPU machine
    slow = host_probe.host_facts(timeout_s=0.01)  # not even torch imports in that time
    assert "TimeoutExpired" in slow["probe_error"] and slow["cpu_count"] == facts["cpu_count"]


# -- the whole plumbing on CPU -----------------------------------------------------------------


@pytest.mark.slow
def test_cpu_run_of_both_modes_reports_medians_and_leaves_nothing_behind(
    tiny_model_dir, tmp_path, proc_scan
):
    out, logs = tmp_path / "e2e.json", tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_grpo_e2e.py"), "--engine", "transformers",
         "--model", str(tiny_model_dir), "--out", str(out), "--log-dir", str(logs),
         "--work-dir", str(tmp_path / "runs"), "--split-sync", "http", "--colocated-sync", "file",
         "--steps-colocated", "3", "--steps-split", "3", "--warmup", "1",
         "--prompts-per-step", "2", "--num-generations", "2", "--max-tokens", "8",
         "--micro-batch-size", "4", "--timeout", "150", "--server-timeout", "90",
         "--learner-set", "run.profile_steps=[3]"],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["verdicts"] == [] and "CPU smoke run" in result["note"]
    host = result["workload"]["host"]  # which machine: its CPUs and launch speeds
    assert host["cpu_count"] >= 1 and host["python_call_ns"] > 0 and host["torch_cpu_op_us"] > 0
    for mode in ("colocated", "split"):
        r = result[mode]
        assert r["status"] == "ok", r
        s = r["summary"]
        assert s["steps_logged"] == 3 and s["step_s"]["n"] == 2
        assert 0 < s["completion_len_mean"] <= 8
        assert s["step_s"]["median"] >= s["phase_median_s"]["train"] > 0
        split = [s["phase_median_s"][f"train/{k}"] for k in common.TRAIN_PHASES]
        assert all(x >= 0 for x in split) and 0 < sum(split) <= s["phase_median_s"]["train"]
        assert (logs / mode / "metrics.jsonl").is_file() and (logs / mode / "server.log").is_file()
        assert "## by host time" in (logs / mode / "profile_step_3.txt").read_text()
        assert not (tmp_path / "runs" / mode).exists()  # run dirs are removed
        assert not Path(r["config"]["rollout"]["sync"].get("dir") or "/nonexistent").exists()
        # the server served the learner's final weights: both digests, equal
        w = r["weights"]
        assert w["match"] is True and "problem" not in w, w
        (served,) = w["served"]
        assert (
            served["weight_version"] >= 3 and served["url"] == r["config"]["rollout"]["servers"][0]
        )
        assert served["checksum"] == pytest.approx(w["learner"]["checksum"], rel=1e-9)
        assert w["learner"]["dtypes"] == ["float32"] and w["learner"]["tensors"] > 0
        # no nvidia-smi here: the holders are unknown, which a CPU run does not hold against it
        holders = r["gpu_holders"]
        assert holders["before"]["available"] is False and holders["problems"] == []
        assert r["processes_ended"]["left"] == []
    assert result["colocated"]["config"]["rollout"]["sleep_while_training"] == 1
    assert "colocated" in proc.stdout and "split" in proc.stdout  # the table
    assert proc_scan(str(tmp_path)) == []
