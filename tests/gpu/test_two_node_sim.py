"""The learner across two machines, simulated on one multi-GPU host (docs/multi-node.md): two
``accelerate launch`` invocations of DeepSpeed ZeRO-3 (deploy/accelerate/zero3.yaml),
``--num_machines 2 --machine_rank 0/1``, one process each on GPUs 0 and 1, meeting at a loopback
rendezvous, with NCCL kept off shared memory and peer-to-peer copies (the socket path two hosts
would take, on the loopback interface); a vLLM rollout server on GPU 2 whose weights come over
the NCCL weight group formed with learner rank 0 (on a host of two GPUs the server shares GPU 1
with learner rank 1, with a smaller share of its memory). Ten steps train like the same run launched as
one machine of two processes with the same seed: the same rewards and losses per step, step
times printed.

The server decodes one sequence at a time (``--max-num-seqs 1``): vLLM's numerics depend on the
batch, and the two runs' ranks interleave their requests differently; with batches of one, the
seeded samples are the same in both runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# over the suite's 300 s per test: the server's start and two 10-step runs, each allowed 900 s
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
# the socket transport between the learner "machines" and to the server, as between hosts
NETWORK_PATH = {
    "NCCL_SHM_DISABLE": "1",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
}
REWARD_TOL = 1e-6  # the same samples: the same rewards
LOSS_TOL = 1e-3  # relative: bf16 ZeRO-3 on two ranks either way, the same reductions


@pytest.fixture(scope="module")
def server(qwen3_text_dir, log_dir):
    from gpu_common import ServerProcess, gpu_count

    if gpu_count() < 2:
        pytest.skip("two learner GPUs (the server on a third, or beside rank 1): needs two GPUs")
    gpu, share = ("2", 0.5) if gpu_count() >= 3 else ("1", 0.3)
    mp = pytest.MonkeyPatch()
    for key, value in NETWORK_PATH.items():  # the server's end of the weight group too
        mp.setenv(key, value)
    proc = ServerProcess(
        qwen3_text_dir,
        gpu=gpu,
        gpu_memory_utilization=share,
        extra_args=["--no-enable-prefix-caching", "--max-num-seqs", "1"],
        log_path=log_dir / "test_two_node_sim.server.log",
    )
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()
        mp.undo()


def _learner_args(model: Path, server_url: str, run_dir: Path) -> list[str]:
    from grpo_common.net import free_port

    sync = f'{{type = "nccl", master_address = "127.0.0.1", master_port = {free_port()}}}'
    sets = [
        f'model.name_or_path="{model}"',
        f'rollout.servers=["{server_url}"]',
        f"rollout.sync={sync}",
        f"run.steps={STEPS}",
        "run.checkpoint_every=5",  # checkpoints across the machines: every rank's files
        "run.progress_bar=false",
        "sampling.seed=11",
        # the demo's charset reward is 0 for nearly every sample of a random-weight model;
        # lengths vary with the tokenizer-vocabulary model (qwen3_text_dir): nonzero advantages.
        # No cliff: 32 tokens of its longest (16-character) added token stay under 2 x target.
        'rewards=[{name="length", kwargs={unit="chars", target=300}}]',
        # the demo's 3e-3 suits its hidden-64 model; at this width it collapses the policy onto
        # one long added token within three steps, and every reward is then equal
        "optim.lr=1e-5",
        "sampling.max_tokens=32",
        "eval.max_prompts=4",
        "deepspeed.zero_stage=launch",  # ZeRO-3 as launched, not the plan's ZeRO-2
    ]
    args = ["-m", "learner", "--config", str(ROOT / "learner/configs/demo.toml")]
    return [*args, "--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))]


def _launch(gpus: str, *machine: str) -> tuple[list[str], dict[str, str]]:
    from gpu_common import API_KEY, gpu_env

    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "deploy/accelerate/zero3.yaml"), "--num_processes", "2",
        *machine,
    ]  # fmt: skip
    return cmd, gpu_env(gpus, ROLLOUT_API_KEY=API_KEY, **NETWORK_PATH)


def _two_machines(model: Path, server_url: str, run_dir: Path, log_dir: Path) -> None:
    from grpo_common.net import free_port

    port = str(free_port())
    procs = []
    for rank in (0, 1):
        machine = ("--num_machines", "2", "--machine_rank", str(rank))
        machine += ("--main_process_ip", "127.0.0.1", "--main_process_port", port)
        cmd, env = _launch(str(rank), *machine)
        log = (log_dir / f"test_two_node_sim.machine{rank}.log").open("w")
        cmd += _learner_args(model, server_url, run_dir)
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=ROOT), log))
    for rank, (proc, log) in enumerate(procs):
        try:
            proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        text = (log_dir / f"test_two_node_sim.machine{rank}.log").read_text()
        assert proc.returncode == 0, text[-4000:]
        assert f"process {rank} of 2 (local 0 of 1)" in text  # one process on each machine


def _one_machine(model: Path, server_url: str, run_dir: Path, log_dir: Path) -> None:
    from grpo_common.net import free_port

    cmd, env = _launch("0,1", "--num_machines", "1", "--main_process_port", str(free_port()))
    log = log_dir / "test_two_node_sim.one_machine.log"
    with log.open("w") as out:  # written as it runs: a run cut by a timeout leaves its log
        proc = subprocess.run(
            cmd + _learner_args(model, server_url, run_dir),
            env=env, stdout=out, stderr=out, timeout=900, cwd=ROOT,
        )  # fmt: skip
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert "process 1 of 2 (local 1 of 2)" in text


def test_two_simulated_machines_train_like_one(server, qwen3_text_dir, tmp_path, log_dir):
    from learner.run.metrics import read_metrics

    _two_machines(qwen3_text_dir, server.url, tmp_path / "two", log_dir)
    two = read_metrics(tmp_path / "two")
    (log_dir / "test_two_node_sim.two.metrics.json").write_text(json.dumps(two))
    # before the second run: a run whose rewards were all equal trained nothing to compare
    assert any(r["reward/std"] > 0 for r in two), [
        {k: v for k, v in r.items() if k == "step" or k.startswith(("reward/", "completion/"))}
        for r in two
    ]
    # the server now serves the two-machine run's weights: the one-machine run syncs its own
    # starting weights before its first generation (a server another learner updated)
    _one_machine(qwen3_text_dir, server.url, tmp_path / "one", log_dir)
    one = read_metrics(tmp_path / "one")
    (log_dir / "test_two_node_sim.one.metrics.json").write_text(json.dumps(one))
    for name, records in (("two machines", two), ("one machine", one)):
        times = [r["time/step"] for r in records]
        print(
            f"{name}: step times {[round(t, 2) for t in times]} s, mean {sum(times) / len(times):.2f} s"
        )
    assert len(two) == len(one) == STEPS
    for a, b in zip(two, one, strict=True):
        assert abs(a["reward/mean"] - b["reward/mean"]) <= REWARD_TOL, (a["step"], a, b)
        assert abs(a["loss"] - b["loss"]) <= LOSS_TOL * max(abs(b["loss"]), 1e-3), (a["step"], a, b)
        assert a["data/fingerprint"] == b["data/fingerprint"]
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == [
        "step_000005",
        "step_000010",
    ]
    sums = json.loads((tmp_path / "two" / "rank_checksums.json").read_text())
    assert len(sums) == 2 and sums[0] == sums[1]
