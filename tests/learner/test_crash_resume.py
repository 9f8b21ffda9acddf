"""Real crashes: the learner (or its embedded rollout server) SIGKILLed at chosen moments, then
``--resume``. What must hold: no process outlives the learner, the run continues from its newest
complete checkpoint, and the step counter, weight version, metrics and data order go on as if
nothing had happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "learner" / "configs" / "demo.toml"
QUIET = ("run.progress_bar=false", "run.tensorboard=false", "run.save_final=false")


def _cmd(run_dir: Path, *overrides: str, resume: bool = False) -> list[str]:
    sets = [a for o in (*QUIET, *overrides) for a in ("--set", o)]
    return [
        sys.executable,
        "-m",
        "learner",
        "--config",
        str(DEMO),
        "--run-dir",
        str(run_dir),
        *sets,
        *(["--resume"] if resume else []),
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def _kill_when(
    run_dir: Path, overrides: tuple[str, ...], when: Callable[[], bool], timeout_s: float = 120
) -> None:
    """Start the learner, SIGKILL it as soon as ``when()`` holds (polled every millisecond)."""
    log = (run_dir.parent / f"{run_dir.name}.log").open("ab")
    proc = subprocess.Popen(_cmd(run_dir, *overrides), env=_env(), stdout=log, stderr=log)
    deadline = time.monotonic() + timeout_s
    try:
        while not when():
            assert proc.poll() is None, f"the learner exited ({proc.returncode}) before the kill"
            assert time.monotonic() < deadline, "the moment to kill never came"
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        log.close()


def _resume(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        _cmd(run_dir, *overrides, resume=True),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _gone_within(scan: Callable[[str], list[int]], text: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := scan(text)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_a_learner_killed_mid_generation_leaves_no_server_behind(tmp_path, proc_scan):
    """SIGTERM alone (PR_SET_PDEATHSIG) let uvicorn finish the generation in flight first: the
    orphan ran on for as long as that generation (here over a minute)."""
    run_dir = tmp_path / "run"
    server_log = run_dir / "rollout_server.log"
    started: list[float] = []

    def generating() -> bool:  # the first /generate is in flight from ready + ~1 s for a minute
        if not started and server_log.exists() and "startup complete" in server_log.read_text():
            started.append(time.monotonic())
        return bool(started) and time.monotonic() - started[0] > 3

    long_samples = ("sampling.max_tokens=2048", "sampling.ignore_eos=true")
    _kill_when(run_dir, long_samples, generating)
    assert "POST /generate" not in server_log.read_text(), "the generation ended before the kill"
    left = _gone_within(proc_scan, str(run_dir / "model"), 12)
    for pid in left:  # not to leave it running after the failure
        os.kill(pid, signal.SIGKILL)
    assert not left, f"rollout server {left} outlived the SIGKILLed learner by 12 s"
