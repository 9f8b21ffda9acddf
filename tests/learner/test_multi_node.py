"""The learner across machines, simulated on this one: two ``accelerate launch`` invocations
(``--num_machines 2 --machine_rank 0/1``, one gloo process each) that meet on a loopback
rendezvous, against one external rollout server, train step for step like the same run launched
as one machine with two processes and the same seed (docs/multi-node.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from learner.run.metrics import read_metrics
from tests.learner.demo_runs import DEMO, ROOT, learner_env

STEPS = 3
COMPARED = ("reward/mean", "reward/std", "loss", "grad_norm", "data/fingerprint")


def launch(*machine: str) -> list[str]:
    """``accelerate launch`` of two gloo processes in all; ``machine`` adds the machine flags."""
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_processes", "2", *machine,
        "--mixed_precision", "no", "--dynamo_backend", "no",
    ]  # fmt: skip


def learner_args(run_dir: Path, server_url: str, model: Path) -> list[str]:
    sets = [
        f"run.steps={STEPS}",
        "run.progress_bar=false",
        "sampling.seed=7",  # the same samples in both runs
        "eval.max_prompts=2",
        f'model.name_or_path="{model}"',
        *([f'rollout.servers=["{server_url}"]'] if server_url else []),  # "": embedded
    ]
    args = ["-m", "learner", "--config", str(DEMO), "--run-dir", str(run_dir)]
    return args + [a for s in sets for a in ("--set", s)]


def run_one_machine(run_dir: Path, server_url: str, model: Path) -> str:
    from grpo_common.net import free_port

    machine = ("--num_machines", "1", "--main_process_port", str(free_port()))
    proc = subprocess.run(
        [*launch(*machine), *learner_args(run_dir, server_url, model)],
        env=learner_env(), capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def run_two_machines(
    run_dir: Path, server_url: str, model: Path, *, run_dir_1: Path | None = None, exit: int = 0
) -> list[str]:
    """Machine 0 and machine 1, each an ``accelerate launch`` of one process, started together
    and meeting at machine 0's rendezvous on 127.0.0.1; machine 1 in ``run_dir_1`` if given (a
    disk the machines do not share). Each must end with ``exit``; their stderr."""
    from grpo_common.net import free_port

    port = str(free_port())
    procs = []
    for rank, where in enumerate((run_dir, run_dir_1 or run_dir)):
        machine = ("--num_machines", "2", "--machine_rank", str(rank))
        machine += ("--main_process_ip", "127.0.0.1", "--main_process_port", port)
        cmd = [*launch(*machine), *learner_args(where, server_url, model)]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        procs.append(subprocess.Popen(cmd, env=learner_env(), text=True, cwd=ROOT, **pipes))
    logs = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == (1 if exit else 0), err[-4000:]  # the launcher's
        assert not exit or f"exitcode  : {exit} " in err, err[-4000:]  # the learner's
        logs.append(err)
    return logs


@pytest.mark.slow
def test_two_machines_train_like_one(tmp_path, start_server, tiny_model_dir):
    from rollout_server.settings import ServerSettings

    settings = ServerSettings(model=str(tiny_model_dir))
    with start_server(settings) as server:
        logs = run_two_machines(tmp_path / "two", server.url, tiny_model_dir)
    with start_server(settings) as server:  # a fresh server: both runs start from its weights
        one = run_one_machine(tmp_path / "one", server.url, tiny_model_dir)

    # each machine ran one process of the two: rank 0 on machine 0, rank 1 on machine 1
    assert "process 0 of 2 (local 0 of 1)" in logs[0], logs[0][-3000:]
    assert "process 1 of 2 (local 0 of 1)" in logs[1], logs[1][-3000:]
    assert "process 1 of 2 (local 1 of 2)" in one  # one machine: rank 1 is its second process
    two_records, one_records = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    assert len(two_records) == len(one_records) == STEPS
    for a, b in zip(two_records, one_records, strict=True):
        for key in COMPARED:
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(b[key])), (key, a, b)
    assert [r["weight_version"] for r in two_records] == [1.0, 2.0, 3.0]
    two_sums = json.loads((tmp_path / "two" / "rank_checksums.json").read_text())
    one_sums = json.loads((tmp_path / "one" / "rank_checksums.json").read_text())
    assert len(two_sums) == 2 and two_sums[0] == two_sums[1]
    # float32 noise: the server's batches (two ranks' requests) need not line up the same way
    assert abs(two_sums[0] - one_sums[0]) <= 1e-6 * abs(one_sums[0])


def test_a_run_dir_the_machines_do_not_share_stops_every_rank_at_setup(tmp_path, tiny_model_dir):
    """Machine 1 given another directory than machine 0 (as a local disk would be): both stop
    before any model loads, naming the setting, instead of writing checkpoints that hold only
    machine 0's files."""
    logs = run_two_machines(
        tmp_path / "m0", "http://127.0.0.1:9", tiny_model_dir, run_dir_1=tmp_path / "m1", exit=2
    )
    for err in logs:
        last = [line for line in err.splitlines() if line.startswith("error: ")][-1]
        assert "run.run_dir" in last and "is not shared by every process: process(es) [1]" in last
        # the learner's own one line (the launcher reports the exit with its own traceback)
        assert f'File "{ROOT / "learner"}' not in err and "Loading weights" not in err


def test_an_embedded_server_across_machines_stops_every_rank_at_setup(tmp_path, tiny_model_dir):
    """Without rollout.servers the main process would start a server on machine 0's loopback,
    which machine 1's process cannot reach: both stop before any model loads, naming the
    setting."""
    logs = run_two_machines(tmp_path / "run", "", tiny_model_dir, exit=2)
    for err in logs:
        last = [line for line in err.splitlines() if line.startswith("error: ")][-1]
        assert "the learner runs on 2 machines and rollout.servers is empty" in last
        assert "Loading weights" not in err
    assert not (tmp_path / "run" / "rollout_server.log").exists()  # no server started


def test_a_loopback_nccl_rendezvous_with_servers_on_other_hosts_is_named():
    """The NCCL weight group's rendezvous (rollout.sync.master_address) must be reachable from
    the servers' hosts: its loopback default with a server elsewhere is warned about by name."""
    from learner.sync.nccl_group import loopback_master

    local = ["http://127.0.0.1:8000", "http://localhost:8001"]
    assert loopback_master("127.0.0.1", local) is None
    assert loopback_master("10.0.0.1", ["http://10.0.0.2:8000"]) is None
    why = loopback_master("127.0.0.1", [*local, "http://gpu-node-2:8000"])
    assert why is not None and "rollout.sync.master_address = 127.0.0.1" in why
    assert "['http://gpu-node-2:8000']" in why and "machine_rank 0" in why
