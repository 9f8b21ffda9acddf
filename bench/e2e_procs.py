"""The processes of bench_grpo_e2e.py's runs: each started in its own session and marked with
the mode's run (``proc_tree``), so that every process it starts, in whatever session, ends
with it; the wait for the learner's steps while every server stays up, and facts about the
machine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_common import BenchError
from gpu_common import ROOT, ServerProcess
from proc_tree import end_run


def start_process(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``argv`` in a session of its own, output to ``log``; ``env`` carries the run's marker
    (``proc_tree.mark``), by which ``end_run`` finds it and all it starts."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as f:
        return subprocess.Popen(
            argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )


def end_mode(tag: str, procs: list[subprocess.Popen | None], grace_s: float) -> dict:
    """End every process of a mode's run: those marked ``tag`` in their environment and the
    descendants of ``procs`` (torchrun's ranks and their servers each in sessions of their
    own included), and wait until none is alive; ``procs`` are reaped."""
    report = end_run(tag, [p.pid for p in procs if p is not None], grace_s=grace_s)
    for p in procs:
        if p is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
    return report


def tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def ram_dir(need_bytes: int) -> str | None:
    """/dev/shm when it has room (the colocated file sync never touches a disk), else None
    (the default temp directory)."""
    with contextlib.suppress(OSError):
        if shutil.disk_usage("/dev/shm").free > need_bytes:
            return "/dev/shm"
    return None


def gpu_names() -> list[str]:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return []


def logged_steps(run_dir: Path) -> int:
    with contextlib.suppress(OSError):
        return sum(1 for line in (run_dir / "metrics.jsonl").open() if line.strip())
    return 0


def wait_for_steps(
    learner: subprocess.Popen,
    servers: list[ServerProcess],
    run_dir: Path,
    steps: int,
    deadline: float,
) -> bool:
    """Until ``steps`` metric records exist; True if the learner was still running then (it is
    saving its final checkpoint). A dead learner or server, or the deadline, raises."""
    while True:
        rc = learner.poll()
        done = logged_steps(run_dir)
        if done >= steps:
            return rc is None
        if rc is not None:
            raise BenchError(f"the learner exited with code {rc} after {done} of {steps} steps")
        for server in servers:
            if server.proc is not None and (rc := server.proc.poll()) is not None:
                raise BenchError(f"the rollout server on GPU {server.gpu} exited with code {rc}")
        if time.monotonic() > deadline:
            raise BenchError(f"timed out with {logged_steps(run_dir)} of {steps} steps logged")
        time.sleep(0.05)  # the served weights are read right after the last step


def start_servers(servers: list[ServerProcess], timeout_s: float) -> None:
    """Start every server at once and wait until all are ready (each loads on its own GPUs)."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(servers))) as pool:
        for future in [pool.submit(s.start, ready_timeout_s=timeout_s) for s in servers]:
            future.result()
