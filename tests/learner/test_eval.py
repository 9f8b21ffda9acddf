"""Held-out evaluation while training (``[eval]``): real learner runs on the demo task with its
embedded rollout server, and the config's checks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from learner.config import ConfigError, load_config
from learner.run.metrics import read_metrics
from tests.learner.demo_runs import DEMO, assert_setup_error, learner_env, run_ok
from tests.learner.test_config_data_batch import write_hub_layout

DEMO_EVAL = DEMO.parent.parent / "data" / "demo_eval.jsonl"


def _demo_as_hub_layout(root: Path) -> Path:
    """The demo's training and held-out rows as the ``main`` subset's train and test splits of a
    Hub-layout directory, each prompt's text in an ``instruction`` column (no ``prompt``)."""

    def rows(name: str) -> list[dict]:
        out = []
        for line in (DEMO_EVAL.parent / name).read_text().splitlines():
            row = json.loads(line)
            out.append({"instruction": row.pop("prompt")[-1]["content"], **row})
        return out

    return write_hub_layout(root, {"train": rows("demo.jsonl"), "test": rows("demo_eval.jsonl")})


def test_eval_scores_held_out_prompts_and_writes_the_samples(tmp_path):
    # The data comes as from the Hub (a subset with train and test splits), and the prompts are
    # built by a template and a system prompt: the run trains on one split, evaluates the other.
    hub = _demo_as_hub_layout(tmp_path / "hub")
    run = tmp_path / "run"
    run_ok(
        run,
        f'data.path="{hub}"',
        'data.subset="main"',
        'data.prompt_template="{instruction}"',
        'data.system_prompt="You sing."',
        f'eval.data="{hub}"',  # eval.split "test" by default, the subset data's
        "run.steps=3",
        "sampling.max_tokens=8",
        "eval.every=2",
        "eval.num_generations=3",
        "eval.temperature=1.0",
        "eval.max_prompts=4",
        "eval.at_start=true",
    )
    held_out = [
        json.loads(x)["prompt"][-1]["content"] for x in DEMO_EVAL.read_text().split("\n") if x
    ]
    records = {int(r["step"]): r for r in read_metrics(run)}
    assert sorted(records) == [0, 1, 2, 3]  # step 0: the starting weights (at_start)
    evaluated = [s for s, r in records.items() if "eval/reward/mean" in r]
    assert evaluated == [0, 2, 3]  # every 2 steps, and after the last
    assert "reward/mean" not in records[0]  # step 0 trained nothing
    for step in evaluated:
        r = records[step]
        assert r["eval/prompts"] == 4.0
        assert 0.0 <= r["eval/reward/mean"] <= r["eval/reward/best_of_n"] <= 1.0
        assert r["eval/reward/charset/mean"] == pytest.approx(r["eval/reward/mean"])
        assert 0 < r["eval/completion/len_mean"] <= 8
        samples = [
            json.loads(line)
            for line in (run / "eval" / f"step_{step}.jsonl").read_text().splitlines()
        ]
        assert [(s["row"], s["sample"]) for s in samples] == [
            (i, j) for i in range(4) for j in range(3)
        ]
        assert [s["prompt"] for s in samples[::3]] == [
            [{"role": "system", "content": "You sing."}, {"role": "user", "content": text}]
            for text in held_out[:4]
        ]
        assert all(s["rewards"]["charset"] == s["reward"] for s in samples)
        mean = sum(s["reward"] for s in samples) / len(samples)
        assert mean == pytest.approx(r["eval/reward/mean"])
        if step:  # the weights of that very step
            assert r["eval/weight_version"] == r["weight_version"]
    assert records[0]["eval/weight_version"] == 0.0


def test_eval_data_the_rewards_cannot_use_stops_before_any_model_loads(tmp_path):
    held_out = tmp_path / "held_out.jsonl"  # the demo's reward needs the 'allowed' column
    held_out.write_text(json.dumps({"prompt": "Sing."}) + "\n")
    for override, message in [
        (f'eval.data="{held_out}"', f"eval.data {held_out}: reward function 'charset'"),
        ('eval.data="missing.jsonl"', "eval.data missing.jsonl does not exist"),
    ]:
        assert_setup_error(tmp_path / "run", override, message)


def test_eval_config_checks(tmp_path):
    cfg = load_config(DEMO)
    assert cfg.eval is not None and Path(cfg.eval.data).is_absolute()  # next to the config
    assert Path(cfg.eval.data).exists()
    with pytest.raises(ConfigError, match=r"eval\.num_generations: greedy decoding"):
        load_config(DEMO, ["eval.num_generations=4"])
    load_config(DEMO, ["eval.num_generations=4", "eval.temperature=0.7"])
    with pytest.raises(ConfigError, match=r"\[eval\] takes `data` .* and `split` .* with one"):
        load_config(None, ['environment="calculator"', 'eval.data="x.jsonl"'])
    with pytest.raises(ConfigError, match=r"\[eval\] takes `data`"):
        load_config(None, ['data.path="x.jsonl"', 'rewards=[{name="charset"}]', "eval.every=3"])


def test_learner_eval_evaluates_a_saved_model_without_training(tmp_path):
    import sys

    def learner_eval(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "learner", "eval", "--config", str(DEMO), *args]
        return subprocess.run(argv, env=learner_env(), capture_output=True, text=True, timeout=180)

    out = tmp_path / "base"
    proc = learner_eval("--out", str(out), "--set", "eval.max_prompts=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval/reward/mean" in proc.stdout and f"samples and metrics in {out}" in proc.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval/prompts"] == 4.0 and metrics["model"] == str(out / "model")
    first = (out / "step_0.jsonl").read_text().splitlines()
    assert len(first) == 4
    # the same weights again, named by --model: the same greedy samples
    again = tmp_path / "again"
    proc = learner_eval("--model", str(out / "model"), "--out", str(again), "--set",
                        "eval.max_prompts=4")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = (again / "step_0.jsonl").read_text().splitlines()
    assert [json.loads(x)["completion"] for x in second] == [
        json.loads(x)["completion"] for x in first
    ]
    assert not list((tmp_path / "run").glob("*"))  # nothing trained, no run dir written
    proc = learner_eval("--model", str(out / "model"), "--set",
                        'rollout.servers=["http://127.0.0.1:9"]')  # fmt: skip
    assert proc.returncode == 2 and "rollout.servers serve the weights they hold" in proc.stderr
    proc = learner_eval("--model", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].startswith(f"error: --model '{tmp_path / 'nope'}': no such")


@pytest.mark.slow
def test_eval_of_a_model_directory_writes_beside_it_not_into_the_configs_run_dir(tmp_path):
    import sys

    from rollout_server.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "mine" / "final")
    config_run_dir = tmp_path / "config_run_dir"
    argv = [sys.executable, "-m", "learner", "eval", "--config", str(DEMO), "--model", str(model),
            "--set", "eval.max_prompts=2", "--set", f'run.run_dir="{config_run_dir}"']  # fmt: skip
    proc = subprocess.run(argv, env=learner_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "mine" / "eval" / "final"
    assert f"samples and metrics in {out}" in proc.stdout
    assert json.loads((out / "metrics.json").read_text())["model"] == str(model)
    assert len((out / "step_0.jsonl").read_text().splitlines()) == 2
    assert not config_run_dir.exists()


def test_the_eval_directory_of_each_kind_of_model(tmp_path):
    from learner.cli import eval_dir

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    (run / "final").mkdir()
    assert eval_dir(str(run / "final"), tmp_path / "cfg") == run / "eval" / "final"
    checkpoint = str(run / "checkpoints" / "step_000010")
    assert eval_dir(checkpoint, tmp_path / "cfg") == run / "eval" / "step_000010"
    assert eval_dir("Qwen/Qwen3-0.6B", run) == run / "eval" / "standalone"  # a hub id
    assert eval_dir(None, run) == run / "eval" / "standalone"  # the config's model
