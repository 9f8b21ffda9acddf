"""``[rollout.embedded] per_rank = true``: under ``accelerate launch`` every learner process
starts its own embedded rollout server (colocated on every rank), generates its share of the
prompts there and syncs the weights to it alone; all servers serve one weight version.

On two CPU processes with the demo config: two servers ran (a log each, distinct ports), each
served generate requests and every weight push of the run, both end at the learner's weight
version, the ranks end with identical weights, no server outlives the run, and, seeded, the run
samples and trains exactly as the run with one shared server does (each rank's requests are the
same, and its server holds the same weights).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from learner.run.metrics import read_metrics
from tests.learner.demo_runs import DEMO, ROOT, assert_setup_error, learner_env, wait_gone
from tests.learner.launch import cpu_launch

STEPS = 3
SAME = ("reward/mean", "reward/std", "tokens/generated", "data/fingerprint")  # exactly
CLOSE = ("loss",)  # float32 noise: one server batches both ranks' requests its own way


def _run_two(run_dir: Path, *overrides: str) -> list[dict]:
    cmd = [*cpu_launch(2), "-m", "learner", "--config", str(DEMO), "--run-dir", str(run_dir)]
    for o in (f"run.steps={STEPS}", "run.progress_bar=false", "sampling.seed=7", *overrides):
        cmd += ["--set", o]
    proc = subprocess.run(
        cmd, env=learner_env(), capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    sums = json.loads((run_dir / "rank_checksums.json").read_text())
    assert len(sums) == 2 and sums[0] == sums[1]
    records = read_metrics(run_dir)
    assert len(records) == STEPS and records[-1]["weight_version"] == STEPS
    return records


@pytest.mark.slow
def test_every_rank_generates_on_and_syncs_its_own_server(tmp_path, proc_scan):
    run_dir = tmp_path / "per_rank"
    records = _run_two(run_dir, "rollout.embedded.per_rank=true")
    assert not (run_dir / "rollout_server.log").exists(), "the main process started a server"
    logs = [run_dir / f"rollout_server.rank{k}.log" for k in range(2)]
    ports = set()
    for log in logs:
        text = log.read_text()
        (port,) = re.findall(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", text)
        ports.add(port)
        # each rank's share of every step on its own server (rank 0's also the evaluation)
        assert text.count('"POST /generate HTTP/1.1" 200') >= STEPS, text[-3000:]
        for version in range(1, STEPS + 1):  # every sync, under the learner's versions
            assert f"weights v{version} loaded over http" in text, text[-3000:]
    assert len(ports) == 2, "the two servers share a port"
    assert not wait_gone(proc_scan, str(run_dir / "model")), "a server outlived the run"

    shared = _run_two(tmp_path / "shared")  # one server for both ranks, the same seeds
    assert (tmp_path / "shared" / "rollout_server.log").exists()
    for mine, theirs in zip(records, shared, strict=True):
        for key in SAME:
            assert mine[key] == theirs[key], (key, mine, theirs)
        for key in CLOSE:
            assert abs(mine[key] - theirs[key]) <= 1e-6 * max(1.0, abs(theirs[key])), key


def test_per_rank_takes_no_listed_servers_nor_nccl(tmp_path):
    assert_setup_error(
        tmp_path / "a",
        "rollout.embedded.per_rank=true",
        "rollout.embedded.per_rank: starts a server on every rank",
        'rollout.servers=["http://127.0.0.1:9"]',
    )
    assert_setup_error(
        tmp_path / "b",
        "rollout.embedded.per_rank=true",
        'its weights go over sync = "http" or "ipc"',
        "rollout.sync=nccl",
    )
