"""deploy/slurm/grpo.sbatch through its dry run (``DRY_RUN=1``) with a fake SLURM environment: the
commands it would run are parsed and checked, the learner's through accelerate's parser and the
learner's config loader, the servers' through the rollout server's CLI, and the config check it
runs first is run for real.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "slurm" / "grpo.sbatch"
KEY = "s3cr3t-key-for-the-test"


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "rollout_key"
    path.write_text(KEY + "\n")
    return path


def dry_run(key_file: Path, nodelist: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ROLLOUT_"))}
    base.update(
        DRY_RUN="1",
        SLURM_JOB_NODELIST=nodelist,
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_JOB_ID="4242",
        MODEL="Qwen/Qwen3-0.6B",
        LEARNER_CONFIG=str(ROOT / "learner" / "configs" / "demo.toml"),
        ROLLOUT_API_KEY_FILE=str(key_file),
        GPUS_PER_NODE="4",
    )
    base.update(env)
    return subprocess.run(
        ["bash", str(SCRIPT)], env=base, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def commands(out: subprocess.CompletedProcess) -> tuple[list[str], list[list[str]]]:
    assert out.returncode == 0, out.stderr
    lines = [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]
    check, steps = lines[0], lines[1:]
    assert all(s[0] == "srun" for s in steps)
    return check, steps


def srun_split(step: list[str]) -> tuple[dict[str, str], list[str]]:
    """srun's own --options, and the command it runs."""
    opts, i = {}, 1
    while step[i].startswith("--"):
        name, _, value = step[i][2:].partition("=")
        opts[name] = value
        i += 1
    return opts, step[i:]


def learner_launch(command: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    from accelerate.commands.launch import launch_command_parser

    from learner.cli import train_parser

    assert command[:2] == ["accelerate", "launch"]
    args = launch_command_parser().parse_args(command[2:])
    assert args.module and args.training_script == "learner"
    return args, train_parser().parse_args(args.training_script_args)


def test_every_node_gets_one_command_servers_first(key_file: Path) -> None:
    out = dry_run(key_file, "gpu[01-03],cpu7,node[8-10]", SERVER_NODES="2")
    nodes = ["gpu01", "gpu02", "gpu03", "cpu7", "node8", "node9", "node10"]
    _, steps = commands(out)
    split = [srun_split(s) for s in steps]
    assert [o["nodelist"] for o, _ in split] == nodes
    assert all(o["nodes"] == "1" and o["ntasks"] == "1" for o, _ in split)
    # a step gets only what it asks for: the node's GPUs and CPUs
    assert all(o["gpus-per-node"] == "4" and o["cpus-per-task"] == "16" for o, _ in split)
    assert [c[0] for _, c in split] == ["rollout-server"] * 2 + ["accelerate"] * 5


def test_learner_ranks_rendezvous_and_servers_list(
    key_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from learner.config import load_config

    out = dry_run(key_file, "gpu[01-05]", SERVER_NODES="2", RUN_DIR="/shared/runs/r1")
    _, steps = commands(out)
    learners = [srun_split(s) for s in steps[2:]]
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    for rank, (_, command) in enumerate(learners):
        args, learner_args = learner_launch(command)
        assert args.machine_rank == rank
        assert args.num_machines == 3 and args.num_processes == 3 * 4
        assert args.main_process_ip == "gpu03" and args.main_process_port == 29500
        assert (ROOT / args.config_file).is_file()
        assert learner_args.resume and learner_args.run_dir == "/shared/runs/r1"
        cfg = load_config(learner_args.config, learner_args.overrides)
        assert cfg.rollout.servers == ["http://gpu01:8000", "http://gpu02:8000"]
        assert cfg.rollout.api_key_file == str(key_file) and cfg.rollout.api_key is None
        assert cfg.rollout.key() == KEY
        assert cfg.rollout.sync.type == "nccl"
        assert (cfg.rollout.sync.master_address, cfg.rollout.sync.master_port) == ("gpu03", 29600)
        assert cfg.model.name_or_path == "Qwen/Qwen3-0.6B"


def test_servers_read_the_key_from_a_file_never_the_command_line(
    key_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollout_server.cli import build_parser, settings_from_args

    out = dry_run(key_file, "a,b,c", SERVER_NODES="1", SERVER_ARGS="--max-model-len 4096")
    assert KEY not in out.stdout and KEY not in out.stderr
    _, steps = commands(out)
    _, command = srun_split(steps[0])
    assert command[0] == "rollout-server" and "--api-key" not in command
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    settings = settings_from_args(build_parser().parse_args(command[1:]))
    assert settings.api_key == KEY and settings.host == "0.0.0.0" and settings.port == 8000
    assert settings.engine == "vllm" and settings.max_model_len == 4096


def test_tls_gives_https_servers(key_file: Path, tmp_path: Path) -> None:
    out = dry_run(
        key_file, "a,b", SSL_CERTFILE=str(tmp_path / "c.pem"), SSL_KEYFILE=str(tmp_path / "k.pem")
    )
    _, steps = commands(out)
    _, server = srun_split(steps[0])
    assert server[server.index("--ssl-certfile") + 1] == str(tmp_path / "c.pem")
    _, learner = srun_split(steps[1])
    assert 'rollout.servers=["https://a:8000"]' in learner


def test_the_config_check_runs_the_learner_command_first(key_file: Path) -> None:
    out = dry_run(key_file, "a,b,c", SERVER_NODES="1")
    check, steps = commands(out)
    _, rank0 = srun_split(steps[1])
    assert check[:2] == ["python", str(ROOT / "deploy" / "check_config.py")]
    assert check[2:] == rank0
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_API_KEY"}
    # the job's environment: the one with the package installed first on PATH
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    ran = subprocess.run(check, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    bad = subprocess.run(
        [*check, "--set", "optim.lr=-1"], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "optim.lr" in bad.stderr


@pytest.mark.parametrize(
    ("nodelist", "env", "message"),
    [
        ("a,b", {"SERVER_NODES": "2"}, "need SERVER_NODES=2"),
        ("a,b", {"ROLLOUT_API_KEY_FILE": "/nonexistent/key"}, "no API key in /nonexistent/key"),
        ("a[1-2]b[3]", {}, "without scontrol"),
    ],
)
def test_refuses_what_it_cannot_launch(
    key_file: Path, nodelist: str, env: dict[str, str], message: str
) -> None:
    out = dry_run(key_file, nodelist, **env)
    assert out.returncode == 2 and message in out.stderr and not out.stdout
