"""The GPU suite's setup step and its per-run files, with the real bench/gpu_suite.sh.

A machine where the project and its GPU dependencies import installs nothing; one where they
do not, and no wheel bundle is there, fails in one line naming the pip commands. Each suite
run keeps its logs in a directory of its own, so its archive never holds another run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "bench" / "gpu_suite.sh"


def _suite(tmp_path: Path, steps: str, run_id: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES", "GRPO_BENCH_RUN")}  # fmt: skip
    env |= {"PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
            "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
            "SUITE_STEPS": steps, "SUITE_RUN_ID": run_id, "SUITE_BUDGET_S": "300",
            "WHEEL_PARTS": str(tmp_path / "no-bundle"), **extra}  # fmt: skip
    return subprocess.run(
        ["bash", str(SUITE)], env=env, capture_output=True, text=True, timeout=300
    )


def _step(tmp_path: Path, name: str) -> dict:
    steps = json.loads((tmp_path / "out" / "summary.json").read_text())["steps"]
    return next(s for s in steps if s["step"] == name)


def test_setup_without_the_gpu_extras_names_the_install_command(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") and importlib.util.find_spec("deepspeed"):
        import pytest

        pytest.skip("vLLM and DeepSpeed are installed here")
    proc = _suite(tmp_path, "setup", "nogpu")
    assert proc.returncode == 1, proc.stdout[-2000:]
    step = _step(tmp_path, "setup")
    assert step["status"] == "failed" and step["valid"] is False
    log = (tmp_path / "work" / "runs" / "nogpu" / "logs" / "setup.log").read_text()
    lines = [line for line in log.splitlines() if line.strip()]
    assert len(lines) == 1, log  # one line, no traceback
    assert 'pip install -e ".[vllm,deepspeed]"' in lines[0]
    assert "pip install trl==1.16.0 liger-kernel==0.8.5" in lines[0]
    assert "vllm" in lines[0].split("Install")[0]  # what is missing, by name


def test_setup_where_everything_imports_installs_nothing(tmp_path: Path) -> None:
    """vLLM and DeepSpeed stand-ins that import (this machine has neither), and a wheel bundle
    directory that would fail the offline path if it were taken: setup is ok and installs
    nothing."""
    fake = tmp_path / "site"
    for mod in ("vllm", "deepspeed"):
        (fake / mod).mkdir(parents=True)
        (fake / mod / "__init__.py").write_text('__version__ = "stand-in"\n')
    bundle = tmp_path / "bundle"
    bundle.mkdir()  # present but empty: the offline install would fail on it
    proc = _suite(tmp_path, "setup", "ready", PYTHONPATH=str(fake), WHEEL_PARTS=str(bundle))
    log = (tmp_path / "work" / "runs" / "ready" / "logs" / "setup.log").read_text()
    assert proc.returncode == 0, proc.stdout[-2000:] + log
    assert _step(tmp_path, "setup")["status"] == "ok"
    assert "nothing to install" in log and "vllm stand-in" in log
    assert "wheel bundle" not in log


def test_each_suite_run_archives_only_its_own_logs(tmp_path: Path) -> None:
    """Two runs on one machine (the same $WORK), each a different step: the second's
    logs.tar.gz holds the second's step log only, and the first's stays in its own directory."""
    for run_id, step in (("first", "bench_loss"), ("second", "bench_rollout")):
        _suite(tmp_path, step, run_id)
        with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
            logs = sorted(n for n in tar.getnames() if n.endswith(".log"))
        assert logs == [f"logs/{step}.log"], logs
    assert (tmp_path / "work" / "runs" / "first" / "logs" / "bench_loss.log").is_file()
