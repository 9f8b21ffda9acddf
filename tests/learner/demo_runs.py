"""The demo learner as a subprocess, for the end-to-end tests: its command line, environment,
a run that must succeed, a setup that must fail in one line, and waiting for processes to go."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from learner.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "learner" / "configs" / "demo.toml"


def learner_cmd(run_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "learner",
        "--config",
        str(DEMO),
        "--run-dir",
        str(run_dir),
        *args,
    ]


def learner_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def spawn_learner(run_dir: Path, *overrides: str) -> subprocess.Popen:
    """The demo learner with ``--set`` overrides, running: stderr piped (for its log), stdout
    dropped."""
    return subprocess.Popen(
        learner_cmd(run_dir, *(a for o in overrides for a in ("--set", o))),
        env=learner_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_ok(
    run_dir: Path, *overrides: str, timeout: int = 300, resume: bool = False
) -> subprocess.CompletedProcess:
    """Run the demo learner with ``--set`` overrides and require it to succeed."""
    args = [a for o in ("run.progress_bar=false", *overrides) for a in ("--set", o)]
    args += ["--resume"] if resume else []
    proc = subprocess.run(
        learner_cmd(run_dir, *args), env=learner_env(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def wait_gone(scan, text: str, timeout_s: float = 15.0) -> list[int]:
    """Poll ``scan(text)`` (the ``proc_scan`` fixture: processes whose command line holds
    ``text``) until it finds none or ``timeout_s`` passes; what it found last."""
    deadline = time.monotonic() + timeout_s
    while (left := scan(text)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def assert_setup_error(
    run_dir: Path, override: str, message: str, *more: str, model_loads: bool = False
) -> None:
    """The demo with ``--set override`` (and ``more``) stops at setup: exit 2, ``message`` in one
    last line, no traceback, before any model loads (unless ``model_loads``: what only the
    rollout servers can tell comes after the learner's model loaded)."""
    sets = [a for o in (override, *more) for a in ("--set", o)]
    proc = subprocess.run(
        learner_cmd(run_dir, *sets),
        env=learner_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert message in proc.stderr.splitlines()[-1], proc.stderr[-3000:]
    if not model_loads:
        assert "Loading weights" not in proc.stderr  # found before any model loads


def serve_cmd(model: Path, port: int, *args: str) -> list[str]:
    """A rollout server subprocess (transformers engine) for ``model`` on loopback ``port``."""
    return [
        sys.executable, "-m", "rollout_server", "--model", str(model), "--engine",
        "transformers", "--port", str(port), "--log-level", "warning", *args,
    ]  # fmt: skip


def kill_after_step(
    run_dir: Path, learner: subprocess.Popen, server: subprocess.Popen, step: int
) -> None:
    """SIGKILL the server as soon as step ``step``'s metrics are written: the learner is then
    about to generate (or generating) the next step's rollouts."""
    wait_for_step(run_dir, learner, step)
    server.kill()
    server.wait()


def wait_for_step(run_dir: Path, learner: subprocess.Popen, step: int) -> None:
    """Poll until step ``step``'s metrics are written (the learner, still running, has synced
    that step's weights)."""
    deadline = time.monotonic() + 240
    while len(read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []) < step:
        assert time.monotonic() < deadline and learner.poll() is None
        time.sleep(0.01)
