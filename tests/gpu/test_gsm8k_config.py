"""learner/configs/gsm8k.toml as shipped, on one GPU: the learner starts its own colocated vLLM
rollout server (``rollout.embedded``: sleep mode, CUDA IPC syncs), reads a dataset laid out as
openai/gsm8k on the Hub (a local copy: the GPU machine reaches no Hub) through its subset, split
and prompt template, and grades with math_accuracy. The random-weight Qwen3-0.6B-shaped model
stands in for Qwen/Qwen3-0.6B: two steps, the start-of-run and final evaluations, the final model.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# over the suite's 300 s per test: the colocated run is allowed 480 s
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def _gsm8k_like(count: int, offset: int) -> list[dict[str, str]]:
    rows = []
    for i in range(offset, offset + count):
        a, b = 3 + i % 7, 4 + i % 5
        rows.append(
            {"question": f"What is {a} times {b}?", "answer": f"{a} * {b} = {a * b}\n#### {a * b}"}
        )
    return rows


# DAPO's dynamic sampling (its refill rounds go to the colocated server before it sleeps) and
# GSPO's sequence-level ratio over two passes (the second off-policy). math_accuracy is 0 for
# every sample of the random model, so no group would train; a length-in-chars reward makes
# most groups informative but seldom all 16 (about 1 sample in 5 of this model holds any text:
# 0.18 % of its ids decode to some), so a step still refills and GSPO's passes train.
DAPO_GSPO = [
    "grpo.dynamic_sampling=true",
    "grpo.max_sampling_rounds=2",
    'grpo.importance_sampling_level="sequence"',
    "grpo.num_iterations=2",
    'rewards=[{name="math_accuracy"}, {name="length", kwargs={unit="chars", target=100}}]',
]


@pytest.mark.parametrize("extra", [[], DAPO_GSPO], ids=["as_shipped", "dapo_gspo"])
def test_gsm8k_config_runs_colocated_on_one_gpu(qwen3_dir, tmp_path, log_dir, extra):
    from gpu_common import gpu_env

    from learner.run.metrics import read_metrics
    from tests.learner.test_config_data_batch import write_hub_layout

    held_out = _gsm8k_like(16, 100)
    hub = write_hub_layout(tmp_path / "gsm8k", {"train": _gsm8k_like(64, 0), "test": held_out})
    run = tmp_path / "run"
    sets = [
        f"model.name_or_path={qwen3_dir}",
        f"data.path={hub}",
        f"eval.data={hub}",
        "eval.at_start=true",
        "eval.max_prompts=16",
        "run.steps=2",
        "grpo.prompts_per_step=16",
        "sampling.max_tokens=128",
        "run.progress_bar=false",
        *extra,
    ]
    cmd = [sys.executable, "-m", "learner", "--config", str(ROOT / "learner/configs/gsm8k.toml"),
           "--run-dir", str(run), *(a for s in sets for a in ("--set", s))]  # fmt: skip
    proc = subprocess.run(cmd, env=gpu_env("0"), capture_output=True, text=True, timeout=480)
    name = "test_gsm8k_config" + (".dapo_gspo" if extra else "")
    if (run / "rollout_server.log").exists():
        shutil.copy(run / "rollout_server.log", log_dir / f"{name}.server.log")
    (log_dir / f"{name}.learner.log").write_text(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = {int(r["step"]): r for r in read_metrics(run)}
    assert sorted(records) == [0, 1, 2]
    for step in (1, 2):
        r = records[step]
        assert 0.0 <= r["reward/math_accuracy/mean"] <= 1.0
        assert r["weight_version"] == step
        assert 0 < r["completion/len_mean"] <= 128
        if extra:  # a round adds 16 prompts' groups; one round only if all 16 were informative
            rounds = r["sampling/rounds"]
            assert rounds in (1.0, 2.0) and r["sampling/groups_generated"] == 16 * rounds
            assert rounds == 2.0 or r["sampling/informative_frac"] == 1.0
    if extra:  # GSPO's two passes trained on informative groups (a loss may still be ~0:
        # equal-length completions' centred advantages cancel in it, their gradients do not)
        for step in (1, 2):
            assert records[step]["tokens/trained"] > 0 and records[step]["grad_norm"] > 0, step
    for step in (0, 2):  # the starting weights and the last step's
        assert records[step]["eval/prompts"] == 16.0
    samples = [json.loads(x) for x in (run / "eval" / "step_2.jsonl").read_text().splitlines()]
    system, user = samples[0]["prompt"]
    assert system["role"] == "system" and user["content"].startswith(
        held_out[0]["question"] + "\nThink"
    )
    assert (run / "final" / "config.json").exists()
    log = (run / "rollout_server.log").read_text()
    assert "vllm" in log.lower()  # the embedded server ran the vLLM engine
