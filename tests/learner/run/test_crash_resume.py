"""Real crashes: the learner (or its embedded rollout server) SIGKILLed at chosen moments, then
``--resume``. What must hold: no process outlives the learner, the run continues from its newest
complete checkpoint, and the step counter, weight version, metrics and data order go on as if
nothing had happened.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from learner.run.checkpoint import latest_checkpoint
from learner.run.metrics import MetricsLogger, read_metrics
from learner.run.runtime import check_fresh_run_dir
from tests.learner.demo_runs import learner_cmd, learner_env, wait_gone

QUIET = ("run.progress_bar=false", "run.tensorboard=false", "run.save_final=false")


def _cmd(run_dir: Path, *overrides: str, resume: bool = False) -> list[str]:
    sets = [a for o in (*QUIET, *overrides) for a in ("--set", o)]
    return learner_cmd(run_dir, *sets, *(["--resume"] if resume else []))


def _kill_when(
    run_dir: Path, overrides: tuple[str, ...], when: Callable[[], bool], timeout_s: float = 120
) -> None:
    """Start the learner, SIGKILL it as soon as ``when()`` holds (polled every millisecond)."""
    log = (run_dir.parent / f"{run_dir.name}.log").open("ab")
    proc = subprocess.Popen(_cmd(run_dir, *overrides), env=learner_env(), stdout=log, stderr=log)
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
        env=learner_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _trained_steps(run_dir: Path) -> list[int]:
    return [int(r["step"]) for r in read_metrics(run_dir) if r["step"] > 0]


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


@pytest.mark.slow
def test_a_checkpoint_cut_off_mid_write_is_deleted_and_the_one_before_resumes(tmp_path):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    cut = ckpts / ".tmp-step_000002"
    _kill_when(run_dir, ("run.steps=4", "run.checkpoint_every=1"), cut.exists)
    assert cut.is_dir() and not (ckpts / "step_000002").exists()

    done = _resume(run_dir, "run.steps=3", "run.checkpoint_every=5")  # saves step 3, not 2
    assert "step_000001 at step 1" in done.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001", "step_000003"]
    assert _trained_steps(run_dir) == [1, 2, 3]


_SAVE_ONE = """
import sys
from pathlib import Path
import torch
from accelerate import Accelerator
from learner.run.checkpoint import save_checkpoint
acc = Accelerator(cpu=True)
model, opt = acc.prepare(torch.nn.Linear(4, 4), torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]))
save_checkpoint(acc, Path(sys.argv[1]), 7, keep=2)
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_a_checkpoint_is_on_disk_before_its_name_appears(tmp_path):
    """A host crash keeps the rename but may lose unsynced data: every file and the directory
    must be fsynced before the rename, and the rename itself after it (strace's record)."""
    trace = tmp_path / "trace.txt"
    strace = [
        "strace",
        "-f",
        "-qq",
        "-y",
        "-o",
        str(trace),
        "-e",
        "trace=fsync,rename,renameat,renameat2",
    ]
    subprocess.run(
        [*strace, sys.executable, "-c", _SAVE_ONE, str(tmp_path / "run")],
        env=learner_env(),
        check=True,
        timeout=120,
    )
    ckpts = tmp_path / "run" / "checkpoints"
    tmp, final = ckpts / ".tmp-step_000007", ckpts / "step_000007"
    calls = [line.split(None, 1)[1] for line in trace.read_text().splitlines()]
    renamed = next(i for i, c in enumerate(calls) if c.startswith("rename") and str(final) in c)
    synced_before = {c for c in calls[:renamed] if c.startswith("fsync(")}
    files = sorted(p.name for p in final.iterdir())
    assert "model.safetensors" in files and "optimizer.bin" in files
    for name in [*files, ""]:  # "": the directory itself
        path = str(tmp / name).rstrip("/")
        assert any(f"<{path}>)" in c for c in synced_before), f"{path} not fsynced before rename"
    assert any(f"<{ckpts}>)" in c for c in calls[renamed:] if c.startswith("fsync(")), (
        "the checkpoints directory was not fsynced after the rename"
    )


def test_a_metrics_record_cut_off_by_a_host_crash_is_dropped_on_resume(tmp_path):
    """metrics.jsonl is flushed, not fsynced: after a host crash its tail may be a partial record
    or zeros. The resumed run's logger must read past it, not stop on a JSONDecodeError."""
    path = tmp_path / "metrics.jsonl"
    records = "".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2, 3))
    for tail in ('{"step": 4, "lo', "\0" * 40):
        path.write_text(records + tail)
        logger = MetricsLogger(
            tmp_path, total_steps=5, start_step=2, tensorboard=False, progress_bar=False
        )
        logger.log(3, {"loss": 0.25})
        logger.close()
        assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [
            (1, 0.5),
            (2, 0.5),
            (3, 0.25),
        ]
        assert len(path.read_text().splitlines()) == 3
    path.write_text(records.replace("\n", "\n" + "\0" * 8 + "\n", 1))  # damage inside: an error
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON record"):
        read_metrics(tmp_path)


def test_a_killed_embedded_server_stops_the_run_with_a_named_error(tmp_path, proc_scan):
    """The run stops with an error saying how the server died, not with the client's bare 'All
    connection attempts failed'."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _cmd(run_dir, "run.steps=20"),
        env=learner_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and '"step": 2,' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "no second step"
        time.sleep(0.05)
    (server,) = proc_scan(str(run_dir / "model"))
    os.kill(server, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    last = stderr.strip().splitlines()
    assert any(
        line.startswith(
            "learner.servers.embedded.EmbeddedServerError: the embedded rollout server died "
            "during the run (killed by SIGKILL: out of memory?)"
        )
        for line in last
    ), stderr[-3000:]
    assert "--resume continues it from its last checkpoint" in stderr


def test_a_file_sync_cut_off_by_a_kill_leaves_no_copy_of_the_weights_behind(tmp_path):
    """A learner killed while writing the weights file left ``.weights.<pid>.tmp`` (a full copy
    of the weights) on the shared disk for good, one per crash. The write lasts too short on
    the demo model to be hit by a kill reliably, so the test places what such a kill leaves."""
    sync_dir = tmp_path / "sync"
    sync_dir.mkdir()
    (sync_dir / ".weights.safetensors.tmp").write_bytes(b"\0" * 4096)  # a cut-off write
    run_dir = tmp_path / "run"
    file_sync = ('rollout.sync="file"', f'rollout.sync.dir="{sync_dir}"', "run.steps=1")
    done = subprocess.run(
        _cmd(run_dir, *file_sync), env=learner_env(), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in sync_dir.iterdir()) == ["weights.safetensors"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # three learner starts: 184 s on two cores busy with other jobs
def test_sigterm_stops_after_the_step_with_a_checkpoint_and_resume_continues(tmp_path, proc_scan):
    """A preemption (or ``docker stop``) sends SIGTERM: the step in progress ends, is saved,
    the run exits 143, and ``--resume`` goes on from that very step, not from the last periodic
    checkpoint (none here). Deleting older checkpoints leaves no half-deleted one. Before the
    first step (the rollout server starting) there is no step to wait for: it stops at once."""
    early = tmp_path / "early"
    proc = subprocess.Popen(
        _cmd(early), env=learner_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    # The embedded server is starting once a process's command line names its model (its log
    # file is opened a moment before that process exists).
    while not proc_scan(str(early / "model")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.02)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    assert time.monotonic() - t0 < 15  # the server's stop (SIGTERM, 10 s grace) at most
    assert "stopped by SIGTERM before the first step" in err.splitlines()[-1]
    assert "run the same command again" in err.splitlines()[-1]
    assert not read_metrics(early) and latest_checkpoint(early) is None
    check_fresh_run_dir(early)  # "the same command again" (no --resume) may start there
    assert not wait_gone(proc_scan, str(early / "model"))  # the embedded server went with it
    run_dir = tmp_path / "run"
    sets = ("run.checkpoint_every=100", "run.keep_checkpoints=1", "sampling.max_tokens=8")
    proc = subprocess.Popen(
        _cmd(run_dir, "run.steps=40", *sets),
        env=learner_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while len(_trained_steps(run_dir) if (run_dir / "metrics.jsonl").exists() else []) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    steps = _trained_steps(run_dir)
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last < 40
    assert f"stopped by SIGTERM after step {last} of 40" in err.splitlines()[-1]
    assert "--resume" in err.splitlines()[-1] and not (run_dir / "final").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{last:06d}"]
    _resume(run_dir, f"run.steps={last + 1}", *sets)
    assert _trained_steps(run_dir) == list(range(1, last + 2))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{last + 1:06d}"]
