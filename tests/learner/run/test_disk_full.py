"""A checkpoint that the disk refuses: the learner ends in one line naming the checkpoint, the
reason and the checkpoint ``--resume`` continues from (exit 74), the unfinished directory is
gone, and ``--resume`` with room again trains the rest once.

The refusal is real: the learner runs under a file size limit (``RLIMIT_FSIZE``, ``SIGXFSZ``
ignored), so the kernel fails the checkpoint's writes with ``EFBIG`` as a full disk fails them
with ``ENOSPC``: the same failed ``write(2)`` inside safetensors."""

from __future__ import annotations

import resource
import signal
import subprocess
from pathlib import Path

import pytest

from learner.run.checkpoint import CHECKPOINT_WRITE_EXIT, all_checkpoints, write_failure
from learner.run.metrics import read_metrics
from tests.learner.demo_runs import learner_cmd, learner_env, run_ok

SETS = ("eval=none", "run.save_final=false", "run.checkpoint_every=1")
LIMIT = 100_000  # bytes a file: the tiny model's weights are ~360 kB, every log line far less


def _limited() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, no kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


@pytest.mark.slow
@pytest.mark.timeout(900)  # three learner runs: ~40 s each on a quiet machine
def test_a_checkpoint_the_disk_refuses_is_one_line_and_resume_goes_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_ok(run_dir, *SETS, "run.steps=1", timeout=600)  # the tiny model and step 1's checkpoint
    assert [p.name for p in all_checkpoints(run_dir)] == ["step_000001"]

    sets = [a for o in ("run.progress_bar=false", *SETS, "run.steps=3") for a in ("--set", o)]
    proc = subprocess.run(
        learner_cmd(run_dir, *sets, "--resume"), env=learner_env(), capture_output=True,
        text=True, timeout=600, preexec_fn=_limited,
    )  # fmt: skip
    assert proc.returncode == CHECKPOINT_WRITE_EXIT, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"error: could not write the checkpoint {run_dir}/checkpoints/step_000002 (File too large)")  # fmt: skip
    assert last.endswith("run again with --resume, which continues from step_000001"), last
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001"]

    run_ok(run_dir, *SETS, "run.steps=3", resume=True, timeout=600)
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert all_checkpoints(run_dir)[0].name == "step_000003"


def test_each_form_of_a_failed_write_is_named_and_nothing_else_is() -> None:
    """safetensors' Rust errors (two spellings), an OSError, torch's stream writer; a bug is
    not a failed write (its traceback stays)."""
    rust = "Error while serializing: I/O error: No space left on device (os error 28)"
    assert write_failure(RuntimeError(rust)) == "No space left on device"
    assert write_failure(RuntimeError("IoError(Os { code: 122, kind: QuotaExceeded })")) == (
        "Disk quota exceeded"
    )
    assert write_failure(OSError(28, "No space left on device", "/r/x")) == (
        "No space left on device (/r/x)"
    )
    torch_save = RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter "
                              "failed writing file data/0: file write failed")  # fmt: skip
    assert write_failure(torch_save) == "a file write failed"
    assert write_failure(ValueError("a bug")) is None
