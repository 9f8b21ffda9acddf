"""Colocated on every rank (``[rollout.embedded] per_rank = true``) on 2 GPUs: two DDP learner
processes, each with its own embedded vLLM server on its own GPU, asleep while the learner
trains (``sleep_while_training = 1``) and synced over CUDA IPC from that rank's own buffers.

The learner's own loop (``learner.trainer``: setup, servers, connect, train_step) runs under
``accelerate launch``; before the first step and after every one, each rank asks its server for
its checksum of the weights it serves (``GET /weights/checksum``) and computes its own over the
weights it sent (cast to the server's bf16, ``rollout_server.weight_digest``, the comparison of
tests/gpu/test_ipc_sync.py): they must be equal, on both ranks, with both servers at the
learner's weight version, the two ranks' weights equal, and the weights changed by training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# over the suite's 300 s per test: two colocated servers' start and the run, allowed 560 s
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(700)]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 3

DRIVER = """
import json, sys
import torch
from learner.config import load_config
from learner.servers.pool import EventLoopThread, servers
from learner.sync.tensors import sync_tensors
from learner.trainer import connect, in_flight, train_step
from learner.trainer_setup import setup
from rollout_server.weight_digest import named_checksum

cfg = load_config(sys.argv[1])
run = setup(cfg, resume=False)
acc, loop = run.accelerator, EventLoopThread()
checks = []

def check(conn):
    (served,) = loop.run(conn.client.weights_checksum())
    hf = acc.unwrap_model(run.policy).model
    with torch.no_grad():
        mine = named_checksum((n, t.to(torch.bfloat16)) for n, t in sync_tensors(hf))
    checks.append({"step": run.state.step, "learner_version": run.state.weight_version,
                   "server_version": served.weight_version, "served": served.checksum,
                   "learner": mine, "server": conn.client.servers[0]})

with servers(cfg, run.model_path, run.run_dir, acc) as (urls, key):
    conn = connect(run, loop, urls, key)
    inflight = in_flight(run, conn)
    check(conn)
    while run.state.step < cfg.run.steps:
        if train_step(run, conn, inflight) is not None:
            check(conn)
    inflight.cancel()
    conn.close()
loop.close()
print(json.dumps({"rank": acc.process_index, "checks": checks}), flush=True)
acc.wait_for_everyone()
acc.end_training()
"""


def _config(model_dir: Path, work: Path) -> Path:
    data = work / "prompts.jsonl"
    words = ["apple", "river", "stone", "cloud", "maple", "ember", "tiger", "ocean"]
    data.write_text(
        "".join(
            json.dumps({"prompt": f"Sing about {w}:", "allowed": "aeiou"}) + "\n" for w in words * 4
        )
    )
    cfg = work / "per_rank.toml"
    cfg.write_text(f"""
[model]
name_or_path = "{model_dir}"
dtype = "bfloat16"
[data]
path = "{data}"
[sampling]
num_generations = 4
max_tokens = 32
temperature = 1.0
[[rewards]]
name = "charset"
[grpo]
prompts_per_step = 8
micro_batch_size = 16
[optim]
lr = 1e-3
[rollout]
sleep_while_training = 1
ready_timeout_s = 600
sync = "ipc"
[rollout.embedded]
engine = "vllm"
dtype = "bfloat16"
per_rank = true
startup_timeout_s = 600
extra_args = ["--gpu-memory-utilization", "0.3", "--max-model-len", "1024"]
[run]
steps = {STEPS}
run_dir = "{work / "run"}"
checkpoint_every = 1000000
tensorboard = false
progress_bar = false
save_final = false
""")
    return cfg


def test_every_rank_serves_exactly_the_learners_weights(qwen3_text_dir, log_dir, tmp_path):
    from gpu_common import gpu_count, gpu_env

    from grpo_common.net import free_port

    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    driver = tmp_path / "per_rank_driver.py"
    driver.write_text(DRIVER)
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_processes", "2", "--num_machines", "1", "--main_process_port", str(free_port()),
        "--mixed_precision", "no", "--dynamo_backend", "no",
        str(driver), str(_config(qwen3_text_dir, tmp_path)),
    ]  # fmt: skip
    env = gpu_env("0,1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    learner_log, stdout = log_dir / "test_per_rank_ipc.learner.log", tmp_path / "stdout.txt"
    run_dir = tmp_path / "run"
    try:  # written as it runs: a run cut by a timeout leaves its log
        with learner_log.open("w") as err, stdout.open("w") as out:
            proc = subprocess.run(cmd, env=env, stdout=out, stderr=err, timeout=560, cwd=ROOT)
    finally:
        for k in range(2):  # the servers' logs next to the suite's
            log = run_dir / f"rollout_server.rank{k}.log"
            if log.exists():
                (log_dir / f"test_per_rank_ipc.server{k}.log").write_text(log.read_text())
    assert proc.returncode == 0, learner_log.read_text()[-4000:]
    text = stdout.read_text()
    lines = [json.loads(x) for x in text.splitlines() if x.startswith('{"rank"')]
    by_rank = {line["rank"]: line["checks"] for line in lines}
    assert sorted(by_rank) == [0, 1], text[-3000:]
    assert by_rank[0][0]["server"] != by_rank[1][0]["server"], "the ranks share a server"
    for rank, checks in by_rank.items():
        assert [c["step"] for c in checks] == list(range(STEPS + 1)), checks
        for c in checks:
            print(f"rank {rank} step {c['step']}: served {c['served']!r} learner {c['learner']!r}")
            assert c["server_version"] == c["learner_version"] == c["step"], c
            assert c["served"] == pytest.approx(c["learner"], rel=1e-9), c
        assert checks[-1]["learner"] != checks[0]["learner"], (
            "training left the weights as they were"
        )
    for a, b in zip(by_rank[0], by_rank[1], strict=True):
        assert a["learner"] == b["learner"], (a, b)  # DDP: every rank holds the same weights
