"""End-to-end learner runs: real subprocesses, a real embedded rollout server, real HTTP.

These are the acceptance runs of the learner: the demo learns, a SIGKILLed run resumes with the
same data order and leaves no orphan server, an unreachable server fails fast and clearly, and a
2-process ``accelerate launch`` ends with identical weights on both ranks.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from learner.config import load_config
from learner.data.prompts import PromptStream, load_rows
from learner.run.metrics import read_metrics
from learner.step.inflight import rows_fingerprint
from tests.learner.demo_runs import (
    DEMO,
    ROOT,
    assert_setup_error,
    kill_after_step,
    learner_cmd,
    learner_env,
    run_ok,
    spawn_learner,
    wait_gone,
)
from tests.learner.launch import cpu_launch


def _expected_fingerprints(steps: int) -> list[int]:
    """The demo's data order per step, straight from a fresh seeded stream."""
    cfg = load_config(DEMO)
    stream = PromptStream(
        load_rows(cfg.data.path, cfg.data.prompt_column),
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
    )
    return [rows_fingerprint(stream.take(cfg.grpo.prompts_per_step)) for _ in range(steps)]


@pytest.mark.slow
def test_demo_learns_within_five_minutes(tmp_path, proc_scan):
    run_dir = tmp_path / "demo"
    t0 = time.monotonic()
    proc = subprocess.run(
        learner_cmd(run_dir, "--set", "run.progress_bar=false"),
        env=learner_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert seconds < 300, f"demo took {seconds:.0f} s (limit 300)"
    records = read_metrics(run_dir)
    assert len(records) == load_config(DEMO).run.steps
    rewards = [r["reward/mean"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"demo: {seconds:.0f} s, reward first5={first:.3f} last5={last:.3f}")
    assert last >= 0.5, rewards
    assert last >= 3 * first, rewards
    plot = subprocess.run(
        [sys.executable, "-m", "learner", "plot", str(run_dir)],
        env=learner_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plot.returncode == 0, plot.stderr
    assert (run_dir / "curves.png").stat().st_size > 10_000
    assert (run_dir / "final" / "config.json").exists()
    assert not wait_gone(proc_scan, str(run_dir / "model")), (
        "the embedded rollout server outlived the learner"
    )


@pytest.mark.slow
def test_sigkill_then_resume_continues_same_data_order(tmp_path, proc_scan):
    """Killed after step 3's checkpoint and step 4's metrics: the resumed run logs every step
    once, on the prompts, weight versions and data positions of an uninterrupted run, and with
    sampling.seed it draws step 4's samples again: the same rewards and loss as the killed run."""
    run_dir = tmp_path / "run"
    args = [
        "--set",
        "run.steps=8",
        "--set",
        "run.checkpoint_every=3",
        "--set",
        "run.progress_bar=false",
        "--set",
        "sampling.seed=11",
    ]
    proc = subprocess.Popen(
        learner_cmd(run_dir, *args),
        env=learner_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpt = run_dir / "checkpoints" / "step_000003"
    deadline = time.monotonic() + 240

    def killable() -> bool:
        metrics = run_dir / "metrics.jsonl"
        return ckpt.exists() and metrics.exists() and len(read_metrics(run_dir)) >= 4

    while not killable() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert killable(), "no checkpoint at step 3 and metrics of step 4"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = read_metrics(run_dir)
    assert 4 <= len(killed) < 8
    # PR_SET_PDEATHSIG: the embedded server dies with the learner, even on SIGKILL.
    assert not wait_gone(proc_scan, str(run_dir / "model")), "orphan rollout server after SIGKILL"

    again = subprocess.run(
        learner_cmd(run_dir, *args), env=learner_env(), capture_output=True, text=True
    )
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert "already holds a run (step_000003): pass --resume" in again.stderr
    assert len(read_metrics(run_dir)) == len(killed)  # nothing written

    done = subprocess.run(
        learner_cmd(run_dir, "--resume", *args),
        env=learner_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 9))
    raw = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in raw] == list(range(1, 9))  # no step twice
    assert [int(r["data/fingerprint"]) for r in records] == _expected_fingerprints(8)
    # the weight versions go on from the checkpoint's (a fresh server starts at 0)
    assert [r["weight_version"] for r in records] == list(range(1, 9))
    assert [r["data/position"] for r in records] == [8 * s for s in range(1, 9)]
    for before, after in zip(killed[3:], records[3:], strict=False):  # steps 4.. trained twice
        for key in ("reward/mean", "loss", "completion/len_mean"):
            assert after[key] == before[key], (before["step"], key)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ('model.name_or_path="/nonexistent/model"', "model.name_or_path = '/nonexistent/model': "),
        ('data.path="missing.jsonl"', "data.path missing.jsonl does not exist (looked at /"),
        ('rewards=[{name="no_such_reward"}]', "no_such_reward"),
        ('rewards=[{name="charset", kwargs={allowd="ab"}}]', "did you mean 'allowed'"),
    ],
)
def test_setup_errors_are_one_line_and_name_the_setting(tmp_path, override, message):
    assert_setup_error(tmp_path / "run", override, message)


def _demo_with_rows(tmp_path: Path, rows: list[dict], *overrides: str):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        "--set",
        f'data.path="{data}"',
        "--set",
        "run.steps=1",
        "--set",
        "sampling.max_tokens=4",
    ]
    args += [a for o in overrides for a in ("--set", o)]
    return subprocess.run(
        learner_cmd(tmp_path / "run", *args),
        env=learner_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_a_reward_parameter_that_names_no_column_stops_before_any_model_loads(tmp_path):
    proc = _demo_with_rows(tmp_path, [{"prompt": "sing", "vowels": "aeiou"}] * 8)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        "error: reward function 'charset': charset_reward() needs the column(s) ['allowed'], but "
        "the data's columns are ['completion_ids', 'vowels']: add them to the data, pass them in "
        "the reward's kwargs, or give the parameters a default"
    )
    assert "Loading weights" not in proc.stderr


def test_unreachable_server_fails_fast_and_clearly(tmp_path):
    from grpo_common.net import free_port

    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    proc = subprocess.run(
        learner_cmd(
            tmp_path / "run",
            "--set",
            f'rollout.servers=["{url}"]',
            "--set",
            "rollout.ready_timeout_s=3",
            "--set",
            "rollout.max_retries=1",
        ),
        env=learner_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 120
    assert url in proc.stderr and "not ready after 3 s" in proc.stderr, proc.stderr[-2000:]


def test_nccl_group_is_formed_before_the_first_generation(tmp_path):
    """The learner forms the NCCL weight-sync group at start (a new group also ends what a
    crashed earlier run left prepared on the servers), not at its first sync after step 1's
    generation: on CPU, where NCCL cannot run, it stops before any step, saying why and what
    to use instead."""
    proc = subprocess.run(
        learner_cmd(tmp_path / "run", "--set", 'rollout.sync="nccl"', "--set", "run.steps=2",
                 "--set", "run.progress_bar=false"),
        env=learner_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert 'rollout.sync = "nccl" needs the learner on a CUDA GPU' in proc.stderr, proc.stderr[
        -3000:
    ]
    assert 'use sync = "http" or "file"' in proc.stderr
    assert not read_metrics(tmp_path / "run"), "a step ran before the group was formed"


def test_profile_steps_write_the_op_tables_and_trace(tmp_path):
    """run.profile_steps: the chosen step's train phase under torch.profiler, its op table
    (and trace) in RUN_DIR/profile; other steps are not profiled; a step beyond run.steps is
    refused before anything starts."""
    run_dir = tmp_path / "run"
    run_ok(run_dir, "run.steps=2", "run.profile_steps=[2]", "run.profile_trace=true",
            "run.save_final=false")  # fmt: skip
    prof = run_dir / "profile"
    assert sorted(p.name for p in prof.iterdir()) == ["step_2.trace.json", "step_2.txt"]
    table = (prof / "step_2.txt").read_text()
    assert "## by host time" in table and "aten::mm" in table  # the LM head's products
    trace = json.loads((prof / "step_2.trace.json").read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    bad = subprocess.run(
        learner_cmd(tmp_path / "bad", "--set", "run.steps=2", "--set", "run.profile_steps=[3]"),
        env=learner_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0 and "run.profile_steps [3] outside 1..run.steps (2)" in bad.stderr


@pytest.mark.slow
def test_accelerate_two_processes_end_with_identical_weights(tmp_path):
    run_dir = tmp_path / "ddp"
    cmd = [*cpu_launch(2), "-m", "learner", "--config", str(DEMO), "--run-dir", str(run_dir)]
    cmd += ["--set", "run.steps=3", "--set", "run.progress_bar=false"]
    proc = subprocess.run(
        cmd, env=learner_env(), capture_output=True, text=True, timeout=400, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    sums = json.loads((run_dir / "rank_checksums.json").read_text())
    assert len(sums) == 2 and sums[0] == sums[1]
    records = read_metrics(run_dir)
    assert len(records) == 3
    assert records[-1]["weight_version"] == 3


@pytest.mark.slow
def test_environment_config_runs_multi_turn_episodes(tmp_path):
    run_dir = tmp_path / "calc"
    cfg = ROOT / "learner" / "configs" / "calculator.toml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "learner",
            "--config",
            str(cfg),
            "--run-dir",
            str(run_dir),
            "--set",
            "run.steps=2",
            "--set",
            "run.progress_bar=false",
            # held-out evaluation on the test split, after the last step (tests/learner/test_eval.py)
            *("--set", "eval.max_prompts=3", "--set", "eval.num_generations=2"),
            *("--set", "eval.temperature=1.0"),
            *("--set", "sampling.seed=3"),  # each episode's turns seeded on their own
        ],
        env=learner_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(run_dir)
    assert len(records) == 2
    for r in records:
        assert r["episode/error_frac"] == 0.0
        assert 1.0 <= r["episode/turns_mean"] <= 3.0
        # every episode's sampled tokens were loss tokens (trained on, or skipped for a zero
        # advantage: the random model's episodes all score alike); tool/template tokens were not
        assert r["tokens/trained"] + r["tokens/skipped"] == r["tokens/generated"] > 0
    assert [("eval/reward/mean" in r) for r in records] == [False, True]
    r = records[-1]
    assert r["eval/prompts"] == 3.0 and r["eval/episode/error_frac"] == 0.0
    assert 1.0 <= r["eval/episode/turns_mean"] <= 3.0
    assert r["eval/reward/mean"] <= r["eval/reward/best_of_n"]
    assert r["eval/weight_version"] == r["weight_version"]
    samples = [json.loads(x) for x in (run_dir / "eval" / "step_2.jsonl").read_text().splitlines()]
    from rewards.builtin.calculator import CalculatorEnv

    test_tasks = CalculatorEnv.list_tasks("test")[:3]  # eval.split's default
    assert [s["task"] for s in samples] == [t for t in test_tasks for _ in range(2)]
    assert all(s["messages"][0]["role"] in ("system", "user") for s in samples)


@pytest.mark.parametrize("level", [1, 2])
def test_colocated_mode_sleeps_the_server_while_training(tmp_path, level):
    run_dir = tmp_path / f"colocated{level}"
    run_ok(run_dir, "run.steps=3", f"rollout.sleep_while_training={level}")
    records = read_metrics(run_dir)
    # every step generated with the weights synced after the previous step, even after level 2
    assert [r["weight_version/min"] for r in records] == [0.0, 1.0, 2.0]
    log = (run_dir / "rollout_server.log").read_text()
    assert log.count("POST /sleep") == 3 and log.count("POST /wake_up") == 6
    # what the server served as the run ended, read awake, right before it was stopped
    served = json.loads((run_dir / "served_checksum.rank0.json").read_text())
    assert served["weight_version"] == 3 and "error" not in served, served


def test_overlap_never_exceeds_the_staleness_bound(tmp_path):
    run_dir = tmp_path / "overlap"
    run_ok(run_dir, "run.steps=6", "rollout.max_staleness=1")
    records = read_metrics(run_dir)
    staleness = [r["staleness"] for r in records]
    assert max(staleness) <= 1
    assert staleness[0] == 0 and staleness.count(1) >= 4  # generation really ran ahead
    # each batch was generated one version behind the weights it was trained from
    assert [r["weight_version/min"] for r in records] == [0, 0, 1, 2, 3, 4]
    assert [int(r["data/fingerprint"]) for r in records] == _expected_fingerprints(6)


def test_lora_run_syncs_merged_weights_to_the_server(tmp_path, start_server):
    """A LoRA run against a real server: the server ends holding exactly the merged model the
    learner saved (its weights' digest is the digest of ``final``), not the base weights."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from rollout_server.client import RolloutClient
    from rollout_server.settings import ServerSettings
    from rollout_server.tiny import save_tiny_model
    from rollout_server.weight_digest import params_checksum

    run_dir = tmp_path / "lora"
    demo = load_config(DEMO)  # the server serves the model the run makes for itself
    save_tiny_model(run_dir / "model", seed=demo.run.seed, **demo.model.tiny)

    async def served(url: str) -> float:
        async with RolloutClient(url) as client:
            (answer,) = await client.weights_checksum()
            return answer.checksum

    with start_server(ServerSettings(model=str(run_dir / "model"))) as server:
        base_digest = asyncio.run(served(server.url))
        run_ok(
            run_dir,
            "run.steps=3",
            "model.lora.r=4",
            "grpo.beta=0.05",
            f'rollout.servers=["{server.url}"]',
        )
        served_digest = asyncio.run(served(server.url))
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32)
    assert served_digest == pytest.approx(params_checksum(merged), rel=1e-9)
    assert served_digest != pytest.approx(base_digest, rel=1e-9)
    records = read_metrics(run_dir)
    assert [r["weight_version"] for r in records] == [1, 2, 3]
    assert all("kl" in r for r in records)
    # final: a plain model with the adapter merged (what the servers got), and the adapter alone
    from safetensors.torch import load_file

    base = load_file(str(run_dir / "model" / "model.safetensors"))
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    assert final.keys() == base.keys()
    changed = [k for k in base if not torch.equal(base[k], final[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed), changed
    assert (run_dir / "final" / "adapter" / "adapter_config.json").exists()


@pytest.mark.slow
def test_qlora_run_checkpoints_the_adapter_alone_and_resumes(tmp_path):
    pytest.importorskip("bitsandbytes")
    run_dir = tmp_path / "qlora"
    qlora = ("model.lora.r=4", 'model.lora.quantization="nf4"', "run.checkpoint_every=2")
    run_ok(run_dir, "run.steps=2", *qlora)
    ckpt = run_dir / "checkpoints" / "step_000002"
    files = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    assert "adapter/adapter_model.safetensors" in files, files
    assert not any(f.startswith("model") for f in files), files  # no frozen base weights
    proc = run_ok(run_dir, "run.steps=4", *qlora, resume=True)
    assert "resumed from" in proc.stderr
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [int(r["data/fingerprint"]) for r in records] == _expected_fingerprints(4)


def test_ignore_eos_and_no_final_save(tmp_path):
    run_dir = tmp_path / "fixed"
    run_ok(run_dir, "run.steps=2", "sampling.ignore_eos=true", "run.save_final=false")
    records = read_metrics(run_dir)
    max_tokens = load_config(DEMO).sampling.max_tokens
    assert all(r["completion/len_mean"] == max_tokens for r in records)  # EOS never stops one
    assert not (run_dir / "final").exists()


def test_fresh_run_syncs_a_server_that_another_learner_updated(
    tmp_path, start_server, tiny_model_dir
):
    """An external server that serves updated weights (here: version 3, the embedding zeroed)
    gets this learner's weights before the first generation, not another run's."""
    import asyncio

    import torch
    from safetensors.torch import load_file

    from rollout_server.client import RolloutClient
    from rollout_server.settings import ServerSettings

    emb = "model.embed_tokens.weight"
    zeroed = torch.zeros_like(load_file(str(tiny_model_dir / "model.safetensors"))[emb])

    async def update_three_times(url: str) -> int:
        async with RolloutClient(url) as client:
            for _ in range(3):
                (answer,) = await client.update_weights([(emb, zeroed)])
            return answer.weight_version

    with start_server(ServerSettings(model=str(tiny_model_dir))) as server:
        assert asyncio.run(update_three_times(server.url)) == 3
        run_dir = tmp_path / "run"
        proc = run_ok(
            run_dir,
            "run.steps=2",
            f'model.name_or_path="{tiny_model_dir}"',
            f'rollout.servers=["{server.url}"]',
        )
    assert "serve weight versions [3], not the weights they loaded" in proc.stderr
    records = read_metrics(run_dir)
    assert [r["weight_version/min"] for r in records] == [4.0, 5.0]  # the learner's, then its own
    assert [r["staleness"] for r in records] == [0.0, 0.0]


def test_a_config_over_the_servers_limits_stops_before_any_step(
    tmp_path, start_server, tiny_model_dir
):
    from learner.servers.embedded import limit_args
    from rollout_server.protocol import Limits
    from rollout_server.settings import ServerSettings

    settings = ServerSettings(model=str(tiny_model_dir), limits=Limits(max_n=4))
    with start_server(settings) as server:
        proc = subprocess.run(
            learner_cmd(tmp_path / "run", "--set", f'rollout.servers=["{server.url}"]'),
            env=learner_env(),
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"sampling.num_generations = 8 is over the rollout server {server.url}'s limit " in (
        proc.stderr
    )
    assert "max_n = 4: lower it, or start the server with --max-n 8" in proc.stderr
    assert read_metrics(tmp_path / "run") == []  # no step ran
    # the embedded server is started with limits that fit the config
    cfg = load_config(DEMO, ["sampling.num_generations=80", "sampling.max_tokens=5000"])
    assert limit_args(cfg) == ["--max-n", "80", "--max-tokens", "5000"]
    assert limit_args(load_config(DEMO)) == []


def test_a_restarted_server_gets_the_weights_again_and_the_run_goes_on(tmp_path, tiny_model_dir):
    """The external server is SIGKILLed after step 2 and started again on its port: it serves
    its base weights (version 0), so the learner syncs again (and regenerates the prompts it
    was generating); the run ends with every step and the data order unchanged."""
    from grpo_common.net import free_port

    port = free_port()
    serve = [sys.executable, "-m", "rollout_server", "--model", str(tiny_model_dir)]
    serve += ["--engine", "transformers", "--port", str(port), "--log-level", "warning"]

    def start() -> subprocess.Popen:
        return subprocess.Popen(serve, env=learner_env(), stderr=subprocess.DEVNULL)

    server = start()
    run_dir = tmp_path / "run"
    sets = ["run.steps=5", "run.progress_bar=false", "rollout.max_retries=7"]
    sets += [
        f'model.name_or_path="{tiny_model_dir}"',
        f'rollout.servers=["http://127.0.0.1:{port}"]',
    ]
    learner = spawn_learner(run_dir, *sets)
    try:
        kill_after_step(run_dir, learner, server, 2)
        server = start()
        _, err = learner.communicate(timeout=300)
    finally:
        learner.kill()
        server.kill()
        server.wait()
    assert learner.returncode == 0, err[-3000:]
    # killed while generating: the samples come back at version 0, the learner syncs again and
    # regenerates; killed while syncing or training: the sync waits for the server and retries
    assert "(restarted?): syncing again" in err or "waiting for the rollout servers" in err
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["staleness"] for r in records] == [0.0] * 5
    assert [int(r["data/fingerprint"]) for r in records] == _expected_fingerprints(5)
    # the restarted server got the learner's version, not 1 again
    assert [r["weight_version"] for r in records] == [1, 2, 3, 4, 5]


def test_a_sync_is_retried_only_when_a_server_went_away():
    from learner.servers.pool import server_went_away
    from rollout_server.client import RolloutHTTPError, RolloutUnavailableError, WeightSyncError

    def wrapped(cause: Exception) -> WeightSyncError:
        try:
            raise WeightSyncError("http://s", "update aborted") from cause
        except WeightSyncError as e:
            return e

    gone = RolloutUnavailableError("http://s", "POST /weights/begin failed to connect")
    lost = RolloutHTTPError("http://s", "POST", "/weights/bucket", 404, "no open weight update")
    refused = RolloutHTTPError("http://s", "POST", "/weights/commit", 400, "unknown tensor")
    assert server_went_away(wrapped(gone)) and server_went_away(wrapped(lost))
    assert not server_went_away(wrapped(refused))
